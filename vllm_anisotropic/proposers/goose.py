"""GOOSE spine tree: BuildSpineTree, confidence-adaptive spine ratio, linear bypass.

Scope: drafting only (tree construction from a context match and an adjacency table, the
spine-acceptance EMA and the routing of Algorithm 2). Verification is the greedy walk of
``verifiers.greedy`` (arXiv 2604.02047 Algorithm 3); the model forward lives in the caller.

Source: GOOSE, "Anisotropic Speculation Trees for Training-Free Speculative Decoding"
(arXiv 2604.02047): Algorithm 1 (BuildSpineTree), Algorithm 2 (decoding loop and routing),
Sec. 4.3 (confidence adaptation), Appendix B.1 (duplicates), C.1 (score-modulated branch width,
pruning below 0.01), Table 5 (hyperparameters; see ``config.GooseConfig``).

Terms
-----
spine
    The context-match draft ``d = (d_1 .. d_m)`` laid as a chain below the root (SPINE nodes).
branch
    An adjacency-table successor attached to the root or to a spine node, and its BFS
    extension (BRANCH nodes). A branch subtree has depth <= D below its branching node.
value
    Estimated probability that the node's root-to-node path is accepted: spine node i has
    ``p_s ** i`` (p_s = EMA spine acceptance); a branch child has ``value(parent) * score``
    (score = the target's softmax probability of the successor when it was harvested).
budget B
    Tree nodes *including* the root: at most B - 1 draft tokens (Algorithm 1 line 2 uses
    ``B - 1 - b_s``).

BuildSpineTree (Algorithm 1) as implemented, ``B`` budget, ``r`` spine ratio, ``rho``
spine-branch ratio::

    b_s     = min(m, floor(B * r))                  # spine nodes            (line 1)
    b_r     = ceil((B - 1 - b_s) * (1 - rho))       # root-branch slots      (line 2)
    b_sigma = B - 1 - b_s - b_r                     # spine-branch slots     (line 3)
    a_i     = floor(b_sigma * (1/i) / H(b_s))       # harmonic share, H(m) = sum_{j<=m} 1/j  (line 10)
    e.g. B=60, r=0.30, m=20: b_s=18, b_r=21, b_sigma=20, a = [5, 2, 1, 1, 1, 0, ...]

The root gets its top ``b_r`` successors, spine node i its top ``a_i`` (both capped by the K
successors the table holds, scores >= min_branch_score, the spine continuation excluded as a
duplicate). Step 4 then spends *all* remaining budget (B - 1 minus the nodes placed, which
includes slots the table could not fill) extending branch leaves through the table up to depth
D. We expand in order of path value (a max-heap over "next best child of each node"): a
node's children come in score order and a high-score successor receives more descendants than
its low-score siblings -- the score-modulated width of Appendix C.1. Because every child has a
value <= its parent's, this visits shallow nodes first along each subtree, i.e. a breadth-first
expansion ordered by value rather than by level; with a budget far smaller than K^D the
level-by-level reading would spend everything at depth 2 and never reach D = 6.

Output order: nodes sorted by value (ties: smaller depth, then build order), so parents precede
children and any prefix is a valid subtree (``DraftTree.truncate``).
"""

from __future__ import annotations

import heapq
import math
from typing import Callable

import numpy as np
import torch

from vllm_anisotropic.proposers.adjacency import AdjacencyTable, HarvestingState, TenantTables
from vllm_anisotropic.proposers.base import ProposalInfo, ProposalMode, Proposer, node_budget
from vllm_anisotropic.proposers.config import GooseConfig
from vllm_anisotropic.proposers.context_match import ContextMatch, ContextMatcher
from vllm_anisotropic.proposers.output_store import OutputStore
from vllm_anisotropic.proposers.treebuild import TreeBuilder
from vllm_anisotropic.tree import DraftTree, NodeSource

__all__ = [
    "harmonic_allocation",
    "spine_ratio_tier",
    "build_spine_tree",
    "spine_chain",
    "GooseState",
    "GooseProposer",
]

# (prev_token, token) -> ([n] successor ids best first, [n] scores)
SuccessorFn = Callable[[int, int], tuple[np.ndarray, np.ndarray]]

