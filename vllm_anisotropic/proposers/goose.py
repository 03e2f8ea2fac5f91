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

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_anisotropic import kernels
from vllm_anisotropic.proposers.adjacency import AdjacencyTable, HarvestingState, TenantTables, TopKRows, tenant_budget
from vllm_anisotropic.proposers.base import MODE_CODES, ProposalInfo, ProposalMode, Proposer, node_budget
from vllm_anisotropic.proposers.config import GooseConfig
from vllm_anisotropic.proposers.output_store import OutputStore
from vllm_anisotropic.tree import DraftTree, FlatTrees, NodeSource

__all__ = [
    "harmonic_allocation",
    "spine_ratio_tier",
    "build_spine_tree",
    "spine_chain",
    "GooseBatch",
    "GooseState",
    "GooseProposer",
    "propose_spine_trees",
]

# an empty table: every lookup misses (a table allocated only at its first harvest)
_NO_TABLE = (np.zeros((0, 1), np.int32), np.zeros((0, 1), np.float32), np.full(1, -1, np.int64), np.zeros(1, np.int64),
             np.zeros((1, 1), np.int32), np.zeros((1, 1), np.float32), np.zeros(3, np.int64))


def harmonic_allocation(total: int, num_nodes: int) -> list[int]:
    """Algorithm 1 line 10: ``a_i = floor(total * (1/i) / sum_{j=1}^{m} 1/j)``, i = 1..m.

    ``total 20, m 4 -> H = 2.083 -> [9, 4, 3, 2]`` (sum <= total; the remainder is left to
    the BFS extension).
    """
    return kernels.load("goose").harmonic_widths(int(total), int(num_nodes)).tolist() if num_nodes > 0 else []


def spine_ratio_tier(p_s: float, thresholds=(0.2, 0.4), ratios=(0.15, 0.30, 0.50)) -> float:
    """Sec. 4.3 / Table 5: p_s < 0.2 -> 0.15, < 0.4 -> 0.30, else 0.50."""
    if p_s < thresholds[0]:
        return ratios[0]
    if p_s < thresholds[1]:
        return ratios[1]
    return ratios[2]


def spine_chain(root_token: int, spine: np.ndarray, spine_acceptance: float) -> DraftTree:
    """The linear bypass tree: root -> d_1 -> ... -> d_m, SPINE nodes, values p_s ** i."""
    v = min(max(float(spine_acceptance), 1e-3), 1.0)
    return DraftTree.spine(int(root_token), spine, v ** np.arange(len(spine) + 1, dtype=np.float64))


def _table_args(table: AdjacencyTable | None) -> tuple:
    """The kernels' table arguments: the seven arrays, the vocabulary size, the bigram switch."""
    if table is None or table.unigram_ids is None:
        return (*_NO_TABLE, 0, False)
    return (*table.arrays, int(table.vocab_size), bool(table.use_bigram))


def _build(table, roots, prevs, spines, spine_offsets, modes, budgets, ratios, p_s, *, max_depth, rho, min_score,
           spine_branches) -> tuple[FlatTrees, np.ndarray]:
    """``kernels.goose.build_trees`` over one table; (trees, build index of every node)."""
    sizes = np.maximum(budgets, np.diff(spine_offsets) + 1)
    cap = int(sizes.sum())
    tokens, parents, depths, build = (np.empty(cap, np.int64) for _ in range(4))
    sources = np.empty(cap, np.int8)
    values = np.empty(cap, np.float64)
    offsets = np.empty(roots.shape[0] + 1, np.int64)
    total = kernels.load("goose").build_trees(*_table_args(table), roots, prevs, spines, spine_offsets, modes, budgets, ratios, p_s,
                           int(max_depth), float(rho), float(min_score), bool(spine_branches),
                           tokens, parents, sources, values, depths, build, offsets)
    flat = FlatTrees(offsets, tokens[:total], parents[:total], sources[:total], values[:total], depths[:total])
    return flat, build[:total]


