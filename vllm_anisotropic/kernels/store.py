"""Compiled cross-request store (``kernels.load("store")``): the arrays behind
``proposers.output_store.OutputStore`` (its module docstring has the rule), their update when a
finished request is stored, and the lookup of a whole step's requests in one call over vLLM's
token array, read in place.

Arrays (``C`` the capacity in tokens, ``S`` the n-gram sizes, ``H`` a power of two >= 2 C):

``tokens [C]`` int32, ``till [C]`` int32
    A ring over absolute token positions: position a lives at ``a % C``; ``till[a % C]`` is how
    many tokens of a's document follow from a on (a document's first position: its length).
    The live documents are the positions ``[lo, hi)``, oldest first, ``hi - lo <= C``.
``keys [S, H]`` uint64, ``follows [S, H]`` int64, ``used [S]`` int64
    One open-addressing table per n (linear probing, key 0: empty): the hash of an n-gram ->
    the absolute position that followed its most recent occurrence. A slot whose position fell
    below ``lo`` is dead: an insert may take it, a lookup that meets it first knows the n-gram
    has no live occurrence (a newer one would sit in that slot or before it). ``used[s]`` counts
    the slots ever filled; past 3/4 of ``H`` the table is built again from the live documents.

A hit is checked against the ring's tokens, so a hash collision (2^-64 a pair) is a miss, never a
wrong draft.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["add_document", "match_rows"]

_jit = numba.njit(cache=True, nogil=True)

_SEED = np.uint64(0x9E3779B97F4A7C15)
_MUL = np.uint64(0xFF51AFD7ED558CCD)
_S33 = np.uint64(33)


@_jit
def _mix(h, tok):
    h = (h ^ np.uint64(np.int64(tok) & 0xFFFFFFFF)) * _MUL
    return h ^ (h >> _S33)


@_jit
def _final(h):
    return h if h != 0 else np.uint64(1)  # 0 marks an empty slot


@_jit
def _hash_row(row, end, n):
    """The key of ``row[end - n : end]``."""
    h = _SEED ^ np.uint64(n)
    for i in range(end - n, end):
        h = _mix(h, row[i])
    return _final(h)


@_jit
def _hash_ring(tokens, end, n):
    """The key of the n absolute positions before ``end`` in the ring (``_hash_row``'s value for
    the same tokens)."""
    c = tokens.shape[0]
    h = _SEED ^ np.uint64(n)
    for a in range(end - n, end):
        h = _mix(h, tokens[a % c])
    return _final(h)


@_jit
def _insert(keys, follows, used, s, key, follow, lo):
    mask = keys.shape[1] - 1
    i = np.int64(key & np.uint64(mask))
    while True:
        k = keys[s, i]
        if k == 0 or k == key or follows[s, i] < lo:  # empty, the n-gram's older occurrence, or dead
            used[s] += k == 0
            keys[s, i], follows[s, i] = key, follow
            return
        i = (i + 1) & mask


@_jit
def _index(tokens, keys, follows, used, sizes, start, end, lo):
    """Index the document at absolute positions ``[start, end)``: every n-gram with a token
    after it, in position order (the most recent occurrence wins)."""
    for s in range(sizes.shape[0]):
        n = sizes[s]
        for f in range(start + n, end):
            _insert(keys, follows, used, s, _hash_ring(tokens, f, n), f, lo)


@_jit
def add_document(tokens, till, keys, follows, used, sizes, doc, lo, hi):
    """Store ``doc`` (``len(doc) <= C``) after the live documents ``[lo, hi)``, evicting the
    oldest whole documents it needs room for; returns ``(lo, documents evicted, rebuilt)``."""
    c = tokens.shape[0]
    length = doc.shape[0]
    evicted = 0
    while hi + length - lo > c:
        lo += till[lo % c]
        evicted += 1
    for j in range(length):
        tokens[(hi + j) % c] = doc[j]
        till[(hi + j) % c] = length - j
    _index(tokens, keys, follows, used, sizes, hi, hi + length, lo)
    end = hi + length
    rebuilt = False
    for s in range(sizes.shape[0]):
        if used[s] * 4 > keys.shape[1] * 3:
            rebuilt = True
    if rebuilt:  # only the live documents' n-grams again, oldest first
        keys[:] = 0
        used[:] = 0
        a = lo
        while a < end:
            n = till[a % c]
            _index(tokens, keys, follows, used, sizes, a, a + n, lo)
            a += n
    return lo, evicted, rebuilt


@_jit
def _lookup(tokens, keys, follows, s, row, end, n, lo):
    """The absolute follow position of ``row[end - n : end]``'s most recent live occurrence, -1
    when none."""
    key = _hash_row(row, end, n)
    mask = keys.shape[1] - 1
    i = np.int64(key & np.uint64(mask))
    c = tokens.shape[0]
    while True:
        k = keys[s, i]
        if k == 0:
            return -1
        if k == key:
            f = follows[s, i]
            if f < lo:
                return -1
            for j in range(n):
                if tokens[(f - n + j) % c] != row[end - n + j]:
                    return -1  # a hash collision
            return f
        i = (i + 1) & mask


@_jit
def match_rows(tokens, till, keys, follows, sizes, lo, token_ids, rows, lengths, limits, which, ngrams, lens, starts,
               out, at):
    """For each request ``which[i]`` (context ``token_ids[rows[r], :lengths[r]]``): the longest n,
    then the most recent live occurrence of its last n tokens; its continuation (at most
    ``limits[r]`` tokens, never past its document's end) goes to ``out`` from ``at`` on, and
    ``ngrams[r]``, ``lens[r]``, ``starts[r]`` are set; requests without a hit are left alone.
    Returns the new ``at``. ``out`` must hold ``at + sum(limits[which])``."""
    c = tokens.shape[0]
    for i in range(which.shape[0]):
        r = which[i]
        row = token_ids[rows[r]]
        end = lengths[r]
        limit = limits[r]
        if limit <= 0:
            continue
        for s in range(sizes.shape[0]):
            n = sizes[s]
            if end < n:
                continue
            f = _lookup(tokens, keys, follows, s, row, end, n, lo)
            if f < 0:
                continue
            m = min(limit, np.int64(till[f % c]))
            for j in range(m):
                out[at + j] = tokens[(f + j) % c]
            ngrams[r], lens[r], starts[r] = n, m, at
            at += m
            break
    return at
