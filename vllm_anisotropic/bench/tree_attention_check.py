"""``vllm-anisotropic tree-attention-check``: the tree-attention split against float64, and its cost.

Scope: random batches of draft trees (up to 64 nodes, random contexts including none beyond the
root) in FlashAttention's paged KV layout (``[num_blocks, block_size, num_kv_heads, head_size]``,
shuffled block tables). For each (dtype, head size, block size, GQA) it compares

    split      ``tree_attention.tree_rows_attention``: part (a) paged context attention
               (``paged_context_attention`` in the compute dtype: the stand-in for vLLM's
               FlashAttention call, which needs vLLM), part (b) ``ancestor_attention``, merged
               by ``merge_partials``
    one-pass   the same rows in one masked softmax in the compute dtype (no split): the
               rounding a correct kernel may show
    reference  ``dense_tree_reference`` in float64

and reports the max absolute error of each against the reference. It then times part (b) and the
merge on the device for batch sizes x tree sizes (CUDA events, median of repeats), next to one
paged decode-row attention of the same batch for scale. Runs on CPU or CUDA; no vLLM needed.

Example::

    vllm-anisotropic tree-attention-check --device cuda --out results/tree_attention_gpu.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time

import numpy as np
import torch

from vllm_anisotropic.attention.random_batch import random_batch, random_tree
from vllm_anisotropic.attention.tree_attention import (
    TreeAttentionPlan,
    ancestor_attention,
    merge_partials,
    paged_context_attention,
    tree_rows_attention,
)

__all__ = ["add_parser", "run", "random_tree", "random_batch", "check_case"]

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tree-attention-check", help="tree-attention split vs float64, and its cost")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--head-sizes", default="64,128")
    p.add_argument("--block-sizes", default="16,32,64")
    p.add_argument("--heads", default="14:2,32:8,16:16", help="num_heads:num_kv_heads pairs")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-context", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--timing-shapes", default="14:2:64,12:2:128",
                   help="num_heads:num_kv_heads:head_size of the timing tables (Qwen2.5 0.5B, 1.5B)")
    p.add_argument("--out", default=None, help="JSON output")
    p.set_defaults(func=run)
    return p


def _fused_available(device) -> bool:
    """The Triton kernel runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``."""
    import os

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _one_pass(b, compute_dtype):
    """All node rows in one masked softmax in ``compute_dtype`` (no split)."""
    outs = []
    bs = b["key_cache"].shape[1]
    for r, (c, n, m, e) in enumerate(zip(b["ctx"], b["nodes"], b["masks"], b["q_end"])):
        pos = torch.arange(c, device=b["query"].device)
        blocks = b["block_table"][r].long()[pos // bs]
        rows = slice(e - n, e)
        keys = torch.cat([b["key_cache"][blocks, pos % bs], b["key"][rows]]).to(compute_dtype)
        vals = torch.cat([b["value_cache"][blocks, pos % bs], b["value"][rows]]).to(compute_dtype)
        q = b["query"][rows].to(compute_dtype)
        h, kvh = q.shape[1], keys.shape[1]
        allowed = torch.ones(n, c + n, dtype=torch.bool, device=q.device)
        allowed[:, c:] = torch.from_numpy(m).to(q.device)
        mask = torch.zeros(n, c + n, dtype=compute_dtype, device=q.device).masked_fill(~allowed, float("-inf"))
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1), attn_mask=mask,
            scale=b["scale"], enable_gqa=h != kvh,
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def check_case(b) -> dict:
    """Max |error| of the split and of the one-pass baseline against the float64 reference.

    The context part accumulates in float32 and returns the input dtype, as FlashAttention does.
    """
    dt = b["query"].dtype

    def context(q, cu, lens):
        return paged_context_attention(q, b["key_cache"], b["value_cache"], cu, lens, b["block_table"],
                                       b["scale"], b["softcap"])

    split = tree_rows_attention(b["query"], b["key"], b["value"], b["plan"], context, b["scale"], b["softcap"])
    ref = b["reference"]
    err_split = float((split.double() - ref).abs().max())
    out = {"split_max_abs_err": err_split, "ref_max_abs": float(ref.abs().max()), "rows": int(ref.shape[0])}
    if _fused_available(b["query"].device):
        from vllm_anisotropic.attention.tree_attention_triton import fused_tree_rows_attention

        plan = b["plan"]
        out_a, lse_a = context(b["query"][plan.packed_rows], plan.cu_nodes, plan.context_lens)
        output = torch.zeros_like(b["query"])
        variants = {"fused_max_abs_err": None}  # the default: tensor cores for 16-bit inputs
        if dt in (torch.float16, torch.bfloat16):
            variants["fused_ieee_max_abs_err"] = False
        for name, tensor_cores in variants.items():
            output = torch.zeros_like(b["query"])
            fused_tree_rows_attention(b["query"], b["key"], b["value"], out_a, lse_a, plan.node_rows,
                                      plan.ancestor_bits, plan.cu_nodes, output, b["scale"], b["softcap"],
                                      tensor_cores=tensor_cores)
            out[name] = float((output[plan.packed_rows].double() - ref).abs().max())
    if not b["softcap"]:
        out["one_pass_max_abs_err"] = float((_one_pass(b, dt).double() - ref).abs().max())
    return out


def _time(fn, device, repeats=20, inner=20) -> float:
    """Median seconds of ``fn()``. On CUDA ``fn`` is captured ``inner`` times in one CUDA graph
    and the replay is timed with CUDA events (small kernels timed eagerly measure the Python
    launch overhead, not the GPU); on CPU, perf_counter."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        graph.replay()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / inner)
        return float(np.median(times))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# fused-kernel variants timed side by side: (name, tensor_cores, num_warps)
