"""The cost model's refit by SVD sub-solves (``allocator.cost.nnls``, before 64ef4f3) against the
compiled normal equations (``nnls_normal``, ``kernels.fit.nnls_gram``) in one process, on an
engine-like window: 600 online steps of 1-63 requests (the window keeps 512), tree rows,
contexts. Alternates the two, ``ROUNDS`` rounds of ``CALLS`` refits each; prints ms per refit
and how far the coefficients and the predictions move.

    PYTHONPATH=. .venv/bin/python docs/measurements/cpu/cost_refit_normal_2026_12_06.py   # ~10 s
"""

import platform
import statistics
import time

import numpy as np

from vllm_anisotropic.allocator import cost as cost_module
from vllm_anisotropic.allocator.cost import CostModel, CostSample, cost_features, nnls, nnls_normal

ROUNDS, CALLS = 5, 100


def model(seed: int) -> CostModel:
    rng = np.random.default_rng(seed)
    m = CostModel.linear(0.02, 0.0007)
    for _ in range(600):
        r, t = int(rng.integers(1, 64)), int(rng.integers(0, 80))
        m.update(CostSample(r, r + t, t, t * float(rng.integers(10, 3000)), min(r, t),
                            0.02 + 0.0007 * (r + t) + 1e-4 * t + abs(rng.normal(0, 2e-3))), refit=False)
    return m


def timed(m: CostModel, solver) -> float:
    cost_module.nnls_normal = solver
    m.refit()  # warm
    t0 = time.perf_counter()
    for _ in range(CALLS):
        m.refit()
    return (time.perf_counter() - t0) / CALLS * 1e3


def main() -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"# {cpu}; numpy {np.__version__}")
    m = model(3)
    svd, normal = [], []
    for _ in range(ROUNDS):
        svd.append(timed(m, nnls))
        normal.append(timed(m, nnls_normal))
    cost_module.nnls_normal = nnls_normal
    print(f"refit, SVD sub-solves:      {statistics.median(svd):.3f} ms (rounds {', '.join(f'{x:.3f}' for x in svd)})")
    print(f"refit, normal equations:    {statistics.median(normal):.3f} ms (rounds {', '.join(f'{x:.3f}' for x in normal)})")
    for seed in range(5):
        m = model(seed)
        data, w, step = m._retained()
        cost_module.nnls_normal = nnls
        old = cost_module._weighted_fit(data, w, m.knots, m.config.ridge, step)
        cost_module.nnls_normal = nnls_normal
        new = cost_module._weighted_fit(data, w, m.knots, m.config.ridge, step)
        x = cost_features(*data[:, :5].T, m.knots, step)
        rel = np.abs(new - old) / np.maximum(np.abs(old), 1e-300)
        pred = float(np.max(np.abs(x @ new - x @ old) / (x @ old)))
        print(f"window {seed}: largest coefficient change {rel.max():.1e} ({cost_module.feature_names(m.knots)[int(np.argmax(rel))]}), "
              f"largest prediction change {pred:.1e}, same support {((new > 0) == (old > 0)).all()}")


if __name__ == "__main__":
    main()
