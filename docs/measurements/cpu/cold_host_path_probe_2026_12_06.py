"""Warm against cold: what the plugin's per-step host code costs right after a model forward.

A CPU forward streams the model's weights (smollm2-135m bf16: ~270 MB) through the caches, so the
host code that follows runs with its code and data evicted. This probe times three pieces of the
propose stage at one request back to back (warm) and after a sweep of S MiB (cold):
``one ufunc`` (``a + 1`` on 5 floats), ``offers`` (the drafter's ``_offers`` arithmetic, about ten numpy
calls), ``propose+rank`` (``propose_spine_trees`` + ``rank_flat`` on a 400-token context).

Usage: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/cold_host_path_probe_2026_12_06.py   (~1 min)
"""
import platform
import subprocess
import time

import numpy as np

from vllm_anisotropic.allocator import AcceptanceModel, rank_flat
from vllm_anisotropic.proposers.goose import GooseConfig, GooseProposer, propose_spine_trees

rng = np.random.default_rng(0)
state = GooseProposer(GooseConfig(), vocab_size=49152).new_request(None)
token_ids = np.zeros((4, 2048), np.int64)
token_ids[0, :400] = rng.integers(0, 60, 400)  # repeats: the context matcher finds spines
acc = AcceptanceModel()
a5 = np.arange(5.0)


def one_ufunc(it):
    return a5 + 1


def offers(it):
    kept, ids, room = {"a": 3.0}, ["a"], np.array([40])
    marks = np.array([kept.get(r, -1.0) for r in ids])
    drafts = np.maximum(4, np.ceil(1.5 * marks)).astype(np.int64)
    return np.where((marks < 0) | (drafts >= room), 0, drafts + 1)


def propose_rank(it):
    b = propose_spine_trees([state], token_ids, np.array([0]), np.array([300 + it % 100]), None, None)
    return rank_flat(b.trees, acc)


def timed(fn, sweep_mib, iters=200):
    buf = np.ones(max(sweep_mib, 1) * 2**20 // 8)
    warm, cold = [], []
    for it in range(2 * iters + 20):
        is_cold = it % 2 == 1
        if is_cold and sweep_mib:
            buf.sum()
        t0 = time.perf_counter()
        fn(it)
        dt = time.perf_counter() - t0
        if it >= 20:
            (cold if is_cold else warm).append(dt * 1e6)
    return np.median(warm), np.median(cold)


cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
model = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), platform.processor())
print(f"# {model}; numpy {np.__version__}; median us of 200 calls each, warm (the call before ran the same code) / cold (after the sweep)")
print(f"{'piece':14s} {'sweep MiB':>9s} {'warm us':>8s} {'cold us':>8s} {'cold/warm':>9s}")
for fn, name in ((one_ufunc, "one ufunc"), (offers, "offers"), (propose_rank, "propose+rank")):
    for mib in (8, 64, 512):
        w, c = timed(fn, mib)
        print(f"{name:14s} {mib:9d} {w:8.1f} {c:8.1f} {c / w:9.1f}")
