"""The compiled GOOSE kernels against their references: the tree builder against the Python
Algorithm 1 it replaced (``goose_reference.py``: same trees, same values bit for bit, same LRU
stamps left in the table), and the batch proposal against one request at a time."""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from goose_reference import build_spine_tree as reference_tree
from vllm_anisotropic.proposers import get_proposer
from vllm_anisotropic.proposers.adjacency import AdjacencyTable
from vllm_anisotropic.proposers.base import MODE_CODES
from vllm_anisotropic.proposers.goose import build_spine_tree, propose_spine_trees


def random_table(rng: np.random.Generator, vocab: int, k: int, fill: float, bigrams: int, capacity: int = 64,
                 ties: bool = False):
    """A table of random rows; ``ties``: scores from {1/2, 1/4, 1/8, 1/16}, so equal scores and
    equal products (tree values) are common and the builder's tie order is exercised."""
    table = AdjacencyTable(vocab, k, bigram_capacity=capacity)
    for _ in range(int(vocab * fill) + bigrams):
        width = int(rng.integers(1, k + 1))
        ids = rng.choice(vocab, size=width, replace=False).astype(np.int32)[None]
        if ties:
            scores = np.sort(rng.choice([0.5, 0.25, 0.125, 0.0625], width))[::-1].astype(np.float32)[None]
        else:
            scores = np.sort(rng.dirichlet(np.ones(width + 1) * 0.5)[:width])[::-1].astype(np.float32)[None]
        prev = int(rng.integers(-1, vocab)) if rng.random() < bigrams / (bigrams + vocab * fill + 1) else -1
        table.update([prev], [int(rng.integers(vocab))], ids, scores)
    return table


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 100_000),
    budget=st.integers(1, 80),
    spine_len=st.integers(0, 25),
    ratio=st.sampled_from([0.15, 0.30, 0.50]),
    rho=st.floats(0.0, 1.0),
    depth=st.integers(1, 7),
    fill=st.floats(0.0, 1.0),
    bigrams=st.integers(0, 60),
    p_s=st.floats(0.0, 1.2),
    min_score=st.sampled_from([0.0, 0.01, 0.05]),
    spine_branches=st.booleans(),
    ties=st.booleans(),
)
def test_kernel_equals_the_python_reference(seed, budget, spine_len, ratio, rho, depth, fill, bigrams, p_s, min_score,
                                            spine_branches, ties):
    rng = np.random.default_rng(seed)
    vocab = 40
    table = random_table(rng, vocab, 10, fill, bigrams, capacity=16, ties=ties)  # small: lookups refresh LRU stamps
    twin = copy.deepcopy(table)
    spine = rng.integers(0, vocab, spine_len)
    root, prev = int(rng.integers(vocab)), int(rng.integers(-1, vocab))
    kw = dict(budget=budget, max_depth=depth, spine_ratio=ratio, spine_branch_ratio=rho, min_branch_score=min_score,
              spine_acceptance=p_s, spine_branches=spine_branches)
    got = build_spine_tree(root, prev, spine, table, **kw)
    want = reference_tree(root, prev, spine, twin.successors, **kw)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.parents.tolist() == want.parents.tolist()
    assert got.sources.tolist() == want.sources.tolist()
    assert got.values.tolist() == want.values.tolist()  # bit for bit
    assert got.depths.tolist() == want.depths.tolist()
    assert table.bigram_stamps.tolist() == twin.bigram_stamps.tolist()  # the same lookups, in the same order


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 100_000), num=st.integers(1, 6), offer=st.integers(0, 30), chains=st.booleans())
def test_batch_equals_one_request_at_a_time(seed, num, offer, chains):
    """``propose_spine_trees`` over a batch read in place from a 2-D token array == each
    request's own ``propose`` / ``propose_chain`` (contexts with repeats, so spines and bypasses
    occur; one shared table, so lookups interleave)."""
    rng = np.random.default_rng(seed)
    vocab = 30
    prop = get_proposer("goose", vocab_size=vocab, bigram_capacity=16)
    prop.table.update(*_rows(rng, vocab, 60))
    solo = get_proposer("goose", vocab_size=vocab, bigram_capacity=16)
    solo.tables.default = copy.deepcopy(prop.table)
    contexts = [rng.integers(0, 6 if rng.random() < 0.5 else vocab, int(rng.integers(1, 40))) for _ in range(num)]
    width = max(len(c) for c in contexts) + 3
    token_ids = np.full((num + 2, width), -7, np.int32)  # extra rows and columns: never read
    rows = rng.permutation(num + 2)[:num]
    for r, c in zip(rows, contexts):
        token_ids[r, : len(c)] = c
    batch_states = [prop.new_request() for _ in range(num)]
    solo_states = [solo.new_request() for _ in range(num)]
    for a, b in zip(batch_states, solo_states):  # the clamp's edges too: p_s 0, below 1e-3, above 1
        a.spine_acceptance = b.spine_acceptance = float(rng.choice([0.0, 4e-4, rng.random(), 1.2]))
    offers = None if chains else [offer] * num
    drafts = [offer] * num if chains else None
    batch = propose_spine_trees(batch_states, token_ids, rows, [len(c) for c in contexts], offers, drafts)
    for k, (state, ctx) in enumerate(zip(solo_states, contexts)):
        want = state.propose_chain(ctx, offer) if chains else state.propose(ctx, offer if offer > 0 else None)
        got = batch.trees.tree(k)
        assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
        assert got.values.tolist() == want.values.tolist()
        assert got.depths.tolist() == want.depths.tolist() and got.sources.tolist() == want.sources.tolist()
        assert int(batch.modes[k]) == MODE_CODES[state.last_info.mode]


def _rows(rng, vocab, n):
    """``n`` random table rows: (prev or -1, token, [n, 10] ids, [n, 10] descending scores)."""
    ids = rng.integers(0, vocab, (n, 10)).astype(np.int32)
    scores = np.sort(rng.random((n, 10)).astype(np.float32) / 5, axis=1)[:, ::-1].copy()
    prev = np.where(rng.random(n) < 0.5, rng.integers(0, vocab, n), -1)
    return prev, rng.integers(0, vocab, n), ids, scores
