"""Context matcher (the compiled backward scan) vs the stateless PLD oracle (proposers.pld)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_anisotropic.proposers.context_match import ContextMatcher
from vllm_anisotropic.proposers.pld import propose_prompt_lookup


def test_worked_example():
    m = ContextMatcher((2,), max_continuation=3)
    m.sync([5, 6, 7, 5, 6])
    hit = m.match()
    assert hit.ngram == 2 and hit.position == 2 and hit.draft.tolist() == [7, 5, 6]
    m.extend([9])
    assert m.lookup(2) == -1  # (6, 9) never occurred
    m.extend([5, 6])
    assert m.lookup(2) == 5  # the old suffix (follow position 5) is now the latest earlier occurrence


def test_no_match_and_short_context():
    m = ContextMatcher((3, 4, 5))
    m.sync([1, 2])
    assert not m.match().found
    m.sync([1, 2, 3, 4])
    assert not m.match().found and m.match().draft.size == 0


def test_consensus_and_match_length():
    m = ContextMatcher((3, 4, 5), max_continuation=20)
    ctx = [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5]
    m.sync(ctx)
    hit = m.match()
    assert hit.ngram == 5 and hit.draft[0] == 6 and hit.consensus
    assert hit.match_length == 5  # preceded by 9 vs 8
    # a more recent 3-gram occurrence with another continuation: no consensus among 4/5? (both agree)
    m2 = ContextMatcher((3, 4, 5))
    m2.sync([1, 2, 3, 4, 5, 6, 0, 3, 4, 5, 7, 8, 1, 2, 3, 4, 5])
    hit2 = m2.match()
    assert hit2.ngram == 5 and hit2.draft[0] == 6
    assert hit2.consensus  # n=5 and n=4 agree on 6 (n=3 says 7)
    m3 = ContextMatcher((3, 4, 5))
    m3.sync([1, 2, 3, 4, 5, 6, 0, 3, 4, 5, 7, 8, 3, 4, 5])
    hit3 = m3.match()
    assert hit3.ngram == 3 and hit3.draft[0] == 7 and not hit3.consensus


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=120),
    st.lists(st.integers(1, 6), min_size=1, max_size=30),
)
def test_incremental_matches_oracle(tokens, chunks):
    """Grow the context in random chunks; after every chunk the scan agrees with the oracle."""
    m = ContextMatcher((3, 4, 5), max_continuation=7)
    pos = 0
    for c in chunks + [len(tokens)]:
        pos = min(len(tokens), pos + c)
        ctx = np.asarray(tokens[:pos])
        m.sync(ctx)
        hit = m.match()
        oracle = propose_prompt_lookup(ctx, 7, 3, 5)
        assert hit.draft.tolist() == oracle.tolist()
        for n in (3, 4, 5):  # per-length oracle, for the consensus flag
            assert (m.lookup(n) >= 0) == (propose_prompt_lookup(ctx, 1, n, n).size > 0)
        if pos == len(tokens):
            break


def test_rollback_rebuilds():
    m = ContextMatcher((2,))
    m.sync([1, 2, 3, 1, 2, 3, 4])
    m.sync([1, 2, 3, 1, 2])  # shorter: rebuild
    assert m.match().draft.tolist() == [3, 1, 2]
    m.sync([7, 7, 7, 7, 7, 7])  # different boundary token: rebuild
    assert m.match().draft.tolist() == [7]


def _reference_match(tokens, sizes, cap):
    """The backward match by its definition (proposers/context_match.py): for each n, the latest
    earlier occurrence f of the context's last n tokens (``tokens[f-n:f]``, f < len); the
    longest n found wins; the match length extends backwards from there (capped, >= n);
    consensus: >= 2 of the lengths' latest occurrences are followed by the same token."""
    length = len(tokens)
    found = {}
    for n in sizes:
        tail = list(tokens[length - n:]) if n <= length else None
        for f in range(length - 1, n - 1, -1):
            if tail is not None and list(tokens[f - n:f]) == tail:
                found[n] = f
                break
    best = next((n for n in sizes if n in found), None)
    if best is None:
        return (-1, 0, 0, 0)
    f = found[best]
    m = best
    while m < cap and f - 1 - m >= 0 and tokens[f - 1 - m] == tokens[length - 1 - m]:
        m += 1
    agree = sum(1 for g in found.values() if tokens[g] == tokens[f])
    return (f, best, m, int(agree >= 2))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), num=st.integers(1, 5), alphabet=st.integers(2, 6),
       sizes=st.sampled_from([(3,), (4, 2), (5, 3, 1), (3, 2, 1), (6, 4, 2)]), cap=st.integers(1, 12),
       budget=st.integers(1, 12), max_cont=st.integers(0, 8), given_budgets=st.booleans(), chains=st.booleans(),
       context_spine=st.booleans())
def test_proposal_inputs_equal_their_definitions(seed, num, alphabet, sizes, cap, budget, max_cont, given_budgets,
                                                 chains, context_spine):
    """``kernels.goose.proposal_inputs`` over a 2-D token array read in place (rows permuted, the
    padding never read) gives, per request, the context match's follow position, n, match length
    and consensus of the definition (zeros with the context spine off), the root and the token
    before it, the node budget (the proposer's, or the one given when > 0, clamped to [1,
    budget]), the draft limit (a chain step's, or the budget's) and the count of requests that ask
    the store."""
    from vllm_anisotropic import kernels

    rng = np.random.default_rng(seed)
    contexts = [rng.integers(0, alphabet, int(rng.integers(1, 30))) for _ in range(num)]
    width = max(len(c) for c in contexts) + 2
    # padding past each context holds tokens of the same alphabet: a read outside the context
    # (e.g. a negative index wrapping to the row's end) would change the answer
    token_ids = rng.integers(0, alphabet, (num + 1, width)).astype(np.int32)
    rows = rng.permutation(num + 1)[:num]
    for r, c in zip(rows, contexts):
        token_ids[r, : len(c)] = c
    given = rng.integers(-2, budget + 4, num) if given_budgets else np.zeros(0, np.int64)
    drafts = rng.integers(-2, 10, num) if chains else np.zeros(0, np.int64)
    budgets, limits, roots, prevs, match, asking = kernels.load("goose").proposal_inputs(
        token_ids, rows.astype(np.int64), np.array([len(c) for c in contexts], np.int64), given, drafts, budget,
        max_cont, np.array(sizes, np.int64), cap, context_spine)
    for k, c in enumerate(contexts):
        want = _reference_match(c.tolist(), sizes, cap) if context_spine else (0, 0, 0, 0)
        assert tuple(match[k].tolist()) == want, (k, c.tolist())
        assert (roots[k], prevs[k]) == (c[-1], c[-2] if len(c) >= 2 else -1), k
        b = budget if not given_budgets or given[k] <= 0 else max(1, min(budget, given[k]))
        assert budgets[k] == b, (k, given)
        assert limits[k] == (min(max_cont, max(drafts[k], 0)) if chains else min(max_cont, b - 1)), k
    assert asking == int(((match[:, 1] <= 0) & (limits > 0)).sum())
