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


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 100_000), num=st.integers(1, 6), budget=st.integers(2, 30))
def test_the_batchs_figures_per_request_follow_their_definitions(seed, num, budget):
    """Each request's proposal mode, spine length, n-gram, match length, consensus and spine ratio
    in ``propose_spine_trees``' batch, against their definitions (GOOSE Algorithm 2, docs/goose.md)
    from the request's own context match (``ContextMatcher``) and its tree, under every routing
    policy (consensus bypass on / off, the long-match signal the spine drafted or the match
    length, thresholds 3 and 9) and offers of 0 (the proposer's budget), 1, 2 and 7 nodes, on tree
    steps and chain steps. The match is taken when it exists and the request may draft (its
    limit: the chain drafts on a chain step, else min(continuation cap, budget - 1)); n-gram,
    match length and consensus are the match's, else 0 / 0 / False; a tree step bypasses (a chain
    of the spine) on consensus when ``consensus_bypass``, or when its signal reaches
    ``bypass_min_length``; the mode is plain when the tree is the root alone, bypass on a chain
    step with a spine; the spine length counts the tree's SPINE nodes (a budget below the spine
    cuts it); the spine ratio is p_s's tier (the tier edges 0.2 and 0.4 included), nan on a chain
    step. Contexts: half of them end with a repeat of an earlier stretch of 3-15 tokens (match
    lengths beyond the n-gram), half random over 5 tokens."""
    from vllm_anisotropic.proposers.base import ProposalMode
    from vllm_anisotropic.proposers.context_match import ContextMatcher
    from vllm_anisotropic.proposers.goose import spine_ratio_tier
    from vllm_anisotropic.tree import NodeSource

    rng = np.random.default_rng(seed)
    vocab = 30
    rows = _rows(rng, vocab, 60)
    contexts = []
    for _ in range(num):
        if rng.random() < 0.5:
            seg = rng.integers(0, vocab, 16)
            stretch = int(rng.integers(3, 16))
            contexts.append(np.concatenate([rng.integers(0, vocab, int(rng.integers(0, 6))), seg,
                                            rng.integers(0, vocab, int(rng.integers(0, 8))), seg[:stretch]]))
        else:
            contexts.append(rng.integers(0, 5, int(rng.integers(1, 40))))
    token_ids = np.zeros((num, max(len(c) for c in contexts)), np.int32)
    for r, c in enumerate(contexts):
        token_ids[r, : len(c)] = c
    p_s = rng.choice([0.2, 0.4, np.nextafter(0.2, 0), np.nextafter(0.4, 0), rng.random()], num)
    for consensus_bypass in (True, False):
        for signal in ("draft_length", "match_length"):
            for min_length in (3, 9):
                prop = get_proposer("goose", vocab_size=vocab, bigram_capacity=16, budget=budget,
                                    consensus_bypass=consensus_bypass, bypass_signal=signal,
                                    bypass_min_length=min_length)
                prop.table.update(*rows)
                cfg = prop.config
                for offer in (0, 1, 2, 7):
                    for chains in (False, True):
                        states = [prop.new_request() for _ in range(num)]
                        for s, p in zip(states, p_s.tolist()):
                            s.spine_acceptance = p
                        batch = propose_spine_trees(states, token_ids, np.arange(num), [len(c) for c in contexts],
                                                    None if chains else [offer] * num, [offer] * num if chains else None)
                        assert batch.trees.tokens.shape[0] == batch.trees.offsets[-1] == batch.trees.sizes().sum()
                        node_budget = min(budget, offer) if offer > 0 else budget
                        limit = min(cfg.max_continuation, offer if chains else node_budget - 1)
                        for k, (state, ctx) in enumerate(zip(states, contexts)):
                            matcher = ContextMatcher(cfg.ngram_sizes, cfg.max_continuation)
                            matcher.sync(ctx)
                            hit = matcher.match(limit)
                            taken = hit.found and limit > 0
                            tree = batch.trees.tree(k)
                            spine_nodes = int(np.sum(tree.sources == NodeSource.SPINE))
                            assert (int(batch.ngrams[k]), int(batch.match_lengths[k]), bool(batch.consensus[k])) == (
                                (hit.ngram, hit.match_length, hit.consensus) if taken else (0, 0, False))
                            assert int(batch.spine_lens[k]) == spine_nodes <= (len(hit.draft) if taken else 0)
                            sig = len(hit.draft) if signal == "draft_length" else hit.match_length
                            bypass = not chains and taken and ((consensus_bypass and hit.consensus) or sig >= min_length)
                            if tree.num_nodes == 1:
                                want = ProposalMode.PLAIN
                            elif chains or bypass:
                                want = ProposalMode.BYPASS
                            else:
                                want = ProposalMode.TREE
                            assert int(batch.modes[k]) == MODE_CODES[want]
                            if bypass or chains:
                                assert tree.num_nodes == 1 + (len(hit.draft) if taken else 0)
                            if chains:
                                assert np.isnan(batch.spine_ratios[k])
                            else:
                                assert batch.spine_ratios[k] == spine_ratio_tier(state.spine_acceptance,
                                                                                cfg.tier_thresholds, cfg.tier_ratios)


def test_a_batch_of_several_tenants_equals_each_tenants_batch_alone():
    """Requests of three tenants (three adjacency tables, filled differently) interleaved in one
    batch: each request's tree and figures equal those of its tenant's requests proposed alone,
    in batch order (one compiled call per table, the trees and figures put back in request order)."""
    rng = np.random.default_rng(5)
    vocab = 30
    prop = get_proposer("goose", vocab_size=vocab, bigram_capacity=16, budget=12)
    tenants = ["a", None, "b", "a", "b", None, "a"]
    for t in ("a", "b", None):
        prop.new_request(t).table.update(*_rows(rng, vocab, 40))
    contexts = [np.concatenate([rng.integers(0, 5, 12), rng.integers(0, 5, 3)]) for _ in tenants]
    token_ids = np.stack(contexts).astype(np.int32)
    lengths = [len(c) for c in contexts]
    batch = propose_spine_trees([prop.new_request(t) for t in tenants], token_ids, np.arange(len(tenants)), lengths)
    assert len({id(prop.new_request(t).table) for t in tenants}) == 3
    for tenant in ("a", "b", None):
        rows = np.array([i for i, t in enumerate(tenants) if t == tenant])
        alone = propose_spine_trees([prop.new_request(tenant) for _ in rows], token_ids, rows, [lengths[i] for i in rows])
        for k, i in enumerate(rows.tolist()):
            got, want = batch.trees.tree(i), alone.trees.tree(k)
            assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
            assert got.values.tolist() == want.values.tolist() and got.sources.tolist() == want.sources.tolist()
            for field in ("modes", "prev_roots", "spine_lens", "ngrams", "match_lengths", "consensus", "spine_ratios"):
                assert getattr(batch, field)[i] == getattr(alone, field)[k], field
