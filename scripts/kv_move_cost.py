#!/usr/bin/env python
"""What the K/V slot moves cost on a device (issue 43, target 4): ``KVMover.move`` over every
layer's paged cache of a model shape, for M moved tokens, timed with the device synchronised,
each result checked against the moved slots' source values.

The caches are FLASH_ATTN's layout (``[num_blocks, num_kv_heads, block_size, 2 * head_size]``,
``KVMover.plain_offsets``), one tensor per layer, random bf16 values; the moves are M distinct
source slots and M distinct destinations (one tree's accepted path off its leading chain is
1-8 moves; a step at 64 requests up to a few hundred). On ``--device cpu`` the same device path
(``gather_scatter``) runs, for a functional check; the engine's CPU path is a compiled kernel.

    python scripts/kv_move_cost.py --device cuda            # on the GPU machine (scripts/device/gpu.sh kvmove)
    python scripts/kv_move_cost.py --device cpu --repeats 3  # here
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from vllm_anisotropic.integration.vllm.engine.kv_moves import KVMover

# (name, layers, kv heads, head size): SmolLM2-135M, Qwen2.5-1.5B, Llama-3.1-8B
SHAPES = [("smollm2-135m", 30, 3, 64), ("qwen2.5-1.5b", 28, 2, 128), ("llama-3.1-8b", 32, 8, 128)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--moves", default="8,64,512")
    ap.add_argument("--blocks", type=int, default=2048, help="blocks per layer's cache (block size 16)")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    block = 16
    for name, layers, heads, hs in SHAPES:
        caches = [torch.randn(args.blocks, heads, block, 2 * hs, generator=gen).to(torch.bfloat16).to(dev)
                  for _ in range(layers)]
        k_off, v_off = KVMover.plain_offsets(block, hs)
        mover = KVMover([(c, k_off.to(dev), v_off.to(dev)) for c in caches])
        for m in (int(x) for x in args.moves.split(",")):
            slots = torch.randperm(args.blocks * block, generator=gen)[: 2 * m]
            src, dst = slots[:m].to(dev), slots[m:].to(dev)
            # check once: every moved token's K and V (all heads) equal its source's
            want = [c[src // block, :, src % block] for c in caches]  # (advanced indexing: copies)
            mover.move(src, dst)
            sync()
            ok = all(torch.equal(c[dst // block, :, dst % block], w) for c, w in zip(caches, want))
            times = []
            for _ in range(args.repeats):
                sync()
                t0 = time.perf_counter()
                mover.move(src, dst)
                sync()
                times.append(time.perf_counter() - t0)
            times.sort()
            print(json.dumps({"device": str(dev), "shape": name, "layers": layers, "moves": m, "correct": ok,
                              "us_median": round(1e6 * times[len(times) // 2], 1), "us_min": round(1e6 * times[0], 1)}),
                  flush=True)
        del caches, mover
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
