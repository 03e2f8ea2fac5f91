"""Compiled inner loops of the budget allocator (``kernels.load("allocate")``): the concave
envelopes of the requests' gain lists and the scan of every total T along a node order.

Scope: ``allocate_batch``, the allocator's whole decision for a batch (``allocator.allocate``'s
steps 2-6: envelopes, orders, scans and Dinkelbach rounds in one call), ``allocate_one`` (the
same for one request: every prefix scored, no orders; it calls ``concave_rows`` and
``step_seconds``), and ``allocate_batch``'s two loops:
``concave_rows`` (the antitonic regression of each row, by pool-adjacent-
violators: a stack of blocks, each new entry merged into the blocks before it while their mean
is not larger) and ``scan_prefixes`` (cumulative gains and the step-cost model at every prefix
of an order; the model is ``cost.CostModel.predict``, a piecewise-linear function of the query
tokens plus linear terms, passed as arrays by ``CostModel.kernel_params``).

Also ``offer_budgets``: the node budgets the drafter offers the proposer for the next step,
from each request's recent kept drafts (``TreeDrafter._offers``); ``cut_accounts``: the cut's
metrics after the allocation (``BatchBudget.cut``).

Example (``concave_rows``): ``[0.1, 0.9, 0.2]`` -> blocks [0.1], then 0.9 > 0.1 merges into
[0.1, 0.9] (mean 0.5), then 0.2 < 0.5 stays -> ``[0.5, 0.5, 0.2]``.
"""

from __future__ import annotations

import math

import numba
import numpy as np

__all__ = ["allocate_batch", "allocate_one", "concave_rows", "cut_accounts", "offer_budgets", "scan_prefixes", "step_seconds"]

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
def _hull_gap(p, h):
    """max over rows i and prefixes k of sum(h[i, :k]) - sum(p[i, :k]) (at least 0): how far a
    row's concave envelope ``h`` (``concave_rows``) runs above its gains ``p``, the allocator's
    bound on what a prefix cut loses; rows padded with zeros in both."""
    gap = 0.0
    for i in range(p.shape[0]):
        ch = 0.0
        cp = 0.0
        for k in range(p.shape[1]):
            ch += h[i, k]
            cp += p[i, k]
            gap = max(gap, ch - cp)
    return gap


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


@_jit
def allocate_one(gain, t_max, ctx, base, num_reqs, q0, knots, at_knots, tail):
    """``allocator.allocate`` for one request with a compiled cost model, in one call: every
    prefix n = 0 .. ``t_max`` of ``gain`` (the request's capped list) scored, the first best
    kept, and the hull gap of the whole list (``concave_rows``). The same arithmetic in the same
    order as the prefix scan (``scan_prefixes`` with every node at context ``ctx``, the first
    one speculating), and its refusal of seconds that are not positive at any n (a negative or
    NaN ``ctx`` can make them so). Returns (n, expected tokens, seconds, plain rate, hull gap)."""
    size = gain.shape[0]
    for k in range(size):
        v = gain[k]
        if not (v >= 0.0 and v <= 1.0):  # NaN fails too
            raise ValueError("probs must be probabilities in [0, 1]")
    sec = step_seconds(num_reqs, q0, 0, 0.0, 0, knots, at_knots, tail)
    if not sec > 0.0:
        raise ValueError("cost.predict must return positive seconds for every total")
    plain_rate = base / sec
    best_t, best_num, best_sec, top = 0, base, sec, plain_rate
    g = base
    c = 0.0
    for t in range(1, t_max + 1):
        g += gain[t - 1]
        c += ctx
        sec = step_seconds(num_reqs, q0 + t, t, c, 1, knots, at_knots, tail)
        if not sec > 0.0:
            raise ValueError("cost.predict must return positive seconds for every total")
        rate = g / sec
        if rate > top:
            best_t, best_num, best_sec, top = t, g, sec, rate
    row = gain.reshape((1, size))
    hull = np.empty((1, size))
    concave_rows(row, np.full(1, size, np.int64), hull)
    return best_t, best_num, best_sec, plain_rate, _hull_gap(row, hull)


