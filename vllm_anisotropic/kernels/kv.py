"""Compiled K/V slot moves (``kernels.load("kv")``) for ``integration/vllm/engine/kv_moves.py``:
the accepted nodes' K/V copied to the slots the sequence needs, in every layer of one cache
layout at once (one call a step, instead of a gather and a scatter per layer)."""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["move_slots"]


@numba.njit(cache=True, nogil=True)
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
    m = src.shape[0]
    head_size = two_hs // 2
    region = block_size * two_hs
    if len(caches) == 0:
        return
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
    buf = np.empty(n, caches[0].dtype)
    for cache in caches:
        for j in range(n):
            buf[j] = cache[from_el[j]]
        for j in range(n):
            cache[to_el[j]] = buf[j]
