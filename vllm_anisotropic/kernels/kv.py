"""Compiled K/V slot moves (``kernels.load("kv")``) for ``integration/vllm/engine/kv_moves.py``:
the accepted nodes' K/V copied to the slots the sequence needs, in every layer of one cache
layout at once (one call a step, instead of a gather and a scatter per layer).

The element indices of the moved K and V are computed once a call; each cache is then copied
through a buffer, every source read before any destination is written. With ``parts`` above 1
(``move_slots_threads``) the caches are cut into contiguous parts, one a thread (numba's thread
count set by the caller: ``kernels.split``), each with a buffer of its own: the moves of one
cache never read another's (the caches must not share memory: ``KVMover.from_layers`` drops a
second layer on one tensor). The copies wait on memory (a bf16 ``vec`` layout stores K
transposed: a token's 64 K values of a head sit in 64 cache lines): alone, a second thread made
them 1.4x (2 moves) to 1.9x (100 moves) faster (docs/measurements/cpu/kv_threads_alone_2026_12_05.txt)."""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["move_slots", "move_slots_threads"]

_jit = numba.njit(cache=True, nogil=True)


@_jit
def _elements(caches, src, dst, k_off, v_off, num_heads, block_size, two_hs):
    """Checks every slot against the smallest cache, then ``(from_el, to_el)``: the element
    indices of the K and V of each move's source and destination (move, head, dim; K then V)."""
    m = src.shape[0]
    head_size = two_hs // 2
    region = block_size * two_hs
    slots = caches[0].shape[0] // (num_heads * region) * block_size  # slots of the smallest cache
    for cache in caches:
        slots = min(slots, cache.shape[0] // (num_heads * region) * block_size)
    for i in range(m):
        if min(src[i], dst[i]) < 0 or max(src[i], dst[i]) >= slots:
            raise ValueError("a K/V move names a slot outside the caches")
    n = m * num_heads * 2 * head_size
    from_el = np.empty(n, np.int64)
    to_el = np.empty(n, np.int64)
    for i in range(m):
        for side in range(2):
            slot = src[i] if side == 0 else dst[i]
            out = from_el if side == 0 else to_el
            base = (slot // block_size) * num_heads * region
            t = slot % block_size
            e = i * num_heads * 2 * head_size
            for h in range(num_heads):
                head = base + h * region
                for d in range(head_size):
                    out[e] = head + k_off[t, d]
                    out[e + 1] = head + v_off[t, d]
                    e += 2
    return from_el, to_el


@_jit
def _move_part(caches, lo, hi, from_el, to_el):
    """The moves in caches ``lo`` to ``hi`` (exclusive), through one buffer."""
    n = from_el.shape[0]
    buf = np.empty(n, caches[0].dtype)
    for c in range(lo, hi):
        cache = caches[c]
        for j in range(n):
            buf[j] = cache[from_el[j]]
        for j in range(n):
            cache[to_el[j]] = buf[j]


@_jit
def move_slots(caches, src, dst, k_off, v_off, num_heads, block_size, two_hs):
    """``slot[dst[m]] <- slot[src[m]]`` (K and V of every head) in each of ``caches``, every
    source read before any destination of its cache is written (a source may be a later
    destination). A slot outside the caches raises ValueError (the writes are not bounds-checked).

    ``caches``: a typed list of the layers' caches ``[num_blocks, num_heads, block_size,
    two_hs]`` flattened (1-D, any element type: the bits are copied); ``src``, ``dst`` ``[M]``
    int64 slots; ``k_off``, ``v_off`` ``[block_size, head_size]`` int64: where token t, dim d of
    one (block, head) region of ``block_size * two_hs`` elements lives. Example: plain layout
    (``k_off[t, d] = t * two_hs + d``), one head, block 4, head size 1: moving slot 5 to slot 1
    copies elements 10, 11 (block 1, token 1: K, V) to 2, 3."""
    if len(caches) == 0:
        return
    from_el, to_el = _elements(caches, src, dst, k_off, v_off, num_heads, block_size, two_hs)
    _move_part(caches, 0, len(caches), from_el, to_el)


@numba.njit(cache=True, nogil=True, parallel=True)
def move_slots_threads(caches, src, dst, k_off, v_off, num_heads, block_size, two_hs, parts):
    """``move_slots`` with the caches cut into ``parts`` contiguous parts, one a thread."""
    n = len(caches)
    if n == 0:
        return
    from_el, to_el = _elements(caches, src, dst, k_off, v_off, num_heads, block_size, two_hs)
    for p in numba.prange(parts):
        _move_part(caches, n * p // parts, n * (p + 1) // parts, from_el, to_el)