_NO_MATCH = ContextMatch(np.zeros(0, np.int64), 0, 0, False, -1)


def harmonic_allocation(total: int, num_nodes: int) -> list[int]:
    """Algorithm 1 line 10: ``a_i = floor(total * (1/i) / sum_{j=1}^{m} 1/j)``, i = 1..m.

    ``total 20, m 4 -> H = 2.083 -> [9, 4, 3, 2]`` (sum <= total; the remainder is left to
    the BFS extension).
    """
    if num_nodes <= 0 or total <= 0:
        return [0] * max(num_nodes, 0)
    h = sum(1.0 / j for j in range(1, num_nodes + 1))
    return [int(math.floor(total * (1.0 / i) / h)) for i in range(1, num_nodes + 1)]


def spine_ratio_tier(p_s: float, thresholds=(0.2, 0.4), ratios=(0.15, 0.30, 0.50)) -> float:
    """Sec. 4.3 / Table 5: p_s < 0.2 -> 0.15, < 0.4 -> 0.30, else 0.50."""
    if p_s < thresholds[0]:
        return ratios[0]
    if p_s < thresholds[1]:
        return ratios[1]
    return ratios[2]


def _filtered(successors: SuccessorFn, prev: int, token: int, min_score: float, exclude: int) -> list[tuple[int, float]]:
    ids, scores = successors(int(prev), int(token))
    return [(int(t), float(s)) for t, s in zip(ids, scores) if s >= min_score and s > 0.0 and int(t) != exclude]


def spine_chain(root_token: int, spine: np.ndarray, spine_acceptance: float) -> DraftTree:
    """The linear bypass tree: root -> d_1 -> ... -> d_m, SPINE nodes, values p_s ** i."""
    v = min(max(float(spine_acceptance), 1e-3), 1.0)
    return DraftTree.spine(int(root_token), spine, v ** np.arange(len(spine) + 1, dtype=np.float64))


def build_spine_tree(
    root_token: int,
    prev_token: int,
    spine: np.ndarray,
    successors: SuccessorFn,
    *,
    budget: int = 60,
    max_depth: int = 6,
    spine_ratio: float = 0.3,
    spine_branch_ratio: float = 0.5,
    min_branch_score: float = 0.01,
    spine_acceptance: float = 0.3,
    spine_branches: bool = True,
) -> DraftTree:
    """GOOSE Algorithm 1 (see module docstring for the arithmetic and the step-4 order).

    Args:
        root_token: the anchor t_a (last accepted token), node 0.
        prev_token: the context token before the root (bigram key of the root), -1 if none.
        spine: ``[m]`` context-match draft d (may be empty: a TR-only tree).
        successors: adjacency lookup ``(prev, token) -> (ids, scores)``, best first.
        budget: B, nodes including the root.
        max_depth: D, depth of a branch subtree below its branching node.
        spine_ratio: r; spine_branch_ratio: rho.
        min_branch_score: successors scoring below are pruned (C.1).
        spine_acceptance: p_s, for the node values only.
        spine_branches: False = ablation 'w/o spine branches' (all branch slots at the root).

    Returns:
        A ``DraftTree`` with ``<= budget`` nodes in value order.
    """
    spine = np.asarray(spine, np.int64).reshape(-1)
    builder = TreeBuilder(root_token)
    draft_budget = int(budget) - 1
    if draft_budget <= 0:
        return builder.finish()
    v = min(max(float(spine_acceptance), 1e-3), 1.0)

    # line 1-3: split the budget
    b_s = min(len(spine), int(math.floor(budget * spine_ratio)), draft_budget)
    rest = draft_budget - b_s
    if spine_branches:
        b_r = int(math.ceil(rest * (1.0 - spine_branch_ratio)))
        b_sigma = rest - b_r
    else:
        b_r, b_sigma = rest, 0

    # lines 4-7: lay the spine; spine_nodes[i] = node of d_i (spine_nodes[0] = root)
    spine_nodes = [0]
    for i in range(b_s):
        spine_nodes.append(builder.add(spine_nodes[-1], spine[i], NodeSource.SPINE, v ** (i + 1), 0))

    def next_spine(i: int) -> int:  # the spine child of spine node i (excluded as a duplicate)
        return int(spine[i]) if i < b_s else -1

    # lines 8-12: first-level branches (root: b_r, spine node i: a_i harmonic), best first
    heap: list[tuple[float, int, int, int]] = []  # (-value, tie, node, next candidate rank)
    cand: dict[int, list[tuple[int, float]]] = {}
    tie = 0

    def push_children(node: int) -> None:
        nonlocal tie
        if builder.branch_depths[node] >= max_depth:
            return
        prev = builder.tokens[builder.parents[node]] if node > 0 else prev_token
        cand[node] = _filtered(successors, prev, builder.tokens[node], min_branch_score, -1)
        if cand[node]:
            heapq.heappush(heap, (-builder.values[node] * cand[node][0][1], tie, node, 0))
            tie += 1

    allocations = [b_r] + harmonic_allocation(b_sigma, b_s)
    for i, width in enumerate(allocations):  # i = 0: root, i >= 1: spine node d_i
        if width <= 0:
            continue
        node = spine_nodes[i]
        prev = prev_token if i == 0 else builder.tokens[spine_nodes[i - 1]]
        for tok, score in _filtered(successors, prev, builder.tokens[node], min_branch_score, next_spine(i))[:width]:
            if len(builder) - 1 >= draft_budget:
                break
            child = builder.add(node, tok, NodeSource.BRANCH, builder.values[node] * score, 1)
            push_children(child)

    # line 13: extend branch leaves through the table, best path value first, depth <= D
    while heap and len(builder) - 1 < draft_budget:
        _, _, node, rank = heapq.heappop(heap)
        tok, score = cand[node][rank]
        child = builder.add(node, tok, NodeSource.BRANCH, builder.values[node] * score, builder.branch_depths[node] + 1)
        if rank + 1 < len(cand[node]):
            heapq.heappush(heap, (-builder.values[node] * cand[node][rank + 1][1], tie, node, rank + 1))
            tie += 1
        push_children(child)
    return builder.finish()


