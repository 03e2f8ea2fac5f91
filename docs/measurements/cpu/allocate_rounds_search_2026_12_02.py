"""Does a second Dinkelbach round ever change the allocator's decision? ``_allocate_numpy`` with
one round of each loop against thirty, on 20,000 random batches (2-8 requests, non-increasing
lists, random costs with the context and b_D terms). Printed on 2026-12-02 (AMD EPYC): "differ 0".

    PYTHONPATH=. .venv/bin/python docs/measurements/cpu/allocate_rounds_search_2026_12_02.py
"""
import importlib, numpy as np
from vllm_anisotropic.allocator import CostModel, request_caps
m = importlib.import_module("vllm_anisotropic.allocator.allocate")
rng = np.random.default_rng(0)
found = 0
for trial in range(20000):
    b = int(rng.integers(2, 9))
    probs = [np.sort(rng.uniform(0, 1, int(rng.integers(1, 8))))[::-1] * rng.uniform(0.2, 1) for _ in range(b)]
    knots = [0.0]
    cost = CostModel.from_coefficients(knots, base=float(rng.uniform(0.05, 1)), slopes=[float(rng.uniform(0, 0.3))],
                                       tree_row=float(rng.uniform(0, 0.05)), tree_ctx=float(rng.uniform(0, 0.001)),
                                       spec_request=float(rng.uniform(0, 0.5)))
    ctx = rng.choice([0.0, 10.0, 300.0, 3000.0], b)
    caps = request_caps([len(p) for p in probs])
    args = (b, b, float(b), ctx, True, None)
    m._DINKELBACH_ROUNDS = 30
    full = m._allocate_numpy(probs, caps, cost, cost.kernel_params(), *args)
    m._DINKELBACH_ROUNDS = 1
    one = m._allocate_numpy(probs, caps, cost, cost.kernel_params(), *args)
    if full.cuts.tolist() != one.cuts.tolist():
        found += 1
        if found <= 2:
            print(trial, [p.round(3).tolist() for p in probs], dict(base=cost.weights[0]), ctx.tolist(), full.cuts.tolist(), one.cuts.tolist(), full.rate, one.rate)
print("differ", found)
