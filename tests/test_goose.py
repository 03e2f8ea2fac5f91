"""GOOSE spine tree: Algorithm 1 arithmetic, tree invariants under random inputs, routing
(bypass / tree / plain), EMA tiers, and the non-degradation property (Prop. 4) on synthetic
acceptance models with the analytic expected yield."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_anisotropic.proposers import get_proposer
from vllm_anisotropic.proposers.base import ProposalMode
from vllm_anisotropic.proposers.goose import build_spine_tree, harmonic_allocation, spine_ratio_tier
from vllm_anisotropic.tree import NodeSource


def table_fn(rows: dict):
    """A successor function over a dict ``token -> [(succ, score), ...]`` (unigram only)."""

    def fn(prev, tok):
        r = rows.get(int(tok), [])
        return np.array([t for t, _ in r], np.int64), np.array([s for _, s in r], np.float64)

    return fn


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
    tree = build_spine_tree(0, -1, spine, succ, budget=60, spine_ratio=0.3, spine_branch_ratio=0.5)
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


# ---------------------------------------------------------------- Prop. 4 (analytic)
def expected_yield(tree, p_s: float, branch_prob) -> float:
    """E[tau] = 1 + sum over nodes of P(path accepted) under a synthetic target: at a node
    with a spine child, the target's next token is that child w.p. p_s; a branch child c of
    node u is the target's next token w.p. branch_prob(u_token, c_token) (the remaining mass
    split among the table's successors). Children are distinct, so the greedy walk follows at
    most one child and these events are exclusive."""
    reach = np.zeros(tree.num_nodes)
    reach[0] = 1.0
    for i in range(1, tree.num_nodes):
        u = int(tree.parents[i])
        q = p_s if tree.sources[i] == NodeSource.SPINE else branch_prob(int(tree.tokens[u]), int(tree.tokens[i]), bool(
            any(tree.sources[k] == NodeSource.SPINE for k in tree.children_lists()[u])))
        reach[i] = reach[u] * q
    return 1.0 + reach[1:].sum()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), p_s=st.floats(0.1, 0.95), spine_len=st.integers(0, 20), budget=st.sampled_from([20, 40, 60]))
def test_non_degradation_prop4(seed, p_s, spine_len, budget):
    """GOOSE's tree (the spine tree, or the bypass chain) yields at least as much as
    standalone PLD (the same chain) and as the standalone transition tree given the full
    budget, in the regime of Prop. 3-4: spine tokens at least as reliable as branch tokens
    (p_s >= the largest branch acceptance)."""
    rng = np.random.default_rng(seed)
    vocab = 60
    spine = rng.choice(np.arange(30, 60), size=spine_len, replace=False) if spine_len else np.zeros(0, np.int64)
    rows = {}
    for tok in range(vocab):  # successors among tokens 0..29 (never spine tokens)
        ids = rng.choice(30, size=10, replace=False)
        p = np.sort(rng.dirichlet(np.ones(10)))[::-1] * min(p_s, 0.9)
        rows[tok] = list(zip(ids.tolist(), p.tolist()))
    fn = table_fn(rows)

    def branch_prob(u_tok, c_tok, has_spine):
        s = dict(rows[u_tok]).get(c_tok, 0.0)
        return s * (1.0 - p_s) if has_spine else s

    root = 0
    pld = 1.0 + sum(p_s ** i for i in range(1, min(spine_len, budget - 1) + 1))
    tr = expected_yield(build_spine_tree(root, -1, np.zeros(0), fn, budget=budget, spine_ratio=0.3), p_s, branch_prob)
    for ratio in (0.15, 0.30, 0.50):
        if spine_len >= 8:  # bypass (Prop. 4 part i): the chain itself
            goose = pld
        else:
            goose_tree = build_spine_tree(root, -1, spine, fn, budget=budget, spine_ratio=ratio)
            goose = expected_yield(goose_tree, p_s, branch_prob)
            assert goose >= pld - 1e-9 or spine_len > math.floor(budget * ratio)
        if spine_len < 8 and spine_len <= math.floor(budget * ratio):
            assert goose >= pld - 1e-9
        if spine_len == 0:
            assert goose == pytest.approx(tr)
        elif spine_len < 8:
            assert goose >= tr - 1e-9, (goose, tr)
