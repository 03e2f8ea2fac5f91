"""One labelling pass of the drafter (``TreeDrafter._label``) on fixed inputs, for an A/B of two
source trees: R requests, 4 GOOSE proposals each (the trees of ``host_stages_bench.py``'s setup),
then one pass with every tree's tokens known (``--grow``: the contexts grow 1-3 tokens a step
and the pass finds what is ready, as in the engine). Median microseconds per pass over --repeats.

    PYTHONPATH=/tmp/before python docs/measurements/cpu/label_pass_bench.py --requests 8,64
    PYTHONPATH=.           python docs/measurements/cpu/label_pass_bench.py --requests 8,64
"""
import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_stages_bench import drafter_and_contexts  # noqa: E402  (the same drafter and contexts)


def bench(num: int, repeats: int, grow: bool = False) -> dict:
    d, rng, tokens, lengths, req_ids = drafter_and_contexts(num)
    times = []
    for it in range(repeats + 2):
        for _ in range(4):
            d.propose_trees(req_ids, [True] * num, [[1]] * num, lengths, tokens)
            d.take_step(req_ids, {})
            if grow:  # the engine's rhythm: 1-3 tokens a step, some trees still waiting at a pass
                lengths = lengths + rng.integers(1, 4, num)
        d._deferred = []  # the queued passes: this bench runs its own
        t0 = time.perf_counter()
        d._label(req_ids, lengths if grow else lengths + 16, tokens)
        if it >= 2:
            times.append(time.perf_counter() - t0)
    return {"requests": num, "grow": grow, "trees_per_pass": 4 * num, "us": round(float(np.median(times)) * 1e6, 1),
            "us_min": round(float(np.min(times)) * 1e6, 1)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", default="8,64")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--grow", action="store_true", help="contexts grow 1-3 tokens a step (else every tree is ready)")
    args = ap.parse_args()
    print(json.dumps({"cpu": platform.processor() or "see lscpu"}))
    for n in (int(x) for x in args.requests.split(",")):
        print(json.dumps(bench(n, args.repeats, args.grow)), flush=True)
