"""Issue 43: GOOSE's cross-request store as Python dicts (before) or compiled arrays (after).

One process per code tree (``PYTHONPATH`` picks it), interleaved, 3 rounds:
    python docs/measurements/cpu/store_lookup_ab_2026_12_08.py BEFORE_TREE AFTER_TREE
prints, per tree and round: ``goose._store_spines`` per call at 1 / 8 / 64 requests (every request
asking: no context match of its own; half of them hit the store), ``OutputStore.add`` per
300-token document into a full store, and the store's bytes (tracemalloc, 16,384 tokens held).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, time, tracemalloc
import numpy as np
from vllm_anisotropic.proposers import goose
from vllm_anisotropic.proposers.config import GooseConfig
from vllm_anisotropic.proposers.output_store import OutputStore

rng = np.random.default_rng(0)
docs = [rng.integers(0, 30000, 300) for _ in range(80)]
warm = OutputStore((3, 4, 5), 1 << 10)
warm.add(docs[0]); warm.match(docs[0][:5], 5)
tracemalloc.start()
base = tracemalloc.get_traced_memory()[0]
store = OutputStore((3, 4, 5), 1 << 14)
for d in docs[:60]:
    store.add(d)
held = tracemalloc.get_traced_memory()[0] - base
tracemalloc.stop()
t = time.perf_counter()
for d in docs[60:]:
    store.add(d)
add_ms = (time.perf_counter() - t) / 20 * 1e3
cfg = GooseConfig()

class State:
    pass

out = {"held_bytes": held, "add_ms": add_ms}
for R in (1, 8, 64):
    states = []
    for _ in range(R):
        s = State(); s.store = store; s.config = cfg; states.append(s)
    tok = rng.integers(30000, 40000, (R, 512)).astype(np.int32)  # vLLM's int32 token array
    for r in range(0, R, 2):  # every other request ends with a stored document's 5 tokens: a hit
        d = docs[79 - r % 20]
        tok[r, 395:400] = d[100:105]
    rows, lengths = np.arange(R), np.full(R, 400)
    limits, match = np.full(R, 20), np.zeros((R, 4), np.int64)
    n = {1: 3000, 8: 2000, 64: 400}[R]
    for _ in range(n // 10):
        goose._store_spines(states, tok, rows, lengths, limits, match, R)
    t = time.perf_counter()
    for _ in range(n):
        res = goose._store_spines(states, tok, rows, lengths, limits, match, R)
    out[f"us_c{R}"] = (time.perf_counter() - t) / n * 1e6
    out[f"hits_c{R}"] = int((res[0] > 0).sum())
print(json.dumps(out))
"""


def main() -> None:
    trees = {"before": sys.argv[1], "after": sys.argv[2]}
    print(os.popen("lscpu | grep 'Model name'").read().strip())
    for rnd in range(3):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=tree)
            got = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True,
                                 cwd=tree)
            rec = json.loads(got.stdout.strip().splitlines()[-1])
            print(f"round {rnd} {name:6s} " + " ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()))


if __name__ == "__main__":
    main()
