"""Why rows shared over a helper thread gain alone but not in the engine: the top-k of R bf16 rows
(49,152 logits, top-10, kernels.vocab.topk_probs) on the calling thread alone against split with one
blocking helper thread (ThreadPoolExecutor), each call either cold (after a 2 ms sleep) or right
after a torch matmul that runs on torch's OpenMP threads (as the engine's host path runs right
after torch ops). Median us over 30 calls. Run: PYTHONPATH=. .venv/bin/python
docs/measurements/cpu/shares_spin_probe_2026_12_05.py [GOMP_SPINCOUNT values are read from the env]"""
import os, time
import numpy as np, torch
from concurrent.futures import ThreadPoolExecutor
from vllm_anisotropic import kernels

vocab = kernels.load("vocab")
pool = ThreadPoolExecutor(1)
a = torch.randn(512, 512)
print("torch threads", torch.get_num_threads(), "GOMP_SPINCOUNT", os.environ.get("GOMP_SPINCOUNT"),
      "OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY"))
for R in (8, 64, 512):
    x = torch.randn(R, 49152).to(torch.bfloat16).view(torch.int16).numpy()
    rows = np.arange(R, dtype=np.int64)
    ids, pr = np.empty((R, 10), np.int32), np.empty((R, 10), np.float32)
    one = lambda: vocab.topk_probs(x, rows, 10, ids, pr)  # noqa: E731

    def two():
        h = R // 2
        f = pool.submit(vocab.topk_probs, x, rows[h:], 10, ids[h:], pr[h:])
        vocab.topk_probs(x, rows[:h], 10, ids[:h], pr[:h])
        f.result()

    for before in ("cold", "after matmul"):
        t = {one: [], two: []}
        for _ in range(30):
            for f in (one, two):
                if before == "cold":
                    time.sleep(0.002)
                else:
                    a @ a
                s = time.perf_counter(); f(); t[f].append(time.perf_counter() - s)
        print(f"R={R:4d} {before:13s}: one thread {np.median(t[one]) * 1e6:7.0f} us, "
              f"with a helper {np.median(t[two]) * 1e6:7.0f} us")
