"""Compiled kernels of the adjacency table (``proposers.adjacency.AdjacencyTable``): lookup,
update, and which of a harvest's rows it would write (``last_writes``, ``skip_fresh``).

Scope: the array layout of one table and the operations on it, as numba functions that the
table's methods and the GOOSE tree kernel (``kernels.goose``) both call. No policy.

Layout (``AdjacencyTable.arrays``, in this argument order):

* ``uni_ids [V, K]`` int32 (-1 = empty), ``uni_scores [V, K]`` float32: row t = successors of t;
* ``bi_keys [C]`` int64 (-1 = empty), key ``prev * V + token``; ``bi_stamps [C]`` int64 last use;
  ``bi_ids [C, K]`` int32, ``bi_scores [C, K]`` float32; C a power of two;
* ``counters [4]`` int64: ``CLOCK`` (the stamp clock), ``HELD`` (bigram entries), ``EVICTED``,
  ``HARVESTS`` (the harvest clock, one tick per ``skip_fresh`` call);
* written stamps, outside ``arrays`` (only ``update`` and ``skip_fresh`` take them): ``uni_written
  [V]``, ``bi_written [C]`` int32, the harvest clock when the entry was last written, modulo
  2^31; empty arrays when the table keeps no window (nothing stamped).

Bigram placement: key k hashes to slot h(k) (a 64-bit mix, masked to C); it lives in one of the
``WAYS`` slots h, h+1, ..., h+WAYS-1 (mod C). A slot is never emptied once taken, only
overwritten, so a lookup may stop at the first empty slot of the window: every key placed
later in the window found the slots before it taken. Insertion: the key's own slot if present,
else the first empty slot of the window, else the window's least recently stamped slot
(eviction). Example, C = 8, WAYS = 8: all 8 slots form one window, so eviction is exact LRU.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["WAYS", "CLOCK", "HELD", "EVICTED", "HARVESTS", "NEVER", "NONE", "UNIGRAM", "BIGRAM", "find", "last_writes",
           "lookup", "skip_fresh", "slot_of", "update"]

WAYS = 8  # slots a bigram key may occupy (the probe window)
CLOCK, HELD, EVICTED, HARVESTS = 0, 1, 2, 3  # counters[...]
WRAP = 0x7FFFFFFF  # written stamps are the harvest clock modulo 2^31
NEVER = 0x40000000  # the stamp of an entry never written: 2^30 ticks from the clock's start
NONE, UNIGRAM, BIGRAM = -1, 0, 1  # tiers returned by ``lookup``

_jit = numba.njit(cache=True, nogil=True)


@_jit
def _home(key: np.int64, mask: np.int64) -> np.int64:
    """First slot of ``key``'s window: splitmix64's finaliser, masked (keys of neighbouring
    tokens land far apart)."""
    z = np.uint64(key) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return np.int64(z & np.uint64(mask))


@_jit
def find(bi_keys, key):
    """The slot holding ``key``, or -1."""
    mask = bi_keys.shape[0] - 1
    h = _home(key, mask)
    for w in range(min(WAYS, bi_keys.shape[0])):
        s = (h + w) & mask
        k = bi_keys[s]
        if k == key:
            return s
        if k == -1:
            return -1
    return -1


@_jit
def slot_of(bi_keys, bi_stamps, counters, key):
    """The slot ``key`` is written to (its own, else the first empty one of its window, else
    the least recently used one of its window, which is evicted); the key is stored there."""
    mask = bi_keys.shape[0] - 1
    h = _home(key, mask)
    victim = -1
    oldest = np.int64(0x7FFFFFFFFFFFFFFF)
    for w in range(min(WAYS, bi_keys.shape[0])):
        s = (h + w) & mask
        k = bi_keys[s]
        if k == key:
            return s
        if k == -1:
            bi_keys[s] = key
            counters[HELD] += 1
            return s
        if bi_stamps[s] < oldest:
            oldest = bi_stamps[s]
            victim = s
    bi_keys[victim] = key
    counters[EVICTED] += 1
    return victim


@_jit
def lookup(uni_ids, uni_scores, bi_keys, bi_stamps, bi_ids, bi_scores, counters, prev, token, vocab, use_bigram):
    """``(tier, row)`` of ``(prev, token)``'s successors: ``(BIGRAM, slot)`` when the bigram is
    held (its stamp refreshed), else ``(UNIGRAM, token)``; ``(NONE, -1)`` for a token outside
    the vocabulary. ``prev < 0`` skips the bigram tier."""
    if token < 0 or token >= vocab:
        return NONE, -1
    if use_bigram and prev >= 0:
        s = find(bi_keys, prev * vocab + token)
        if s >= 0:
            counters[CLOCK] += 1
            bi_stamps[s] = counters[CLOCK]
            return BIGRAM, s
    return UNIGRAM, token


@_jit
def update(uni_ids, uni_scores, bi_keys, bi_stamps, bi_ids, bi_scores, counters, prev, tokens, top_ids, top_scores,
           vocab, use_bigram, uni_written, bi_written):
    """Rows i = 0, 1, ... in order (the last duplicate key wins): unigram row ``tokens[i]`` and,
    when ``prev[i] >= 0``, bigram ``(prev[i], tokens[i])`` become ``top_ids[i]``/``top_scores[i]``
    (cut to K columns, the rest emptied). With written stamps (non-empty arrays) each entry
    written is stamped with the harvest clock."""
    k_table = uni_ids.shape[1]
    k = min(k_table, top_ids.shape[1])
    stamp = np.int32(counters[HARVESTS] & WRAP)
    stamping = uni_written.shape[0] > 0
    for i in range(tokens.shape[0]):
        t = tokens[i]
        if stamping:
            uni_written[t] = stamp
        for j in range(k):
            uni_ids[t, j] = top_ids[i, j]
            uni_scores[t, j] = top_scores[i, j]
        for j in range(k, k_table):
            uni_ids[t, j] = -1
            uni_scores[t, j] = 0.0
        if use_bigram and prev[i] >= 0:
            s = slot_of(bi_keys, bi_stamps, counters, prev[i] * vocab + t)
            counters[CLOCK] += 1
            bi_stamps[s] = counters[CLOCK]
            if stamping:
                bi_written[s] = stamp
            for j in range(k):
                bi_ids[s, j] = top_ids[i, j]
                bi_scores[s, j] = top_scores[i, j]
            for j in range(k, k_table):
                bi_ids[s, j] = -1
                bi_scores[s, j] = 0.0


@_jit
def last_writes(prev, tokens, offsets, tables, live):
    """Which of a step's rows an ``update`` would keep: ``live[k]`` is True unless node k's tree
    has ``tables[t] < 0`` (no table learns from it) or a later node (in node order) of a tree
    with the same table number has the same key ``(prev[k], tokens[k])``. ``update`` takes rows
    in order and the last duplicate wins (its unigram row is the same token's, its bigram the
    same key's), so the top-k of a dead row is never read: the harvest skips it. The unigram
    rows and the successors of every bigram key held are those of updating every row; only the
    slot stamps can differ, so a window that evicts during the step may evict another key.
    Returns the number of live rows.

    Example: one tree per table number ``[0, 0]``, trees of 2 nodes, keys
    ``(5, 1) (1, 2) | (5, 1) (1, 3)`` -> live ``[False, True, True, True]``."""
    n = tokens.shape[0]
    size = 16
    while size < 2 * n:
        size *= 2
    mask = size - 1
    seen_t = np.full(size, -1, np.int64)  # tree number of the key held in a slot (-1 = empty)
    seen_p = np.empty(size, np.int64)
    seen_k = np.empty(size, np.int64)
    count = 0
    for t in range(offsets.shape[0] - 2, -1, -1):  # from the last node back: the first seen is the last write
        g = tables[t]
        for k in range(offsets[t + 1] - 1, offsets[t] - 1, -1):
            live[k] = False
            if g < 0:
                continue
            s = _home((g * 0x9E3779B1 + prev[k]) * 0x85EBCA77 + tokens[k], mask)
            while seen_t[s] >= 0 and not (seen_t[s] == g and seen_p[s] == prev[k] and seen_k[s] == tokens[k]):
                s = (s + 1) & mask
            if seen_t[s] < 0:
                seen_t[s] = g
                seen_p[s] = prev[k]
                seen_k[s] = tokens[k]
                live[k] = True
                count += 1
    return count


@_jit
def skip_fresh(uni_written, bi_keys, bi_stamps, bi_written, counters, prev, tokens, vocab, use_bigram, window, live):
    """One tick of the harvest clock, then ``live[k] = False`` for each live row whose every
    entry (unigram row ``tokens[k]``, and bigram ``(prev[k], tokens[k])`` when ``use_bigram``
    and ``prev[k] >= 0``) was written within the last ``window`` ticks: the table would
    overwrite entries it wrote at most ``window`` harvests ago, so the harvest skips the row
    (its vocabulary pass too). A skipped row's bigram gets its LRU stamp, as its write would
    have given it. A bigram key not held, or a token outside the vocabulary, is never fresh.
    Returns the number of live rows. Stamps compare modulo 2^31 (``update``); ``NEVER`` is 2^30
    ticks from the clock's start, so an entry never written looks fresh only for ``window``
    ticks after 2^30 (+ a multiple of 2^31) ticks. Example, window 2: keys written at ticks 1
    and 3, the clock now at 4 (this call's tick) -> the first is 3 ticks old and kept, the
    second 1 tick old and skipped."""
    counters[HARVESTS] += 1
    now = counters[HARVESTS]
    count = 0
    for k in range(tokens.shape[0]):
        if not live[k]:
            continue
        t = tokens[k]
        fresh = t >= 0 and t < vocab and ((now - uni_written[t]) & WRAP) <= window
        s = -1
        if fresh and use_bigram and prev[k] >= 0:
            s = find(bi_keys, prev[k] * vocab + t)
            fresh = s >= 0 and ((now - bi_written[s]) & WRAP) <= window
        if fresh:
            live[k] = False
            if s >= 0:
                counters[CLOCK] += 1
                bi_stamps[s] = counters[CLOCK]
        else:
            count += 1
    return count
