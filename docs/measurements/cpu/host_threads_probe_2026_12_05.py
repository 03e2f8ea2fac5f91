"""Why the vocabulary passes use numba's OpenMP layer (kernels/split.py), and why a fork child runs
one thread: two probes, each in fresh processes.

1. The top-k of 40 bf16 rows of 49,152 (``kernels.vocab``) right after a 512 x 512 matmul on
   torch's OpenMP threads (what a pass meets after vLLM's forward), then 2 and 20 ms later: one
   thread; two parts, one on a Python helper thread (``ThreadPoolExecutor``, the kernel releases
   the GIL); two parts on numba's ``workqueue`` layer; two on its OpenMP layer. Median of 30, us.
2. A fork child running the threaded top-k (numba's OpenMP layer), its parent having run
   nothing on OpenMP, or a torch matmul: the child's exit status and time (a watchdog ends a hung
   child after 8 s with status 256 and prints where it hung).

    PYTHONPATH=. .venv/bin/python docs/measurements/cpu/host_threads_probe_2026_12_05.py
"""
import os
import subprocess
import sys
import time

_TIMING = r"""
import sys, time, numpy as np, torch
from concurrent.futures import ThreadPoolExecutor
import numba
how = sys.argv[1]
if how in ("workqueue", "omp"):
    numba.config.THREADING_LAYER = how
from vllm_anisotropic import kernels
vocab = kernels.load("vocab")
x = torch.randn(600, 49152).to(torch.bfloat16).view(torch.int16).numpy()
rows = np.arange(40, dtype=np.int64)
ids, probs = np.empty((40, 10), np.int32), np.empty((40, 10), np.float32)
pool = ThreadPoolExecutor(1)
def run():
    if how == "one":
        vocab.topk_probs(x, rows, 10, ids, probs)
    elif how == "helper":
        f = pool.submit(vocab.topk_probs, x, rows[20:], 10, ids[20:], probs[20:])
        vocab.topk_probs(x, rows[:20], 10, ids[:20], probs[:20])
        f.result()
    else:
        numba.set_num_threads(2)
        vocab.topk_probs_threads(x, rows, 10, ids, probs, 2)
a = torch.randn(512, 512)
run()
out = []
for gap in (0.0, 0.002, 0.02):
    ts = []
    for _ in range(30):
        a @ a
        time.sleep(gap)
        t0 = time.perf_counter(); run(); ts.append(time.perf_counter() - t0)
    out.append("%.0f" % (np.median(ts) * 1e6))
print(how, numba.threading_layer() if how in ("workqueue", "omp") else "-", *out)
"""

_FORK = r"""
import os, sys, faulthandler, numpy as np
import torch, numba
numba.config.THREADING_LAYER = "omp"
if sys.argv[1] == "torch":
    a = torch.randn(512, 512); a @ a
from vllm_anisotropic import kernels
x = np.random.default_rng(0).standard_normal((64, 3000)).astype(np.float32)
rows = np.arange(64)
ids, probs = np.empty((64, 4), np.int32), np.empty((64, 4), np.float32)
import time
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    faulthandler.dump_traceback_later(8, exit=True)  # a hung child: its stack on stderr, status 256
    numba.set_num_threads(2)
    kernels.load("vocab").topk_probs_threads(x, rows, 4, ids, probs, 2)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("parent ran", sys.argv[1], "-> child status", status, "after %.1f s" % (time.perf_counter() - t0))
"""

if __name__ == "__main__":
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    print(time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()), os.uname().nodename)
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Model name:")[1].split("\n")[0].strip())
    print("top-k of 40 rows after a torch matmul, us (median of 30): how, layer, at once, 2 ms later, 20 ms later")
    for how in ("one", "helper", "workqueue", "omp"):
        out = subprocess.run([sys.executable, "-c", _TIMING, how], capture_output=True, text=True, env=env)
        print(out.stdout.strip() or out.stderr[-500:])
    for parent in ("nothing", "torch"):
        out = subprocess.run([sys.executable, "-c", _FORK, parent], capture_output=True, text=True, env=env)
        print(out.stdout.strip() or out.stderr[-500:])
        hung = [line for line in out.stderr.splitlines() if "Timeout" in line or "topk_probs_threads" in line]
        print("  child's stderr:", " | ".join(hung) or "-")
