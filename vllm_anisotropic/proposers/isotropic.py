"""Isotropic(k) baseline: a uniform k-ary tree from GOOSE's sources under the same budget.

Scope: the topology control of GOOSE arXiv 2604.02047 Sec. 5.3 / Table 1: "a uniform-rate k-ary tree
with k in {3, 5} and the same node budget, derived from Sequoia's framework but using GOOSE's
draft source". Under one uniform acceptance rate the best tree is balanced: we fill it
breadth-first, each node taking up to k children, until B nodes. A node's candidate children
are, in order: the context-match continuation when the node lies on the match path (SPINE),
then its adjacency-table successors (bigram first, scores >= min_branch_score, duplicates of
the spine child removed; BRANCH). ``k 3, B 60`` -> levels of 3, 9, 27 and 20 nodes (depth 4);
``k 5`` -> 5, 25, 29 (depth 3), fewer where the table runs dry.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from vllm_anisotropic.proposers.adjacency import AdjacencyTable, HarvestingState, TenantTables, tenant_budget
from vllm_anisotropic.proposers.base import ProposalInfo, ProposalMode, Proposer, node_budget
from vllm_anisotropic.proposers.config import IsotropicConfig
from vllm_anisotropic.proposers.context_match import ContextMatcher
from vllm_anisotropic.proposers.treebuild import TreeBuilder
from vllm_anisotropic.tree import DraftTree, NodeSource

__all__ = ["build_isotropic_tree", "IsotropicProposer", "IsotropicState"]

# value factor of a spine child (the tree shape ignores it; it only orders the output)
_SPINE_PRIOR = 0.3


def build_isotropic_tree(
    root_token: int,
    prev_token: int,
    spine: np.ndarray,
    successors,
    *,
    branching: int,
    budget: int,
    max_depth: int,
    min_branch_score: float,
) -> DraftTree:
    """Breadth-first k-ary fill (see module docstring); ``<= budget`` nodes, value order."""
    spine = np.asarray(spine, np.int64).reshape(-1)
    builder = TreeBuilder(root_token)
    spine_depth = {0: 0}  # builder node on the match path -> index into spine of its child
    queue = deque([0])
    while queue and len(builder) < budget:
        node = queue.popleft()
        if builder.depths[node] >= max_depth:
            continue
        kids: list[tuple[int, NodeSource, float]] = []
        j = spine_depth.get(node)
        if j is not None and j < len(spine):
            kids.append((int(spine[j]), NodeSource.SPINE, _SPINE_PRIOR))
        prev = builder.tokens[builder.parents[node]] if node > 0 else prev_token
        ids, scores = successors(prev, builder.tokens[node])
        taken = {t for t, _, _ in kids}
        for t, s in zip(ids, scores):
            if len(kids) >= branching:
                break
            if s >= min_branch_score and s > 0 and int(t) not in taken:
                kids.append((int(t), NodeSource.BRANCH, float(s)))
                taken.add(int(t))
        for t, src, s in kids[:branching]:
            if len(builder) >= budget:
                break
            child = builder.add(node, t, src, builder.values[node] * s, 0)
            if src == NodeSource.SPINE:
                spine_depth[child] = j + 1
            queue.append(child)
    return builder.finish()


class IsotropicState(HarvestingState):
    def __init__(self, config: IsotropicConfig, table: AdjacencyTable) -> None:
        self.config = config
        self.table = table
        self.matcher = ContextMatcher(config.ngram_sizes, config.max_continuation)
        self._prev_root = -1
        self.last_info = ProposalInfo(ProposalMode.PLAIN)

    def propose(self, context_tokens, max_nodes: int | None = None) -> DraftTree:
        c = self.config
        context = np.asarray(context_tokens)
        self._prev_root = int(context[-2]) if len(context) >= 2 else -1
        self.matcher.sync(context)
        hit = self.matcher.match()
        tree = build_isotropic_tree(
            int(context[-1]),
            self._prev_root,
            hit.draft,
            self.table.successors,
            branching=c.branching,
            budget=node_budget(c.budget, max_nodes),
            max_depth=c.max_depth,
            min_branch_score=c.min_branch_score,
        )
        spine_len = int(np.count_nonzero(tree.sources == NodeSource.SPINE))
        mode = ProposalMode.TREE if tree.num_nodes > 1 else ProposalMode.PLAIN
        self.last_info = ProposalInfo(mode, spine_len=spine_len, ngram=hit.ngram, match_length=hit.match_length, consensus=hit.consensus)
        return tree


class IsotropicProposer(Proposer):
    name = "iso"

    def __init__(self, config: IsotropicConfig | None = None, vocab_size: int | None = None) -> None:
        self.config = c = config or IsotropicConfig()
        self.vocab_size = vocab_size
        tenants, self.state_budget = tenant_budget(c, vocab_size)  # draft_state_bytes
        self.tables = TenantTables(self._new_table, c.shared_table, tenants)

    def _new_table(self) -> AdjacencyTable:
        c = self.config
        return AdjacencyTable.for_config(c, self.vocab_size)

    def new_request(self, tenant: str | None = None) -> IsotropicState:
        return IsotropicState(self.config, self.tables.for_request(tenant))

    @property
    def table(self) -> AdjacencyTable | None:
        """The table of requests without a tenant (None without ``shared_table``)."""
        return self.tables.default
