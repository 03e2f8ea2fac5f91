"""Intervals for speedups measured side by side: paired ratios, never a ratio of two medians.

Two designs occur: a pass repeated R times per engine, paired repeat by repeat (``bench``'s
cells, the demo's batch repeats): ``ratio_interval`` gives the geometric mean of the per-repeat
ratios with a Student-t interval on their logarithms; and one pass over N prompts timed one at
a time (the demo's one-request-at-a-time pass), paired prompt by prompt: ``bootstrap_rate_ratio``
resamples the prompts. An interval that contains 1.0 does not show a difference (``contains_one``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

# two-sided 95 % Student-t quantiles t(0.975, df); df > 30 uses 1.96 + 2.4 / df (within 0.3 %)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """``t975(2)`` -> 4.303."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df


def ratio_interval(ratios: Sequence[float]) -> tuple[float, float | None, float | None]:
    """``(geometric mean, low, high)`` of paired ratios: a 95 % t-interval on their logs (no
    interval from a single ratio: ``low``, ``high`` None). ``ratio_interval([1.1, 1.2, 1.15])`` ->
    ``(1.149, 1.032, 1.280)``."""
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    if n == 0:
        raise ValueError("no ratios")
    mean = sum(logs) / n
    if n < 2:
        return math.exp(mean), None, None
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def bootstrap_rate_ratio(spec_tokens: Sequence[int], spec_seconds: Sequence[float], plain_tokens: Sequence[int],
                         plain_seconds: Sequence[float], resamples: int = 4000,
                         seed: int = 0) -> tuple[float, float, float]:
    """``(ratio, low, high)``: the speculative pass's tokens/s over plain's, each the pass's total
    tokens over its total seconds, with a 95 % percentile bootstrap interval over the prompts
    (prompt i of both passes resampled together: the pairing keeps a prompt's length and
    difficulty out of the spread)."""
    arrays = [np.asarray(a, dtype=np.float64) for a in (spec_tokens, spec_seconds, plain_tokens, plain_seconds)]
    n = len(arrays[0])
    if n == 0 or any(len(a) != n for a in arrays):
        raise ValueError(f"need one entry per prompt in all four sequences, got {[len(a) for a in arrays]}")
    st, ss, pt, ps = arrays

    def rate_ratio(idx):
        return (st[idx].sum(-1) / ss[idx].sum(-1)) / (pt[idx].sum(-1) / ps[idx].sum(-1))

    point = float(rate_ratio(np.arange(n)))
    draws = rate_ratio(np.random.default_rng(seed).integers(0, n, size=(resamples, n)))
    low, high = np.quantile(draws, [0.025, 0.975])
    return point, float(low), float(high)


def contains_one(low: float | None, high: float | None) -> bool:
    """True when the interval does not exclude 1.0 (also when there is no interval)."""
    return low is None or high is None or low <= 1.0 <= high


def format_interval(low: float | None, high: float | None) -> str:
    """`` [1.03, 1.28]``; `` ~`` appended when it contains 1.0 (no difference shown); "" without one."""
    if low is None:
        return ""
    return f" [{low:.2f}, {high:.2f}]" + (" ~" if contains_one(low, high) else "")


def format_speedup(point: float, low: float | None, high: float | None) -> str:
    """``1.15x [1.03, 1.28]`` (``format_interval``)."""
    return f"{point:.2f}x" + format_interval(low, high)
