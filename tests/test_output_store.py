"""Cross-request spine store (proposers.output_store) against a brute-force scan, and its use by
GOOSE: a request without a match of its own takes its spine from its tenant's finished requests."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_anisotropic.proposers.config import GooseConfig
from vllm_anisotropic.proposers.goose import GooseProposer
from vllm_anisotropic.proposers.output_store import OutputStore
from vllm_anisotropic.tree import NodeSource


def brute_force(live_docs: list[list[int]], sizes, tail: list[int], limit: int) -> tuple[list[int], int]:
    """Longest n first; newest document first; latest follow position first; never empty."""
    for n in sorted(sizes, reverse=True):
        if len(tail) < n or limit <= 0:
            continue
        key = tail[len(tail) - n :]
        for doc in reversed(live_docs):
            for f in range(len(doc) - 1, n - 1, -1):
                if doc[f - n : f] == key:
                    return doc[f : f + limit], n
    return [], 0


def test_newest_document_longest_n_and_no_run_across_documents():
    s = OutputStore((2, 3), capacity=1000)
    s.add([1, 2, 3, 4, 5])
    s.add([7, 2, 3, 9])
    draft, n = s.match([0, 2, 3], 10)
    assert (draft.tolist(), n) == ([9], 2)  # the newer document, and its end: not into another one
    draft, n = s.match([1, 2, 3], 10)
    assert (draft.tolist(), n) == ([4, 5], 3)  # the 3-gram (1, 2, 3) wins over the newer 2-gram
    assert s.match([5, 5], 10)[1] == 0
    assert s.match([1, 2, 3], 0)[1] == 0


def test_capacity_evicts_oldest_first():
    s = OutputStore((2,), capacity=8)
    s.add([1, 2, 3, 4])
    s.add([5, 6, 7, 8])
    assert s.match([1, 2], 5)[0].tolist() == [3, 4]
    s.add([9, 10, 11])  # 11 tokens > 8: the first document goes
    assert s.match([1, 2], 5)[1] == 0
    assert s.match([5, 6], 5)[0].tolist() == [7, 8]
    assert s.num_tokens == 7 and len(s) == 2
    s.add([1 << 31, 1, 2, 3])  # ids beyond the ring's int32: not stored
    assert len(s) == 2 and s.match([1, 2], 5)[1] == 0
    s.add(list(range(20, 30)))  # longer than the capacity: its last 8 tokens only
    assert len(s) == 1 and s.num_tokens == 8
    assert s.match([21, 22], 5)[1] == 0 and s.match([22, 23], 3)[0].tolist() == [24, 25, 26]


@settings(max_examples=150, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=14), min_size=1, max_size=12),
    queries=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=6), min_size=1, max_size=6),
    capacity=st.integers(64, 90),
    limit=st.integers(0, 6),
)
def test_matches_brute_force_over_live_documents(docs, queries, capacity, limit):
    """Eviction, lazy skipping of evicted entries and the rebuild never change an answer."""
    sizes = (1, 2, 3)
    s = OutputStore(sizes, capacity=capacity)
    live: list[list[int]] = []
    for doc in docs:
        s.add(doc * 3)  # long enough to evict at these capacities
        if len(doc * 3) > 1:
            live.append(doc * 3)
        while sum(map(len, live)) > capacity:
            live.pop(0)
        for q in queries:
            draft, n = s.match(q, limit)
            assert (draft.tolist(), n) == brute_force(live, sizes, q, limit)


def _chat(prompt_tail: list[int], answer: list[int]) -> np.ndarray:
    return np.asarray(prompt_tail + answer)


def test_goose_takes_a_spine_from_a_finished_request_of_its_tenant_only():
    cfg = GooseConfig(budget=12, store_prompt_tail=3)
    prop = GooseProposer(cfg, vocab_size=100)
    header = [90, 91, 92]  # the chat template's assistant header ends every prompt
    first = prop.new_request()
    first.propose(_chat([10, 11] + header, [40]))  # the first proposal: prompt + 1 token
    first.propose(_chat([10, 11] + header, [40, 41, 42, 43, 44, 45]))
    first.finish(_chat([10, 11] + header, [40, 41, 42, 43, 44, 45]))
    second = prop.new_request()
    tree = second.propose(_chat([20, 21] + header, [40]))  # no match of its own
    spine = tree.tokens[tree.sources == NodeSource.SPINE].tolist()
    assert spine[:3] == [41, 42, 43]
    assert second.last_info.mode.value != "bypass"  # another request's text never bypasses
    other = GooseProposer(cfg.model_copy(update={"cross_request_spine": False}), vocab_size=100)
    st2 = other.new_request()
    st2.propose(_chat([10, 11] + header, [40, 41, 42, 43, 44, 45]))
    st2.finish(_chat([10, 11] + header, [40, 41, 42, 43, 44, 45]))
    tree = other.new_request().propose(_chat([20, 21] + header, [40]))
    assert not np.any(tree.sources == NodeSource.SPINE)
    salted = prop.new_request(tenant="b").propose(_chat([20, 21] + header, [40]))
    assert not np.any(salted.sources == NodeSource.SPINE)  # another tenant's store is empty


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), capacity=st.integers(16, 120), alphabet=st.integers(3, 400))
def test_rebuilds_and_reused_dead_slots_never_change_an_answer(seed, capacity, alphabet):
    """Many documents through a small store: the hash tables fill with evicted documents'
    entries, take dead slots and are built again (``rebuilds``); every answer stays the brute
    force's over the live documents. Fails if a dead slot shadowed a live occurrence, a rebuild
    indexed an evicted document or lost a live one, or eviction dropped part of a document."""
    rng = np.random.default_rng(seed)
    sizes = (1, 2, 3)
    s = OutputStore(sizes, capacity=capacity)
    live: list[list[int]] = []
    for _ in range(40):
        doc = rng.integers(0, alphabet, int(rng.integers(2, 30))).tolist()
        s.add(doc)
        live.append(doc[-capacity:])
        while sum(map(len, live)) > capacity:
            live.pop(0)
        assert (len(s), s.num_tokens) == (len(live), sum(map(len, live)))
        for _ in range(3):
            src = live[int(rng.integers(len(live)))]  # a tail that often occurs in a live document
            end = int(rng.integers(1, len(src) + 1))
            q = src[max(0, end - 3) : end] if rng.random() < 0.7 else rng.integers(0, alphabet, 3).tolist()
            draft, n = s.match(q, 5)
            assert (draft.tolist(), n) == brute_force(live, sizes, q, 5)
    if alphabet >= 100 and capacity <= 40:
        assert s.rebuilds > 0


def test_one_call_answers_a_whole_step_of_rows_as_each_alone():
    """``match_rows`` over vLLM's int32 token array, in place: each asking request's draft as
    ``match`` gives it for its context alone, packed one after another; requests not asked, with
    no room (limit 0) or without a hit, left as they were."""
    s = OutputStore((2, 3), capacity=100)
    s.add([1, 2, 3, 4, 5, 6])
    s.add([7, 8, 9, 1, 2, 10])
    contexts = [[5, 1, 2], [0, 3, 4], [9, 9, 9], [8, 9, 1, 2], [0, 7, 8], [0, 7, 8]]
    token_ids = np.zeros((6, 12), np.int32)
    for r, c in enumerate(contexts):
        token_ids[5 - r, : len(c)] = c  # rows in another order than the requests
    rows, lengths = np.arange(5, -1, -1), np.array([len(c) for c in contexts], np.int64)
    limits = np.array([3, 1, 4, 6, 0, 4], np.int64)
    which = np.array([0, 1, 2, 3, 4], np.int64)  # request 5 does not ask; request 4 has no room
    ngrams, lens, starts = np.zeros(6, np.int64), np.zeros(6, np.int64), np.full(6, -7, np.int64)
    out = np.zeros(int(limits[which].sum()), np.int64)
    at = s.match_rows(token_ids, rows, lengths, limits, which, ngrams, lens, starts, out, 0)
    got = [out[starts[r] : starts[r] + lens[r]].tolist() if ngrams[r] else None for r in range(6)]
    assert got == [[10], [5], None, [10], None, None]
    assert ngrams.tolist() == [2, 2, 0, 3, 0, 0] and at == 3 and starts.tolist() == [0, 1, -7, 2, -7, -7]
    for r in (0, 1, 3):
        draft, n = s.match(contexts[r], int(limits[r]))
        assert (draft.tolist(), n) == (got[r], ngrams[r])
    assert s.match(contexts[5], 4)[0].tolist() == [9, 1, 2, 10]


def test_the_tables_are_built_again_only_past_three_quarters_full():
    """Each n's hash table (``2 capacity`` rounded up to a power of two: 128 slots here) is
    built again when more than 3/4 of its slots were ever filled, and then holds only the live
    documents' n-grams: fails if it rebuilt on every document (a cost, not a wrong answer) or
    never (the probes would lengthen until the table filled)."""
    s = OutputStore((1,), capacity=64)
    assert s._arrays is None
    for i in range(200):
        before = s.rebuilds
        s.add(np.arange(i * 10, i * 10 + 10))  # 9 new keys a document, none seen before
        used = int(s._arrays[4][0])
        assert s._arrays[2].shape == (1, 128) and used * 4 <= 128 * 3
        if s.rebuilds > before:
            assert used == 9 * len(s)  # the live documents' keys only
    # after a rebuild 54-63 keys are live: at most one rebuild in 4 documents (23 here: inserts
    # also take dead slots, which fills fewer)
    assert 0 < s.rebuilds <= 200 // 4, s.rebuilds


def test_a_hash_hit_is_checked_against_the_stored_tokens():
    """A key that hits but whose stored n-gram differs (a hash collision, here made by editing the
    ring) is a miss, never another document's continuation."""
    s = OutputStore((3,), capacity=32)
    s.add([11, 12, 13, 14, 15])
    assert s.match([11, 12, 13], 5)[0].tolist() == [14, 15]
    s._arrays[0][1] = 99  # the ring now holds 11, 99, 13 where the key says 11, 12, 13
    assert s.match([11, 12, 13], 5)[1] == 0