def build_spine_tree(
    root_token: int,
    prev_token: int,
    spine: np.ndarray,
    table: AdjacencyTable,
    *,
    budget: int = 60,
    max_depth: int = 6,
    spine_ratio: float = 0.3,
    spine_branch_ratio: float = 0.5,
    min_branch_score: float = 0.01,
    spine_acceptance: float = 0.3,
    spine_branches: bool = True,
    with_build_order: bool = False,
):
    """GOOSE Algorithm 1 for one tree (see module docstring for the arithmetic and the step-4
    order; the compiled kernel is ``kernels.goose.build_trees``).

    Args:
        root_token: the anchor t_a (last accepted token), node 0.
        prev_token: the context token before the root (bigram key of the root), -1 if none.
        spine: ``[m]`` context-match draft d (may be empty: a TR-only tree).
        table: the adjacency table the successors come from (bigram row, else unigram row).
        budget: B, nodes including the root.
        max_depth: D, depth of a branch subtree below its branching node.
        spine_ratio: r; spine_branch_ratio: rho.
        min_branch_score: successors scoring below are pruned (C.1).
        spine_acceptance: p_s, for the node values only.
        spine_branches: False = ablation 'w/o spine branches' (all branch slots at the root).
        with_build_order: also return ``[num_nodes]`` the build index of each node.

    Returns:
        A ``DraftTree`` with ``<= budget`` nodes in value order (and the build order).
    """
    spine = np.ascontiguousarray(spine, np.int64).reshape(-1)
    gk = kernels.load("goose")
    flat, build = _build(table, np.array([root_token], np.int64), np.array([prev_token], np.int64), spine,
                         np.array([0, spine.shape[0]], np.int64), np.array([gk.TREE], np.int64),
                         np.array([max(int(budget), 1)], np.int64), np.array([spine_ratio], np.float64),
                         np.array([spine_acceptance], np.float64), max_depth=max_depth, rho=spine_branch_ratio,
                         min_score=min_branch_score, spine_branches=spine_branches)
    tree = flat.tree(0)
    return (tree, build) if with_build_order else tree


@dataclass(frozen=True)
class GooseBatch:
    """One step's proposals for a batch of GOOSE requests (``propose_spine_trees``)."""

    trees: FlatTrees  # request r's tree is tree r
    modes: np.ndarray  # [R] int8 ``base.MODE_CODES`` of each proposal (plain, tree, bypass)
    prev_roots: np.ndarray  # [R] int64 the token before each root (its bigram key's first token), -1: none
    spine_lens: np.ndarray  # [R] int64 spine tokens drafted (context match or store)
    ngrams: np.ndarray  # [R] int64 n of the match (0: none)
    match_lengths: np.ndarray  # [R] int64 its backward match length
    consensus: np.ndarray  # [R] bool >= 2 n-gram lengths agree on the first draft token
    spine_ratios: np.ndarray  # [R] float64 the spine ratio r of each tree (Sec. 4.3 tier)


def propose_spine_trees(states: list["GooseState"], token_ids: np.ndarray, rows, lengths, max_nodes=None,
                        chain_drafts=None) -> GooseBatch:
    """GOOSE proposals (Algorithm 2 routing + Algorithm 1) for a batch of requests at once.

    ``token_ids`` ``[*, max_len]``: request r's context is ``token_ids[rows[r], :lengths[r]]``
    (vLLM's token array, read in place), its last token the root. ``max_nodes`` ``[R]``: each
    call's node budget below the proposer's own (<= 0: the proposer's). ``chain_drafts`` ``[R]``:
    a chain step (each request's spine alone, at most that many tokens) instead of trees.

    Stages: one compiled call for every request's budget, draft limit, root and context match
    (``kernels.goose.proposal_inputs``, the match ``kernels.match.match_tokens``'); the
    tenant's cross-request store for requests without a match of their own (``_store_spines``);
    then, per adjacency table (one for every request of a tenant), one compiled call that takes
    each spine, routes (bypass on consensus or a long match, never from the store; the spine
    ratio tier of p_s) and builds the tree (``kernels.goose.spine_trees``).
    """
    cfg = states[0].config
    rows = np.ascontiguousarray(rows, np.int64)
    lengths = np.ascontiguousarray(lengths, np.int64)
    num = rows.shape[0]
    chains = chain_drafts is not None
    sizes, policy, tiers = _config_arrays(cfg)
    budgets, limits, roots, prevs, match, asking = kernels.load("goose").proposal_inputs(
        token_ids, rows, lengths, _NONE if max_nodes is None else np.asarray(max_nodes, np.int64),
        np.asarray(chain_drafts, np.int64) if chains else _NONE, int(cfg.budget), int(cfg.max_continuation), sizes,
        max(32, int(sizes[0])), bool(cfg.context_spine))
    p_s = np.fromiter((s.spine_acceptance for s in states), np.float64, num)
    for s, prev, length in zip(states, prevs.tolist(), lengths.tolist()):
        s._prev_root = prev
        if s._prompt_len < 0:
            s._prompt_len = length - 1  # the first proposal follows the prefill's token
    ngrams, lens, starts, store_tokens = _store_spines(states, token_ids, rows, lengths, limits, match, asking)
    per_request = (rows, lengths, roots, prevs, match, ngrams, lens, starts, limits, budgets, p_s)
    groups: dict[int, list[int]] = {}
    for r, s in enumerate(states):
        groups.setdefault(id(s.table), []).append(r)
    parts = []
    for members in groups.values():
        idx = None if len(groups) == 1 else np.asarray(members, np.int64)
        part = per_request if idx is None else tuple(a[idx] for a in per_request)
        parts.append((idx, _spine_trees(states[members[0]].table, cfg, token_ids, part, store_tokens, chains, policy,
                                        tiers)))
    if len(parts) == 1:
        trees, stats, ratios = parts[0][1]
    else:
        trees = _in_order([(idx, t) for idx, (t, _, _) in parts], num)
        stats, ratios = np.empty((num, 5), np.int64), np.empty(num, np.float64)
        for idx, (_, st, ra) in parts:
            stats[idx], ratios[idx] = st, ra
    return GooseBatch(trees, stats[:, 0].astype(np.int8), prevs, stats[:, 1], stats[:, 2], stats[:, 3],
                      stats[:, 4].astype(bool), ratios)


