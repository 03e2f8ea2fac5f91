"""Microbenchmark: per-step cost of the incremental context matcher vs the stateless rescan.

Scope: ``python -m vllm_anisotropic.bench.context_match_speed [--lengths 1000,8000,32000,128000]``.
For each context length L it builds a matcher over a synthetic context of L tokens (a random
token stream over a 32k vocabulary with repeated spans copied from earlier, so lookups hit
about half the time), then times steps of "append a few accepted tokens (1-4) + match()"
(the per-step work of a decode loop) and, for comparison, the stateless kernel
``proposers.pld.propose_prompt_lookup`` on the same contexts. Prints a table of microseconds
per step (median over steps) and the one-off index build time.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from vllm_anisotropic.proposers.context_match import ContextMatcher
from vllm_anisotropic.proposers.pld import propose_prompt_lookup

__all__ = ["synthetic_context", "measure", "main"]


def synthetic_context(length: int, vocab: int = 32000, seed: int = 0) -> np.ndarray:
    """Random tokens with spans of 8-64 tokens copied from earlier positions (~50% of tokens)."""
    rng = np.random.default_rng(seed)
    out = list(rng.integers(0, vocab, 16))
    while len(out) < length:
        if rng.random() < 0.5 and len(out) > 64:
            start = int(rng.integers(0, len(out) - 64))
            out.extend(out[start : start + int(rng.integers(8, 65))])
        else:
            out.extend(rng.integers(0, vocab, int(rng.integers(8, 65))).tolist())
    return np.asarray(out[:length], np.int64)


def measure(length: int, steps: int = 200, oracle_steps: int = 20, seed: int = 0) -> dict:
    ctx = synthetic_context(length + 4 * steps, seed=seed)
    rng = np.random.default_rng(seed + 1)
    m = ContextMatcher((3, 4, 5), max_continuation=20)
    t0 = time.perf_counter()
    m.sync(ctx[:length])
    build_s = time.perf_counter() - t0
    pos = length
    times = []
    hits = 0
    for _ in range(steps):
        pos += int(rng.integers(1, 5))
        t = time.perf_counter()
        m.sync(ctx[:pos])  # appends only the new tail
        hit = m.match()
        times.append(time.perf_counter() - t)
        hits += hit.found
    otimes = []
    for i in range(oracle_steps):
        sub = ctx[: length + i]
        t = time.perf_counter()
        propose_prompt_lookup(sub, 20, 3, 5)
        otimes.append(time.perf_counter() - t)
    return {
        "length": length,
        "incremental_us": 1e6 * float(np.median(times)),
        "incremental_p99_us": 1e6 * float(np.percentile(times, 99)),
        "oracle_us": 1e6 * float(np.median(otimes)),
        "build_ms": 1e3 * build_s,
        "hit_rate": hits / steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_anisotropic.bench.context_match_speed", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1000,8000,32000,128000")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    rows = [measure(int(x), args.steps) for x in args.lengths.split(",")]
    out = [f"{'context':>9} {'incr us/step':>13} {'p99 us':>8} {'rescan us':>10} {'speedup':>8} {'build ms':>9} {'hit':>5}"]
    for r in rows:
        out.append(
            f"{r['length']:>9} {r['incremental_us']:>13.1f} {r['incremental_p99_us']:>8.1f} {r['oracle_us']:>10.1f}"
            f" {r['oracle_us'] / r['incremental_us']:>8.0f} {r['build_ms']:>9.1f} {r['hit_rate']:>5.2f}"
        )
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
