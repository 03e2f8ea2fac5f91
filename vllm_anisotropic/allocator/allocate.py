"""Budget allocation: where to cut each request's value-ordered draft list, for the whole batch.

Scope: one decision per engine step (the batch as ECHO's "super-tree"): given, per request, the
calibrated probabilities of its draft nodes in the tree's value order, the step-cost model and
the step's caps, return per-request cuts n_i (n_i = 0: plain decoding for that request) that
maximise the expected tokens per second of the step. With a compiled cost model
(``CostModel.kernel_params``, the engine's) a batch's steps 2-6 run in one compiled call
(``kernels.allocate.allocate_batch``; one request's, ``allocate_one``); otherwise numpy
(``_allocate_numpy``, also the definition the batch's call is tested against; one request's:
``_allocate_one``'s own numpy branch). No trees, no vLLM (the engine hook applies the cuts
with ``DraftTree.truncate(1 + n_i)``).

Source: ECHO (arXiv 2604.09603): the super-tree under a verification cap (Sec. 3.1, Eq. 4),
Theorem 2 (Sec. 4 / App. A.3, marginal utility exchange) and Alg. 1 (Sec. 3.3, elastic budget
scheduling). Dinkelbach (1967, Management Science 13(7)) for the ratio objective.

Terms
-----
probs_i[k-1]
    Calibrated P(node k of request i is on the accepted path), k = 1..L_i in value order
    (root excluded). E_i(n) = sum_{k <= n} probs_i[k-1] is the expected number of accepted
    draft tokens when the first n nodes are verified (linearity of expectation).
cut n_i
    Request i verifies its first n_i nodes (a prefix: value order keeps parents first, so
    every prefix is a subtree).
base tokens
    Tokens the step yields with no drafts at all: one per decoding request (the bonus).
rate
    rate(n) = (base + sum_i E_i(n_i)) / cost(R, Q0 + T, T, C0 + sum_i n_i ctx_i), T = sum_i n_i.

The algorithm
-------------
1. Caps: n_i <= c_i = min(L_i, max_per_request, headroom_i); sum_i n_i <= token_budget.
2. Concave envelope per request: H_i = least concave majorant of k -> E_i(k) on 0..c_i. Its
   slopes h_i[k] are non-increasing, and they are the antitonic (non-increasing) regression
   of probs_i, computed for all rows at once by a parallel pool-adjacent-violators (rows
   already non-increasing skip it).
3. Order all nodes of all requests by h descending (ties: request, then k): for every total T,
   the first T nodes of this order maximise sum_i H_i(n_i) subject to sum n_i = T (greedy on
   concave separable functions; this is ECHO's Theorem 2 exchange argument made exhaustive:
   no node outside the prefix has a larger marginal gain than one inside). Each request's
   nodes appear in k order, so every prefix of the order is a vector of prefix cuts.
4. Scan every T = 0 .. T_max (cumsum along the order; one vectorised cost-model call) and keep
   the T with the best *true* rate (E, not H). T = 0 (no drafts anywhere) wins when drafts do
   not pay; ties go to the smaller T.
5. If the cost charges tree rows by their context (``cost.ctx_weight > 0`` and ``ctx_lens``
   given), nodes of long requests cost more: Dinkelbach's iteration orders by
   h_i[k] - r ctx_weight ctx_i with r the current best ratio, rescans, and repeats until r
   stops improving (it is the exact maximiser of the relaxed ratio; usually 2-3 rounds).
6. If the cost charges each request that speculates (``cost.spec_request_weight`` b_D > 0:
   host work per request with drafts, see ``cost.py``), spreading one node over each of eight
   requests costs 8 b_D more than eight nodes of one request. Dinkelbach's iteration on the
   true ratio orders by the concave hull of each row with its first node's gain lowered by
   r b_D (the first node is bundled with the followers that pay for it), rescans with the
   speculating requests D(T) counted in the cost, and repeats while the rate improves. This
   step is a heuristic (the fixed cost makes the problem a knapsack with setup costs); the
   certificate below stays valid because it bounds the cost from below without the D terms.
   Measured against brute force (tests/test_allocator.py's generator, 4,000 cases): exact on
   all 2,618 with non-increasing lists; 1,375 of 1,382 with rising lists, worst 94.7 %.

Optimality (proof sketch in the comments of ``_best_prefix``). Let delta = max_i max_k
(H_i(k) - E_i(k)) >= 0, the hull gap (0 iff every E_i is concave, i.e. every probs_i is
non-increasing, as value-ordered calibrated lists usually are). Then

    rate_upper >= OPT >= rate >= OPT - delta / min_T cost(T)

where OPT is the best rate over all prefix-cut vectors within the caps and rate_upper the
optimum of the relaxation with H in place of E (returned, so every decision carries its own
certificate). With delta = 0 and no per-request cost (b_D = b_spec = 0) the allocation is
exactly optimal; with them, rate_upper is the relaxation's optimum with the cost's D terms
dropped (still >= OPT) and the lower bound does not hold (step 6). Reason: at any T the greedy
prefix takes every hull block whole except at most one (ties are broken so that blocks are
contiguous in the order), so its true value is >= sum H - delta >= OPT(T) - delta.

Relation to ECHO Alg. 1: ECHO extends depth globally across the confident requests (Phase 1)
and spends what is left on width (Phase 2) under a fixed K_max. Here (a) value order already
puts a request's deep spine before its wide branches, and the greedy takes nodes across
requests by marginal gain, so "depth before width" and "reallocate from truncated to confident
requests" both fall out of step 3; (b) the gate is the calibrated probability (sparse: only
sweet-spot depths resolve the value, see ``acceptance.py``); (c) K_max is not a constant near
the hardware's saturation point but the argmax of the rate over T, read off the cost model, so
a memory-bound GPU gets large trees and a compute-bound batch (or a CPU) gets small ones or
none.

Worked example: probs [[0.9, 0.5], [0.6]], base 2 tokens, no fixed query tokens and a cost
of 1 + 0.5 Q seconds (``CostModel.linear(1.0, 0.5)``, so cost(T) = 1 + 0.5 T). Order
by gain: 0.9 (req 0), 0.6 (req 1), 0.5 (req 0). Rates: T=0: 2/1 = 2.0; T=1: 2.9/1.5 = 1.93;
T=2: 3.5/2 = 1.75; T=3: 4.0/2.5 = 1.6 -> cuts [0, 0]. With 1 + 0.05 T: 2.0, 2.76, 3.18, 3.48
-> cuts [2, 1].
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from vllm_anisotropic import kernels

__all__ = ["Allocation", "StepCost", "allocate", "allocate_flat", "concave_slopes", "pad_probs", "request_caps"]

logger = logging.getLogger(__name__)

_DINKELBACH_ROUNDS = 30


class StepCost(Protocol):
    """What the allocator needs from a cost model (``cost.CostModel`` is one).

    ``predict`` must broadcast over arrays; ``ctx_weight`` (optional attribute, seconds per
    context token of a tree row) is only used to order nodes when ``ctx_lens`` is given;
    ``spec_request_weight`` (optional, seconds per request with drafts) bundles a request's first
    node with that fixed cost when ordering nodes (step 6 of the module docstring).
    """

    def predict(self, num_reqs, query_tokens, tree_rows, ctx_tokens=0.0, spec_reqs=None): ...


@dataclass(frozen=True)
class Allocation:
    """The decision for one step, with its predicted value and its optimality certificate."""

    # [batch_size] int64 draft nodes kept per request (0 = plain decoding)
    cuts: np.ndarray
    # T = sum(cuts): tree rows added to the step
    tree_rows: int
    # base + sum_i E_i(cuts_i): expected tokens the step yields
    expected_tokens: float
    # predicted step seconds
    seconds: float
    # expected_tokens / seconds
    rate: float
    # the rate with no drafts anywhere (T = 0)
    plain_rate: float
    # optimum of the concave-envelope relaxation: an upper bound on the optimal rate
    rate_upper: float
    # delta = max_i max_k (H_i(k) - E_i(k)); 0 => the allocation is exactly optimal
    hull_gap: float

    @property
    def speedup(self) -> float:
        """Predicted rate over plain decoding's (>= 1: T = 0 is always a candidate)."""
        return self.rate / self.plain_rate


