"""The reference GOOSE tree builder: Algorithm 1 as plain Python over a successor function.

The per-node implementation the engine used before the compiled kernel
(``vllm_anisotropic.kernels.goose``); kept as the oracle the kernel is tested against
(``tests/test_kernels_goose.py``), with ``proposers.treebuild.TreeBuilder`` for the value order.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable

import numpy as np

from vllm_anisotropic.proposers.goose import harmonic_allocation
from vllm_anisotropic.proposers.treebuild import TreeBuilder
from vllm_anisotropic.tree import DraftTree, NodeSource

SuccessorFn = Callable[[int, int], tuple[np.ndarray, np.ndarray]]  # (prev, token) -> (ids, scores)

def _filtered(successors: SuccessorFn, prev: int, token: int, min_score: float, exclude: int) -> list[tuple[int, float]]:
    ids, scores = successors(int(prev), int(token))
    return [(int(t), float(s)) for t, s in zip(ids, scores) if s >= min_score and s > 0.0 and int(t) != exclude]


def build_spine_tree(
    root_token: int,
    prev_token: int,
    spine: np.ndarray,
    successors: SuccessorFn,
    *,
    budget: int = 60,
    max_depth: int = 6,
    spine_ratio: float = 0.3,
    spine_branch_ratio: float = 0.5,
    min_branch_score: float = 0.01,
    spine_acceptance: float = 0.3,
    spine_branches: bool = True,
) -> DraftTree:
    """The Python reference of ``kernels.goose.build_trees`` (the pre-kernel implementation)."""
    spine = np.asarray(spine, np.int64).reshape(-1)
    builder = TreeBuilder(root_token)
    draft_budget = int(budget) - 1
    if draft_budget <= 0:
        return builder.finish()
    v = min(max(float(spine_acceptance), 1e-3), 1.0)

    # line 1-3: split the budget
    b_s = min(len(spine), int(math.floor(budget * spine_ratio)), draft_budget)
    rest = draft_budget - b_s
    if spine_branches:
        b_r = int(math.ceil(rest * (1.0 - spine_branch_ratio)))
        b_sigma = rest - b_r
    else:
        b_r, b_sigma = rest, 0

    # lines 4-7: lay the spine; spine_nodes[i] = node of d_i (spine_nodes[0] = root)
    spine_nodes = [0]
    for i in range(b_s):
        spine_nodes.append(builder.add(spine_nodes[-1], spine[i], NodeSource.SPINE, v ** (i + 1), 0))

    def next_spine(i: int) -> int:  # the spine child of spine node i (excluded as a duplicate)
        return int(spine[i]) if i < b_s else -1

    # lines 8-12: first-level branches (root: b_r, spine node i: a_i harmonic), best first
    heap: list[tuple[float, int, int, int]] = []  # (-value, tie, node, next candidate rank)
    cand: dict[int, list[tuple[int, float]]] = {}
    tie = 0

    def push_children(node: int) -> None:
        nonlocal tie
        if builder.branch_depths[node] >= max_depth:
            return
        prev = builder.tokens[builder.parents[node]] if node > 0 else prev_token
        cand[node] = _filtered(successors, prev, builder.tokens[node], min_branch_score, -1)
        if cand[node]:
            heapq.heappush(heap, (-builder.values[node] * cand[node][0][1], tie, node, 0))
            tie += 1

    allocations = [b_r] + harmonic_allocation(b_sigma, b_s)
    for i, width in enumerate(allocations):  # i = 0: root, i >= 1: spine node d_i
        if width <= 0:
            continue
        node = spine_nodes[i]
        prev = prev_token if i == 0 else builder.tokens[spine_nodes[i - 1]]
        for tok, score in _filtered(successors, prev, builder.tokens[node], min_branch_score, next_spine(i))[:width]:
            if len(builder) - 1 >= draft_budget:
                break
            child = builder.add(node, tok, NodeSource.BRANCH, builder.values[node] * score, 1)
            push_children(child)

    # line 13: extend branch leaves through the table, best path value first, depth <= D
    while heap and len(builder) - 1 < draft_budget:
        _, _, node, rank = heapq.heappop(heap)
        tok, score = cand[node][rank]
        child = builder.add(node, tok, NodeSource.BRANCH, builder.values[node] * score, builder.branch_depths[node] + 1)
        if rank + 1 < len(cand[node]):
            heapq.heappush(heap, (-builder.values[node] * cand[node][rank + 1][1], tie, node, rank + 1))
            tie += 1
        push_children(child)
    return builder.finish()