FUSED_VARIANTS = [("fused_ieee_w4", False, 4), ("fused_tc_w4", True, 4), ("fused_tc_w8", True, 8)]


def timing_table(device, dtype, num_heads=14, num_kv_heads=2, head_size=64, seed=0,
                 batches=(1, 4, 8, 16, 32, 64), node_counts=(4, 8, 16, 32, 64)) -> list[dict]:
    """Part (b) + merge cost per layer for batch x nodes, each fused-kernel variant (16-bit
    dtypes: IEEE float32 products vs tensor cores, 4 vs 8 warps), and SDPA decode rows over a
    1024 context."""
    rng = np.random.default_rng(seed)
    rows = []
    for batch, nodes in itertools.product(batches, node_counts):
        q = torch.randn(batch, nodes, num_heads, head_size, device=device, dtype=dtype)
        k = torch.randn(batch, nodes, num_kv_heads, head_size, device=device, dtype=dtype)
        v = torch.randn_like(k)
        masks = [random_tree(rng, nodes + 1).ancestor_mask[1:, 1:] for _ in range(batch)]
        allowed = torch.from_numpy(np.stack(masks)).to(device)
        out_a = torch.randn(batch * nodes, num_heads, head_size, device=device, dtype=dtype)
        lse_a = torch.randn(num_heads, batch * nodes, device=device)
        t_anc = _time(lambda: ancestor_attention(q, k, v, allowed, head_size**-0.5), device)
        ob = out_a.clone()
        lb = lse_a.clone()
        t_merge = _time(lambda: merge_partials(out_a, lse_a, ob, lb), device)
        fused = {}
        if _fused_available(device):
            from vllm_anisotropic.attention.tree_attention_triton import fused_tree_rows_attention

            plan = TreeAttentionPlan.build(list(range(batch)), masks, [(r + 1) * nodes for r in range(batch)],
                                           [1024 + nodes] * batch, device=device)
            qf, kf, vf = q.reshape(-1, num_heads, head_size), k.reshape(-1, num_kv_heads, head_size), v.reshape(-1, num_kv_heads, head_size)
            outf = torch.empty_like(qf)
            for name, tensor_cores, warps in FUSED_VARIANTS:
                if tensor_cores and dtype == torch.float32:
                    continue
                fused[f"{name}_us"] = 1e6 * _time(
                    lambda: fused_tree_rows_attention(qf, kf, vf, out_a, lse_a, plan.node_rows, plan.ancestor_bits,
                                                      plan.cu_nodes, outf, head_size**-0.5, tensor_cores=tensor_cores,
                                                      num_warps=warps), device)
        # decode attention of the same batch, one row per request over 1024 keys (SDPA)
        qd = torch.randn(batch, num_heads, 1, head_size, device=device, dtype=dtype)
        kd = torch.randn(batch, num_kv_heads, 1024, head_size, device=device, dtype=dtype)
        vd = torch.randn_like(kd)
        t_dec = _time(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), device)
        rows.append({"batch": batch, "nodes": nodes, "ancestor_us": 1e6 * t_anc, "merge_us": 1e6 * t_merge, **fused,
                     "decode_sdpa_ctx1024_us": 1e6 * t_dec})
    return rows


