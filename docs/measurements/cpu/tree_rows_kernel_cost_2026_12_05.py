"""What vLLM's CPU attention kernel costs per call, query row and context token (issue 43 item 6).

The CPU tree rows run as path rounds through vLLM's own kernel (``kernels/attention.py``,
``_tree_rows_paths``): per round and layer one ``cpu_attn_reshape_and_cache`` (the path's K/V)
and one ``cpu_attention_with_kv_cache`` (the path's uncovered rows), then one more write to put
the tree's K/V back. Item 6 asks whether the context part can cost what the CUDA split costs
(context attention once for all tree rows, merged by log-sum-exp with the dense tree part).
This probe times the kernel at SmolLM2-135M's shapes (9 query heads, 3 KV heads, head 64, bf16,
blocks of 128, ISA ``vec``) to split a call into its fixed part and its per (query row x context
token) part. Usage (~1 min)::

    PYTHONPATH=. .venv/bin/python docs/measurements/cpu/tree_rows_kernel_cost_2026_12_05.py
"""

import platform
import subprocess
import time

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.platforms import current_platform

H, KVH, HS, BS, NB, ISA, DT = 9, 3, 64, 128, 64, "vec", torch.bfloat16


def med(f, n=300):
    for _ in range(20):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e6


def main():
    current_platform.import_kernels()
    cpu = [ln for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
           if ln.startswith("Model name")]
    print(f"# {cpu[0] if cpu else platform.processor()}; torch {torch.__version__}; median us a call, 300 calls")
    cache = torch.zeros(NB, KVH, BS, 2 * HS, dtype=DT)
    kc, vc = cache.view(NB, KVH, 2 * BS, HS).chunk(2, dim=2)
    k = torch.randn(NB * BS, KVH, HS, dtype=DT)
    v = torch.randn_like(k)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(NB * BS), ISA)
    torch.set_num_threads(1)
    for ntok in (1, 4, 16):
        slots = torch.arange(ntok) + 1000
        kk, vv = k[:ntok].clone(), v[:ntok].clone()
        print(f"reshape_and_cache, {ntok:2d} tokens, 1 thread: "
              f"{med(lambda: ops.cpu_attn_reshape_and_cache(kk, vv, kc, vc, slots, ISA)):6.1f}")

    def attn(num_seqs, q_per_seq, ctx):
        qsl = torch.arange(num_seqs + 1, dtype=torch.int32) * q_per_seq
        sl = torch.full((num_seqs,), ctx + q_per_seq, dtype=torch.int32)
        nblk = -(-(ctx + q_per_seq) // BS)
        bt = (torch.arange(num_seqs * nblk, dtype=torch.int32).view(num_seqs, nblk)) % NB
        q = torch.randn(num_seqs * q_per_seq, H, HS, dtype=DT)
        out = torch.empty_like(q)
        kw = dict(num_reqs=num_seqs, num_heads=H, num_kv_heads=KVH, head_dim=HS, seq_lens=sl, dtype=DT,
                  query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=ISA, enable_kv_split=False)
        meta = ops.cpu_attn_get_scheduler_metadata(**kw)
        call = med(lambda: ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=sl, scale=0.125,
            causal=True, alibi_slopes=None, sliding_window=-1, block_table=bt, softcap=0.0,
            scheduler_metadata=meta, s_aux=None))
        return call, med(lambda: ops.cpu_attn_get_scheduler_metadata(**kw))

    shapes = [(1, 1, 300), (1, 2, 300), (1, 4, 300), (1, 8, 300), (1, 16, 300), (1, 1, 1000), (1, 4, 1000),
              (1, 8, 1000), (4, 1, 300), (4, 2, 300), (8, 1, 300), (8, 4, 300), (32, 2, 300)]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        print(f"threads {threads}: sequences x query rows each, context -> us a call (metadata us); "
              "us per query row beyond the 1-row call")
        base = {}
        for ns, qp, ctx in shapes:
            a, m = attn(ns, qp, ctx)
            if (ns, qp) == (1, 1):
                base[ctx] = a
            extra = (a - base[ctx]) / (ns * qp - 1) if ns * qp > 1 and ctx in base else float("nan")
            print(f"  {ns:2d} x {qp:2d} rows, ctx {ctx:4d}: {a:7.1f} ({m:4.1f})   {extra:6.1f}")


if __name__ == "__main__":
    main()
