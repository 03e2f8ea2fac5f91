"""Shared tree-building helper: grow nodes in any order, emit a ``DraftTree`` in value order.

Scope: bookkeeping only (no drafting policy). ``TreeBuilder.finish`` sorts nodes by value
descending, ties by depth then build order. Every proposer here gives a child a value <= its
parent's (products of probabilities), so the sort keeps parents before children and any prefix
of the result is a valid subtree. Example: built order root, a (0.2), b (0.6), a's child
c (0.1) -> value order root, b, a, c with parents [-1, 0, 0, 2].
"""

from __future__ import annotations

import numpy as np

from vllm_anisotropic.tree import DraftTree, NodeSource

__all__ = ["TreeBuilder"]


class TreeBuilder:
    """Growable node lists; ``finish`` sorts into value order."""

    def __init__(self, root_token: int) -> None:
        self.tokens = [int(root_token)]
        self.parents = [-1]
        self.sources = [int(NodeSource.ROOT)]
        self.values = [1.0]
        self.depths = [0]
        self.branch_depths = [0]  # depth below the branching node (0 for root and spine)

    def add(self, parent: int, token: int, source: NodeSource, value: float, branch_depth: int) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.sources.append(int(source))
        self.values.append(float(value))
        self.depths.append(self.depths[parent] + 1)
        self.branch_depths.append(int(branch_depth))
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def finish(self) -> DraftTree:
        n = len(self.tokens)
        # value order: value desc, then depth asc (parent first on ties), then build order
        order = sorted(range(n), key=lambda i: (-self.values[i], self.depths[i], i))
        assert order[0] == 0
        new_index = np.empty(n, np.int64)
        new_index[order] = np.arange(n)
        parents = np.array([-1 if self.parents[i] < 0 else new_index[self.parents[i]] for i in order], np.int64)
        return DraftTree(
            tokens=np.array([self.tokens[i] for i in order], np.int64),
            parents=parents,
            sources=np.array([self.sources[i] for i in order], np.int8),
            values=np.array([self.values[i] for i in order], np.float64),
        )
