"""Compiled refits of the allocator's models (``kernels.load("fit")``): the per-key Platt MAP of
``allocator.acceptance.AcceptanceModel._fit`` in one call (``newton_platt``), and the cost model's
non-negative least squares on its normal equations (``nnls_gram``, below).

Scope: for each key (a row of the binned histograms ``n``, ``a``, ``xbar``) the MAP of

    f(alpha, beta) = sum_b [n_b softplus(z_b) - a_b z_b] + k/2 ((alpha - a0)^2 + (beta - 1)^2),
    z_b = alpha + beta xbar_b,  beta >= 0,

by at most ``steps`` projected Newton steps (fewer once a step moves the key by at most
``CONVERGED``), each the best (lowest f, the first on ties) of the step
sizes ``step_sizes`` along the Newton direction (beta clipped at 0) and one candidate on the
bound (beta = 0, alpha's own Newton step there). Where beta sits at 0 and the joint step would
take it below, alpha takes its own Newton step and beta stays. The same arithmetic as the
vectorised form it replaced (a refit ~1.6 ms at 14 keys x 44 bins on a 2-core EPYC, a handful of
numpy calls per Newton step), key by key: sums run bin by bin, so results can differ from a
pairwise numpy sum in the last bits.

Worked example (one key, one bin, n 10, a 5, xbar 0, k 1, a0 0): f is minimised at alpha 0
(the bin's rate is sigmoid(0) = 1/2, the prior's centre) and beta 1 (xbar 0: beta moves no z,
the prior keeps it at 1).
"""

from __future__ import annotations

import math

import numba
import numpy as np

__all__ = ["newton_platt", "nnls_gram"]

_jit = numba.njit(cache=True, nogil=True)

# a key's iteration stops once a step moves alpha and beta by at most this: Newton has converged
# (on the engine's keys by step 5-7 of the 12 allowed; later steps move them ~1e-16)
CONVERGED = 1e-10


@_jit
def _sigmoid(z):
    if z >= 0.0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


@_jit
def _objective(n, a, xbar, key, al, be, k, a0):
    total = 0.0
    for b in range(n.shape[1]):
        z = al + be * xbar[key, b]
        softplus = max(z, 0.0) + math.log1p(math.exp(-abs(z)))
        total += n[key, b] * softplus - a[key, b] * z
    return total + 0.5 * k * ((al - a0) ** 2 + (be - 1.0) ** 2)


@_jit
def newton_platt(n, a, xbar, k, steps, a0, step_sizes):
    """(alpha, beta) [num_keys] (module docstring). ``n``, ``a``, ``xbar`` [num_keys, num_bins]
    float64; ``step_sizes`` [num_sizes] float64 (1, 1/2, ..., 0)."""
    num_keys, num_bins = n.shape
    alpha = np.full(num_keys, a0)
    beta = np.ones(num_keys)
    for key in range(num_keys):
        al, be = a0, 1.0
        f_now = _objective(n, a, xbar, key, al, be, k, a0)
        for _ in range(steps):
            g0 = g1 = h00 = h01 = h11 = 0.0
            r0 = h0 = 0.0  # at beta = 0: the bound candidate's gradient and curvature
            s0 = _sigmoid(al)
            for b in range(num_bins):
                x = xbar[key, b]
                s = _sigmoid(al + be * x)
                r = n[key, b] * s - a[key, b]
                h = n[key, b] * s * (1.0 - s)
                g0 += r
                g1 += r * x
                h00 += h
                h01 += h * x
                h11 += h * x * x
                r0 += n[key, b] * s0 - a[key, b]
                h0 += n[key, b] * s0 * (1.0 - s0)
            g0 += k * (al - a0)
            g1 += k * (be - 1.0)
            h00 += k
            h11 += k
            det = h00 * h11 - h01 * h01  # > 0: k I makes the Hessian positive definite
            step0 = (h11 * g0 - h01 * g1) / det
            step1 = (h00 * g1 - h01 * g0) / det
            if be <= 0.0 and be - step1 < 0.0:  # held at the bound: alpha's own step
                step0 = g0 / h00
                step1 = 0.0
            best_a, best_b = al, be
            best = np.inf
            for i in range(step_sizes.shape[0]):
                t = step_sizes[i]
                # step size 0 is the current point: its objective is the one carried (bit for bit)
                f = f_now if t == 0.0 else _objective(n, a, xbar, key, al - t * step0, max(be - t * step1, 0.0), k, a0)
                if f < best:
                    best, best_a, best_b = f, al - t * step0, max(be - t * step1, 0.0)
            ca = al - (r0 + k * (al - a0)) / (h0 + k)
            f = _objective(n, a, xbar, key, ca, 0.0, k, a0)
            if f < best:
                best, best_a, best_b = f, ca, 0.0
            moved = max(abs(best_a - al), abs(best_b - be))
            al, be, f_now = best_a, best_b, best
            if moved <= CONVERGED:
                break
        alpha[key] = al
        beta[key] = be
    return alpha, beta