class GooseState(HarvestingState):
    """Per-request GOOSE state: context index, spine-acceptance EMA, the (shared) table."""

    def __init__(self, config: GooseConfig, table: AdjacencyTable, store: OutputStore | None = None) -> None:
        self.config = config
        self.table = table
        self.store = store  # the tenant's finished requests (cross_request_spine), or None
        self._prompt_len = -1
        self.matcher = ContextMatcher(config.ngram_sizes, config.max_continuation)
        self.spine_acceptance = float(config.initial_spine_acceptance)  # p_s (EMA)
        self._prev_root = -1
        self.last_info = ProposalInfo(ProposalMode.PLAIN)

    def _is_bypass(self, hit: ContextMatch) -> bool:
        cfg = self.config
        if not (cfg.bypass and hit.found):
            return False
        if cfg.consensus_bypass and hit.consensus:
            return True
        length = len(hit.draft) if cfg.bypass_signal == "draft_length" else hit.match_length
        return length >= cfg.bypass_min_length

    def _spine(self, context: np.ndarray, limit: int) -> tuple[ContextMatch, bool]:
        """The context match of ``context`` (its continuation at most ``limit`` tokens), from the
        request's own context or else the tenant's finished requests; (match, from the store)."""
        self._prev_root = int(context[-2]) if len(context) >= 2 else -1
        if self._prompt_len < 0:
            self._prompt_len = len(context) - 1  # the first proposal follows the prefill's token
        if not self.config.context_spine:
            return _NO_MATCH, False
        self.matcher.sync(context)
        hit = self.matcher.match(limit)
        if not hit.found and self.store is not None:
            draft, n = self.store.match(self.matcher.tokens, limit)
            if n:
                return ContextMatch(draft, n, n, False, -1), True
        return hit, False

    def propose_chain(self, context_tokens, max_drafts: int) -> DraftTree:
        """The spine alone, at most ``max_drafts`` tokens (root-only without a match): a chain
        step of the measured gate (``allocator.gate``), the linear bypass without its test."""
        context = np.asarray(context_tokens)
        limit = max(0, min(self.config.max_continuation, int(max_drafts)))
        hit, _ = self._spine(context, limit) if limit else (_NO_MATCH, False)
        self.last_info = ProposalInfo(ProposalMode.BYPASS if hit.found else ProposalMode.PLAIN,
                                      spine_len=len(hit.draft), ngram=hit.ngram, match_length=hit.match_length,
                                      consensus=hit.consensus)
        return spine_chain(int(context[-1]), hit.draft[:limit], self.spine_acceptance)

    def propose(self, context_tokens, max_nodes: int | None = None) -> DraftTree:
        cfg = self.config
        budget = node_budget(cfg.budget, max_nodes)
        context = np.asarray(context_tokens)
        root = int(context[-1])
        hit, from_store = self._spine(context, min(cfg.max_continuation, budget - 1))
        r = spine_ratio_tier(self.spine_acceptance, cfg.tier_thresholds, cfg.tier_ratios)
        info = dict(ngram=hit.ngram, match_length=hit.match_length, consensus=hit.consensus, spine_ratio=r)
        if not from_store and self._is_bypass(hit):  # another request's text is no bypass signal
            tree = spine_chain(root, hit.draft, self.spine_acceptance)
            self.last_info = ProposalInfo(ProposalMode.BYPASS, spine_len=len(hit.draft), **info)
            return tree
        tree = build_spine_tree(
            root,
            self._prev_root,
            hit.draft,
            self.table.successors,
            budget=budget,
            max_depth=cfg.max_depth,
            spine_ratio=r,
            spine_branch_ratio=cfg.spine_branch_ratio,
            min_branch_score=cfg.min_branch_score,
            spine_acceptance=self.spine_acceptance,
            spine_branches=cfg.spine_branches,
        )
        mode = ProposalMode.TREE if tree.num_nodes > 1 else ProposalMode.PLAIN
        spine_len = int(np.count_nonzero(tree.sources == NodeSource.SPINE))
        self.last_info = ProposalInfo(mode, spine_len=spine_len, **info)
        return tree

    def finish(self) -> None:
        """The request is done: its prompt's tail and output go to the cross-request store."""
        if self.store is not None and self._prompt_len >= 0:
            start = max(0, self._prompt_len - self.config.store_prompt_tail)
            self.store.add(self.matcher.tokens[start:])
            self.store = None  # once

    def observe(self, tree: DraftTree, accepted, logits: torch.Tensor | None, prev_root: int | None = None) -> None:
        # Algorithm 2 line 15: harvest every verified node, rejected branches included
        super().observe(tree, accepted, logits, prev_root)
        # line 16: p_s <- (1 - c) p_s + c * (accepted spine nodes / proposed spine nodes)
        is_spine = tree.sources == NodeSource.SPINE
        num_spine = int(np.count_nonzero(is_spine))
        if num_spine:
            acc = int(np.count_nonzero(is_spine[np.asarray(accepted, np.int64)])) if len(accepted) else 0
            c = self.config.ema_coef
            self.spine_acceptance = (1.0 - c) * self.spine_acceptance + c * acc / num_spine


