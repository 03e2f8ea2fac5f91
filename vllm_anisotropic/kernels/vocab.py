"""Compiled passes over vocabulary rows of CPU logits (``kernels.load("vocab")``): the top-k of
each row with its softmax probabilities from one log-sum-exp (the harvest,
``adjacency.topk_scores``), and the argmax of the rows the greedy walk visits
(``verifiers.greedy.host_rows_argmax``). CUDA rows stay on the device, in torch.

Rows are float32, or bf16 read as their 16 bits: numba has no scalar bit cast, so a loop over
bf16 logits had to write a widened float32 copy first (and the vectorised ``exp`` its integer
exponents to a scratch array read back through a float view). Three LLVM intrinsics give the
loops registers instead: ``as_float32`` (bf16 bits -> float32, exact: bf16 is float32's upper
half; 0x3F80 -> 0x3F800000 = 1.0), ``pow2`` (2^e in the exponent bits) and ``order_key`` (an
int32 ordered as the values). They live in this module with their callers: numba's disk cache
tracks a function's own source file only, so a kernel in another file would keep machine code
compiled against an old intrinsic.

Top-k and probabilities, per row of V logits:

1. top-k: the row's maxima per block of ``BLOCK`` entries, compared as order keys (ordered as
   the values, both zeros equal, NaN largest); the k-th largest block maximum ``t`` is a lower
   bound of the k-th largest entry (the k largest block maxima are k distinct entries), so only
   blocks whose maximum is >= t are scanned, by insertion into a sorted list of k (strictly
   larger keys move up: among equal logits the lower token id comes first). Example, k = 2,
   blocks [1, 9 | 3, 2 | 8, 4]: maxima [9, 3, 8], t = 8: blocks 0 and 2 are scanned -> ids
   [1, 4] (9, 8).
2. the normaliser ``s = sum_j exp(l_j - m)``, m the row's largest logit, with a vectorisable
   ``exp``: ``exp(y) = 2^t``, ``t = y log2 e = i + f`` with i the nearest integer, put in the
   float's exponent bits (``pow2``), and ``2^f`` for f in [-1/2, 1/2] by its degree-6 Taylor
   polynomial ``sum_n (f ln 2)^n / n!`` (relative error < (ln 2 / 2)^7 / 7! = 1.2e-7; on [0, 1),
   with i = floor(t), it would reach 8e-6); a term below 2^-125 is taken as 2^-125, which moves
   s by at most V 2^-125;
3. ``p_j = exp(l_j - m) / s`` for the k ids.

Cost: two passes over a row's bytes, in registers (a bf16 row of 49,152 entries is 96 KiB read
twice), no copy written; ``docs/measurements/cpu/allocator_measurements.md`` has the times.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["BLOCK", "argmax_row", "argmax_rows", "argmax_rows_threads", "as_float32", "order_key", "pow2", "topk_probs",
           "topk_probs_threads"]

BLOCK = 256  # entries per block of the top-k's first pass and of the argmax's

_I32 = ir.IntType(32)


def _bits32(builder, value, ty):
    """LLVM int32 bit pattern of a float32 ``value``, or of the float32 an int16 (bf16 bits)
    widens to: the 16 bits moved to the top of the word."""
    if ty == types.float32:
        return builder.bitcast(value, _I32)
    return builder.shl(builder.zext(value, _I32), ir.Constant(_I32, 16))


@intrinsic
def as_float32(typingctx, v):
    """The float32 value of ``v``: a float32 as is, an int16 read as bf16 bits (exact)."""
    if v not in (types.float32, types.int16):
        return None
    return types.float32(v), lambda context, builder, sig, args: builder.bitcast(_bits32(builder, args[0], v),
                                                                                  ir.FloatType())


@intrinsic
def pow2(typingctx, e):
    """float32 ``2^e`` for an int32 ``e`` in [-126, 127] (``e + 127`` put in the exponent bits;
    outside that range the result is wrong, callers clamp)."""
    if e != types.int32:
        return None

    def codegen(context, builder, sig, args):
        v = builder.shl(builder.add(args[0], ir.Constant(_I32, 127)), ir.Constant(_I32, 23))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(e), codegen


@intrinsic
def order_key(typingctx, v):
    """int32 key of a float32 or bf16 value, ordered as the values are: both zeros equal, NaN of
    either sign above +inf (as torch's argmax and topk rank NaN). Sign-magnitude to two's
    complement: key = +/- (bits & 0x7FFFFFFF). Examples: 1.0 -> 0x3F800000, -1.0 -> -0x3F800000,
    -0.0 -> 0, NaN -> 0x7FFFFFFF. Written in LLVM's 32-bit integer ops: numba's own integer
    arithmetic widens int32 to int64, which halves the SIMD lanes and has no AVX2 max."""
    if v not in (types.float32, types.int16):
        return None

    def codegen(context, builder, sig, args):
        b = _bits32(builder, args[0], v)
        mag = builder.and_(b, ir.Constant(_I32, 0x7FFFFFFF))
        key = builder.select(builder.icmp_signed("<", b, ir.Constant(_I32, 0)), builder.neg(mag), mag)
        nan = builder.icmp_signed(">", mag, ir.Constant(_I32, 0x7F800000))
        return builder.select(nan, ir.Constant(_I32, 0x7FFFFFFF), key)

    return types.int32(v), codegen


_jit = numba.njit(cache=True, nogil=True)
_fast = numba.njit(cache=True, nogil=True, fastmath=True)
_threads = numba.njit(cache=True, nogil=True, parallel=True)  # callers set the thread count: kernels.split


@_jit
def _block_maxima(x, out):
    """``out[b]`` = the largest order key of ``x[b * BLOCK : (b + 1) * BLOCK]`` (the last block
    may be short). Each block a slice of its own: a loop bounded by ``min(end, len(x))`` is not
    vectorised (3x slower)."""
    for b in range(out.shape[0]):
        block = x[b * BLOCK : (b + 1) * BLOCK]
        m = order_key(block[0])
        for j in range(1, block.shape[0]):
            v = order_key(block[j])
            m = v if v > m else m
        out[b] = m


@_jit
def _kth_largest(values, k, scratch):
    """The k-th largest of ``values`` (k <= len(values), repeats counted: ``np.sort(values)[-k]``)
    by insertion into ``scratch[:k]``, descending: one pass over the 192 block maxima of a
    49,152-token row instead of a sort (~1.1 us a row less on a 2-core EPYC). Example, k = 2:
    [3, 9, 3, 1] -> 3."""
    n = 0
    for b in range(values.shape[0]):
        v = values[b]
        if n == k and v <= scratch[k - 1]:
            continue
        p = n if n < k else k - 1
        while p > 0 and scratch[p - 1] < v:
            scratch[p] = scratch[p - 1]
            p -= 1
        scratch[p] = v
        if n < k:
            n += 1
    return scratch[k - 1]


@_jit
def _row_topk(x, k, ids, keys, maxima):
    """The k largest entries of ``x`` by order key (descending, lower index first among equals)
    into ``ids[:k]``, their keys into ``keys[:k]``; returns how many (min(k, len(x)))."""
    _block_maxima(x, maxima)
    nb = maxima.shape[0]
    bound = np.int32(-0x7FFFFFFF - 1)
    if nb >= k:
        bound = _kth_largest(maxima, k, keys)  # keys: scratch until the scan below
    n = 0
    kth = bound  # the current k-th key once k are held
    for b in range(nb):
        if maxima[b] < bound or (n == k and maxima[b] <= kth):
            continue
        for j in range(b * BLOCK, min((b + 1) * BLOCK, x.shape[0])):
            v = order_key(x[j])
            if v < bound or (n == k and v <= kth):
                continue
            p = n if n < k else k - 1
            while p > 0 and keys[p - 1] < v:
                keys[p] = keys[p - 1]
                ids[p] = ids[p - 1]
                p -= 1
            keys[p] = v
            ids[p] = j
            if n < k:
                n += 1
            if n == k:
                kth = keys[k - 1]
    return n


@_fast
def _sum_exp(x, m):
    """``sum_j exp(x_j - m)`` (module docstring, step 2), float32 or bf16 ``x``."""
    s = np.float32(0.0)
    for j in range(x.shape[0]):
        t = max((as_float32(x[j]) - m) * np.float32(1.4426950408889634), np.float32(-125.0))
        i = np.rint(t)
        f = t - i  # in [-1/2, 1/2]
        p = np.float32(0.0001540353)
        p = p * f + np.float32(0.001333355)
        p = p * f + np.float32(0.009618129)
        p = p * f + np.float32(0.05550411)
        p = p * f + np.float32(0.2402265)
        p = p * f + np.float32(0.6931472)
        p = p * f + np.float32(1.0)
        s += p * pow2(np.int32(i))
    return s


@_jit
def _topk_probs_part(x, rows, k, ids, probs, lo, hi):
    """``topk_probs`` of rows ``lo`` to ``hi`` (exclusive) of ``rows``."""
    maxima = np.empty((x.shape[1] + BLOCK - 1) // BLOCK, np.int32)
    keys = np.empty(k, np.int32)
    top = np.empty(k, np.int64)
    for r in range(lo, hi):
        row = x[rows[r]]
        _row_topk(row, k, top, keys, maxima)
        m = as_float32(row[top[0]])
        s = _sum_exp(row, m)
        for j in range(k):
            ids[r, j] = top[j]
            probs[r, j] = math.exp(as_float32(row[top[j]]) - m) / s


@_jit
def topk_probs(x, rows, k, ids, probs):
    """Rows ``rows`` of ``x [N, V]`` (float32, or int16 bf16 bits), read in place: ``ids [R, k]``
    int32 the top-k token ids of row ``rows[i]`` in row i, ``probs [R, k]`` float32 their softmax
    probabilities (module docstring). k <= V."""
    _topk_probs_part(x, rows, k, ids, probs, 0, rows.shape[0])


@_threads
def topk_probs_threads(x, rows, k, ids, probs, parts):
    """``topk_probs`` in ``parts`` contiguous parts of the rows, one a thread (numba's thread count
    set to ``parts``: ``kernels.split.row_threads``)."""
    n = rows.shape[0]
    for p in numba.prange(parts):
        _topk_probs_part(x, rows, k, ids, probs, n * p // parts, n * (p + 1) // parts)


@_jit
def _argmax_part(x, rows, out, lo, hi):
    maxima = np.empty((x.shape[1] + BLOCK - 1) // BLOCK, np.int32)
    for i in range(lo, hi):
        out[i] = argmax_row(x[rows[i]], maxima)


@_jit
def argmax_rows(x, rows, out):
    """``out[i]`` = the index of the largest entry of ``x[rows[i]]`` (float32, or int16 bf16
    bits): the first among equals, NaN above every number (torch's and numpy's argmax). The
    top-k's block maxima (``_block_maxima``), the first block holding the largest, then the first
    index in it holding that key. Example, BLOCK 2: row [1, 3 | 3, -0] -> block maxima [3, 3] ->
    block 0 -> index 1."""
    _argmax_part(x, rows, out, 0, rows.shape[0])


@_threads
def argmax_rows_threads(x, rows, out, parts):
    """``argmax_rows`` in ``parts`` contiguous parts of the rows, one a thread (``topk_probs_threads``)."""
    n = rows.shape[0]
    for p in numba.prange(parts):
        _argmax_part(x, rows, out, n * p // parts, n * (p + 1) // parts)


@_jit
def argmax_row(row, maxima):
    """``argmax_rows`` of one row, ``maxima`` a scratch of ``ceil(len(row) / BLOCK)`` int32."""
    _block_maxima(row, maxima)
    b = np.argmax(maxima)  # the first block holding the largest key
    j = b * BLOCK
    while order_key(row[j]) != maxima[b]:
        j += 1
    return j
