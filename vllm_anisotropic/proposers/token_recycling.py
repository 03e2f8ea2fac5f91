"""Token Recycling (TR) baseline: adjacency matrix + static breadth-first draft tree.

Scope: drafting for the TR baseline of GOOSE's evaluation (arXiv 2604.02047 Sec. 5.1: "TR using its
default imbalanced BFS tree with unigram adjacency"). Facts from Luo et al., "Turning Trash into
Treasure: Accelerating Inference of Large Language Models with Token Recycling" (ACL 2025,
arXiv 2408.08696): one row of top-k candidate next tokens per vocabulary token, overwritten by
the newest top-k of every forward pass (draft positions included), inherited across queries
(hot start); the draft tree is retrieved from the last token breadth-first along a *static*,
imbalanced tree template in which higher-ranked candidates get more descendants; verification
with tree attention. Here the template has B nodes (same budget as GOOSE) and K = 10 columns.

The template is ours (TR's own template is not reproduced): slot (parent, rank j) gets the
prior ``q_j = 0.5 * (j + 1) ** -rank_decay`` and the template keeps the B - 1 slots of highest
prior path product with depth <= D (the standard static-tree recipe of Medusa/Sequoia). At run
time each slot takes the rank-j successor of its parent's token; a slot whose row has fewer than
j + 1 entries (cold table) is dropped with its subtree.
"""

from __future__ import annotations

import heapq

import numpy as np

from vllm_anisotropic.proposers.adjacency import AdjacencyTable, HarvestingState, TenantTables, tenant_budget
from vllm_anisotropic.proposers.base import ProposalInfo, ProposalMode, Proposer, node_budget
from vllm_anisotropic.proposers.config import TokenRecyclingConfig
from vllm_anisotropic.proposers.treebuild import TreeBuilder
from vllm_anisotropic.tree import DraftTree, NodeSource

__all__ = ["static_template", "TokenRecyclingProposer", "TokenRecyclingState"]


def static_template(budget: int, max_depth: int, top_k: int, rank_decay: float) -> list[tuple[int, int]]:
    """Template slots ``(parent_slot, rank)`` in parent-before-child order; slot 0 is the root
    (its entry is ``(-1, -1)``). Best-first on the prior path product, ``<= budget`` slots.

    ``budget 4, max_depth 2, top_k 2, rank_decay 1.5 -> [(-1,-1), (0,0), (1,0), (0,1)]``
    (priors 0.5, 0.25, 0.177).
    """
    prior = [0.5 * (j + 1) ** -rank_decay for j in range(top_k)]
    slots: list[tuple[int, int]] = [(-1, -1)]
    depth = [0]
    value = [1.0]
    heap = [(-prior[0], 0, 0)]  # (-value, parent slot, rank)
    while heap and len(slots) < budget:
        negv, parent, rank = heapq.heappop(heap)
        slots.append((parent, rank))
        depth.append(depth[parent] + 1)
        value.append(-negv)
        me = len(slots) - 1
        if rank + 1 < top_k:
            heapq.heappush(heap, (-value[parent] * prior[rank + 1], parent, rank + 1))
        if depth[me] < max_depth:
            heapq.heappush(heap, (-value[me] * prior[0], me, 0))
    return slots


class TokenRecyclingState(HarvestingState):
    def __init__(self, config: TokenRecyclingConfig, table: AdjacencyTable, template) -> None:
        self.config = config
        self.table = table
        self.template = template
        self._prev_root = -1
        self.last_info = ProposalInfo(ProposalMode.PLAIN)

    def propose(self, context_tokens, max_nodes: int | None = None) -> DraftTree:
        context = np.asarray(context_tokens)
        root = int(context[-1])
        self._prev_root = int(context[-2]) if len(context) >= 2 else -1
        builder = TreeBuilder(root)
        node_of = [0] + [-1] * (len(self.template) - 1)  # template slot -> builder node, -1 dropped
        rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # a prefix of the template is a template (parents come first): max_nodes slots of it
        slots = self.template[1 : node_budget(len(self.template), max_nodes)]
        for s, (parent, rank) in enumerate(slots, start=1):
            p = node_of[parent]
            if p < 0:
                continue
            if p not in rows:
                prev = builder.tokens[builder.parents[p]] if p > 0 else self._prev_root
                rows[p] = self.table.successors(prev, builder.tokens[p])
            ids, scores = rows[p]
            if rank >= len(ids) or scores[rank] < self.config.min_branch_score:
                continue
            node_of[s] = builder.add(p, int(ids[rank]), NodeSource.BRANCH, builder.values[p] * float(scores[rank]), 0)
        tree = builder.finish()
        self.last_info = ProposalInfo(ProposalMode.TREE if tree.num_nodes > 1 else ProposalMode.PLAIN)
        return tree


class TokenRecyclingProposer(Proposer):
    name = "tr"

    def __init__(self, config: TokenRecyclingConfig | None = None, vocab_size: int | None = None) -> None:
        self.config = c = config or TokenRecyclingConfig()
        self.vocab_size = vocab_size
        self.template = static_template(c.budget, c.max_depth, c.top_k, c.rank_decay)
        tenants, self.state_budget = tenant_budget(c, vocab_size)  # draft_state_bytes
        self.tables = TenantTables(self._new_table, c.shared_table, tenants)

    def _new_table(self) -> AdjacencyTable:
        c = self.config
        return AdjacencyTable.for_config(c, self.vocab_size)

    def new_request(self, tenant: str | None = None) -> TokenRecyclingState:
        return TokenRecyclingState(self.config, self.tables.for_request(tenant), self.template)

    @property
    def table(self) -> AdjacencyTable | None:
        """The table of requests without a tenant (None without ``shared_table``)."""
        return self.tables.default
