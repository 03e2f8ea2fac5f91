"""The K/V slot moves alone: 5337f0c's one-thread kernel (``git show 5337f0c:vllm_anisotropic/kernels/kv.py``,
loaded from a temporary file) against 210f7e0's ``move_slots`` (one thread) and ``move_slots_threads`` (2 parts).
SmolLM2-135M's caches: 30 bf16 layers [200 blocks, 3 kv heads, 128, 2 x 64] in vLLM's ``vec`` layout (K transposed,
probed through vLLM's own writer); each request moves 2 tokens (root + 3, + 5 -> root + 1, + 2), roots in random
blocks. ``cold``: 48 MiB written between calls (a forward's traffic); ``warm``: the moved slots read just before.
Median us a call of 22 (after 3 discarded). Usage: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/kv_threads_alone_2026_12_05.py
"""
import importlib.util
import subprocess
import tempfile
import time

import numpy as np
import torch
from numba.typed import List

from vllm_anisotropic.integration.vllm.kernels.attention import kv_layout
from vllm_anisotropic.kernels import kv as new

src = subprocess.check_output(["git", "show", "5337f0c:vllm_anisotropic/kernels/kv.py"], text=True)
with tempfile.NamedTemporaryFile("w", suffix="_kv_5337f0c.py", delete=False) as f:
    f.write(src)
spec = importlib.util.spec_from_file_location("kv_5337f0c", f.name)
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

bs, heads, hs, layers, nblocks = 128, 3, 64, 30, 200
k_off, v_off, _, _ = kv_layout("vec", torch.bfloat16, bs, hs)
k_off, v_off = k_off.numpy(), v_off.numpy()
caches = List()
for _ in range(layers):
    caches.append(np.ones(nblocks * heads * bs * 2 * hs, np.int16))  # pages touched (vLLM zeroes its caches)
evict = np.ones(48 << 20, np.uint8)
rng = np.random.default_rng(0)
shape = (heads, bs, 2 * hs)
fns = {"5337f0c": lambda s, d: old.move_slots(caches, s, d, k_off, v_off, *shape),
       "one thread": lambda s, d: new.move_slots(caches, s, d, k_off, v_off, *shape),
       "two threads": lambda s, d: new.move_slots_threads(caches, s, d, k_off, v_off, *shape, 2)}
print(open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": "))
for mode in ("cold", "warm"):
    for reqs in (1, 4, 16, 50):
        times = {k: [] for k in fns}
        for rep in range(25):
            roots = rng.choice(nblocks, reqs, replace=False) * bs + rng.integers(0, bs - 10, reqs)
            s = np.concatenate([[r + 3, r + 5] for r in roots]).astype(np.int64)
            d = np.concatenate([[r + 1, r + 2] for r in roots]).astype(np.int64)
            for name, fn in fns.items():
                if mode == "cold":
                    evict += 1
                else:
                    fns["5337f0c"](d, d)  # slot onto itself: reads (and rewrites) the moved slots
                t = time.perf_counter()
                fn(s, d)
                times[name].append(time.perf_counter() - t)
        print(f"{mode} moves={2 * reqs:3d}: " + "  ".join(f"{k} {np.median(v[3:]) * 1e6:7.1f}" for k, v in times.items()),
              flush=True)