class GooseProposer(Proposer):
    """GOOSE (and its ablations, via ``GooseConfig`` switches)."""

    name = "goose"

    def __init__(self, config: GooseConfig | None = None, vocab_size: int | None = None) -> None:
        self.config = config or GooseConfig()
        self.vocab_size = vocab_size
        self.tables = TenantTables(self._new_table, self.config.shared_table)
        c = self.config
        self.stores = (TenantTables(lambda: OutputStore(c.ngram_sizes, c.store_capacity), True)
                       if c.shared_table and c.cross_request_spine and c.context_spine else None)

    def _new_table(self) -> AdjacencyTable:
        c = self.config
        return AdjacencyTable(self.vocab_size, c.top_k, bigram=c.bigram, bigram_capacity=c.bigram_capacity)

    @classmethod
    def drafts_chains(cls, config: GooseConfig) -> bool:
        return bool(config.context_spine)  # the spine; without it there is no chain to draft

    def new_request(self, tenant: str | None = None) -> GooseState:
        store = self.stores.for_request(tenant) if self.stores is not None else None
        return GooseState(self.config, self.tables.for_request(tenant), store)

    @property
    def table(self) -> AdjacencyTable | None:
        """The table of requests without a tenant (None without ``shared_table``)."""
        return self.tables.default
