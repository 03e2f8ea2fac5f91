"""Do the Dinkelbach rounds after the first change anything? ``_allocate_numpy`` with 1, 2 and 30
rounds on 20,000 random batches (2-5 requests, non-increasing lists from a small set of gains,
context weights 1e-6 to 1e-2, b_D zero or not), counting batches where round 2 changes the
certificate (rate_upper) or the cuts. Printed on 2026-12-02 (AMX Xeon): the certificate differs
in many batches (the first five hits came within 15 trials); the cuts in one (trial 17309, a
context round: b_D = 0, cuts [0, 1, 1, 0, 2] after one round, [0, 1, 0, 0, 2] after two).

    PYTHONPATH=. .venv/bin/python docs/measurements/cpu/allocate_rounds_search_2026_12_02b.py
"""
import importlib, numpy as np
from vllm_anisotropic.allocator import CostModel, request_caps
m = importlib.import_module("vllm_anisotropic.allocator.allocate")
rng = np.random.default_rng(1)
hits5, hits6 = [], []
def run(probs, caps, cost, args, rounds):
    m._DINKELBACH_ROUNDS = rounds
    return m._allocate_numpy(probs, caps, cost, cost.kernel_params(), *args)
for trial in range(20000):
    b = int(rng.integers(2, 6))
    probs = [np.sort(rng.choice([0.05, 0.3, 0.5, 0.7, 0.9], int(rng.integers(1, 6))))[::-1].copy() for _ in range(b)]
    cost = CostModel.from_coefficients([0.0], base=float(rng.uniform(0.01, 0.2)), slopes=[float(rng.uniform(0, 0.05))],
                                       tree_row=float(rng.uniform(0, 0.02)), tree_ctx=float(10 ** rng.uniform(-6, -2)),
                                       spec_request=float(rng.choice([0.0, rng.uniform(0, 0.05)])))
    ctx = rng.choice([0.0, 10.0, 300.0, 3000.0], b)
    caps = request_caps([len(p) for p in probs])
    args = (b, b, float(b), ctx, True, None)
    r1, r2, r30 = (run(probs, caps, cost, args, k) for k in (1, 2, 30))
    if r1.rate_upper != r2.rate_upper and len(hits5) < 5:
        hits5.append((trial, [p.tolist() for p in probs], cost.weights.tolist(), ctx.tolist(), r1.rate_upper, r2.rate_upper, r30.rate_upper))
    if (r1.cuts.tolist() != r2.cuts.tolist() or r1.expected_tokens != r2.expected_tokens) and len(hits6) < 5:
        hits6.append((trial, [p.tolist() for p in probs], cost.weights.tolist(), ctx.tolist(), r1.cuts.tolist(), r2.cuts.tolist(), r30.cuts.tolist()))
print("rate_upper differs after round 1:", len(hits5)); [print(h) for h in hits5[:3]]
print("cuts differ after round 1:", len(hits6)); [print(h) for h in hits6[:3]]