def request_caps(lengths, max_per_request: int | None = None, headroom=None) -> np.ndarray:
    """[batch_size] int64 per-request cap c_i = min(L_i, max_per_request, max(headroom_i, 0)).

    ``headroom_i`` is how many draft tokens request i can still take without passing
    ``max_model_len`` (the caller's ``max_model_len - num_tokens_i - 1``: the bonus token needs
    a slot too). ``lengths [5, 3, 7], max 4, headroom [9, 9, 2] -> [4, 3, 2]``.
    """
    caps = np.asarray(lengths, np.int64).copy()
    if max_per_request is not None:
        caps = np.minimum(caps, max(int(max_per_request), 0))
    if headroom is not None:
        h = np.asarray(headroom, np.int64)
        if h.shape != caps.shape:
            raise ValueError(f"headroom needs one entry per request: {h.shape} vs {caps.shape}")
        caps = np.minimum(caps, np.maximum(h, 0))
    return caps


def pad_probs(probs: Sequence[np.ndarray], caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ragged lists cut to their caps -> ([batch_size, max_len] float64, [batch_size, max_len] bool).

    Padding is 0 and ``valid[i, k] = k < caps[i]``.
    ``probs [[.9,.5], [.6]], caps [2, 0] -> [[.9,.5], [0,0]], valid [[T,T], [F,F]]``.
    """
    width = int(caps.max(initial=0))
    out = np.zeros((len(probs), width))
    valid = np.arange(width)[None, :] < caps[:, None]
    if width:
        lens = np.minimum([len(p) for p in probs], width)
        flat = np.concatenate([np.asarray(p, np.float64)[:n] for p, n in zip(probs, lens)])
        full = np.arange(width)[None, :] < lens[:, None]
        out[full] = flat  # row-major fill: the rows' leading entries
        out[~valid] = 0.0
    return out, valid


def concave_slopes(p: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """[batch_size, max_len] slopes of the least concave majorant of each row's cumulative sum.

    Equals the antitonic (non-increasing) regression of the row with unit weights: same total,
    constant on blocks, the block value the mean of the row over the block (pool-adjacent-
    violators, compiled: ``kernels.allocate.concave_rows``). ``valid`` must be a prefix of each
    row (``pad_probs``); padding is returned as 0.
    ``[0.1, 0.9, 0.2] -> [0.5, 0.5, 0.2]``; ``[0.9, 0.1] -> [0.9, 0.1]``; ``[2, 1, 4] -> [7/3] * 3``.
    """
    out = np.empty(p.shape)
    kernels.load("allocate").concave_rows(np.ascontiguousarray(p, np.float64), valid.sum(axis=1).astype(np.int64), out)
    return out


def allocate(
    probs: Sequence[np.ndarray],
    cost: StepCost,
    *,
    num_reqs: int | None = None,
    fixed_query_tokens: int | None = None,
    token_budget: int | None = None,
    max_per_request: int | None = None,
    headroom=None,
    ctx_lens=None,
    base_tokens: float | None = None,
) -> Allocation:
    """Per-request cuts maximising expected tokens per second of the step (module docstring).

    Args:
        probs: batch_size arrays, ``probs[i]`` [L_i] calibrated P(node k on the accepted path)
            in value order (root excluded).
        cost: the step-cost model (``predict(num_reqs, query_tokens, tree_rows, ctx_tokens)``).
        num_reqs: requests in the step, decoding and prefilling (default: batch_size).
        fixed_query_tokens: query rows already scheduled without any draft: roots, prefill
            chunks, re-run tokens (default: batch_size, one root per request).
        token_budget: tree rows the step may still add (vLLM's ``max_num_batched_tokens`` minus
            what is scheduled); None = unlimited.
        max_per_request: per-request cap (``num_speculative_tokens``); None = unlimited.
        headroom: [batch_size] drafts each request can take before ``max_model_len``.
        ctx_lens: [batch_size] context length of each request (tokens before its tree rows), for
            the cost model's per-tree-row attention term; None = 0.
        base_tokens: tokens the step yields with no drafts (default: batch_size).
    """
    lengths = np.array([len(p) for p in probs], np.int64)
    flat = np.concatenate([np.asarray(p, np.float64).reshape(-1) for p in probs]) if len(probs) else np.zeros(0)
    return allocate_flat(flat, lengths, cost, num_reqs=num_reqs, fixed_query_tokens=fixed_query_tokens,
                         token_budget=token_budget, max_per_request=max_per_request, headroom=headroom,
                         ctx_lens=ctx_lens, base_tokens=base_tokens)


def allocate_flat(flat: np.ndarray, lengths: np.ndarray, cost: StepCost, *, limits=None, num_reqs: int | None = None,
                  fixed_query_tokens: int | None = None, token_budget: int | None = None,
                  max_per_request: int | None = None, headroom=None, ctx_lens=None,
                  base_tokens: float | None = None) -> Allocation:
    """``allocate`` over the lists laid one after another: request i's list is the next
    ``lengths[i]`` entries of ``flat`` [sum(lengths)] float64, of which only the first
    ``limits[i]`` (default: all) may be kept; the other arguments as ``allocate``'s. What the
    engine's cut passes: one array for the step, and its chains-only cut as ``limits``."""
    batch = lengths.shape[0]
    caps = request_caps(lengths if limits is None else np.minimum(lengths, limits), max_per_request, headroom)
    num_reqs = batch if num_reqs is None else int(num_reqs)
    q0 = batch if fixed_query_tokens is None else int(fixed_query_tokens)
    base = float(batch if base_tokens is None else base_tokens)
    ctx = np.zeros(batch) if ctx_lens is None else np.asarray(ctx_lens, np.float64)
    if ctx.shape != (batch,):
        raise ValueError(f"ctx_lens needs one entry per request, got shape {ctx.shape}")

    if batch == 1:
        return _allocate_one(flat[: int(caps[0])], cost, num_reqs, q0, base, float(ctx[0]), token_budget)
    params = getattr(cost, "kernel_params", None)
    if params is not None:  # the cost model's arithmetic compiled: steps 2-6 in one call
        return _allocate_compiled(flat, lengths, caps, cost, params(), num_reqs, q0, base, ctx, ctx_lens is not None,
                                  token_budget)
    probs = np.split(flat, np.cumsum(lengths)[:-1]) if batch else []
    return _allocate_numpy(probs, caps, cost, None, num_reqs, q0, base, ctx, ctx_lens is not None, token_budget)


def _allocate_compiled(flat, lengths, caps, cost, params, num_reqs: int, q0: int, base: float, ctx: np.ndarray,
                       ctx_given: bool, token_budget: int | None) -> Allocation:
    """Steps 2-6 for a batch in one compiled call (``kernels.allocate.allocate_batch``): the
    same arithmetic in the same order as ``_allocate_numpy`` with the same ``params``, so the
    same cuts and numbers (tests/test_allocator.py compares the two)."""
    cuts = np.empty(lengths.shape[0], np.int64)
    t, expected, seconds, plain_rate, rate_upper, hull_gap = kernels.load("allocate").allocate_batch(
        flat, lengths, caps, ctx, -1 if token_budget is None else max(int(token_budget), 0),
        base, float(num_reqs), float(q0), *params, float(getattr(cost, "ctx_weight", 0.0) or 0.0), ctx_given,
        float(getattr(cost, "spec_request_weight", 0.0) or 0.0), _DINKELBACH_ROUNDS, cuts)
    return Allocation(cuts=cuts, tree_rows=int(t), expected_tokens=float(expected), seconds=float(seconds),
                      rate=expected / seconds, plain_rate=float(plain_rate),
                      rate_upper=float(max(rate_upper, expected / seconds)), hull_gap=float(hull_gap))


def _allocate_numpy(probs, caps, cost, params, num_reqs: int, q0: int, base: float, ctx: np.ndarray, ctx_given: bool,
                    token_budget: int | None) -> Allocation:
    """Steps 2-6 for a batch in numpy: the path of a cost model without ``kernel_params``
    (``params`` None: ``cost.predict`` at every prefix) and, with ``params``, the definition
    the compiled path is tested against."""
    batch = len(probs)
    p, valid = pad_probs(probs, caps)  # [batch_size, max_len]
    _check_probs(p)
    h = concave_slopes(p, valid)  # [batch_size, max_len]
    # hull gap delta: max over requests and k of H_i(k) - E_i(k)
    hull_gap = float(np.max(np.cumsum(h, axis=1) - np.cumsum(p, axis=1), initial=0.0))

    rows, ks = np.nonzero(valid)  # [num_nodes] request and index k of each candidate node, row-major
    first = ks == 0  # [num_nodes] a request's first node: taking it makes the request speculate
    gain = p[valid]  # [num_nodes] true marginal gains
    slope = h[valid]  # [num_nodes] hull marginal gains
    node_ctx = ctx[rows]  # [num_nodes]
    t_max = rows.size if token_budget is None else min(rows.size, max(int(token_budget), 0))
    totals = np.arange(t_max + 1)  # [t_max + 1] candidate T

    first_i = first.astype(np.int64)

    def scan(order: np.ndarray):
        """(true numerators, hull numerators, seconds, seconds without the speculating-request
        terms), each [t_max + 1], for the prefixes of ``order``. The last is a lower bound on
        the seconds of any allocation with that T and context (the cost is monotone in D)."""
        if params is not None:  # the cost model's own arithmetic, compiled
            out = np.empty((4, t_max + 1))
            kernels.load("allocate").scan_prefixes(order, t_max, gain, slope, node_ctx, first_i, base, float(num_reqs),
                                                   float(q0), *params, out[0], out[1], out[2], out[3])
            if np.any(~(out[2:] > 0)):
                raise ValueError("cost.predict must return positive seconds for every total")
            return out[0], out[1], out[2], out[3]
        take = order[:t_max]
        num = base + np.concatenate([[0.0], np.cumsum(gain[take])])
        num_hull = base + np.concatenate([[0.0], np.cumsum(slope[take])])
        c = np.concatenate([[0.0], np.cumsum(node_ctx[take])])
        d = np.concatenate([[0], np.cumsum(first[take])])  # requests with drafts in the prefix
        # one cost call for both: with D, then with D = 0
        both = np.asarray(cost.predict(num_reqs, np.tile(q0 + totals, 2), np.tile(totals, 2), np.tile(c, 2),
                                       np.concatenate([d, np.zeros_like(d)])), np.float64).reshape(-1)
        if both.shape != (2 * totals.size,) or np.any(~(both > 0)):
            raise ValueError("cost.predict must return positive seconds for every total")
        return num, num_hull, both[: totals.size], both[totals.size:]

    # stable sort of -slope: descending, ties in (request, k) order -> prefixes are prefix cuts
    order = np.argsort(-slope, kind="stable")
    num, num_hull, sec, sec_low = scan(order)
    best = _best_prefix(order, num, sec, None)
    rate_upper = float(np.max(num_hull / sec_low))
    w = float(getattr(cost, "ctx_weight", 0.0) or 0.0)
    if w > 0 and ctx_given and np.ptp(ctx) > 0 and t_max > 0:
        # Dinkelbach on the relaxed ratio: maximise N_H(n) - r D(n) by the greedy on
        # h - r w ctx_i (still non-increasing within a request), then r <- N_H / D, until the
        # maximum is 0 (r is then the relaxed optimum).
        # Whatever round it stops at, F(r) = max_n N_H - r D bounds the relaxed optimum:
        # OPT_H <= r + F(r) / min D (take n* = argmax N_H / D: N_H(n*) - r D(n*) <= F(r)).
        r = rate_upper  # a feasible relaxed ratio (a prefix of the first order): a warm start
        for _ in range(_DINKELBACH_ROUNDS):
            order_r = np.argsort(-(slope - r * w * node_ctx), kind="stable")
            num_r, num_hull_r, sec_r, low_r = scan(order_r)
            best = _best_prefix(order_r, num_r, sec_r, best)
            gap = num_hull_r - r * low_r  # [t_max + 1]
            t = int(np.argmax(gap))
            rate_upper = r + max(float(gap[t]), 0.0) / float(low_r.min())
            if gap[t] <= 1e-12 * r * low_r[t]:
                break
            r = float(num_hull_r[t] / low_r[t])
        else:
            logger.debug("Dinkelbach stopped after %d rounds without converging", _DINKELBACH_ROUNDS)
    b_d = float(getattr(cost, "spec_request_weight", 0.0) or 0.0)
    if b_d > 0 and t_max > 0:
        # Step 6: a request's first node also costs b_D. Dinkelbach on the true ratio with that
        # cost in the node keys: the first node's gain minus r b_D, the row's concave hull (the
        # first node is bundled with as many followers as pay for it), minus r w ctx_i.
        for _ in range(_DINKELBACH_ROUNDS):
            r = best[2] / best[3]
            adjusted = p.copy()
            adjusted[:, 0] -= r * b_d
            keys = concave_slopes(adjusted, valid)[valid] - r * w * node_ctx
            order_r = np.argsort(-keys, kind="stable")
            num_r, _, sec_r, _ = scan(order_r)
            found = _best_prefix(order_r, num_r, sec_r, best)
            if found is best:
                break
            best = found

    cut_order, t, expected, seconds = best
    cuts = np.bincount(rows[cut_order[:t]], minlength=batch).astype(np.int64)
    return Allocation(
        cuts=cuts,
        tree_rows=t,
        expected_tokens=expected,
        seconds=seconds,
        rate=expected / seconds,
        plain_rate=float(num[0] / sec[0]),
        rate_upper=float(max(rate_upper, expected / seconds)),
        hull_gap=hull_gap,
    )


def _check_probs(p: np.ndarray) -> None:
    if not (p.min(initial=0.0) >= 0.0 and p.max(initial=0.0) <= 1.0):  # NaN fails both
        raise ValueError("probs must be probabilities in [0, 1]")


def _allocate_one(gain: np.ndarray, cost: StepCost, num_reqs: int, q0: int, base: float, ctx: float,
                  token_budget: int | None) -> Allocation:
    """One request: every prefix n = 0 .. cap scored, the best kept (exact, so ``rate_upper``
    is the rate itself). ``gain`` [cap]: the request's capped probabilities. Ties go to the
    smaller n, as in the batched scan; the reported ``hull_gap`` is the request's own concave
    envelope's largest gap (the scan itself is exact and does not use it). Example: gains [0.9, 0.1], cost
    1 + 0.2 n s, base 1 -> rates [1, 1.58, 1.43] -> n = 1."""
    t_max = gain.size if token_budget is None else min(gain.size, max(int(token_budget), 0))
    params = getattr(cost, "kernel_params", None)
    if params is not None:  # the cost model's own arithmetic, compiled: the whole decision in one call
        t, expected, seconds, plain_rate, hull_gap = kernels.load("allocate").allocate_one(
            np.ascontiguousarray(gain, np.float64), t_max, float(ctx), base, float(num_reqs), float(q0), *params())
        rate = expected / seconds
        return Allocation(cuts=np.array([t], np.int64), tree_rows=t, expected_tokens=expected, seconds=seconds, rate=rate,
                          plain_rate=plain_rate, rate_upper=rate, hull_gap=hull_gap)
    _check_probs(gain)
    totals = np.arange(t_max + 1)  # [t_max + 1] candidate n
    num = base + np.concatenate([[0.0], np.cumsum(gain[:t_max])])
    sec = np.asarray(cost.predict(num_reqs, q0 + totals, totals, ctx * totals, np.minimum(totals, 1)),
                     np.float64).reshape(-1)
    if sec.shape != (t_max + 1,) or not sec.min() > 0:
        raise ValueError("cost.predict must return positive seconds for every total")
    rate = num / sec
    t = int(np.argmax(rate))
    h = concave_slopes(gain[None, :], np.ones((1, gain.size), bool))[0]
    hull_gap = float(np.max(np.cumsum(h) - np.cumsum(gain), initial=0.0))
    return Allocation(cuts=np.array([t], np.int64), tree_rows=t, expected_tokens=float(num[t]),
                      seconds=float(sec[t]), rate=float(rate[t]), plain_rate=float(rate[0]),
                      rate_upper=float(rate[t]), hull_gap=hull_gap)


def _best_prefix(order: np.ndarray, num: np.ndarray, sec: np.ndarray, best):
    """Keep the better of ``best`` and the best prefix of ``order``: (order, T, tokens, seconds).

    Why the best prefix is within delta of the optimum at each T: the greedy prefix of length
    T maximises sum_i H_i(n_i) under sum n_i = T (concave separable, exchange argument); H >= E,
    so that maximum is >= OPT_E(T). Blocks of a hull (maximal runs of equal slope inside a
    request) are contiguous in the stable order, so at most one block is cut inside, and the
    true value loses at most H_i(n_i) - E_i(n_i) <= delta against the hull value. Dividing by
    the same cost(T) and maximising over T gives rate >= OPT - delta / min_T cost(T).
    """
    rate = num / sec  # [t_max + 1]
    t = int(np.argmax(rate))  # first maximum: the smallest T among ties (T = 0 first)
    if best is None or rate[t] > best[2] / best[3]:
        return order, t, float(num[t]), float(sec[t])
    return best
