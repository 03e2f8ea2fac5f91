"""The acceptance model's refit on a fixed state, warm: the numpy refit (f318b62's
``acceptance.py``, read with ``git show``) against the package's (AMD EPYC, 2026-12-06).

The state (``refit_state_2026_12_06.json``) is the drafter's acceptance model at its 4th refit in
a ``profile-host --method goose-auto --max-num-seqs 8`` run (mbpp + math500, 8 prompts each, 128
tokens): 14 keys with data, 44 bins used. Prints the largest difference of the two fits and the
median microseconds of each over 200 calls after one warming call.

    PYTHONPATH=. .venv/bin/python docs/measurements/cpu/refit_microbench_2026_12_06.py
"""
import subprocess
import time
import types
from pathlib import Path

import numpy as np

from vllm_anisotropic.allocator.acceptance import AcceptanceModel

here = Path(__file__).parent
new = AcceptanceModel.from_json((here / "refit_state_2026_12_06.json").read_text())
src = subprocess.check_output(["git", "show", "f318b62:vllm_anisotropic/allocator/acceptance.py"], text=True)
mod = types.ModuleType("acceptance_f318b62")
mod.__package__ = "vllm_anisotropic.allocator"
exec(compile(src, "acceptance_f318b62", "exec"), mod.__dict__)
old = mod.AcceptanceModel.from_json((here / "refit_state_2026_12_06.json").read_text())
ra, rb = old._fit(), new._fit()
print("largest difference: alpha %.1e, beta %.1e" % (np.abs(ra[0] - rb[0]).max(), np.abs(ra[1] - rb[1]).max()))
for name, model in (("numpy (f318b62)", old), ("compiled", new)):
    model._fit()
    times = []
    for _ in range(200):
        t = time.perf_counter()
        model._fit()
        times.append(time.perf_counter() - t)
    print(f"{name:16s} median {np.median(times) * 1e6:8.1f} us a refit")

# how far each further Newton step moves the keys: the compiled kernel run with 1..12 steps
from vllm_anisotropic import kernels  # noqa: E402
from vllm_anisotropic.allocator.acceptance import _STEP_SIZES  # noqa: E402

cfg = new.config
n, a = new.count, new.accepted
centers = cfg.logit_min + (np.arange(cfg.num_bins) + 0.5) * (cfg.logit_max - cfg.logit_min) / cfg.num_bins
with np.errstate(invalid="ignore", divide="ignore"):
    xbar = np.where(n > 0, new.logit_sum / np.where(n > 0, n, 1.0), centers)
active = n.sum(-1) > 0
used = n[active].sum(0) > 0
rows = [np.ascontiguousarray(x[active][:, used]) for x in (n, a, xbar)]
print(f"{int(active.sum())} keys x {int(used.sum())} bins; the largest move of a key at each step:")
prev = None
for steps in range(1, 13):
    al, be = kernels.load("fit").newton_platt(*rows, float(cfg.prior_strength), steps, float(cfg.prior_intercept),
                                              _STEP_SIZES)
    if prev is not None:
        print(f"  step {steps:2d}: {max(np.abs(al - prev[0]).max(), np.abs(be - prev[1]).max()):.1e}")
    prev = (al, be)