@_jit
def _solve_passive(gram, atb, passive, chol, z):
    """``z`` = the least-squares coefficients on the ``passive`` columns (0 elsewhere): the
    Cholesky factor of ``gram``'s passive block into ``chol``, then two triangular solves.
    False where the block is not positive definite (dependent columns, no ridge)."""
    n = atb.shape[0]
    cols = np.flatnonzero(passive)
    k = cols.shape[0]
    for i in range(k):
        for j in range(i + 1):
            v = gram[cols[i], cols[j]]
            for m in range(j):
                v -= chol[i, m] * chol[j, m]
            if i == j:
                if not v > 0.0:
                    return False
                chol[i, i] = math.sqrt(v)
            else:
                chol[i, j] = v / chol[j, j]
    y = np.empty(k)
    for i in range(k):
        v = atb[cols[i]]
        for m in range(i):
            v -= chol[i, m] * y[m]
        y[i] = v / chol[i, i]
    for i in range(k - 1, -1, -1):
        v = y[i]
        for m in range(i + 1, k):
            v -= chol[m, i] * y[m]
        y[i] = v / chol[i, i]
    for i in range(n):
        z[i] = 0.0
    for i in range(k):
        z[cols[i]] = y[i]
    return True


@_jit
def nnls_gram(gram, atb, tol, max_iter, x):
    """argmin_{x >= 0} ||a x - b||_2 from ``gram`` = a^T a [n, n] and ``atb`` = a^T b [n] into
    ``x`` [n]: ``allocator.cost.nnls``'s active-set iteration (Lawson & Hanson 1974, Ch. 23;
    the same pivot rule and tolerance ``tol``, at most ``max_iter`` outer steps) with each
    sub-solve on the normal equations of the passive columns (Cholesky of an at most n x n block)
    instead of an SVD of ``a``'s columns: a refit's cost no longer grows with ``a``'s rows past
    the one product ``a^T a``. Returns False (``x`` unspecified) where a Cholesky pivot is not
    positive (a singular block; a nearly singular one may pass with a pivot of rounding noise:
    the cost fit's ridge rows keep its blocks well away from that); the caller then solves by
    SVD. Example: ``gram`` I, ``atb`` [1, -1] -> [1, 0]."""
    n = atb.shape[0]
    passive = np.zeros(n, np.bool_)
    chol = np.empty((n, n))
    z = np.zeros(n)
    grad = np.empty(n)
    for i in range(n):
        x[i] = 0.0
        grad[i] = atb[i]
    for _ in range(max_iter):
        j = -1
        top = tol
        for i in range(n):  # the most violated KKT condition above tol, the first of ties
            if not passive[i] and grad[i] > top:
                j, top = i, grad[i]
        if j < 0:
            break
        passive[j] = True
        while True:
            # the sub-solve (no passive column left: z = 0, and the loop ends)
            if not _solve_passive(gram, atb, passive, chol, z):
                return False
            feasible = True
            for i in range(n):
                if passive[i] and not z[i] > tol:
                    feasible = False
                    break
            if feasible:
                break
            # step from x towards z until the first passive coefficient hits 0, drop it (the
            # others' x is not read again before x = z below)
            alpha = np.inf
            for i in range(n):
                if passive[i] and z[i] <= tol:
                    alpha = min(alpha, x[i] / (x[i] - z[i]))
            for i in range(n):
                if passive[i]:
                    x[i] += alpha * (z[i] - x[i])
                    passive[i] = x[i] > tol
        for i in range(n):
            x[i] = z[i]
        for i in range(n):
            v = atb[i]
            for m in range(n):
                v -= gram[i, m] * x[m]
            grad[i] = v
    return True
