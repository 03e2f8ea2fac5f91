"""What a cold cache costs the greedy walk: ``verifiers.greedy.walk_flat`` on one 8-node tree
(chain of 4 with 3 side nodes) over bf16 rows of SmolLM2's vocabulary (49,152), the walk
accepting 3 nodes (4 rows read), timed (a) warm: the same logits again and again; (b) after a
64 MB copy (evicts L2 and most of L3) before each call; (c) on fresh logits of an lm_head
matmul (576 -> 49,152, torch's threads) after such a copy, as in the engine, where the step's
forward runs between two walks. In the engine (profile-host, goose-b8, one request) the same
call took ~138 us a tree step (a scratch clock around it, 2026-12-05).

    PYTHONPATH=. .venv/bin/python docs/measurements/cpu/walk_cold_cache_2026_12_05.py
"""

import time

import numpy as np
import torch

from vllm_anisotropic.tree import DraftTree, FlatTrees
from vllm_anisotropic.verifiers.greedy import walk_flat

V = 49152


def main() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, 8)
    flat = FlatTrees.from_trees([DraftTree(tokens=tokens, parents=[-1, 0, 1, 2, 3, 0, 1, 2])])
    starts = np.array([0])

    def plant(lg):  # rows 0-2 pick nodes 1-3: the walk reads rows 0..3
        for r, t in ((0, 1), (1, 2), (2, 3)):
            lg[r, tokens[t]] = 50.0
        return lg

    logits = plant(torch.randn(9, V).to(torch.bfloat16))
    walk_flat(flat, logits, starts)
    assert walk_flat(flat, logits, starts)[1][0] == 3
    t = time.perf_counter()
    for _ in range(2000):
        walk_flat(flat, logits, starts)
    warm = (time.perf_counter() - t) / 2000
    a = torch.empty(16 * 2**20)
    b = torch.empty_like(a)
    cold = 0.0
    for _ in range(300):
        b.copy_(a)
        t = time.perf_counter()
        walk_flat(flat, logits, starts)
        cold += time.perf_counter() - t
    w, h = torch.randn(V, 576).to(torch.bfloat16), torch.randn(9, 576).to(torch.bfloat16)
    fresh = 0.0
    for _ in range(300):
        b.copy_(a)
        lg = plant(torch.nn.functional.linear(h, w))
        t = time.perf_counter()
        walk_flat(flat, lg, starts)
        fresh += time.perf_counter() - t
    print(f"walk_flat, 4 rows read: warm {warm * 1e6:.1f} us, after a 64 MB copy {cold / 300 * 1e6:.1f} us, "
          f"on fresh lm_head logits after a copy {fresh / 300 * 1e6:.1f} us (torch threads {torch.get_num_threads()})")


if __name__ == "__main__":
    main()
