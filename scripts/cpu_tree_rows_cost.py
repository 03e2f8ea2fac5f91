"""CPU tree rows: path rounds through vLLM's kernel vs the masked float32 recompute, timed alone.

SmolLM2-135M's attention shape (9 query / 3 KV heads, head 64, 30 layers), bf16 KV cache in
vLLM's ``vec`` layout, KV block 128, one thread; trees: stars, a chain with two side branches,
binary trees; R requests x n draft nodes over ``ctx`` context tokens. Median of 5 (30 layers
each) after a warm call. Next to the two paths, ``kernel``: one call of vLLM's CPU kernel for
the same R x (n + 1) query rows, causal, over the same caches: what the rows' context part costs
when each row reads its context once (the CUDA split's context pass; vLLM's CPU kernel returns
no log-sum-exp, so its output cannot be merged with a dense tree part), and ``chain``: the
same call over each request's root and leading chain only (R x (c + 1) rows), the first
kernel call of a tree step since ``TreeCPUAttentionImpl._main_plan``; a step's attention was
``kernel`` + the tree rows and is ``chain`` + the tree rows. Usage:
.venv/bin/python scripts/cpu_tree_rows_cost.py [--contexts 256,1024,4096] [--dtype float32]
(records: docs/measurements/cpu/tree_rows_paths_vs_recompute_2026_11_26.txt,
tree_rows_by_context_2026_11_28.txt)
"""

import argparse
import time
from types import SimpleNamespace

import numpy as np
import torch

from vllm_anisotropic.integration.vllm.kernels.attention import TreeCPUAttentionImpl
from vllm_anisotropic.integration.vllm.engine.runner import TreePlan
from vllm_anisotropic.tree import DraftTree, FlatTrees

H, KVH, HS, BS, DTYPE, ISA, LAYERS = 9, 3, 64, 128, torch.bfloat16, "vec", 30
TREES = {
    "star": lambda n: [-1] + [0] * n,
    "chain+2": lambda n: [-1] + list(range(n - 2)) + [0, 1],  # a chain and two side branches
    "binary": lambda n: [-1] + [(i - 1) // 2 for i in range(1, n + 1)],
}
SHAPES = [(1, 4, 300), (1, 8, 300), (1, 4, 1000), (4, 4, 300), (8, 8, 500)]


def kernel_call(impl, layer, q, kv, md):
    """One call of vLLM's CPU kernel over every query row (causal), per layer."""
    from vllm import _custom_ops as ops
    from vllm import envs

    num_blocks, kvh, bs, two_hs = kv.shape
    kc, vc = kv.view(num_blocks, kvh, 2 * bs, two_hs // 2).chunk(2, dim=2)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(md.seq_lens), num_heads=H, num_kv_heads=KVH, head_dim=HS, seq_lens=md.seq_lens, dtype=q.dtype,
        query_start_loc=md.query_start_loc, causal=True, sliding_window_size=-1, isa=layer.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype="auto")
    qs = q.view(-1, H, HS)
    res = torch.empty_like(qs)

    def run():
        ops.cpu_attention_with_kv_cache(
            query=qs, key_cache=kc, value_cache=vc, output=res, query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens, scale=impl.scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=md.block_table, softcap=0.0, scheduler_metadata=meta, s_aux=None)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default=None,
                    help="comma-separated contexts: R in 1,4 x n = 8 at each (default: the fixed shapes)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    global DTYPE
    DTYPE = getattr(torch, args.dtype)
    shapes = SHAPES if not args.contexts else [
        (r, 8, int(c)) for c in args.contexts.split(",") for r in (1, 4)]
    torch.set_num_threads(1)
    impl = object.__new__(TreeCPUAttentionImpl)
    impl.num_heads, impl.head_size, impl.num_kv_heads = H, HS, KVH
    impl.num_queries_per_kv, impl.scale, impl.kv_cache_dtype = H // KVH, HS ** -0.5, "auto"
    layer = SimpleNamespace(isa=ISA)
    for kind, make in TREES.items():
        for reqs, n, ctx in shapes:
            parents = make(n)
            tree = DraftTree(tokens=np.zeros(n + 1, dtype=np.int64), parents=np.array(parents), values=np.zeros(n + 1))
            seq = ctx + n
            per = -(-seq // BS)
            kv = torch.randn(reqs * per + 1, KVH, BS, 2 * HS).to(DTYPE)
            tokens = reqs * (n + 1)
            q = torch.randn(tokens, H * HS).to(DTYPE)
            k = torch.randn(tokens, KVH * HS).to(DTYPE)
            v = torch.randn_like(k)
            out = torch.zeros(tokens, H * HS, dtype=DTYPE)
            md = SimpleNamespace(seq_lens=torch.full((reqs,), seq, dtype=torch.int32),
                                 query_start_loc=torch.arange(0, tokens + 1, n + 1, dtype=torch.int32),
                                 block_table=torch.arange(reqs * per, dtype=torch.int32).view(reqs, per))
            kernel = kernel_call(impl, layer, q, kv, md)
            c = tree.chain_prefix()  # the first call's rows: root and leading chain
            chain = kernel_call(impl, layer, q[: reqs * (c + 1)], kv, SimpleNamespace(
                seq_lens=torch.full((reqs,), ctx + c, dtype=torch.int32),
                query_start_loc=torch.arange(0, reqs * (c + 1) + 1, c + 1, dtype=torch.int32),
                block_table=md.block_table))
            probe = TreePlan([*range(reqs)], FlatTrees.from_trees([tree] * reqs))
            slim = impl._path_plan(probe, md, BS, DTYPE, ISA, tokens) is not None  # else the engine takes the recompute
            res = {"paths": float("nan")}
            for method in ("recompute", "paths", "kernel", "chain") if slim else ("recompute", "kernel", "chain"):
                times = []
                for _ in range(6):
                    plan = TreePlan([*range(reqs)], FlatTrees.from_trees([tree] * reqs))
                    t0 = time.perf_counter()
                    for _ in range(LAYERS):
                        if method == "kernel":
                            kernel()
                        elif method == "chain":
                            chain()
                        elif method == "paths":
                            impl._tree_rows_paths(layer, q, k, v, kv, impl._path_plan(plan, md, BS, DTYPE, ISA, tokens), out)
                        else:
                            impl._tree_rows(layer, q, kv, impl._gather_plan(plan, md, BS), plan, out)
                    times.append(time.perf_counter() - t0)
                res[method] = float(np.median(times[1:])) * 1e3
            rows = res["paths"] if slim else res["recompute"]  # what the engine takes
            print(f"{kind:8s} R={reqs} n={n} c={c} ctx={ctx}: recompute {res['recompute']:.2f} ms  "
                  f"paths {res['paths']:.2f} ms  kernel {res['kernel']:.2f} ms  chain {res['chain']:.2f} ms  "
                  f"step before {res['kernel'] + rows:.2f} after {res['chain'] + rows:.2f} ms ({LAYERS} layers)",
                  flush=True)


if __name__ == "__main__":
    main()
