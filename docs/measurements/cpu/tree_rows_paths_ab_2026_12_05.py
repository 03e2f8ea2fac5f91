"""One step's CPU tree attention over 30 layers (``TreeCPUAttentionImpl.forward``), timed on fixed
inputs in the source tree on ``PYTHONPATH``: the per-layer Python around vLLM's kernel calls.

Scene (SmolLM2-135M's attention: 9 query heads, 3 KV heads, head 64, bf16, blocks of 128, ISA
``vec``): R requests of ~300 context tokens, each with a GOOSE-like tree of 8 nodes (spine of 4
below the root, branches under the root, node 1 and node 2: three paths off the leading chain,
three rounds a layer). One "step" builds a fresh plan (as the runner does) and runs the layer's
forward 30 times, one KV cache a layer; median ms a step over ``--steps``. Usage::

    PYTHONPATH=<tree> .venv/bin/python docs/measurements/cpu/tree_rows_paths_ab_2026_12_05.py --requests 1,8
"""

import argparse
import time

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

from vllm_anisotropic.integration.vllm.engine.runner import TreePlan
from vllm_anisotropic.integration.vllm.kernels.attention import TreeCPUAttentionImpl
from vllm_anisotropic.tree import DraftTree, FlatTrees

H, KVH, HS, BS, ISA, DT, LAYERS = 9, 3, 64, 128, "vec", torch.bfloat16, 30
PARENTS = [-1, 0, 1, 2, 3, 0, 1, 2]  # spine 1-2-3-4, branches 5 (root), 6 (node 1), 7 (node 2)


def impl():
    m = object.__new__(TreeCPUAttentionImpl)
    m.num_heads, m.head_size, m.num_kv_heads, m.num_queries_per_kv = H, HS, KVH, H // KVH
    m.kv_cache_dtype, m.scale = "auto", HS ** -0.5
    m.attn_type, m.use_zentorch_sdpa, m.sinks, m.alibi_slopes = AttentionType.DECODER, False, None, None
    m.sliding_window, m.logits_soft_cap = -1, 0
    return m


def scene(num_reqs, rng):
    n = len(PARENTS) - 1
    ctx = [int(c) for c in rng.integers(250, 350, num_reqs)]
    seq = [c + n for c in ctx]
    per = -(-max(seq) // BS)
    num_blocks = num_reqs * per + 2
    table = torch.from_numpy(rng.permutation(num_blocks)[: num_reqs * per].reshape(num_reqs, per).astype(np.int32))
    caches = []
    for _ in range(LAYERS):
        cache = torch.zeros(num_blocks, KVH, BS, 2 * HS, dtype=DT)
        kc, vc = cache.view(num_blocks, KVH, 2 * BS, HS).chunk(2, dim=2)
        for i, s in enumerate(seq):
            pos = torch.arange(s)
            slots = table[i, pos // BS].long() * BS + pos % BS
            k = torch.randn(s, KVH, HS).to(DT)
            ops.cpu_attn_reshape_and_cache(k, torch.randn_like(k), kc, vc, slots, ISA)
        caches.append(cache)
    q_lens = [n + 1] * num_reqs
    total = sum(q_lens)
    qsl = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    lens = torch.tensor(seq, dtype=torch.int32)
    meta = CPUAttentionMetadata(
        num_actual_tokens=total, max_query_len=n + 1, query_start_loc=qsl, max_seq_len=max(seq), seq_lens=lens,
        block_table=table, slot_mapping=torch.zeros(total, dtype=torch.int64),
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=num_reqs, num_heads=H, num_kv_heads=KVH, head_dim=HS, seq_lens=lens, dtype=DT,
            query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=ISA, enable_kv_split=False,
            kv_cache_dtype="auto"))
    tree = DraftTree(tokens=np.zeros(n + 1, np.int64), parents=np.array(PARENTS), values=np.zeros(n + 1))
    query = torch.randn(total, H, HS).to(DT)
    key, value = torch.randn(total, KVH * HS).to(DT), torch.randn(total, KVH * HS).to(DT)
    return caches, meta, [tree] * num_reqs, query, key, value


def step(m, caches, meta, trees, query, key, value, out):
    meta.tree_plan = TreePlan(list(range(len(trees))), FlatTrees.from_trees(trees))
    layer = argparse.Namespace(isa=ISA, _k_scale_float=1.0, _v_scale_float=1.0)
    for cache in caches:
        m.forward(layer, query, key, value, cache, meta, out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--save", help="torch.save the outputs here ({requests: output}), to compare two trees bit by bit")
    args = ap.parse_args()
    current_platform.import_kernels()
    torch.set_num_threads(1)
    saved = {}
    for r in [int(x) for x in args.requests.split(",")]:
        torch.manual_seed(r)
        caches, meta, trees, query, key, value = scene(r, np.random.default_rng(r))
        m, out = impl(), torch.empty_like(query)
        for _ in range(10):
            step(m, caches, meta, trees, query, key, value, out)
        ts = []
        for _ in range(args.steps):
            t = time.perf_counter()
            step(m, caches, meta, trees, query, key, value, out)
            ts.append(time.perf_counter() - t)
        ts = np.array(ts) * 1e3
        print(f"requests {r}: {np.median(ts):.3f} ms a step of {LAYERS} layers (p25 {np.percentile(ts, 25):.3f}, "
              f"p75 {np.percentile(ts, 75):.3f}); output checksum {float(out.float().abs().sum()):.4f}")
        saved[r] = out.clone()
    if args.save:
        torch.save(saved, args.save)


if __name__ == "__main__":
    main()
