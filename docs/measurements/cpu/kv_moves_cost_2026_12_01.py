"""K/V slot moves on fixed inputs: vLLM's CPU cache layout, SmolLM2-135M's 30 layers (3 KV heads,
head size 64, blocks of 128, 264 blocks each), R requests x m moves as a tree step makes them (request
r's accepted nodes at depths 1..m, two slots past them: slot r * 1024 + 50 + d <- that + 2),
one thread; median of
200 calls (after a warm call) of the device path (``gather_scatter``: a gather and a scatter of
element indices per layer, what CPU caches took before) and the compiled one (``KVMover.move``
on CPU caches: one ``kernels/kv.py`` call for the 30 layers). Usage:
.venv/bin/python docs/measurements/cpu/kv_moves_cost_2026_12_01.py
(record: kv_moves_cost_2026_12_01.txt)"""

import platform
import time

import numpy as np
import torch

from vllm_anisotropic.bench.machine import cpu_model
from vllm_anisotropic.integration.vllm.engine.kv_moves import KVMover, gather_scatter
from vllm_anisotropic.integration.vllm.kernels.attention import kv_layout

LAYERS, BLOCKS, KVH, BS, HS = 30, 264, 3, 128, 64


def main() -> None:
    torch.set_num_threads(1)
    cpu = cpu_model()
    print(f"# {cpu['cpu_model']} ({platform.machine()}, {', '.join(cpu['cpu_isa'])}), {LAYERS} layers x [{BLOCKS}, {KVH}, {BS}, {2 * HS}], one thread; "
          "ms per step (all layers), median of 200")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        layers = []
        for _ in range(LAYERS):
            layer = type("Layer", (), {})()
            layer.kv_cache, layer.isa = torch.randn(BLOCKS, KVH, BS, 2 * HS, generator=gen).to(dtype), "vec"
            layers.append(layer)
        mover = KVMover.from_layers(layers)
        kv_layout("vec", dtype, BS, HS)
        for reqs, m in ((1, 1), (1, 4), (8, 1), (8, 4), (32, 4)):
            dst = torch.tensor([r * 1024 + 50 + d for r in range(reqs) for d in range(1, m + 1)])
            src = dst + 2
            out = {}
            for name, fn in (("per layer (torch)", lambda: gather_scatter(mover.caches, src, dst)),
                             ("one compiled call", lambda: mover.move(src, dst))):
                fn()
                times = []
                for _ in range(200):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                out[name] = float(np.median(times)) * 1e3
            a, b = out.values()
            print(f"{str(dtype).split('.')[-1]:8s} R={reqs:2d} m={m}: " + "  ".join(f"{k} {v:.3f} ms" for k, v in out.items())
                  + f"  ratio {a / b:.1f}x", flush=True)


if __name__ == "__main__":
    main()
