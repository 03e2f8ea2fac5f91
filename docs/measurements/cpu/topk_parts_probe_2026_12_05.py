"""The threaded top-k and argmax on few rows: one thread against two parts, each pass right after a torch matmul
(torch's OpenMP threads have just run, as after a forward). 64 random bf16 rows of 49,152 logits, k = 8, median
us of 200. Usage: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/topk_parts_probe_2026_12_05.py (~30 s)"""
import time, numpy as np, torch, numba
from vllm_anisotropic.kernels import split
from vllm_anisotropic import kernels
assert split.host_threads() == 2
V = kernels.load("vocab")
a = torch.randn(256, 256); a @ a  # torch's threads have run
x = (torch.randn(64, 49152) * 3).to(torch.bfloat16).view(torch.int16).numpy()
for n in (2, 4, 8, 16):
    rows = np.arange(n, dtype=np.int64)
    ids = np.empty((n, 8), np.int32); probs = np.empty((n, 8), np.float32)
    V.topk_probs(x, rows, 8, ids, probs); V.topk_probs_threads(x, rows, 8, ids, probs, 2)
    r1, r2 = [], []
    for _ in range(200):
        a @ a  # a forward's threads before each pass
        t = time.perf_counter(); V.topk_probs(x, rows, 8, ids, probs); r1.append(time.perf_counter() - t)
        a @ a
        t = time.perf_counter(); V.topk_probs_threads(x, rows, 8, ids, probs, 2); r2.append(time.perf_counter() - t)
    print(f"topk rows={n:3d} one {np.median(r1)*1e6:7.1f} us  two threads {np.median(r2)*1e6:7.1f} us", flush=True)
for n in (4, 8, 16, 32):
    rows = np.arange(n, dtype=np.int64); out = np.empty(n, np.int64)
    V.argmax_rows(x, rows, out); V.argmax_rows_threads(x, rows, out, 2)
    r1, r2 = [], []
    for _ in range(200):
        a @ a
        t = time.perf_counter(); V.argmax_rows(x, rows, out); r1.append(time.perf_counter() - t)
        a @ a
        t = time.perf_counter(); V.argmax_rows_threads(x, rows, out, 2); r2.append(time.perf_counter() - t)
    print(f"argmax rows={n:3d} one {np.median(r1)*1e6:7.1f} us  two threads {np.median(r2)*1e6:7.1f} us", flush=True)
