"""The learning refits' wall time per call inside a profile-host run (AMD EPYC, 2026-12-06).

Wraps ``CostModel.refit``, ``AcceptanceModel._fit`` / ``update``, ``LabelQueue.take`` and
``BatchBudget._score`` of the package on ``PYTHONPATH`` with timers, runs
``vllm-anisotropic profile-host`` with the arguments given, and prints calls, median and total
per function after its report.

    PYTHONPATH=<tree> .venv/bin/python docs/measurements/cpu/refit_times_probe_2026_12_06.py \
        profile-host --method goose-auto --max-num-seqs 8 --num-prompts 8 --dataset mbpp,math500 \
        --max-tokens 128 --no-profile
"""
import collections
import functools
import sys
import time

import numpy as np

from vllm_anisotropic.allocator import acceptance, cost
from vllm_anisotropic.integration.vllm.engine import budget, labels

TIMES = collections.defaultdict(list)


def wrap(cls, name, key):
    f = getattr(cls, name)

    @functools.wraps(f)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            TIMES[key].append(time.perf_counter() - t)

    setattr(cls, name, timed)


wrap(cost.CostModel, "refit", "cost.refit")
wrap(acceptance.AcceptanceModel, "_fit", "acceptance._fit")
wrap(acceptance.AcceptanceModel, "update", "acceptance.update")
wrap(labels.LabelQueue, "take", "labels.take")
wrap(budget.BatchBudget, "_score", "budget._score")

from vllm_anisotropic.cli import main  # noqa: E402

rc = main(sys.argv[1:])
for key, v in sorted(TIMES.items()):
    us = np.array(v) * 1e6
    print(f"{key:20s} calls {len(us):5d} median {np.median(us):8.1f} us  mean {us.mean():8.1f} us  "
          f"total {us.sum() / 1e3:8.1f} ms")
sys.exit(rc)