@_jit
def _best_of(order, num, sec, best_order, best):
    """``_best_prefix`` of ``allocator.allocate``: the first maximum of ``num / sec`` over T, taken
    into ``best_order`` / ``best`` (= [T, tokens, seconds]) when its rate beats the kept one's
    (``best[0] < 0``: none kept yet); True when taken."""
    t = 0
    top = num[0] / sec[0]
    for j in range(1, num.shape[0]):
        rate = num[j] / sec[j]
        if rate > top:
            t, top = j, rate
    if best[0] >= 0 and not top > best[1] / best[2]:
        return False
    best_order[:] = order
    best[0], best[1], best[2] = t, num[t], sec[t]
    return True


@_jit
def _scan_checked(order, t_max, gain, slope, node_ctx, first, base, num_reqs, q0, knots, at_knots, tail,
                  num, num_hull, sec, sec_low):
    scan_prefixes(order, t_max, gain, slope, node_ctx, first, base, num_reqs, q0, knots, at_knots, tail,
                  num, num_hull, sec, sec_low)
    for j in range(t_max + 1):
        if not (sec[j] > 0.0 and sec_low[j] > 0.0):
            raise ValueError("cost.predict must return positive seconds for every total")


@_jit
def allocate_batch(probs, lengths, caps, ctx, token_budget, base, num_reqs, q0, knots, at_knots, tail, ctx_weight,
                   ctx_given, spec_weight, rounds, cuts):
    """``allocator.allocate`` for two or more requests with a compiled cost model, in one call
    (its steps 2-6, the same arithmetic in the same order, so the same cuts): ``probs`` the
    requests' lists one after another (``lengths`` [B]), ``caps`` [B] how many of each may be
    kept, ``ctx`` [B] their contexts, ``token_budget`` the most tree rows (< 0: none);
    Dinkelbach rounds on the context term when ``ctx_weight`` > 0, ``ctx_given`` and the contexts
    differ, on b_D (``spec_weight``) when it is > 0; ``rounds``: the most rounds of each. Writes
    ``cuts`` [B]; returns (T, expected tokens, seconds, plain rate, rate_upper before its last
    max, hull gap)."""
    batch = caps.shape[0]
    width = 0
    low_ctx, high_ctx = np.inf, -np.inf
    for i in range(batch):
        width = max(width, caps[i])
        low_ctx, high_ctx = min(low_ctx, ctx[i]), max(high_ctx, ctx[i])
    p = np.zeros((batch, width))
    at = 0
    for i in range(batch):
        for k in range(caps[i]):
            v = probs[at + k]
            if not (v >= 0.0 and v <= 1.0):  # NaN fails too
                raise ValueError("probs must be probabilities in [0, 1]")
            p[i, k] = v
        at += lengths[i]
    h = np.empty((batch, width))
    concave_rows(p, caps, h)
    hull_gap = _hull_gap(p, h)
    n = 0
    for i in range(batch):
        n += caps[i]
    t_max = n if token_budget < 0 else min(n, token_budget)
    rows = np.empty(n, np.int64)
    gain = np.empty(n)
    slope = np.empty(n)
    node_ctx = np.empty(n)
    first = np.zeros(n, np.int64)
    j = 0
    for i in range(batch):
        for k in range(caps[i]):
            rows[j] = i
            gain[j] = p[i, k]
            slope[j] = h[i, k]
            node_ctx[j] = ctx[i]
            if k == 0:
                first[j] = 1
            j += 1
    num = np.empty(t_max + 1)
    num_hull = np.empty(t_max + 1)
    sec = np.empty(t_max + 1)
    low = np.empty(t_max + 1)
    best_order = np.empty(n, np.int64)
    best = np.array([-1.0, 0.0, 1.0])  # [T, tokens, seconds]
    order = np.argsort(-slope, kind="mergesort")  # stable: ties in (request, k) order
    _scan_checked(order, t_max, gain, slope, node_ctx, first, base, num_reqs, q0, knots, at_knots, tail,
                  num, num_hull, sec, low)
    _best_of(order, num, sec, best_order, best)
    plain_rate = num[0] / sec[0]
    rate_upper = num_hull[0] / low[0]
    for t in range(1, t_max + 1):
        rate_upper = max(rate_upper, num_hull[t] / low[t])
    if ctx_weight > 0 and ctx_given and high_ctx - low_ctx > 0 and t_max > 0:
        r = rate_upper
        for _ in range(rounds):
            rw = r * ctx_weight
            order = np.argsort(-(slope - rw * node_ctx), kind="mergesort")
            _scan_checked(order, t_max, gain, slope, node_ctx, first, base, num_reqs, q0, knots, at_knots, tail,
                          num, num_hull, sec, low)
            _best_of(order, num, sec, best_order, best)
            t = 0
            top = num_hull[0] - r * low[0]
            least = low[0]
            for u in range(1, t_max + 1):
                g = num_hull[u] - r * low[u]
                if g > top:
                    t, top = u, g
                least = min(least, low[u])
            rate_upper = r + max(top, 0.0) / least
            if top <= 1e-12 * r * low[t]:
                break
            r = num_hull[t] / low[t]
    if spec_weight > 0 and t_max > 0:
        adjusted = np.empty((batch, width))
        hull = np.empty((batch, width))
        keys = np.empty(n)
        for _ in range(rounds):
            r = best[1] / best[2]
            adjusted[:, :] = p
            adjusted[:, 0] -= r * spec_weight
            concave_rows(adjusted, caps, hull)
            rw = r * ctx_weight
            j = 0
            for i in range(batch):
                for k in range(caps[i]):
                    keys[j] = hull[i, k] - rw * node_ctx[j]
                    j += 1
            order = np.argsort(-keys, kind="mergesort")
            _scan_checked(order, t_max, gain, slope, node_ctx, first, base, num_reqs, q0, knots, at_knots, tail,
                          num, num_hull, sec, low)
            if not _best_of(order, num, sec, best_order, best):
                break
    t = int(best[0])
    cuts[:] = 0
    for u in range(t):
        cuts[rows[best_order[u]]] += 1
    return t, best[1], best[2], plain_rate, rate_upper, hull_gap


