"""The runner's per-step node rows, positions and leading chains (``_prepare_inputs``'s tree
part) on fixed inputs: the numpy expressions it ran before 2026-12-01 (written out below as
``before``) against the compiled ``kernels.plan.step_rows`` (``after``), both followed by the
positions' scatter, for R requests with GOOSE-like trees of 9 nodes (a chain of 4 and branches).
Median microseconds over --steps calls, interleaved; one thread.

    python docs/measurements/cpu/step_rows_cost_2026_12_01.py
"""
import argparse
import json
import time

import numpy as np
import torch

from vllm_anisotropic import kernels
from vllm_anisotropic.integration.vllm.engine.runner import scatter_tree_positions
from vllm_anisotropic.tree import DraftTree, FlatTrees


def before(trees, ends, positions):
    n = trees.sizes() - 1
    node_rows = ends - n
    total = int(n.sum())
    within = np.arange(total) - np.repeat(np.cumsum(n) - n, n)
    rows = np.repeat(ends - n, n) + within
    nodes = np.stack([rows, np.repeat(ends - n - 1, n), trees.depths[trees.parents >= 0]]).astype(np.int64)
    scatter_tree_positions(positions, nodes)
    chain = trees.chain_prefix()
    return node_rows, np.flatnonzero(chain < n)


def after(trees, ends, positions):
    n = trees.sizes() - 1
    node_rows, chain = np.empty_like(n), np.empty_like(n)
    nodes = np.empty((3, trees.num_nodes - trees.num_trees), np.int64)
    kernels.load("plan").step_rows(trees.offsets, trees.parents, trees.depths, ends, node_rows, nodes, chain)
    scatter_tree_positions(positions, nodes)
    return node_rows, np.flatnonzero(chain < n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", default="1,8,64")
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tree = DraftTree(list(range(9)), [-1, 0, 1, 2, 3, 0, 1, 5, 2])
    for num in (int(x) for x in args.requests.split(",")):
        trees = FlatTrees.from_trees([tree] * num)
        ends = np.cumsum(np.full(num, 9, np.int64))
        positions = torch.arange(int(ends[-1]) + 1)
        a, b = before(trees, ends, positions.clone()), after(trees, ends, positions.clone())
        assert all((x == y).all() for x, y in zip(a, b))
        times = {"before": [], "after": []}
        for _ in range(args.steps):
            for name, f in (("before", before), ("after", after)):
                t0 = time.perf_counter()
                f(trees, ends, positions)
                times[name].append(time.perf_counter() - t0)
        print(json.dumps({"requests": num, **{k: round(float(np.median(v)) * 1e6, 1) for k, v in times.items()}}))


if __name__ == "__main__":
    main()
