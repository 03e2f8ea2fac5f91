"""GOOSE spine tree: Algorithm 1 arithmetic, tree invariants under random inputs, routing
(bypass / tree / plain), EMA tiers, and golden trees derived by hand from arXiv 2604.02047
Algorithms 1-2 (per-spine-node branch widths, expansion order, EMA values)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_anisotropic.proposers import get_proposer
from vllm_anisotropic.proposers.base import ProposalMode
from vllm_anisotropic.proposers import goose as goose_module
from vllm_anisotropic.proposers.adjacency import AdjacencyTable
from vllm_anisotropic.proposers.goose import build_spine_tree, harmonic_allocation, spine_chain, spine_ratio_tier
from vllm_anisotropic.tree import DraftTree, NodeSource


def table_fn(rows: dict, vocab: int | None = None) -> AdjacencyTable:
    """An adjacency table holding ``rows``: ``token -> [(succ, score), ...]`` unigram rows and
    ``(prev, token) -> [...]`` bigram rows, best first (scores stored as float32, as harvested)."""
    ids = [t for r in rows.values() for t, _ in r] + [k for key in rows for k in (key if isinstance(key, tuple) else (key,))]
    vocab = vocab or max(ids + [0]) + 1
    width = max([len(r) for r in rows.values()] + [1])
    table = AdjacencyTable(vocab, width, bigram=any(isinstance(k, tuple) for k in rows) or True)
    for key, r in rows.items():
        prev, tok = key if isinstance(key, tuple) else (-1, key)
        top = np.full((1, width), -1, np.int32)
        sc = np.zeros((1, width), np.float32)
        top[0, : len(r)] = [t for t, _ in r]
        sc[0, : len(r)] = [s for _, s in r]
        if prev < 0:
            table.update([-1], [tok], top, sc)
        else:  # the bigram only: the unigram row of tok stays as it was
            uni = (table.unigram_ids[tok].copy(), table.unigram_scores[tok].copy())
            table.update([prev], [tok], top, sc)
            table.unigram_ids[tok], table.unigram_scores[tok] = uni
    return table


def table_from(fn, vocab: int) -> AdjacencyTable:
    """The table of a successor function ``fn(prev, tok) -> (ids, scores)`` that ignores prev,
    for tokens below ``vocab`` (successors at or above ``vocab`` dropped; larger tokens: none)."""
    rows = {}
    for tok in range(vocab):
        ids, scores = fn(-1, tok)
        rows[tok] = [(int(t), float(s)) for t, s in zip(ids, scores) if t < vocab]
    return table_fn(rows, vocab)


def random_rows(rng: np.random.Generator, vocab: int, k: int, fill: float):
    rows = {}
    for tok in range(vocab):
        if rng.random() < fill:
            ids = rng.choice(vocab, size=k, replace=False)
            p = np.sort(rng.dirichlet(np.ones(k + 1) * 0.5)[:k])[::-1]
            rows[tok] = list(zip(ids.tolist(), p.tolist()))
    return rows


def test_harmonic_allocation_and_tiers():
    assert harmonic_allocation(20, 4) == [9, 4, 3, 2]
    assert harmonic_allocation(20, 18)[:6] == [5, 2, 1, 1, 1, 0]
    assert harmonic_allocation(0, 3) == [0, 0, 0]
    assert [spine_ratio_tier(p) for p in (0.0, 0.19, 0.2, 0.39, 0.4, 1.0)] == [0.15, 0.15, 0.30, 0.30, 0.50, 0.50]


def test_algorithm1_split_and_spine():
    def succ(prev, tok):  # every token has 10 fresh successors
        return np.arange(100 + 10 * tok, 110 + 10 * tok), 0.2 / np.arange(1, 11)

    spine = np.arange(1, 21)
    tree = build_spine_tree(0, -1, spine, table_from(succ, 5000), budget=60, spine_ratio=0.3, spine_branch_ratio=0.5)
    assert tree.num_nodes == 60
    is_spine = tree.sources == NodeSource.SPINE
    assert is_spine.sum() == 18  # floor(60 * 0.3)
    # spine is a chain root -> d1 -> ... -> d18 with the draft tokens in order
    spine_nodes = np.flatnonzero(is_spine)
    assert sorted(tree.depths[spine_nodes].tolist()) == list(range(1, 19))
    by_depth = {int(tree.depths[i]): int(tree.tokens[i]) for i in spine_nodes}
    assert [by_depth[d] for d in range(1, 19)] == list(range(1, 19))
    # root gets min(b_r = 21, K = 10) first-level branches
    kids = tree.children_lists()[0]
    assert sum(tree.sources[k] == NodeSource.BRANCH for k in kids) == 10


def test_duplicate_spine_child_excluded():
    rows = {0: [(1, 0.5), (2, 0.3)], 1: [(2, 0.6), (3, 0.3)]}
    tree = build_spine_tree(0, -1, np.array([1, 2]), table_fn(rows), budget=10, spine_ratio=0.5)
    for kids in tree.children_lists():
        toks = [int(tree.tokens[k]) for k in kids]
        assert len(toks) == len(set(toks))
    assert tree.num_nodes == 5  # root, spine 1, 2, branch 2 at root, branch 3 at d1


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 10_000),
    budget=st.integers(1, 80),
    spine_len=st.integers(0, 25),
    ratio=st.sampled_from([0.15, 0.30, 0.50]),
    rho=st.floats(0.0, 1.0),
    depth=st.integers(1, 7),
    fill=st.floats(0.0, 1.0),
    spine_branches=st.booleans(),
)
def test_tree_invariants(seed, budget, spine_len, ratio, rho, depth, fill, spine_branches):
    rng = np.random.default_rng(seed)
    vocab = 40
    rows = random_rows(rng, vocab, 10, fill)
    spine = rng.integers(0, vocab, spine_len)
    tree = build_spine_tree(
        int(rng.integers(vocab)), -1, spine, table_fn(rows), budget=budget, max_depth=depth,
        spine_ratio=ratio, spine_branch_ratio=rho, min_branch_score=0.01, spine_branches=spine_branches,
    )
    tree.validate()
    assert tree.num_nodes <= budget
    assert int((tree.sources == NodeSource.SPINE).sum()) == min(spine_len, math.floor(budget * ratio), budget - 1)
    assert np.all(np.diff(tree.values) <= 0)  # value order
    for kids in tree.children_lists():  # no duplicate siblings
        toks = [int(tree.tokens[k]) for k in kids]
        assert len(toks) == len(set(toks))
    # branch subtree depth <= D below its branching (spine or root) node
    for i in range(1, tree.num_nodes):
        if tree.sources[i] == NodeSource.BRANCH:
            j, d = i, 0
            while tree.sources[j] == NodeSource.BRANCH:
                j, d = int(tree.parents[j]), d + 1
            assert d <= depth
        # every branch score passed the 0.01 filter: value ratio child/parent >= 0.01
        if tree.sources[i] == NodeSource.BRANCH:
            assert tree.values[i] >= 0.01 * tree.values[tree.parents[i]] - 1e-12
    for n in range(1, tree.num_nodes + 1):  # any prefix is a valid tree
        tree.truncate(n).validate()
    if not spine_branches:
        assert all(tree.sources[int(tree.parents[i])] != NodeSource.SPINE or tree.sources[i] == NodeSource.SPINE
                   for i in range(1, tree.num_nodes))


def _state(name="goose", **kw):
    return get_proposer(name, vocab_size=64, **kw).new_request()


REPEAT = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]


def test_routing_bypass_consensus_and_long():
    s = _state()
    ctx = np.array(REPEAT + [1] + REPEAT[:5])
    s.propose(ctx)
    assert s.last_info.mode == ProposalMode.BYPASS and s.last_info.consensus
    # long draft without consensus: n=3 only (4- and 5-gram absent)
    s2 = _state(consensus_bypass=False)
    ctx2 = np.array([1, 2, 3] + list(range(30, 45)) + [1, 2, 3])
    t2 = s2.propose(ctx2)
    assert s2.last_info.mode == ProposalMode.BYPASS and t2.num_nodes == 19
    assert np.all(t2.sources[1:] == NodeSource.SPINE)


def test_routing_short_match_tree_and_plain():
    s = _state()
    # n=3 match 2 tokens before the end: draft of 2 tokens, single length -> no bypass
    ctx = np.array([40, 5, 6, 7, 8, 9, 50, 6, 7, 8, 9, 41, 7, 8, 9])
    t = s.propose(ctx)
    info = s.last_info
    assert info.mode == ProposalMode.TREE and not info.consensus
    # empty table (graceful start): the tree is the spine alone
    assert np.all(t.sources[1:] == NodeSource.SPINE) and t.num_nodes == 1 + info.spine_len
    # nothing at all -> plain decoding
    s2 = _state()
    t2 = s2.propose(np.array([1, 2, 3, 4]))
    assert s2.last_info.mode == ProposalMode.PLAIN and t2.num_nodes == 1
    # no-bypass ablation builds a tree where the full goose bypasses
    s3 = _state("goose-no-bypass")
    s3.propose(np.array(REPEAT + [1] + REPEAT[:5]))
    assert s3.last_info.mode == ProposalMode.TREE


def test_table_fills_from_observe_and_ema_tiers():
    s = _state("goose-no-bypass")
    ctx = np.array(REPEAT + [1] + REPEAT[:5])
    t = s.propose(ctx)
    logits = torch.full((t.num_nodes, 64), -10.0)
    logits[:, 33] = 5.0
    s.observe(t, [], logits)  # every spine token rejected
    assert s.spine_acceptance == pytest.approx(0.7 * 0.3)
    t2 = s.propose(ctx)  # table now predicts 33 after every verified token
    assert s.last_info.spine_ratio == 0.30
    assert any(t2.tokens[k] == 33 for k in t2.children_lists()[0])
    s.observe(t2, [], None)
    assert s.spine_acceptance < 0.2 and spine_ratio_tier(s.spine_acceptance) == 0.15
    s.propose(ctx)
    assert s.last_info.spine_ratio == 0.15
    spine = np.flatnonzero(t2.sources == NodeSource.SPINE)
    path = sorted(spine.tolist(), key=lambda i: t2.depths[i])
    for _ in range(6):
        s.observe(t2, path, None)  # all spine accepted
    assert s.spine_acceptance >= 0.4


# ---------------------------------------------------------------- golden trees
# Hand-derived from GOOSE (arXiv 2604.02047) Algorithm 1 lines 1-13, Appendix B.1 (duplicate
# spine continuation excluded) and C.1 (scores < 0.01 pruned), with the value-ordered step 4 of
# ``goose.py``'s module docstring. Each expected value below states how it was derived; none was
# copied from the implementation's output. (They replace a Prop. 4 yield test that asserted
# nothing once the spine was 8 tokens long.)


def _recording_builder(monkeypatch):
    """Record every tree ``build_spine_tree`` builds as its nodes' (parent token, token, value)
    in build (= expansion) order, root excluded, from the kernel's build index; returns the
    list of logs (one per built tree)."""
    logs: list[list[tuple[int, int, float]]] = []
    build = goose_module._build

    def recording(*args, **kwargs):
        flat, order = build(*args, **kwargs)
        tree = flat.tree(0)
        nodes = np.argsort(order[: tree.num_nodes])[1:]
        logs.append([(int(tree.tokens[tree.parents[i]]), int(tree.tokens[i]), float(tree.values[i])) for i in nodes])
        return flat, order

    monkeypatch.setattr(goose_module, "_build", recording)
    return logs


# spine d = (1, 2, 3, 4). Spine token i's row: the continuation d_{i+1} first (score 0.6, the
# duplicate that B.1 excludes; d_4 has none), then five branch tokens 10i .. 10i+4. The root's
# row: d_1 first (excluded), then twelve tokens 50 .. 61. Branch tokens have no rows, so step 4
# (line 13) adds nothing and the first-level widths are visible as they were allocated.
_BRANCH_SCORES = [0.2, 0.1, 0.05, 0.03, 0.02]
_ROOT_SCORES = [0.30, 0.25, 0.20, 0.15, 0.12, 0.10, 0.08, 0.06, 0.05, 0.04, 0.03, 0.02]
_WIDTH_ROWS = {
    0: [(1, 0.6)] + [(50 + j, s) for j, s in enumerate(_ROOT_SCORES)],
    **{i: ([(i + 1, 0.6)] if i < 4 else []) + [(10 * i + j, s) for j, s in enumerate(_BRANCH_SCORES)] for i in (1, 2, 3, 4)},
}


def _branch_children(tree, token: int) -> list[int]:
    (node,) = np.flatnonzero(tree.tokens == token)
    return [int(tree.tokens[k]) for k in tree.children_lists()[node] if tree.sources[k] == NodeSource.BRANCH]


def test_golden_budget_split_and_harmonic_widths():
    """B = 26, r = 0.3, rho = 0.5, m = 4 (Algorithm 1 lines 1-3 and 10):
    b_s = min(4, floor(26 * 0.3) = 7) = 4; B - 1 - b_s = 21; b_r = ceil(21 * 0.5) = 11;
    b_sigma = 21 - 11 = 10; H(4) = 1 + 1/2 + 1/3 + 1/4 = 25/12, so
    a_i = floor(10 / i / H(4)) = floor(4.8 / i) = [4, 2, 1, 1] (widest at d_1, harmonic decay).
    The root takes its top 11 of 12 non-duplicate successors; spine node d_i its top a_i
    branch tokens 10i, 10i+1, ...; nodes 1 + 4 + 11 + 8 = 24 <= B."""
    tree = build_spine_tree(0, -1, np.array([1, 2, 3, 4]), table_fn(_WIDTH_ROWS), budget=26, max_depth=6,
                            spine_ratio=0.3, spine_branch_ratio=0.5, spine_acceptance=0.3)
    assert tree.num_nodes == 24
    assert _branch_children(tree, 0) == [50 + j for j in range(11)]
    widths = [len(_branch_children(tree, i)) for i in (1, 2, 3, 4)]
    assert widths == [4, 2, 1, 1]
    for i, a in zip((1, 2, 3, 4), widths):
        assert _branch_children(tree, i) == [10 * i + j for j in range(a)]  # top-a_i by score
    # values: spine d_i = p_s ** i; a branch child = value(parent) * score
    val = {int(t): float(v) for t, v in zip(tree.tokens, tree.values)}
    assert [val[i] for i in (1, 2, 3, 4)] == pytest.approx([0.3, 0.09, 0.027, 0.0081], rel=1e-6)
    assert val[20] == pytest.approx(0.09 * 0.2, rel=1e-6) and val[50] == pytest.approx(0.3, rel=1e-6)
    assert np.all(np.diff(tree.values) <= 0)


def test_golden_widths_without_spine_branches_and_tight_budget():
    """spine_branches=False (the 'w/o spine branches' ablation): b_r = B - 1 - b_s, b_sigma = 0.
    B = 12, r = 0.3: b_s = min(4, floor(3.6) = 3) = 3 (only d_1..d_3 laid), b_r = 11 - 3 = 8: the
    root gets its top 8 successors 50..57 and no spine node gets a branch; 1 + 3 + 8 = 12 = B.
    With spine branches on and the same B: b_r = ceil(8 * 0.5) = 4, b_sigma = 4,
    a = floor(4 / i / H(3)) with H(3) = 11/6: floor(2.18), floor(1.09), floor(0.73) = [2, 1, 0]."""
    spine = np.array([1, 2, 3, 4])
    fn = table_fn(_WIDTH_ROWS)
    off = build_spine_tree(0, -1, spine, fn, budget=12, spine_ratio=0.3, spine_branches=False)
    assert off.num_nodes == 12 and _branch_children(off, 0) == list(range(50, 58))
    assert [len(_branch_children(off, i)) for i in (1, 2, 3)] == [0, 0, 0] and 4 not in off.tokens
    on = build_spine_tree(0, -1, spine, fn, budget=12, spine_ratio=0.3, spine_branches=True)
    assert _branch_children(on, 0) == [50, 51, 52, 53]
    assert [len(_branch_children(on, i)) for i in (1, 2, 3)] == [2, 1, 0]
    assert on.num_nodes == 1 + 3 + 4 + 3


# A TR-only table (no spine) for the value-ordered step 4. The heap key of a node's next
# candidate is value(node) * score(candidate); the largest is expanded first.
_EXPAND_ROWS = {0: [(1, 0.6), (2, 0.3)], 1: [(3, 0.5), (4, 0.4)], 2: [(5, 0.9)], 3: [(6, 0.5)], 6: [(7, 0.9)]}


def test_golden_expansion_order(monkeypatch):
    """B = 6 (5 drafts), no spine, rho = 0.5: b_r = ceil(5 * 0.5) = 3, the root has 2 successors:
    adds 1 (0.6) and 2 (0.3). Heap: 1's first candidate 3 at 0.6 * 0.5 = 0.30, 2's candidate 5
    at 0.3 * 0.9 = 0.27. Pop 0.30: add 3 under 1 (then 1's next candidate 4 at 0.6 * 0.4 =
    0.24 and 3's candidate 6 at 0.30 * 0.5 = 0.15 enter the heap); pop 0.27: add 5 under 2;
    pop 0.24: add 4 under 1; 5 drafts placed, stop. Output order: value descending, ties by depth
    (2 and 3 both have value 0.3: 2, at depth 1, first)."""
    logs = _recording_builder(monkeypatch)
    tree = build_spine_tree(0, -1, np.zeros(0, np.int64), table_fn(_EXPAND_ROWS), budget=6, max_depth=3)
    (log,) = logs
    assert [(p, t) for p, t, _ in log] == [(0, 1), (0, 2), (1, 3), (2, 5), (1, 4)]
    assert [v for _, _, v in log] == pytest.approx([0.6, 0.3, 0.3, 0.27, 0.24], rel=1e-6)
    assert tree.tokens.tolist() == [0, 1, 2, 3, 5, 4]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 1]
    assert tree.values.tolist() == pytest.approx([1.0, 0.6, 0.3, 0.3, 0.27, 0.24], rel=1e-6)


def test_golden_expansion_depth_cap(monkeypatch):
    """Same table, B = 9 (8 drafts), D = 3: after the five adds above, pop 0.15: add 6 under 3
    (branch depth 3 = D, so 6's candidate 7 is never queued); the heap is empty with 6 drafts
    placed (the budget is not the limit, D is). With D = 4, 7 (0.15 * 0.9 = 0.135) follows."""
    logs = _recording_builder(monkeypatch)
    fn = table_fn(_EXPAND_ROWS)
    tree = build_spine_tree(0, -1, np.zeros(0, np.int64), fn, budget=9, max_depth=3)
    assert [(p, t) for p, t, _ in logs[0]] == [(0, 1), (0, 2), (1, 3), (2, 5), (1, 4), (3, 6)]
    assert tree.num_nodes == 7
    deeper = build_spine_tree(0, -1, np.zeros(0, np.int64), fn, budget=9, max_depth=4)
    assert [(p, t) for p, t, _ in logs[1]][-1] == (6, 7) and deeper.num_nodes == 8
    assert deeper.values[-1] == pytest.approx(0.135, rel=1e-6)


def test_golden_spine_continuation_branches_expand_by_value(monkeypatch):
    """Spine (5,), B = 6, r = 0.5, rho = 0.5, p_s = 0.8: b_s = 1; rest = 4; b_r = 2; b_sigma = 2,
    a_1 = floor(2 / 1 / H(1)) = 2. Root row [5 (dup, excluded), 1 (0.6)]: adds 1 at 0.6, queues
    1's candidate 3 at 0.6 * 0.5 = 0.30. Spine d_1 = 5 (value 0.8), row [8 (0.5), 9 (0.25)]: adds
    8 at 0.4 and 9 at 0.2; 8's candidate 3 (row 8) at 0.4 * 0.9 = 0.36 is queued. 4 drafts
    placed, budget 5: pop the best, 0.36 (3 under 8) -- not 0.30 (3 under 1) and not the worst."""
    logs = _recording_builder(monkeypatch)
    rows = {0: [(5, 0.7), (1, 0.6)], 1: [(3, 0.5)], 5: [(8, 0.5), (9, 0.25)], 8: [(3, 0.9)]}
    tree = build_spine_tree(0, -1, np.array([5]), table_fn(rows), budget=6, spine_ratio=0.5, spine_acceptance=0.8)
    assert [(p, t) for p, t, _ in logs[0]] == [(0, 5), (0, 1), (5, 8), (5, 9), (8, 3)]
    assert [v for _, _, v in logs[0]] == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.36], rel=1e-6)
    assert tree.tokens.tolist() == [0, 5, 1, 8, 3, 9]


def _spine_tree_for_ema():
    # root -> d1 -> d2 -> d3 -> d4 (SPINE), plus BRANCH nodes 5 (at the root) and 6 (at d1)
    S = NodeSource
    return DraftTree(tokens=[9, 1, 2, 3, 4, 7, 8], parents=[-1, 0, 1, 2, 3, 0, 1],
                     sources=[S.ROOT, S.SPINE, S.SPINE, S.SPINE, S.SPINE, S.BRANCH, S.BRANCH])


def test_golden_ema_values_and_tiers():
    """Algorithm 2 line 16 with c = 0.3 (Table 5), p_s starting at 0.3 (Alg. 2 line 3):
    p_s <- 0.7 p_s + 0.3 * (accepted spine nodes / spine nodes proposed); tiers (Sec. 4.3):
    < 0.2 -> 0.15, < 0.4 -> 0.30, else 0.50. Accepted BRANCH nodes do not count; a tree
    without spine nodes leaves p_s unchanged."""
    s = _state()
    tree = _spine_tree_for_ema()
    tr_only = DraftTree(tokens=[9, 7], parents=[-1, 0], sources=[NodeSource.ROOT, NodeSource.BRANCH])
    steps = [
        (tree, [1, 2], 0.7 * 0.3 + 0.3 * 2 / 4),  # 0.36
        (tree, [5], 0.7 * 0.36),  # 0.252: a branch at the root accepted, no spine node
        (tree, [1, 2, 3, 4], 0.7 * 0.252 + 0.3),  # 0.4764
        (tr_only, [1], 0.4764),  # no spine proposed: unchanged
        (tree, [1, 6], 0.7 * 0.4764 + 0.3 / 4),  # 0.40848: spine d1 then the branch under it
        (tree, [], 0.7 * 0.40848),  # 0.285936
        (tree, [], 0.7 * 0.285936),  # 0.2001552
        (tree, [], 0.7 * 0.2001552),  # 0.14010864
    ]
    want_tiers = [0.30, 0.30, 0.50, 0.50, 0.50, 0.30, 0.30, 0.15]
    ctx = np.array([40, 41, 42, 43])  # no n-gram match: the tier is still reported
    for (t, accepted, want), tier in zip(steps, want_tiers):
        s.observe(t, accepted, None)
        assert s.spine_acceptance == pytest.approx(want, rel=1e-6)
        s.propose(ctx)
        assert s.last_info.spine_ratio == tier


def test_golden_bypass_threshold_and_chain_values():
    """Linear bypass (Sec. 4.3, Table 5): a draft of >= 8 tokens, or consensus, is verified as
    the chain root -> d_1 .. d_m with values p_s ** i; 7 tokens without consensus build a tree."""
    def ctx_with_draft(length):
        # (1, 2, 3) seen once, then length - 3 fresh tokens, then (1, 2, 3) again at the end: the
        # 3-gram's continuation runs to the end of the context, fresh tokens + (1, 2, 3)
        return np.array([1, 2, 3] + list(range(30, 27 + length)) + [1, 2, 3])

    for length, mode in ((8, ProposalMode.BYPASS), (7, ProposalMode.TREE)):
        s = _state(consensus_bypass=False)
        s.spine_acceptance = 0.5
        t = s.propose(ctx_with_draft(length))
        assert s.last_info.mode == mode and s.last_info.ngram == 3 and not s.last_info.consensus
        if mode == ProposalMode.BYPASS:
            assert s.last_info.spine_len == 8
            assert t.tokens.tolist() == [3] + list(range(30, 35)) + [1, 2, 3]
            assert t.parents.tolist() == list(range(-1, 8))
            assert t.values.tolist() == pytest.approx([0.5 ** i for i in range(9)], rel=1e-6)
        else:  # the tree's spine: b_s = min(7, floor(60 * 0.5)) = 7 (p_s = 0.5 -> r = 0.50)
            assert s.last_info.spine_len == 7 and s.last_info.spine_ratio == 0.5
    chain = spine_chain(7, np.array([1, 2]), 0.0)  # p_s clamped to 1e-3
    assert chain.values.tolist() == pytest.approx([1.0, 1e-3, 1e-6], rel=1e-6)
    assert chain.sources.tolist() == [NodeSource.ROOT, NodeSource.SPINE, NodeSource.SPINE]


def test_allocation_filter_and_chain_edges():
    """Edges found by mutation testing (docs/testing.md): Algorithm 1 line 10 at m = 1
    (H(1) = 1: a_1 = total) and on empty / non-positive input; C.1's threshold keeps a score of
    exactly 0.01 ("below 0.01 pruned") and never keeps a zero score; p_s is clamped to [1e-3, 1]."""
    assert harmonic_allocation(1, 1) == [1] and harmonic_allocation(5, 1) == [5]
    assert harmonic_allocation(3, 0) == [] and harmonic_allocation(3, -1) == []
    assert harmonic_allocation(-5, 3) == [0, 0, 0]
    rows = {0: [(1, 0.5), (2, 0.01), (3, 0.0099)]}
    tree = build_spine_tree(0, -1, np.zeros(0, np.int64), table_fn(rows), budget=10, min_branch_score=0.01)
    assert sorted(tree.tokens[1:].tolist()) == [1, 2]
    rows = {0: [(1, 0.5), (2, 0.0)]}
    tree = build_spine_tree(0, -1, np.zeros(0, np.int64), table_fn(rows), budget=10, min_branch_score=0.0)
    assert tree.tokens.tolist() == [0, 1]
    assert spine_chain(7, np.array([1, 2]), 1.5).values.tolist() == [1.0, 1.0, 1.0]
    # build_spine_tree clamps p_s the same way for the spine values
    fn = table_fn({})
    low = build_spine_tree(0, -1, np.array([1, 2]), fn, budget=10, spine_ratio=0.5, spine_acceptance=0.0)
    assert low.values.tolist() == pytest.approx([1.0, 1e-3, 1e-6], rel=1e-6)
    high = build_spine_tree(0, -1, np.array([1, 2]), fn, budget=10, spine_ratio=0.5, spine_acceptance=1.5)
    assert high.values.tolist() == [1.0, 1.0, 1.0]
    # spine_branches=False: b_sigma = 0 even when b_s = 1 (a_1 = b_sigma / H(1) would be > 0)
    rows = {0: [(1, 0.6), (5, 0.25)], 1: [(6, 0.5)]}
    tree = build_spine_tree(0, -1, np.array([1]), table_fn(rows), budget=10, spine_ratio=0.5, spine_branches=False)
    assert tree.tokens.tolist() == [0, 1, 5] and tree.parents.tolist() == [-1, 0, 0]


def test_bigram_keys_of_every_lookup():
    """Appendix C.1 bigram tier: every lookup is keyed by (previous token, token) on the path:
    the root by (context token before it, root), spine d_1 by (root, d_1), a branch node by
    (its parent's token, its token). The table below answers 'wrong' for any other key."""
    rows = {(9, 0): [(1, 0.9), (2, 0.6)], (0, 1): [(7, 0.5)], (0, 2): [(3, 0.5)], (2, 3): [(4, 0.5)]}
    # 99: a wrong key was used for a token that has rows (its unigram row); other tokens have none
    succ = table_fn({**{t: [(99, 0.99)] for t in (0, 1, 2, 3)}, **rows}, vocab=100)

    tree = build_spine_tree(0, 9, np.array([1]), succ, budget=8, spine_ratio=0.5)
    assert 99 not in tree.tokens.tolist()
    assert sorted(tree.tokens.tolist()) == [0, 1, 2, 3, 4, 7]
    tr = build_spine_tree(0, 9, np.zeros(0, np.int64), succ, budget=8)  # node 1 is a root branch
    assert 99 not in tr.tokens.tolist()


def test_first_level_fills_the_budget_exactly_and_ties_expand_in_build_order(monkeypatch):
    """(1) B = 6, spine (5,), r = 0.5: b_s = 1, b_r = ceil(4 * 0.5) = 2, b_sigma = 2, a_1 = 2:
    the first level alone spends all 5 draft slots (root: 1, 2; d_1: 8, 9).
    (2) Equal heap keys expand in push order: root children 1 and 2 both at 0.5, each with one
    candidate at score 0.4 (key 0.2); with one slot left, 1's candidate 3 is taken (pushed first)."""
    rows = {0: [(5, 0.9), (1, 0.3), (2, 0.2)], 5: [(8, 0.5), (9, 0.4)]}
    tree = build_spine_tree(0, -1, np.array([5]), table_fn(rows), budget=6, spine_ratio=0.5, spine_acceptance=0.8)
    assert sorted(tree.tokens.tolist()) == [0, 1, 2, 5, 8, 9]
    logs = _recording_builder(monkeypatch)
    rows = {0: [(1, 0.5), (2, 0.5)], 1: [(3, 0.4)], 2: [(4, 0.4)]}
    build_spine_tree(0, -1, np.zeros(0, np.int64), table_fn(rows), budget=4)
    assert [(p, t) for p, t, _ in logs[0]] == [(0, 1), (0, 2), (1, 3)]


def test_next_candidate_rank_and_repush_ties(monkeypatch):
    """(1) A node's candidates are taken in rank order, each once: root -> 1 (0.9); 1's row
    [2 (0.5), 3 (0.3), 4 (0.1)] -> 2, 3, 4. (2) A re-pushed candidate ties with a later-pushed
    one: 1 (0.8) -> 2 at 0.8 * 0.5 = 0.4, then 1's next candidate 3 (key 0.8 * 0.25 = 0.2) is
    re-pushed before 2's candidate 4 (key 0.4 * 0.5 = 0.2): with one slot left, 3 is taken."""
    logs = _recording_builder(monkeypatch)
    rows = {0: [(1, 0.9)], 1: [(2, 0.5), (3, 0.3), (4, 0.1)]}
    build_spine_tree(0, -1, np.zeros(0, np.int64), table_fn(rows), budget=8)
    assert [(p, t) for p, t, _ in logs[0]] == [(0, 1), (1, 2), (1, 3), (1, 4)]
    rows = {0: [(1, 0.8)], 1: [(2, 0.5), (3, 0.25)], 2: [(4, 0.5)]}
    build_spine_tree(0, -1, np.zeros(0, np.int64), table_fn(rows), budget=4)
    assert [(p, t) for p, t, _ in logs[1]] == [(0, 1), (1, 2), (1, 3)]


def test_propose_keys_the_root_by_the_token_before_it():
    """GooseState.propose: the root's successors come from bigram (context[-2], root); a
    one-token context has no previous token (unigram row)."""
    for context, want in (([5, 7, 8], 20), ([7, 8], 20), ([8], 30), ([9, 8], 30)):
        s = _state("goose-no-spine")
        # bigram (7, 8) -> 20, unigram 8 -> 30; decoy bigram (1, 8) -> 40 (no previous token is -1, not 1)
        s.table.update([7, 1, -1], [8, 8, 8], np.array([[20], [40], [30]], np.int32), np.full((3, 1), 0.5, np.float32))
        tree = s.propose(np.array(context))
        assert [int(tree.tokens[k]) for k in tree.children_lists()[0]] == [want], context
        assert tree.num_nodes == 2 and s.last_info.mode == ProposalMode.TREE  # one draft node is a tree


def test_bypass_chain_is_cut_to_the_call_budget():
    """max_nodes = 5: the match is asked for at most B - 1 = 4 tokens; the consensus bypass
    verifies exactly those 4 (a 14-token repeat would give 20)."""
    s = _state()
    tree = s.propose(np.array(REPEAT + [1] + REPEAT[:5]), max_nodes=5)
    assert s.last_info.mode == ProposalMode.BYPASS and tree.tokens.tolist() == [14, 15, 16, 17, 18]


def test_repush_key_uses_the_next_candidates_score(monkeypatch):
    """Root row [1 (0.8), 9 (0.5)], B = 6 (5 drafts, b_r = 3): heap 1 -> 2 at 0.8 * 0.5 = 0.40, 9 -> 7
    at 0.5 * 0.7 = 0.35. Pop 0.40 (add 2); 1's next candidate 3 is re-pushed at 0.8 * 0.4 = 0.32
    (its own score, not another rank's). Pop 0.35 (add 7; 7 -> 8 queued at 0.35 * 0.5 = 0.175).
    Pop 0.32: add 3, the fifth draft. A branch node's candidates exclude nothing (token 1 is a
    legal successor of 9 -> ... nodes: checked with 8 -> 1 below)."""
    logs = _recording_builder(monkeypatch)
    rows = {0: [(1, 0.8), (9, 0.5)], 1: [(2, 0.5), (3, 0.4), (4, 0.1)], 9: [(7, 0.7)], 7: [(8, 0.5)], 8: [(1, 0.9)]}
    build_spine_tree(0, -1, np.zeros(0, np.int64), table_fn(rows), budget=6)
    assert [(p, t) for p, t, _ in logs[0]] == [(0, 1), (0, 9), (1, 2), (9, 7), (1, 3)]
    tree = build_spine_tree(0, -1, np.zeros(0, np.int64), table_fn(rows), budget=20)
    # everything fits: 1 + {1, 9} + {2, 3, 4} + 7 + 8 + 1 (under 8) + its {2, 3, 4} = 12 nodes
    assert (8, 1) in [(p, t) for p, t, _ in logs[1]] and tree.num_nodes == 12


def test_golden_chain_step_tree():
    """A chain step (``propose_chain``): the context match's continuation as one chain below the
    root, depths 0..n, spine sources, values clamp(p_s, 1e-3, 1)^depth (p_s above 1 counts as 1,
    p_s 0 as 1e-3). Context ``7 1 2 3 4 5 1 2 3``: the 3-gram ``1 2 3`` occurred at 1..3, so the
    continuation is ``4 5 1 ...``, cut to 3 tokens."""
    from vllm_anisotropic.proposers import get_proposer
    from vllm_anisotropic.tree import NodeSource

    prop = get_proposer("goose", vocab_size=10)
    ctx = np.array([7, 1, 2, 3, 4, 5, 1, 2, 3])
    for p_s, v in ((1.2, 1.0), (0.0, 1e-3), (0.5, 0.5)):
        state = prop.new_request()
        state.spine_acceptance = p_s
        tree = state.propose_chain(ctx, 3)
        assert tree.tokens.tolist() == [3, 4, 5, 1]
        assert tree.parents.tolist() == [-1, 0, 1, 2]
        assert tree.depths.tolist() == [0, 1, 2, 3]
        assert tree.sources.tolist() == [NodeSource.ROOT] + [NodeSource.SPINE] * 3
        np.testing.assert_allclose(tree.values, [1.0, v, v ** 2, v ** 3], rtol=1e-12)
