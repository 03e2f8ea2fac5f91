"""The allocator's decision for a batch: ``kernels.allocate.allocate_batch`` (one compiled call)
against its numpy definition (``allocator.allocate._allocate_numpy`` with the same compiled cost
parameters), on fixed inputs shaped like the engine's tree steps.

Per step, as ``BatchBudget.cut`` does on a tree step: one allocation over every request's
value-ordered list (non-increasing calibrated probabilities, 2-24 drafts, unequal contexts) and
one over the leading chains (the chain cost: no context term). ``--flush-mb N`` reads N MB before
each step, where the engine's forward runs (docs/measurements/cpu/host_stages_bench.py: a CPU
forward evicts the host path's caches). Both paths in the same process, alternated step by step.

    PYTHONPATH=. .venv/bin/python docs/measurements/cpu/allocate_compiled_bench.py --requests 2,8,16,64 --flush-mb 0
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import time

import numpy as np

from vllm_anisotropic.allocator import CostModel, request_caps
from vllm_anisotropic.bench.machine import cpu_model
from vllm_anisotropic.integration.vllm.engine.budget import _ChainCost

module = importlib.import_module("vllm_anisotropic.allocator.allocate")  # (the package exports the function)


def batch(rng, num: int):
    probs = [np.sort(rng.uniform(0.02, 0.95, int(rng.integers(2, 25))))[::-1] * rng.uniform(0.3, 1.0) for _ in range(num)]
    chains = [p[: int(rng.integers(0, 6))] for p in probs]
    ctx = rng.integers(50, 1500, num).astype(np.float64)
    return probs, chains, ctx


def step(path, cost, chain_cost, probs, chains, ctx, num):
    """One tree step's two allocations by ``path`` (compiled or numpy)."""
    out = []
    for lists, model, c in ((probs, cost, ctx), (chains, chain_cost, np.zeros(num))):
        caps = request_caps([len(p) for p in lists], 24, [4000] * num)
        args = (num, num, float(num), c, True, 256 - num)
        if path == "compiled":
            out.append(module._allocate_compiled(np.concatenate(lists), np.array([len(p) for p in lists]), caps, model,
                                                 model.kernel_params(), *args))
        else:
            out.append(module._allocate_numpy(lists, caps, model, model.kernel_params(), *args))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", default="2,8,16,64")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--flush-mb", type=int, default=0)
    args = ap.parse_args()
    cost = CostModel.from_coefficients([0.0, 16.0, 64.0], base=12e-3, per_request=0.4e-3, slopes=[0.35e-3, 0.3e-3, 0.6e-3],
                                       tree_switch=1.2e-3, tree_row=0.08e-3, tree_ctx=2e-8, spec_request=0.3e-3)
    chain_cost = _ChainCost(cost)
    flush = np.ones(args.flush_mb << 18, np.float32) if args.flush_mb else None
    sink = 0.0
    print(json.dumps({"cpu": cpu_model(), "machine": platform.machine(), "flush_mb": args.flush_mb, "steps": args.steps}))
    for num in (int(x) for x in args.requests.split(",")):
        rng = np.random.default_rng(num)
        inputs = [batch(rng, num) for _ in range(16)]
        for path in ("compiled", "numpy"):  # compile / warm both
            step(path, cost, chain_cost, *inputs[0], num)
        times = {"compiled": [], "numpy": []}
        same = 0
        for i in range(args.steps):
            probs, chains, ctx = inputs[i % len(inputs)]
            results = {}
            for path in (("compiled", "numpy") if i % 2 else ("numpy", "compiled")):
                if flush is not None:
                    sink += float(np.add.reduce(flush))
                t0 = time.perf_counter()
                results[path] = step(path, cost, chain_cost, probs, chains, ctx, num)
                times[path].append(time.perf_counter() - t0)
            same += all(a.cuts.tolist() == b.cuts.tolist() and a.rate == b.rate
                        for a, b in zip(results["compiled"], results["numpy"]))
        print(json.dumps({"requests": num, "identical_steps": f"{same}/{args.steps}",
                          **{f"{p}_us_median": round(statistics.median(t) * 1e6, 1) for p, t in times.items()},
                          **{f"{p}_us_p90": round(float(np.percentile(t, 90)) * 1e6, 1) for p, t in times.items()}}))
    assert sink >= 0


if __name__ == "__main__":
    main()
