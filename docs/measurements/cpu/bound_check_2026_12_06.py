"""The compiled Platt fit's bound candidate and held step, each removed, on 300 random batches of
4 keys (AMD EPYC, 2026-12-06): the largest difference after 6 steps from the kernel's own
40-step result, per variant; then the batch where the variant without the bound candidate is
furthest off (the key of test_acceptance_newton_kernel_reaches_a_map_on_the_bound_in_three_steps).
Variants are the source of ``vllm_anisotropic/kernels/fit.py`` with one edit, compiled afresh.

    PYTHONPATH=. .venv/bin/python docs/measurements/cpu/bound_check_2026_12_06.py
"""
import numpy as np, sys, math
sys.path.insert(0, 'tests')
from vllm_anisotropic.allocator.acceptance import _STEP_SIZES, sigmoid
import vllm_anisotropic.kernels.fit as fitmod
src = open('vllm_anisotropic/kernels/fit.py').read()
def variant(old, new):
    s = src.replace(old, new); assert s != src
    ns = {}
    s = s.replace('_jit = numba.njit(cache=True, nogil=True)', '_jit = numba.njit(cache=False)')
    exec(compile(s, 'v', 'exec'), ns); return ns['newton_platt']
nobound = variant("            if f < best:\n                best, best_a, best_b = f, ca, 0.0", "            pass")
nohold = variant("                step1 = 0.0\n", "                step1 = step1\n")
ref = fitmod.newton_platt
rng = np.random.default_rng(0)
worst = {}
for trial in range(300):
    K, B = 4, int(rng.integers(2, 40))
    xbar = np.sort(rng.uniform(-20, 2, (K, B)), axis=1)
    n = rng.integers(0, int(rng.choice([10, 100, 3000])), (K, B)).astype(float)
    slope = rng.uniform(-1, 0.3, (K, 1))
    rate = sigmoid(rng.uniform(-3, 1, (K, 1)) + slope * (xbar + 8) / 4)
    a = rng.binomial(n.astype(int), rate).astype(float)
    k, a0 = float(rng.choice([0.5, 1.0, 4.0])), -1.0
    full = ref(n, a, xbar, k, 40, a0, _STEP_SIZES)
    for name, f in [("ref6", ref), ("nobound6", nobound), ("nohold6", nohold)]:
        r = f(n, a, xbar, k, 6, a0, _STEP_SIZES)
        d = max(np.abs(r[0] - full[0]).max(), np.abs(r[1] - full[1]).max())
        if d > worst.get(name, (0,))[0]: worst[name] = (d, trial)
print(worst)
rng = np.random.default_rng(0)
for trial in range(300):
    K, B = 4, int(rng.integers(2, 40))
    xbar = np.sort(rng.uniform(-20, 2, (K, B)), axis=1)
    n = rng.integers(0, int(rng.choice([10, 100, 3000])), (K, B)).astype(float)
    slope = rng.uniform(-1, 0.3, (K, 1))
    rate = sigmoid(rng.uniform(-3, 1, (K, 1)) + slope * (xbar + 8) / 4)
    a = rng.binomial(n.astype(int), rate).astype(float)
    k, a0 = float(rng.choice([0.5, 1.0, 4.0])), -1.0
    if trial == 251:
        full = ref(n, a, xbar, k, 40, a0, _STEP_SIZES); r = nobound(n, a, xbar, k, 6, a0, _STEP_SIZES)
        key = int(np.argmax(np.abs(r[0]-full[0]) + np.abs(r[1]-full[1])))
        print("k", k, "B", B, "key", key, "full", full[0][key], full[1][key], "nobound", r[0][key], r[1][key])
        np.set_printoptions(precision=3, linewidth=200, suppress=True)
        print(repr(n[key])); print(repr(a[key])); print(repr(xbar[key]))
        # rounded version
        xr = np.round(xbar[key], 1); nr = n[key]; ar = a[key]
        f2 = ref(nr[None], ar[None], xr[None], k, 40, a0, _STEP_SIZES); r2 = nobound(nr[None], ar[None], xr[None], k, 6, a0, _STEP_SIZES); r3 = ref(nr[None], ar[None], xr[None], k, 6, a0, _STEP_SIZES)
        print("rounded: full", f2, "nobound6", r2, "ref6", r3)
