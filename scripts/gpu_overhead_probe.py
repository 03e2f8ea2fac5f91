#!/usr/bin/env python
"""Where the device time of two GPU paths goes (issue 43 item 3, issue 45 item 5), after the
first H200 run (docs/measurements/h200/*_2026_12_04*) timed both flat in their work:
``KVMover.move`` at ~3.5-4 ms for 8 to 512 moved tokens, and draft_tree's batched drafting step
at ~190 ms for 1 to 16 requests.

Part 1 (kv): a bare ``torch.cuda.synchronize()``; one move timed three ways: wall with a sync
around it, host time of 50 moves launched back to back (then one sync), and CUDA-event time per
move (the GPU's own time); the same for one layer, to split per-layer launch cost from the sync.
Part 2 (draft): forwards per drafting step and their synced wall time (``DraftKV.forward``
wrapped), the step's rest (host work), and for one batched step at B = 8 the torch profiler's
busy device time against the step's wall.

    python scripts/gpu_overhead_probe.py --device cuda > $OUT/gpu_overhead_probe.txt
    .venv/bin/python scripts/gpu_overhead_probe.py --device cpu --layers 1   # a smoke run here
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import draft_batch_cost as dbc  # noqa: E402

from vllm_anisotropic.integration.vllm.engine.kv_moves import KVMover  # noqa: E402
from vllm_anisotropic.proposers import draft_kv  # noqa: E402


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def med(xs):
    return float(np.median(xs))


def kv_part(dev, layers_list):
    n = 50
    t = []
    for _ in range(n):
        t0 = time.perf_counter(); sync(dev); t.append(time.perf_counter() - t0)
    print(f"bare synchronize: {1e6 * med(t):.1f} us median of {n}")
    block, heads, hs, blocks = 16, 2, 128, 2048
    for layers in layers_list:
        caches = [torch.zeros(blocks, heads, block, 2 * hs, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
        k_off, v_off = KVMover.plain_offsets(block, hs)
        mover = KVMover([(c, k_off.to(dev), v_off.to(dev)) for c in caches])
        for m in (8, 512):
            slots = torch.randperm(blocks * block)[: 2 * m]
            src, dst = slots[:m].to(dev), slots[m:].to(dev)
            mover.move(src, dst); sync(dev)
            wall = []
            for _ in range(n):
                sync(dev); t0 = time.perf_counter(); mover.move(src, dst); sync(dev); wall.append(time.perf_counter() - t0)
            sync(dev); t0 = time.perf_counter()
            for _ in range(n):
                mover.move(src, dst)
            launch = (time.perf_counter() - t0) / n
            sync(dev); drained = (time.perf_counter() - t0) / n
            ev = []
            if dev.type == "cuda":
                for _ in range(n):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record(); mover.move(src, dst); b.record(); b.synchronize(); ev.append(a.elapsed_time(b) * 1e-3)
            print(f"kv move: layers {layers} moves {m}: wall+sync {1e6 * med(wall):.0f} us; host launch "
                  f"{1e6 * launch:.0f} us/move (50 back to back, {1e6 * drained:.0f} us/move with the drain); "
                  f"cuda events {1e6 * med(ev) if ev else float('nan'):.0f} us", flush=True)
        del caches, mover


def kv_variants(dev, layers=28, heads=2, hs=128, blocks=2048, block=16, moves=(8, 64, 512)):
    """The same moves four ways, each checked against ``gather_scatter``: per layer
    index_select + index_copy_ (the current device path), per layer ``flat[dst] = flat[src]``,
    per layer 4-D advanced indexing (one index per token, not per element), and the two Triton
    launches for all layers (``attention/kv_move_triton.py``)."""
    from vllm_anisotropic.attention.kv_move_triton import layer_offsets, move_slots
    from vllm_anisotropic.integration.vllm.engine.kv_moves import _elements, gather_scatter

    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(blocks, heads, block, 2 * hs, generator=gen).to(torch.bfloat16).to(dev) for _ in range(layers)]
    k_off, v_off = (t.to(dev) for t in KVMover.plain_offsets(block, hs))
    offsets = layer_offsets(caches)

    def index_put(src, dst):
        both = _elements(torch.cat([src, dst]), k_off, v_off, heads, block, 2 * hs)
        s_, d_ = both[: both.numel() // 2], both[both.numel() // 2 :]
        for c in caches:
            f = c.view(-1)
            f[d_] = f[s_]

    def four_d(src, dst):
        sb, st, db, dt = src // block, src % block, dst // block, dst % block
        for c in caches:
            c[db, :, dt] = c[sb, :, st]

    variants = {"index_copy (now)": lambda s_, d_: gather_scatter([(c, k_off, v_off) for c in caches], s_, d_),
                "index_put": index_put, "4-D index": four_d,
                "triton, 2 launches": lambda s_, d_: move_slots(caches, offsets, s_, d_)}
    for m in moves:
        slots = torch.randperm(blocks * block, generator=gen)[: 2 * m]
        src = slots[:m].clone()
        src[-1] = slots[m]  # a source that is also a destination (read before it is written)
        src, dst = src.to(dev), slots[m:].to(dev)
        for name, fn in variants.items():
            before = [c.clone() for c in caches]
            gather_scatter([(c, k_off, v_off) for c in before], src, dst)
            fn(src, dst); sync(dev)
            ok = all(torch.equal(a, b) for a, b in zip(caches, before))
            del before
            wall = []
            for _ in range(30):
                sync(dev); t0 = time.perf_counter(); fn(src, dst); sync(dev); wall.append(time.perf_counter() - t0)
            print(f"kv variant {name}: layers {layers} moves {m}: correct {ok}; wall+sync {1e6 * med(wall):.0f} us "
                  f"(min {1e6 * min(wall):.0f})", flush=True)
    del caches


def draft_part(dev, batches, context, dtype, backends=None):
    q = dbc.random_q("/tmp/draft_batch_cost")
    fw = {"n": 0, "s": 0.0}
    orig = draft_kv.DraftKV.forward

    def timed(self, *a, **k):
        sync(dev); t0 = time.perf_counter()
        out = orig(self, *a, **k)
        sync(dev); fw["s"] += time.perf_counter() - t0; fw["n"] += 1
        return out

    draft_kv.DraftKV.forward = timed
    if backends:  # only the SDPA backend comparison: the batched step at B = 8, (2, 2, 2)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        pair = dbc.twins(q, dbc.SHAPES[-1], dev.type, dtype)
        for name in backends:
            try:
                with sdpa_kernel([getattr(SDPBackend, name)]):
                    dbc.run(pair, 8, 1, context, dev.type, check=False, seed=3)
                    fw.update(n=0, s=0.0)
                    times = dbc.run(pair, 8, 4, context, dev.type, check=False, seed=3)
            except Exception as e:  # noqa: BLE001 - a backend that cannot take the mask
                print(f"sdpa {name}: failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            print(f"sdpa {name}: draft (2, 2, 2) B=8: batched step {med(times['batched']):.1f} ms, one at a time "
                  f"{med(times['single']):.1f} ms; {1e3 * fw['s'] / max(fw['n'], 1):.1f} ms per DraftKV forward", flush=True)
        draft_kv.DraftKV.forward = orig
        return
    for shape in dbc.SHAPES:
        pair = dbc.twins(q, shape, dev.type, dtype)
        for b in batches:
            dbc.run(pair, b, 1, context, dev.type, check=False, seed=b)  # warm-up, prompts in
            fw.update(n=0, s=0.0)
            times = dbc.run(pair, b, 4, context, dev.type, check=False, seed=b)
            # run() times both paths; the batched path's forwards are the DraftKV ones
            steps = len(times["batched"]) + 1
            per_step = fw["s"] / steps * 1e3
            print(f"draft {shape} B={b}: batched step {med(times['batched']):.1f} ms; DraftKV forwards/step "
                  f"{fw['n'] / steps:.1f}, {per_step:.1f} ms of forwards/step "
                  f"({1e3 * fw['s'] / max(fw['n'], 1):.1f} ms each, synced)", flush=True)
        if shape == dbc.SHAPES[-1]:
            from torch.profiler import ProfilerActivity, profile

            nb = 8 if dev.type == "cuda" else 2
            reqs = [pair[0].new_request() for _ in range(nb)]
            rng = np.random.default_rng(0)
            tokens = rng.integers(100, 150000, (nb, context + 64))
            lengths = np.full(nb, context)
            pair[0].propose_batch(reqs, tokens, np.arange(nb), lengths); sync(dev)
            lengths += 3
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with profile(activities=acts) as prof:
                sync(dev); t0 = time.perf_counter()
                pair[0].propose_batch(reqs, tokens, np.arange(nb), lengths); sync(dev)
                wall = time.perf_counter() - t0
            ka = prof.key_averages()
            busy = sum(e.self_device_time_total for e in ka) * 1e-3
            launches = sum(e.count for e in ka if "cudaLaunchKernel" in e.key or "cuLaunchKernel" in e.key)
            print(f"profiled batched step (2,2,2) B={nb}: wall {1e3 * wall:.1f} ms (under the profiler), "
                  f"device busy {busy:.1f} ms, kernel launches {launches}")
            print(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))
        del pair
    draft_kv.DraftKV.forward = orig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", default="1,28")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--moves", default="8,64,512")
    ap.add_argument("--parts", default="kv,draft", help="kv, kvvar (the move variants), draft, sdpa")
    ap.add_argument("--sdpa", default="CUDNN_ATTENTION,EFFICIENT_ATTENTION,FLASH_ATTENTION,MATH")
    args = ap.parse_args()
    dev = torch.device(args.device)
    print(f"# {dev} {torch.cuda.get_device_name() if dev.type == 'cuda' else ''} torch {torch.__version__}", flush=True)
    parts = args.parts.split(",")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if "kv" in parts:
        kv_part(dev, [int(x) for x in args.layers.split(",")])
    if "kvvar" in parts:
        kv_variants(dev, layers=int(args.layers.split(",")[-1]), moves=[int(m) for m in args.moves.split(",")])
    if "draft" in parts:
        draft_part(dev, [int(x) for x in args.batches.split(",")], args.context, dtype)
    if "sdpa" in parts:
        draft_part(dev, [], args.context, dtype, backends=args.sdpa.split(","))


if __name__ == "__main__":
    main()
