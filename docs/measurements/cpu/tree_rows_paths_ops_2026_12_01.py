"""Where a layer's path rounds spend their time (``TreeCPUAttentionImpl._tree_rows_paths``), on fixed
inputs: SmolLM2-135M's attention shape (9 query / 3 KV heads, head 64), float32 KV cache in
vLLM's ``vec`` layout, blocks of 128, one thread; R requests, each a chain of 4 drafts with 4
side leaves (8 drafts), over 300 context tokens. Median of 300 calls of the whole layer's tree
rows, then of its parts: the gathers of the path nodes' K/V and of the queried rows, the write
back of their outputs, one round's K/V write and kernel call, the restoring write. Usage:
.venv/bin/python docs/measurements/cpu/tree_rows_paths_ops_2026_12_01.py
(record: tree_rows_paths_ops_2026_12_01.txt)"""

import platform
import time
from types import SimpleNamespace

import numpy as np
import torch
from vllm import _custom_ops as ops

from vllm_anisotropic.bench.machine import cpu_model
from vllm_anisotropic.integration.vllm.engine.runner import TreePlan
from vllm_anisotropic.integration.vllm.kernels.attention import TreeCPUAttentionImpl
from vllm_anisotropic.tree import DraftTree, FlatTrees

H, KVH, HS, BS, DTYPE, ISA = 9, 3, 64, 128, torch.float32, "vec"


def timed(name: str, fn, reps: int = 300) -> None:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    print(f"  {name:44s} {np.median(times) * 1e6:8.1f} us", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    cpu = cpu_model()
    print(f"# {cpu['cpu_model']} ({platform.machine()}, {', '.join(cpu['cpu_isa'])}), one thread, float32, "
          "a chain of 4 drafts + 4 side leaves a request, 300 context tokens; us per layer, median of 300")
    impl = object.__new__(TreeCPUAttentionImpl)
    impl.num_heads, impl.head_size, impl.num_kv_heads = H, HS, KVH
    impl.num_queries_per_kv, impl.scale, impl.kv_cache_dtype = H // KVH, HS ** -0.5, "auto"
    layer = SimpleNamespace(isa=ISA)
    n, ctx = 8, 300
    tree = DraftTree(tokens=np.zeros(n + 1, np.int64), parents=np.array([-1, 0, 1, 2, 3, 0, 1, 0, 2]),
                     values=np.zeros(n + 1))
    for reqs in (1, 8):
        per = -(-(ctx + n) // BS)
        kv = torch.randn(reqs * per + 1, KVH, BS, 2 * HS).to(DTYPE)
        tokens = reqs * (n + 1)
        q, k, v = torch.randn(tokens, (H + 2 * KVH) * HS).to(DTYPE).split([H * HS, KVH * HS, KVH * HS], dim=-1)
        out = torch.zeros(tokens, H * HS, dtype=DTYPE)
        md = SimpleNamespace(seq_lens=torch.full((reqs,), ctx + n, dtype=torch.int32),
                             query_start_loc=torch.arange(0, tokens + 1, n + 1, dtype=torch.int32),
                             block_table=torch.arange(reqs * per, dtype=torch.int32).view(reqs, per))
        plan = TreePlan([*range(reqs)], FlatTrees.from_trees([tree] * reqs))
        rounds, src, qrows, restore_rows, restore_slots = impl._path_plan(plan, md, BS, DTYPE, ISA)
        print(f"R={reqs}: {len(rounds)} rounds, {src.numel()} path nodes, {qrows.numel()} queried rows")
        nb = kv.shape[0]
        kc, vc = kv.view(nb, KVH, 2 * BS, HS).chunk(2, dim=2)
        kk, vv, qs = k.view(-1, KVH, HS), v.view(-1, KVH, HS), q.view(-1, H, HS)
        res = torch.empty(qrows.numel(), H, HS, dtype=DTYPE)
        ks, vs, qq = kk[src], vv[src], qs[qrows]
        s_src, dst, s_q, qsl, sl, bt, meta = rounds[0]
        timed("whole layer (_tree_rows_paths)", lambda: impl._tree_rows_paths(layer, q, k, v, kv, md, plan, out))
        timed("gather the path nodes' K and V", lambda: (kk[src], vv[src]))
        timed("gather the queried rows", lambda: qs[qrows])
        timed("write back their outputs", lambda: out.view(-1, H, HS).__setitem__(qrows, res))
        timed("one round: K/V write", lambda: ops.cpu_attn_reshape_and_cache(
            ks[s_src], vs[s_src], kc, vc, dst, ISA, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"))
        timed("one round: kernel call", lambda: ops.cpu_attention_with_kv_cache(
            query=qq[s_q], key_cache=kc, value_cache=vc, output=res[s_q], query_start_loc=qsl, seq_lens=sl,
            scale=impl.scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=bt, softcap=0.0,
            scheduler_metadata=meta, s_aux=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"))
        krr, vrr = kk[restore_rows], vv[restore_rows]
        timed("the restoring K/V write", lambda: ops.cpu_attn_reshape_and_cache(
            krr, vrr, kc, vc, restore_slots, ISA, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"))


if __name__ == "__main__":
    main()
