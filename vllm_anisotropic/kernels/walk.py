"""Compiled greedy walk (``kernels.load("walk")``) for ``verifiers.greedy.walk_flat``: ``walk_rows``
walks every tree of a step to its end over CPU logits in one call (the argmax of each row it
visits: ``kernels.vocab.argmax_row``); ``descend_flat`` takes every tree one depth down from
tokens drawn by the caller (the sampled walk draws each depth's tokens with vLLM's sampler).

numba's disk cache tracks a function's own file: after editing ``vocab.py``'s argmax, delete
``vllm_anisotropic/kernels/__pycache__`` (``walk_rows`` keeps machine code compiled against it)."""

from __future__ import annotations

import numba
import numpy as np

from vllm_anisotropic.kernels.vocab import BLOCK, argmax_row

__all__ = ["descend_flat", "walk_rows", "walk_rows_threads"]

_jit = numba.njit(cache=True, nogil=True)
_threads = numba.njit(cache=True, nogil=True, parallel=True)  # callers set the thread count: kernels.split


@_jit
def _child(tokens, parents, ranks, a, n, c, y):
    """The local index of node ``c``'s first child in priority order (``ranks``: SPINE 0 before
    BRANCH/DRAFT 1, then node index) whose token is ``y``, in the tree at ``a`` of ``n`` nodes;
    -1: none. Children of a node follow it in node order: the scan runs from ``c + 1``."""
    best = -1
    best_rank = 127
    for j in range(c + 1, n):
        if parents[a + j] == c and tokens[a + j] == y and ranks[a + j] < best_rank:
            best = j
            best_rank = ranks[a + j]
            if best_rank == 0:
                break
    return best


@_jit
def descend_flat(tokens, parents, ranks, offsets, active, y, cur, accepted, num_accepted, bonus):
    """One depth step of the greedy walk for every tree ``t`` with ``active[t]``: descend from
    local node ``cur[t]`` to its first child in priority order (``_child``) whose token is
    ``y[t]``, appending it to ``accepted[t]``; with none, ``y[t]`` is the bonus token and the
    tree stops. Returns the trees still active.

    Example: parents ``[-1, 0, 0]``, sources ``[ROOT, BRANCH, SPINE]``, tokens ``[r, 5, 5]``,
    y = 5 at the root -> node 2 (the spine child comes first)."""
    still = 0
    for t in range(active.shape[0]):
        if not active[t]:
            continue
        a = offsets[t]
        best = _child(tokens, parents, ranks, a, offsets[t + 1] - a, cur[t], y[t])
        if best < 0:
            bonus[t] = y[t]
            active[t] = False
        else:
            accepted[t, num_accepted[t]] = best
            num_accepted[t] += 1
            cur[t] = best
            still += 1
    return still


@_jit
def walk_rows(x, tokens, parents, ranks, offsets, starts, accepted, num_accepted, bonus):
    """The greedy walk of every tree to its end: from the root, the argmax of the row of the
    current node (tree t's node j at row ``starts[t] + j`` of ``x``: float32, or int16 bf16
    bits) names the child to descend to (``_child``); the first argmax no child holds is the
    bonus. ``accepted [T, >= max depth]`` (written from column 0), ``num_accepted [T]`` and
    ``bonus [T]`` are filled. Example: one tree, parents ``[-1, 0, 1]``, tokens ``[r, 5, 6]``,
    row argmaxes 5, 7 -> accepted [1], bonus 7."""
    _walk_part(x, tokens, parents, ranks, offsets, starts, accepted, num_accepted, bonus, 0, offsets.shape[0] - 1)


@_threads
def walk_rows_threads(x, tokens, parents, ranks, offsets, starts, accepted, num_accepted, bonus, parts):
    """``walk_rows`` in ``parts`` contiguous parts of the trees, one a thread (numba's thread count
    set to ``parts``: ``kernels.split.row_threads``)."""
    n = offsets.shape[0] - 1
    for p in numba.prange(parts):
        _walk_part(x, tokens, parents, ranks, offsets, starts, accepted, num_accepted, bonus, n * p // parts,
                   n * (p + 1) // parts)


@_jit
def _walk_part(x, tokens, parents, ranks, offsets, starts, accepted, num_accepted, bonus, lo, hi):
    """``walk_rows`` of trees ``lo`` to ``hi`` (exclusive)."""
    maxima = np.empty((x.shape[1] + BLOCK - 1) // BLOCK, np.int32)
    for t in range(lo, hi):
        a = offsets[t]
        n = offsets[t + 1] - a
        c = 0
        num_accepted[t] = 0
        while True:
            y = argmax_row(x[starts[t] + c], maxima)
            best = _child(tokens, parents, ranks, a, n, c, y)
            if best < 0:
                bonus[t] = y
                break
            accepted[t, num_accepted[t]] = best
            num_accepted[t] += 1
            c = best