_NONE = np.zeros(0, np.int64)  # "none given": proposal_inputs' budgets and chain drafts, the store's drafts
_CONFIG_ARRAYS: dict[int, tuple] = {}  # id(config) -> (config, its kernel arrays): built once per config


def _config_arrays(cfg: GooseConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The configuration as the kernels read it: n-gram sizes longest first, the bypass policy
    (bypass, consensus bypass, bypass on the draft length, its minimum length) and the spine
    ratio tiers (thresholds, then ratios); built once per configuration object."""
    hit = _CONFIG_ARRAYS.get(id(cfg))
    if hit is None or hit[0] is not cfg:
        hit = _CONFIG_ARRAYS[id(cfg)] = (
            cfg, np.asarray(sorted(set(cfg.ngram_sizes), reverse=True), np.int64),
            np.array([bool(cfg.bypass), bool(cfg.consensus_bypass), cfg.bypass_signal == "draft_length",
                      cfg.bypass_min_length], np.int64),
            np.array([*cfg.tier_thresholds, *cfg.tier_ratios], np.float64))
    return hit[1:]


def _store_spines(states, token_ids, rows, lengths, limits, match, asking: int) -> tuple:
    """The tenant store's drafts of the ``asking`` requests, those without a context match of
    their own (and room to draft): ``(ngrams [R], lens [R], starts [R], tokens)`` int64, ngrams
    0 where the store had none (or the request did not ask). One compiled lookup per store
    (``OutputStore.match_rows``; one store for every request of a tenant)."""
    num = rows.shape[0]
    ngrams, lens, starts = np.zeros(num, np.int64), np.zeros(num, np.int64), np.zeros(num, np.int64)
    if not asking:
        return ngrams, lens, starts, _NONE
    which = np.flatnonzero((match[:, 1] <= 0) & (limits > 0))
    stores: dict[int, list[int]] = {}
    for r in which.tolist():
        store = states[r].store
        if store is not None and len(store):
            stores.setdefault(id(store), []).append(r)
    if not stores:
        return ngrams, lens, starts, _NONE
    tokens = np.empty(int(limits[which].sum()), np.int64)
    at = 0
    for members in stores.values():
        at = states[members[0]].store.match_rows(token_ids, rows, lengths, limits, np.asarray(members, np.int64),
                                                 ngrams, lens, starts, tokens, at)
    return ngrams, lens, starts, tokens[:at]


def _spine_trees(table, cfg, token_ids, per_request: tuple, store_tokens, chains: bool, policy,
                 tiers) -> tuple[FlatTrees, np.ndarray, np.ndarray]:
    """``kernels.goose.spine_trees`` over one table: (trees, stats [R, 5], ratios [R]).
    ``per_request``: rows, lengths, roots, prevs, match, store n-grams, lengths and starts,
    limits, budgets, p_s of the table's requests."""
    rows, lengths, roots, prevs, match, ngrams, lens, starts, limits, budgets, p_s = per_request
    offsets, tokens, parents, sources, values, depths, stats, ratios = kernels.load("goose").spine_trees(
        *_table_args(table), token_ids, rows, lengths, roots, prevs, match, ngrams, lens, starts, store_tokens,
        limits, budgets, p_s, bool(chains), policy, tiers, _MODE_CODES, int(cfg.max_depth),
        float(cfg.spine_branch_ratio), float(cfg.min_branch_score), bool(cfg.spine_branches))
    return FlatTrees(offsets, tokens, parents, sources, values, depths), stats, ratios


# ``kernels.goose.spine_trees``' proposal codes: plain, tree, bypass (``base.MODE_CODES``)
_MODE_CODES = np.array([MODE_CODES[ProposalMode.PLAIN], MODE_CODES[ProposalMode.TREE], MODE_CODES[ProposalMode.BYPASS]],
                       np.int64)


def _in_order(parts: list[tuple[np.ndarray, FlatTrees]], num: int) -> FlatTrees:
    """The trees of several table groups, back in request order."""
    joined = FlatTrees.from_trees([t for _, flat in parts for t in flat.trees()])
    where = np.concatenate([idx for idx, _ in parts])
    inverse = np.empty(num, np.int64)
    inverse[where] = np.arange(num)
    return joined.select(inverse)


class GooseState(HarvestingState):
    """Per-request GOOSE state: spine-acceptance EMA, the (shared) table, the tenant's store.

    The per-step path proposes for a whole batch (``propose_spine_trees``); ``propose`` and
    ``propose_chain`` are that for one context (tests, the exact harness)."""

    def __init__(self, config: GooseConfig, table: AdjacencyTable, store: OutputStore | None = None) -> None:
        self.config = config
        self.table = table
        self.store = store  # the tenant's finished requests (cross_request_spine), or None
        self._prompt_len = -1
        self.spine_acceptance = float(config.initial_spine_acceptance)  # p_s (EMA)
        self._prev_root = -1
        self.last_info = ProposalInfo(ProposalMode.PLAIN)

    def _one(self, context_tokens, max_nodes=None, chain_drafts=None) -> DraftTree:
        context = np.ascontiguousarray(context_tokens, np.int64).reshape(1, -1)
        batch = propose_spine_trees([self], context, [0], [context.shape[1]],
                                    None if max_nodes is None else [node_budget(self.config.budget, max_nodes)],
                                    None if chain_drafts is None else [int(chain_drafts)])
        self.last_info = ProposalInfo(_MODES[int(batch.modes[0])], spine_len=int(batch.spine_lens[0]),
                                      ngram=int(batch.ngrams[0]), match_length=int(batch.match_lengths[0]),
                                      consensus=bool(batch.consensus[0]), spine_ratio=float(batch.spine_ratios[0]))
        return batch.trees.tree(0)

    def propose(self, context_tokens, max_nodes: int | None = None) -> DraftTree:
        return self._one(context_tokens, max_nodes)

    def propose_chain(self, context_tokens, max_drafts: int) -> DraftTree:
        """The spine alone, at most ``max_drafts`` tokens (root-only without a match): a chain
        step of the measured gate (``allocator.gate``), the linear bypass without its test."""
        return self._one(context_tokens, chain_drafts=max_drafts)

    def finish(self, context_tokens=None) -> None:
        """The request is done: its prompt's tail and output go to the cross-request store."""
        if self.store is not None and self._prompt_len >= 0 and context_tokens is not None:
            start = max(0, self._prompt_len - self.config.store_prompt_tail)
            self.store.add(np.asarray(context_tokens)[start:])
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


_MODES = {code: mode for mode, code in MODE_CODES.items()}


class GooseProposer(Proposer):
    """GOOSE (and its ablations, via ``GooseConfig`` switches)."""

    name = "goose"

    def __init__(self, config: GooseConfig | None = None, vocab_size: int | None = None) -> None:
        self.config = config or GooseConfig()
        self.vocab_size = vocab_size
        c = self.config
        self.max_tree_nodes = int(c.budget)  # the tree kernel builds at most B nodes
        stores = c.shared_table and c.cross_request_spine and c.context_spine
        # draft_state_bytes: a tenant is its table and its store; both kept or dropped together
        # (the same requests touch them in the same order, so their LRU orders agree)
        tenants, self.state_budget = tenant_budget(
            c, vocab_size, OutputStore.max_bytes(c.store_capacity, c.ngram_sizes) if stores else 0)
        self.tables = TenantTables(self._new_table, c.shared_table, tenants)
        self.stores = TenantTables(lambda: OutputStore(c.ngram_sizes, c.store_capacity), True, tenants) if stores else None

    def _new_table(self) -> AdjacencyTable:
        c = self.config
        return AdjacencyTable.for_config(c, self.vocab_size)

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

    def propose_batch(self, states, token_ids, rows, lengths, max_nodes=None, chain_drafts=None) -> GooseBatch:
        return propose_spine_trees(states, token_ids, rows, lengths, max_nodes, chain_drafts)

    def learn_batch(self, states, trees: FlatTrees, on_path: np.ndarray, prev_roots: np.ndarray,
                    rows: Callable[[np.ndarray | None], TopKRows] | None) -> None:
        """Algorithm 2 lines 15-16 for a step's verified trees at once: every node's top-k
        successors into its request's table, keyed (parent token, token), the root (token before
        it, root); p_s updated from the accepted spine nodes (``on_path`` ``[num_nodes]``: the
        node is on the accepted path). ``rows(nodes)``: the top-k rows of those nodes (indices in
        node order; None: every node), asked once, for the nodes whose rows a table keeps; ``rows``
        None: learn the EMA only. A node whose key a later node of the step writes to the same
        table again is not asked for (``kernels.table.last_writes``: the table would overwrite
        its row; only which bigram key a full window evicts can differ), nor are the nodes of
        finished requests and of frozen tables, nor, with ``refresh_steps``, the nodes whose
        entries their table wrote in its last ``refresh_steps`` steps
        (``AdjacencyTable.skip_fresh``)."""
        # each node's table key (its parent's token, a root's the token before it) and each
        # tree's spine nodes and accepted spine nodes: one compiled pass (kernels.goose.learn_keys)
        prev = np.empty(trees.num_nodes, np.int64)
        counts = np.empty((trees.num_trees, 2), np.int64)
        kernels.load("goose").learn_keys(trees.tokens, trees.parents, trees.sources, trees.offsets, on_path,
                                         np.asarray(prev_roots, np.int64), prev, counts)
        c = self.config.ema_coef
        for s, (n, a) in zip(states, counts.tolist()):
            if n and s is not None:
                s.spine_acceptance = (1.0 - c) * s.spine_acceptance + c * a / n
        if rows is None:
            return
        numbers: dict[int, int] = {}  # table id -> its number in this step
        tables = []
        owner = np.full(trees.num_trees, -1, np.int64)  # tree -> its table's number (-1: none learns)
        for k, s in enumerate(states):
            if s is not None and not s.table.frozen:
                g = numbers.setdefault(id(s.table), len(tables))
                if g == len(tables):
                    tables.append(s.table)
                owner[k] = g
        live = np.empty(trees.num_nodes, np.bool_)
        num_live = kernels.load("table").last_writes(prev, trees.tokens, trees.offsets, owner, live)
        if any(table.refresh_steps for table in tables):  # one tick a step per table, its live rows
            node_table = np.repeat(owner, trees.sizes())
            num_live = 0
            for g, table in enumerate(tables):
                mine = live & (node_table == g)
                num_live += table.skip_fresh(prev, trees.tokens, mine)
                live &= mine | (node_table != g)
        if num_live == trees.num_nodes and len(tables) == 1:  # every row kept (most steps of one request)
            tables[0].harvest(prev, trees.tokens, rows(None), checked=True)
            return
        if not num_live:
            return
        nodes = np.flatnonzero(live)
        top = rows(nodes)
        if len(tables) == 1:
            tables[0].harvest(prev[nodes], trees.tokens[nodes], top, checked=True)
            return
        node_table = np.repeat(owner, trees.sizes())[nodes]
        for g, table in enumerate(tables):
            mine = np.flatnonzero(node_table == g)
            table.harvest(prev[nodes[mine]], trees.tokens[nodes[mine]], top[mine], checked=True)
