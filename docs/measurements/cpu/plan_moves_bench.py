"""The tree attention plans and the K/V slot moves on fixed inputs, for an A/B of two source trees
(no engine: median microseconds over --repeats calls, after a warm-up).

* ``cpu_plan``: the runner's ``TreePlan`` (``runner_part``: before, its ancestor masks) and
  ``TreeCPUAttentionImpl._path_plan``, the CPU path rounds of one step (built by the first
  layer, shared by the others): R requests, each an 8-draft GOOSE-like tree (a spine
  of 4 with branches: 3 path rounds), 400 context tokens, blocks of 128;
* ``gpu_plan``: the runner's ``TreePlan`` and the CUDA plan of the same step on the host
  (``gpu_runner.device_plan`` to "cpu");
* ``kv_move``: ``KVMover.move`` of M accepted tokens in 30 layer caches of SmolLM2-135M's shape
  (3 kv heads x 64, bf16, 64 blocks of 128), FLASH_ATTN's layout.

    PYTHONPATH=/tmp/before python docs/measurements/cpu/plan_moves_bench.py
    PYTHONPATH=.           python docs/measurements/cpu/plan_moves_bench.py
"""
import json
import time
from types import SimpleNamespace

import numpy as np
import torch

from vllm_anisotropic.integration.vllm.engine import runner
from vllm_anisotropic.integration.vllm.engine.gpu_runner import device_plan
from vllm_anisotropic.integration.vllm.engine.kv_moves import KVMover
from vllm_anisotropic.integration.vllm.kernels.attention import TreeCPUAttentionImpl
from vllm_anisotropic.tree import DraftTree, FlatTrees

PARENTS = [-1, 0, 1, 2, 3, 0, 1, 2, 5]
BLOCK, CTX = 128, 400


def median_us(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(float(np.median(times)) * 1e6, 1)


def make_plan(trees: FlatTrees, ends, seq):
    """The runner's ``TreePlan`` of the step (what ``_prepare_inputs`` builds for it)."""
    reqs = trees.num_trees
    if "trees" in runner.TreePlan.__dataclass_fields__:  # this tree: the plan holds the step's FlatTrees
        return runner.TreePlan(list(range(reqs)), trees.select(np.arange(reqs)), trees.chain_prefix(), ends, seq)
    # before: per-request masks built by the runner
    return runner.TreePlan(list(range(reqs)), (trees.sizes() - 1).tolist(), runner.node_masks(trees, np.arange(reqs)),
                           trees.chain_prefix().tolist(), ends, seq)


def main(repeats: int = 300) -> None:
    torch.set_num_threads(1)
    impl = TreeCPUAttentionImpl.__new__(TreeCPUAttentionImpl)
    impl.num_heads, impl.num_kv_heads, impl.head_size, impl.kv_cache_dtype = 9, 3, 64, "auto"
    n = len(PARENTS) - 1
    tree = DraftTree(tokens=np.arange(len(PARENTS)), parents=np.array(PARENTS))
    for reqs in (1, 8, 64):
        trees = FlatTrees.from_trees([tree] * reqs)
        ends = list(np.cumsum([n + 1] * reqs))
        seq = [CTX + n] * reqs
        per = -(-max(seq) // BLOCK)
        meta = SimpleNamespace(seq_lens=torch.tensor(seq, dtype=torch.int32),
                               query_start_loc=torch.tensor([0, *ends], dtype=torch.int32),
                               block_table=torch.arange(reqs * per, dtype=torch.int32).view(reqs, per))
        cpu = median_us(lambda: impl._path_plan(make_plan(trees, ends, seq), meta, BLOCK, torch.bfloat16, "vec"),
                        repeats)
        gpu = median_us(lambda: device_plan(make_plan(trees, ends, seq), "cpu"), repeats)
        build = median_us(lambda: make_plan(trees, ends, seq), repeats)  # the runner's part (included in both)
        print(json.dumps({"requests": reqs, "cpu_plan_us": cpu, "gpu_plan_us": gpu, "runner_part_us": build}))
    layers = [SimpleNamespace(kv_cache=torch.zeros(64, 3, BLOCK, 128, dtype=torch.bfloat16)) for _ in range(30)]
    mover = KVMover.from_layers(layers)
    for moves in (1, 4, 16):
        src = torch.arange(103, 103 + moves, dtype=torch.long)
        dst = src - 3
        print(json.dumps({"moved_tokens": moves, "kv_move_us": median_us(lambda: mover.move(src, dst), repeats)}))


if __name__ == "__main__":
    main()
