"""Adjacency-table harvest and context matcher: golden cases for the edges that
``scripts/mutate.py`` found untested (docs/testing.md). Hand-built inputs, exact outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_anisotropic.proposers.adjacency import AdjacencyTable, TopKRows
from vllm_anisotropic.proposers.context_match import ContextMatcher
from vllm_anisotropic.tree import DraftTree


def _rows(*ids):
    """[n, k] int32 successor rows and scores 0.5, 0.25, ... (best first)."""
    a = np.array(ids, np.int32)
    return a, np.tile((0.5 ** np.arange(1, a.shape[1] + 1)).astype(np.float32), (a.shape[0], 1))


# ------------------------------------------------------------------------ adjacency harvest
def test_update_last_duplicate_wins_and_narrow_rows():
    """Duplicate keys in one call: the last row wins in both tiers. Rows narrower than top_k
    leave the rest empty (-1), which lookups drop. prev 0 is a real token (bigram used)."""
    t = AdjacencyTable(10, top_k=3)
    ids, sc = _rows([1, 2], [3, 4], [5, 6])
    t.update([0, 0, 0], [7, 7, 7], ids, sc)
    assert t.successors(0, 7)[0].tolist() == [5, 6]  # bigram (0, 7): the last row
    assert t.successors(-1, 7)[0].tolist() == [5, 6]  # unigram 7: the last row
    assert t.successors(-1, 7)[1].tolist() == pytest.approx([0.5, 0.25])
    assert t.num_harvested == 3 and len(t) == 1
    t.update([2, -1], [7, 8], *_rows([9, 9], [8, 1]))
    assert t.successors(2, 7)[0].tolist() == [9, 9] and t.successors(0, 7)[0].tolist() == [5, 6]
    assert t.successors(1, 8)[0].tolist() == [8, 1] and len(t) == 2  # -1: no bigram entry for 8
    assert t.successors(0, 10)[0].size == 0 and t.successors(0, -1)[0].size == 0  # out of range
    assert t.successors(0, 10)[1].size == 0 and AdjacencyTable(None).successors(0, 1)[1].size == 0
    t.update([], [], np.zeros((0, 3), np.int32), np.zeros((0, 3), np.float32))
    assert t.num_harvested == 5
    t.update([-1], [0], *_rows([1, 2, 3, 4, 5]))  # wider than top_k: the first 3 kept; token 0 is a key
    assert t.successors(-1, 0)[0].tolist() == [1, 2, 3] and t.successors(4, 0)[0].tolist() == [1, 2, 3]


def test_bigram_overwrite_refreshes_and_keeps_its_slot():
    t = AdjacencyTable(10, top_k=2, bigram_capacity=2)
    t.update([1], [2], *_rows([3, 4]))
    t.update([2], [3], *_rows([5, 6]))
    slot_12, slot_23 = t.bigram_slot(1, 2), t.bigram_slot(2, 3)
    assert sorted([slot_12, slot_23]) == [0, 1]
    t.update([1], [2], *_rows([7, 8]))  # overwrite: refreshes (1, 2), same slot
    assert t.bigram_slot(1, 2) == slot_12 and len(t) == 2
    t.update([4], [5], *_rows([9, 1]))  # full: evicts (2, 3), the least recently used
    assert t.bigram_key_set() == {1 * 10 + 2, 4 * 10 + 5} and t.evictions == 1 and len(t) == 2
    assert t.successors(1, 2)[0].tolist() == [7, 8] and t.successors(4, 5)[0].tolist() == [9, 1]
    assert t.bigram_slot(4, 5) == slot_23 and t.bigram_slot(2, 3) == -1  # reused the evicted row
    unigram_only = AdjacencyTable(10, top_k=2, bigram=False)
    unigram_only.update([1], [2], *_rows([3, 4]))
    assert len(unigram_only) == 0 and unigram_only.successors(1, 2)[0].tolist() == [3, 4]


def test_harvest_sequence_keys_and_chunks():
    """Row j follows tokens[j], keyed (tokens[j-1], tokens[j]); row 0 has no previous token.
    Chunking (here 2 rows at a time) must not change any key."""
    vocab = 12
    tokens = [3, 5, 3, 6, 5]
    logits = torch.full((5, vocab), -5.0)
    for j in range(5):
        logits[j, j] = 5.0  # row j's best successor is token j
    full = AdjacencyTable(vocab, top_k=1)
    full.harvest_sequence(tokens, logits)
    chunked = AdjacencyTable(vocab, top_k=1)
    chunked.harvest_sequence(tokens, logits, chunk=2)
    for t in (full, chunked):
        assert t.successors(-1, 3)[0].tolist() == [2]  # unigram 3: the last row for 3 (row 2)
        assert t.successors(5, 3)[0].tolist() == [2] and t.successors(3, 5)[0].tolist() == [1]
        assert t.successors(3, 6)[0].tolist() == [3] and t.successors(6, 5)[0].tolist() == [4]
        assert t.bigram_key_set() == {3 * vocab + 5, 5 * vocab + 3, 3 * vocab + 6, 6 * vocab + 5}
        assert t.num_harvested == 5


def test_harvest_topk_rows_and_tree_root_key():
    vocab = 8
    logits = torch.arange(vocab, dtype=torch.float32).flip(0).repeat(3, 1)  # best: 0, 1, 2, ...
    rows = TopKRows.of(logits, 4)
    t = AdjacencyTable(vocab, top_k=2)
    t.harvest([-1, 1, 2], [1, 2, 3], rows)  # precomputed top-4 cut to the table's top-2
    assert t.successors(-1, 1)[0].tolist() == [0, 1] and t.successors(1, 2)[0].tolist() == [0, 1]
    with pytest.raises(ValueError):
        AdjacencyTable(vocab, top_k=5).harvest([-1], [1], TopKRows.of(logits[:1], 4))
    t.harvest([], [], logits[:0])  # nothing to harvest
    assert t.num_harvested == 3
    lazy = AdjacencyTable(None, top_k=2)
    lazy.harvest([], [], torch.zeros(0, 30))  # an empty harvest allocates nothing
    assert lazy.vocab_size is None and lazy.unigram_ids is None
    tree = DraftTree(tokens=[4, 5], parents=[-1, 0])
    t2 = AdjacencyTable(vocab, top_k=1)
    t2.harvest_tree(tree, 3, logits[:2])  # root keyed (3, 4)
    assert t2.bigram_key_set() == {3 * vocab + 4, 4 * vocab + 5}
    t3 = AdjacencyTable(vocab, top_k=2)
    t3.harvest([0], [1], TopKRows.of(logits[:1], 2))  # exactly top_k precomputed columns; prev 0
    assert t3.successors(0, 1)[0].tolist() == [0, 1] and len(t3) == 1


# ------------------------------------------------------------------------ context matcher
def test_match_length_backward_extension_and_cap():
    """Match length = trailing context tokens equal to those before the follow position, capped
    at max_match_length; stops at the context start."""
    m = ContextMatcher((2,), max_continuation=4, max_match_length=32)
    m.sync([1, 2, 3, 4, 9, 1, 2, 3, 4])
    hit = m.match()
    assert (hit.ngram, hit.position, hit.match_length) == (2, 4, 4)  # 1 2 3 4 matched, then start
    assert hit.draft.tolist() == [9, 1, 2, 3]
    capped = ContextMatcher((2,), max_match_length=3)
    capped.sync([1, 2, 3, 4, 9, 1, 2, 3, 4])
    assert capped.match().match_length == 3
    m.sync([7, 1, 2, 3, 4, 9, 8, 1, 2, 3, 4])  # rollback (different boundary token): 7 vs 8 stop
    assert m.match().match_length == 4 and m.match().position == 5


def test_lookup_needs_an_earlier_occurrence_and_limits():
    m = ContextMatcher((3,), max_continuation=5)
    m.sync([1, 2, 3])
    assert m.lookup(3) == -1  # the suffix itself is not an earlier occurrence
    m.sync([1, 2, 3, 1, 2, 3])
    assert m.lookup(3) == 3 and m.match(0).ngram == 0 and m.match(1).draft.tolist() == [1]
    assert m.match(2).draft.tolist() == [1, 2] and m.match().draft.tolist() == [1, 2, 3]
    assert len(m) == 6 and m.tokens == [1, 2, 3, 1, 2, 3]


def test_sync_appends_only_the_tail_and_consensus_needs_two():
    m = ContextMatcher((2, 3), max_continuation=3)
    m.sync([5, 6, 7, 5, 6])
    assert m.lookup(2) == 2 and m.lookup(3) == -1  # (5, 6) at f = 2; (7, 5, 6) never earlier
    hit = m.match()
    assert hit.ngram == 2 and hit.draft.tolist() == [7, 5, 6] and not hit.consensus  # only n = 2 hits
    m.sync([5, 6, 7, 5, 6, 7])
    assert m.lookup(2) == 3 and m.lookup(3) == 3  # (6, 7) and (5, 6, 7) latest at f = 3
    hit = m.match()
    assert hit.ngram == 3 and hit.draft.tolist() == [5, 6, 7] and hit.consensus  # n = 2 and 3 agree on 5
    m.sync([5, 6, 7, 5, 6, 7])  # same context: nothing appended
    assert m.tokens == [5, 6, 7, 5, 6, 7] and len(m) == 6


def test_sync_rebuilds_when_the_boundary_token_changed():
    """After any sync the context equals a fresh matcher's: a boundary token that changed (here
    the last kept one) replaces the context even when the token before it, or the new token,
    happens to equal some kept token."""
    for old, new in (([1, 2, 2], [1, 2, 5, 1, 2]), ([1, 5, 2], [1, 5, 5, 1, 5])):
        m = ContextMatcher((2,), max_continuation=4)
        m.sync(old)
        m.sync(new)
        fresh = ContextMatcher((2,), max_continuation=4)
        fresh.sync(new)
        assert m.tokens == new and all(m.lookup(n) == fresh.lookup(n) for n in (1, 2, 3))
        assert m.match().draft.tolist() == fresh.match().draft.tolist()


def test_lookup_at_length_n_plus_one_and_match_length_at_the_start():
    """[7, 7, 7, 7], n = 3: the suffix (7, 7, 7) also ends at position 2 (follow position 3 =
    L - 1), an earlier occurrence. [5, 5, 5], n = 2: f = 2, the backward extension stops at the
    context start (match length 2; indexing before it would wrap around to the suffix)."""
    m = ContextMatcher((3,))
    m.sync([7, 7, 7, 7])
    assert m.lookup(3) == 3 and m.match().draft.tolist() == [7]
    m2 = ContextMatcher((2,))
    m2.sync([5, 5, 5])
    assert m2.match().position == 2 and m2.match().match_length == 2


# ------------------------------------------------------------------------ compiled table kernel
_M64 = (1 << 64) - 1


def _splitmix64_finaliser(key: int) -> int:
    """Reference: one splitmix64 output for state ``key`` (Steele, Lea & Flood 2014; Vigna's
    splitmix64.c), in Python integers: add the golden gamma, then the two xor-shift-multiply
    rounds and a last xor-shift."""
    z = (key + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def test_bigram_home_slot_is_splitmix64_masked():
    """The home slot of a bigram key is splitmix64's finaliser masked to the table
    (``kernels.table`` docstring). The reference reproduces splitmix64's published stream for
    seed 0 (0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F); the kernel equals it
    on 63 bits for keys of several sizes, and an empty 4,096-slot table places each key at
    ``hash & 4095``, where ``find`` then finds it."""
    from vllm_anisotropic.kernels import table as tk

    gamma = 0x9E3779B97F4A7C15
    assert [_splitmix64_finaliser(k * gamma & _M64) for k in range(3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    keys = [0, 1, 2, 3, 7, 255, 256, 49151, 49152, 12345 * 49152 + 678, 2**31 - 1, 2**40 + 5, 2**62 + 3]
    wide = (1 << 63) - 1
    for key in keys:
        assert int(tk._home(np.int64(key), np.int64(wide))) == _splitmix64_finaliser(key) & wide, key
    cap = 4096
    for key in keys:
        bi_keys, stamps, counters = np.full(cap, -1, np.int64), np.zeros(cap, np.int64), np.zeros(3, np.int64)
        slot = int(tk.slot_of(bi_keys, stamps, counters, np.int64(key)))
        assert slot == _splitmix64_finaliser(key) & (cap - 1), key
        assert bi_keys[slot] == key and int(tk.find(bi_keys, np.int64(key))) == slot


def test_find_answers_minus_one_for_a_missing_key():
    """``find`` returns the slot or exactly -1 ("the slot holding key, or -1"): a missing key
    whose window reaches an empty slot, and one whose whole window holds other keys."""
    from vllm_anisotropic.kernels import table as tk

    cap = 16
    bi_keys, stamps, counters = np.full(cap, -1, np.int64), np.zeros(cap, np.int64), np.zeros(3, np.int64)
    for key in (3, 40, 77):
        tk.slot_of(bi_keys, stamps, counters, np.int64(key))
    assert int(tk.find(bi_keys, np.int64(5))) == -1
    assert int(tk.find(bi_keys, np.int64(40))) == int(np.flatnonzero(bi_keys == 40)[0])
    full = np.arange(100, 100 + cap, dtype=np.int64)  # every slot taken by another key
    assert int(tk.find(full, np.int64(5))) == -1


def test_update_empties_the_columns_a_narrow_row_leaves():
    """A row narrower than top_k overwrites a full one: the columns past it become empty in both
    tiers, id -1 and score 0 (the layout of ``kernels.table``), not just unreadable."""
    t = AdjacencyTable(6, top_k=3, bigram_capacity=8)
    t.update([2], [4], np.array([[1, 2, 3]], np.int32), np.array([[0.5, 0.25, 0.125]], np.float32))
    t.update([2], [4], np.array([[5]], np.int32), np.array([[0.75]], np.float32))
    slot = t.bigram_slot(2, 4)
    for ids, scores in ((t.unigram_ids[4], t.unigram_scores[4]), (t.bigram_ids[slot], t.bigram_scores[slot])):
        assert ids.tolist() == [5, -1, -1]
        assert scores.tolist() == [0.75, 0.0, 0.0]
    assert t.unigram_ids[3].tolist() == [-1, -1, -1] and len(t) == 1
