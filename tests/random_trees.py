"""Random draft trees for the tests that check a batched kernel against its definitions."""

from __future__ import annotations

import numpy as np

from vllm_anisotropic.tree import DraftTree, NodeSource


def random_trees(rng: np.random.Generator, chain: float = 0.5, sources: bool = False, vocab: int = 50) -> list[DraftTree]:
    """1-5 trees of 1-9 nodes: each node's parent is the node before it with probability
    ``chain`` (long leading chains), else any earlier node; with ``sources``, random non-root
    source codes (else the default ones)."""
    out = []
    for _ in range(int(rng.integers(1, 6))):
        n = int(rng.integers(1, 10))
        parents = [-1] + [i - 1 if rng.random() < chain else int(rng.integers(0, i)) for i in range(1, n)]
        src = None
        if sources:
            src = [NodeSource.ROOT] + [NodeSource(int(rng.integers(1, len(NodeSource)))) for _ in range(n - 1)]
        out.append(DraftTree(tokens=rng.integers(0, vocab, n), parents=parents, sources=src))
    return out


def random_paths(rng: np.random.Generator, trees: list[DraftTree]) -> list[list[int]]:
    """Each tree's accepted path: the root-to-node path (root excluded) of a random node."""
    return [t.path_to(int(rng.integers(0, len(t.tokens)))) for t in trees]
