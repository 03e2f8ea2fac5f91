"""Compiled greedy-walk descent (``kernels.load("walk")``) for ``verifiers.greedy.walk_flat``, and
the widening of a bf16 logits row to float32 for its argmax (``host_rows_argmax``)."""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["descend_flat", "widen_bf16"]


@numba.njit(cache=True, nogil=True)
def widen_bf16(bits, rows, out):
    """``out[i, j]``: the float32 bit pattern of bf16 ``bits[rows[i], j]`` (``bits`` the int16
    view of a logits matrix), i.e. the 16 bits moved to the top of a 32-bit word (exact: bf16 is
    float32's upper half). Example: bf16 1.0 = 0x3F80 -> 0x3F800000. A gather and the widening in
    one single-threaded pass (torch's ``index_select`` then ``.float()`` make two, each a parallel
    region: ~30 us a 49k row on a loaded 2-core CPU against ~2-4 us here)."""
    for i in range(rows.shape[0]):
        r = rows[i]
        for j in range(bits.shape[1]):
            out[i, j] = np.uint32(np.uint16(bits[r, j])) << np.uint32(16)


@numba.njit(cache=True, nogil=True)
def descend_flat(tokens, parents, ranks, offsets, active, y, cur, accepted, num_accepted, bonus):
    """One depth step of the greedy walk for every tree ``t`` with ``active[t]``: descend from
    local node ``cur[t]`` to its first child in priority order (``ranks``: SPINE 0 before
    BRANCH/DRAFT 1, then node index) whose token is ``y[t]``, appending it to ``accepted[t]``;
    with none, ``y[t]`` is the bonus token and the tree stops. Returns the trees still active.

    Children of a node follow it in node order, so the scan runs from ``cur + 1`` to the tree's
    end. Example: parents ``[-1, 0, 0]``, sources ``[ROOT, BRANCH, SPINE]``, tokens ``[r, 5, 5]``,
    y = 5 at the root -> node 2 (the spine child comes first)."""
    still = 0
    for t in range(active.shape[0]):
        if not active[t]:
            continue
        a = offsets[t]
        n = offsets[t + 1] - a
        c = cur[t]
        best = -1
        best_rank = 127
        for j in range(c + 1, n):
            if parents[a + j] == c and tokens[a + j] == y[t] and ranks[a + j] < best_rank:
                best = j
                best_rank = ranks[a + j]
                if best_rank == 0:
                    break
        if best < 0:
            bonus[t] = y[t]
            active[t] = False
        else:
            accepted[t, num_accepted[t]] = best
            num_accepted[t] += 1
            cur[t] = best
            still += 1
    return still
