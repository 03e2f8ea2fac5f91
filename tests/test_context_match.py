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
