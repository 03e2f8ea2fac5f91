"""Compiled greedy-walk descent (``kernels.load("walk")``) for ``verifiers.greedy.walk_flat``: every
tree of a step one depth down (the argmax of the rows it visits: ``kernels.vocab.argmax_rows``)."""

from __future__ import annotations

import numba

__all__ = ["descend_flat"]


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
