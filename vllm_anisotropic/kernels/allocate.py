"""Compiled inner loops of the budget allocator (``kernels.load("allocate")``): the concave
envelopes of the requests' gain lists and the scan of every total T along a node order.

Scope: the two loops ``allocator.allocate`` runs several times per step (once, then once per
Dinkelbach round): ``concave_rows`` (the antitonic regression of each row, by pool-adjacent-
violators: a stack of blocks, each new entry merged into the blocks before it while their mean
is not larger) and ``scan_prefixes`` (cumulative gains and the step-cost model at every prefix
of an order; the model is ``cost.CostModel.predict``, a piecewise-linear function of the query
tokens plus linear terms, passed as arrays by ``CostModel.kernel_params``).

Example (``concave_rows``): ``[0.1, 0.9, 0.2]`` -> blocks [0.1], then 0.9 > 0.1 merges into
[0.1, 0.9] (mean 0.5), then 0.2 < 0.5 stays -> ``[0.5, 0.5, 0.2]``.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["concave_rows", "scan_prefixes", "step_seconds"]

_jit = numba.njit(cache=True, nogil=True)


@_jit
def concave_rows(p, lengths, out):
    """``out[i, :lengths[i]]``: the non-increasing regression of ``p[i, :lengths[i]]`` (unit
    weights); 0 beyond."""
    rows, width = p.shape
    sums = np.empty(width, np.float64)
    counts = np.empty(width, np.int64)
    for i in range(rows):
        n = lengths[i]
        top = 0
        for k in range(n):
            s = p[i, k]
            c = 1
            # merge while the block before has a mean not larger than the new one's
            while top > 0 and sums[top - 1] * c < s * counts[top - 1]:
                top -= 1
                s += sums[top]
                c += counts[top]
            sums[top] = s
            counts[top] = c
            top += 1
        k = 0
        for b in range(top):
            mean = sums[b] / counts[b]
            for _ in range(counts[b]):
                out[i, k] = mean
                k += 1
        for j in range(n, width):
            out[i, j] = 0.0


@_jit
def step_seconds(num_reqs, q, t, c, d, knots, at_knots, tail):
    """``CostModel.predict`` for one step: ``tail`` = (w0, w_request, last slope, b_on, b_on_r,
    b_t, b_c, b_spec, b_d, b_step)."""
    top = knots[knots.shape[0] - 1]
    x = min(q, top)
    j = np.searchsorted(knots, x, side="right") - 1
    if j >= knots.shape[0] - 1:
        f = at_knots[knots.shape[0] - 1]
    else:
        f = at_knots[j] + (at_knots[j + 1] - at_knots[j]) * (x - knots[j]) / (knots[j + 1] - knots[j])
    f += tail[2] * max(q - top, 0.0)
    out = tail[0] + tail[1] * num_reqs + f
    if t > 0:
        out += tail[3] + tail[4] * num_reqs
    out += tail[5] * t + tail[6] * c
    if d > 0:
        out += tail[7]
    return out + tail[8] * d + tail[9]


@_jit
def scan_prefixes(order, t_max, gain, slope, node_ctx, first, base, num_reqs, q0, knots, at_knots, tail,
                  num, num_hull, sec, sec_low):
    """For T = 0 .. t_max, the first T nodes of ``order``: expected tokens ``num[T]`` (true
    gains), ``num_hull[T]`` (hull gains), predicted seconds ``sec[T]`` and ``sec_low[T]`` (the
    same without the speculating-request terms: a lower bound for any D)."""
    g = base
    h = base
    c = 0.0
    d = 0
    for t in range(t_max + 1):
        if t > 0:
            node = order[t - 1]
            g += gain[node]
            h += slope[node]
            c += node_ctx[node]
            d += first[node]
        num[t] = g
        num_hull[t] = h
        sec[t] = step_seconds(num_reqs, q0 + t, t, c, d, knots, at_knots, tail)
        sec_low[t] = step_seconds(num_reqs, q0 + t, t, c, 0, knots, at_knots, tail)
