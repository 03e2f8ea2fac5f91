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
    s.add([1 << 21, 1, 2, 3])  # ids beyond the packed keys' 21 bits: not stored
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