@_jit
def offer_budgets(marks, room, factor, min_drafts, out):
    """``out[k]``: the node budget (root included) offered for request k's next proposal,
    ``max(min_drafts, ceil(factor x marks[k])) + 1``; 0 (the proposer's own budget) where the
    request has no mark (``marks[k]`` negative or NaN) or those drafts reach its ``room[k]``
    (tested before the ceil, so an infinite or huge mark never meets an integer conversion).
    Example: marks ``[5.0, -1.0, 2.0]``, room ``[60, 60, 8]``, factor 3, min_drafts 8 ->
    ``[16, 0, 0]``."""
    for k in range(marks.shape[0]):
        m = marks[k]
        if not m >= 0 or factor * m >= room[k]:
            out[k] = 0
            continue
        drafts = max(min_drafts, math.ceil(factor * m))
        out[k] = 0 if drafts >= room[k] else drafts + 1


@_jit
def cut_accounts(flat, lengths, max_per_request, headroom, cuts, kept):
    """The accounts of a step's cut (``BatchBudget.cut``'s metrics), request i's list being the
    next ``lengths[i]`` entries of ``flat``: ``kept[i]``, the expected accepted drafts of its
    first ``cuts[i]`` entries, as a difference of ``flat``'s prefix sums (``np.cumsum``'s order).
    Returns ``(caps, given up, drafts)``: the requests' caps summed (``allocate.request_caps``
    with ``max_per_request``, -1 for none (the engine's is never negative), and ``headroom``), the expected accepted drafts
    between each cut and its cap, and ``cuts`` summed. Example: ``flat [0.9, 0.5, 0.8]``,
    lengths ``[2, 1]``, no max, headroom ``[9, 9]``, cuts ``[1, 0]`` -> kept ``[0.9, 0.0]``,
    ``(3, 1.3, 1)``."""
    total = 0.0  # the running prefix sum of flat
    caps = 0
    given_up = 0.0
    drafts = 0
    start = 0
    for i in range(lengths.shape[0]):
        n = lengths[i]
        cap = n if max_per_request < 0 else min(n, max_per_request)
        cap = min(cap, max(headroom[i], 0))
        at_start = total
        at_cut = total
        at_cap = total
        for k in range(n):
            total += flat[start + k]
            if k + 1 == cuts[i]:
                at_cut = total
            if k + 1 == cap:
                at_cap = total
        kept[i] = at_cut - at_start
        given_up += at_cap - at_cut
        caps += cap
        drafts += cuts[i]
        start += n
    return caps, given_up, drafts