def run(args) -> int:
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    rng = np.random.default_rng(args.seed)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "cases": [], "timing": []}
    heads = [tuple(int(x) for x in p.split(":")) for p in args.heads.split(",")]
    worst = {}
    fused = _fused_available(device)
    for dt_name, hs, bs, (h, kvh), softcap in itertools.product(
        args.dtypes.split(","), [int(x) for x in args.head_sizes.split(",")],
        [int(x) for x in args.block_sizes.split(",")], heads, [0.0, 30.0],
    ):
        b = random_batch(rng, args.requests, h, kvh, hs, bs, _DTYPES[dt_name], device,
                         max_context=args.max_context, softcap=softcap)
        case = {"dtype": dt_name, "head_size": hs, "block_size": bs, "num_heads": h, "num_kv_heads": kvh,
                "softcap": softcap, **check_case(b)}
        results["cases"].append(case)
        w = worst.setdefault(dt_name, {"split": 0.0, "one_pass": 0.0, "fused": 0.0})
        w["split"] = max(w["split"], case["split_max_abs_err"])
        w["fused"] = max(w["fused"], case.get("fused_max_abs_err", 0.0))
        if "fused_ieee_max_abs_err" in case:
            w["fused_ieee"] = max(w.get("fused_ieee", 0.0), case["fused_ieee_max_abs_err"])
        w["one_pass"] = max(w["one_pass"], case.get("one_pass_max_abs_err", 0.0))
    results["worst"] = worst
    for dt_name, w in worst.items():
        print(f"{dt_name:9s} {sum(c['dtype'] == dt_name for c in results['cases'])} cases: "
              f"split max |err| {w['split']:.2e}   one-pass (no split) max |err| {w['one_pass']:.2e}"
              + (f"   fused Triton split max |err| {w['fused']:.2e}" if fused else "")
              + (f" (IEEE float32 products: {w['fused_ieee']:.2e})" if fused and "fused_ieee" in w else ""))
    if not args.no_timing:
        for dt_name in args.dtypes.split(","):
            for shape in args.timing_shapes.split(","):
                h, kvh, hs = (int(x) for x in shape.split(":"))
                for row in timing_table(device, _DTYPES[dt_name], num_heads=h, num_kv_heads=kvh, head_size=hs):
                    results["timing"].append({"dtype": dt_name, "shape": shape, **row})
        names = [n for n, _, _ in FUSED_VARIANTS]
        print("per layer, us: dtype  heads:kv:size batch nodes  ancestor  merge  " + "  ".join(names)
              + "  decode_sdpa_ctx1024")
        for r in results["timing"]:
            fused_cols = "  ".join(f"{r.get(n + '_us', float('nan')):{len(n)}.1f}" for n in names)
            print(f"{r['dtype']:9s} {r['shape']:>9s} {r['batch']:5d} {r['nodes']:5d} {r['ancestor_us']:9.1f} "
                  f"{r['merge_us']:6.1f}  "
                  f"{fused_cols}  {r['decode_sdpa_ctx1024_us']:19.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0
