"""One attention call of q's short rows on the CPU: torch's SDPA (its default CPU kernel, and its
math backend) against ``draft_kv.short_rows_attention``, Qwen2.5-0.5B's 14:2 heads x 64, bf16
(q's engine dtype), boolean masks (90 % True), keys / values views of wider slots as in DraftKV;
the prompt case (one row, causal mask) SDPA only, bf16 and float32. Median us of 50 (10 for
prompts) after 5 warm, 2 threads; max |error| against float32 SDPA.

    PYTHONPATH=. .venv/bin/python docs/measurements/cpu/q_short_rows_attention_2026_12_04.py
"""
import platform
import subprocess
import time

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from vllm_anisotropic.proposers.draft_kv import short_rows_attention

torch.set_num_threads(2)


def bench(f, n=50):
    for _ in range(5):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return np.median(ts) * 1e6


cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
flags = open("/proc/cpuinfo").read()
print(f"# {cpu} ({platform.machine()}, amx: {'amx_bf16' in flags}, avx512_bf16: {'avx512_bf16' in flags}), "
      f"torch {torch.__version__}, 2 threads")
print("| rows x queries | columns | SDPA | SDPA math | short_rows_attention | error SDPA / short_rows |")
print("|---|---:|---:|---:|---:|---|")
H, KH, D = 14, 2, 64
for rows, n, width in ((1, 1, 301), (4, 1, 301), (4, 3, 301), (4, 8, 301), (8, 1, 601), (16, 1, 1001)):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, H, n, D, generator=g).bfloat16()
    k = torch.randn(rows, KH, 1024, D, generator=g).bfloat16()[:, :, :width]
    v = torch.randn(rows, KH, 1024, D, generator=g).bfloat16()[:, :, :width]
    mask = torch.rand(rows, 1, n, width, generator=g) < 0.9
    mask[..., 0] = True
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)

    def math():
        with sdpa_kernel([SDPBackend.MATH]):
            return sdpa()

    ours = lambda: short_rows_attention(q, k, v, mask, 0.125)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125,
                                                           enable_gqa=True)
    err = lambda x: (x.float() - ref).abs().max().item()
    print(f"| {rows} x {n} | {width} | {bench(sdpa):.0f} | {bench(math):.0f} | {bench(ours):.0f} | "
          f"{err(sdpa()):.1e} / {err(ours()):.1e} |")
print()
print("| prompt tokens (causal) | SDPA bf16 | SDPA float32 |")
print("|---:|---:|---:|")
for n in (64, 300, 1000):
    q = torch.randn(1, H, n, D).bfloat16()
    k = torch.randn(1, KH, n, D).bfloat16()
    v = torch.randn(1, KH, n, D).bfloat16()
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    b = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), 10)
    f = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                                       enable_gqa=True), 10)
    print(f"| {n} | {b:.0f} | {f:.0f} |")
