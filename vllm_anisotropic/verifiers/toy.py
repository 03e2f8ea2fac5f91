"""Synthetic target/draft "models" and draft-tree samplers for exactness tests and benchmarks.

Scope: a model is a fixed table prefix -> distribution over V tokens (a stable hash of the
prefix seeds the row), so the target's sequential law is known exactly. A draft model mixes
the target with an independent table, the mixing weight growing with depth (draft/target
divergence grows deeper in the tree, arXiv 2602.16994 Figure 1). Tree samplers build chains,
i.i.d. multi-path trees, delayed trees (arXiv 2602.16994 Def. 5.2) and deterministic top-k trees;
``enumerate_*`` list every draft tree with its exact probability.
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import torch

from vllm_anisotropic.tree import DraftTree, NodeSource

__all__ = ["TableModel", "DraftTable", "tree_rows", "sample_iid_paths", "enumerate_iid_paths", "topk_tree"]


class TableModel:
    """prefix (tuple of tokens) -> logits [V]; deterministic in (seed, prefix)."""

    def __init__(self, vocab_size: int, seed: int, sharpness: float = 1.5) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self.sharpness = sharpness
        self._cache: dict[tuple, np.ndarray] = {}

    def logits(self, prefix: tuple) -> np.ndarray:
        if prefix not in self._cache:
            h = zlib.crc32(np.asarray(prefix, np.int64).tobytes()) ^ (self.seed * 0x9E3779B1 & 0xFFFFFFFF)
            rng = np.random.default_rng(h)
            self._cache[prefix] = rng.standard_normal(self.vocab_size) * self.sharpness
        return self._cache[prefix]

    def probs(self, prefix: tuple) -> np.ndarray:
        z = self.logits(prefix)
        e = np.exp(z - z.max())
        return e / e.sum()


class DraftTable:
    """q(. | prefix) = (1 - lam_d) p(. | prefix) + lam_d r(. | prefix), lam_d = min(1, lam0 + slope d)."""

    def __init__(self, target: TableModel, seed: int, lam0: float = 0.3, slope: float = 0.15) -> None:
        self.target = target
        self.noise = TableModel(target.vocab_size, seed, target.sharpness)
        self.lam0, self.slope = lam0, slope

    def probs(self, prefix: tuple, root_len: int = 1) -> np.ndarray:
        lam = min(1.0, self.lam0 + self.slope * max(0, len(prefix) - root_len))
        return (1 - lam) * self.target.probs(prefix) + lam * self.noise.probs(prefix)


def tree_rows(tree: DraftTree, prefix: tuple, target: TableModel, draft: DraftTable | None = None):
    """(target logits [num_nodes, V] float64, draft probs [num_nodes, V] or None) for a tree
    rooted after ``prefix`` (prefix ends with the root token)."""
    paths = [prefix + tuple(int(tree.tokens[n]) for n in tree.path_to(i)) for i in range(tree.num_nodes)]
    logits = torch.tensor(np.stack([target.logits(pp) for pp in paths]), dtype=torch.float64)
    q = None
    if draft is not None:
        q = torch.tensor(np.stack([draft.probs(pp, len(prefix)) for pp in paths]), dtype=torch.float64)
    return logits, q


def sample_iid_paths(draft: DraftTable, prefix: tuple, k: int, l1: int, l2: int, rng: np.random.Generator):
    """Delayed tree (arXiv 2602.16994 Def. 5.2): a trunk of l1 tokens ~ q, then k i.i.d. branches of
    l2 tokens. l1 = 0 gives the i.i.d. multi-path tree, k = 1 a chain. Returns token paths."""
    v = draft.target.vocab_size
    trunk: list[int] = []
    for _ in range(l1):
        trunk.append(int(rng.choice(v, p=draft.probs(prefix + tuple(trunk), len(prefix)))))
    paths = []
    for _ in range(k):
        br = list(trunk)
        for _ in range(l2):
            br.append(int(rng.choice(v, p=draft.probs(prefix + tuple(br), len(prefix)))))
        paths.append(br)
    return paths


def enumerate_iid_paths(draft: DraftTable, prefix: tuple, k: int, l1: int, l2: int):
    """Every delayed tree (as token paths, trunk shared) with its exact probability."""
    v = draft.target.vocab_size

    def seqs(start: tuple, length: int):
        for toks in itertools.product(range(v), repeat=length):
            pr, cur = 1.0, start
            for t in toks:
                pr *= draft.probs(cur, len(prefix))[t]
                cur = cur + (t,)
            yield list(toks), pr

    for trunk, pt in seqs(prefix, l1):
        branches = list(seqs(prefix + tuple(trunk), l2))
        for combo in itertools.product(branches, repeat=k):
            pr = pt
            for _, pb in combo:
                pr *= pb
            yield [trunk + b for b, _ in combo], pr


def paths_to_tree(paths, root_token: int, l1: int) -> DraftTree:
    """Unmerged tree from paths sharing a trunk of length l1 (the trunk is stored once)."""
    tokens, parents = [root_token], [-1]
    parent = 0
    for t in paths[0][:l1]:
        tokens.append(int(t))
        parents.append(parent)
        parent = len(tokens) - 1
    branch_root = parent
    for path in paths:
        parent = branch_root
        for t in path[l1:]:
            tokens.append(int(t))
            parents.append(parent)
            parent = len(tokens) - 1
    src = [NodeSource.ROOT] + [NodeSource.DRAFT] * (len(tokens) - 1)
    return DraftTree(tokens=tokens, parents=parents, sources=src)


def topk_tree(target: TableModel, prefix: tuple, width: int, depth: int, spine: list[int] | None = None) -> DraftTree:
    """Deterministic tree: an optional SPINE chain, plus the top-``width`` tokens of a proxy
    table at every node as BRANCH children (duplicates of spine tokens allowed, so source
    priority matters), up to ``depth``."""
    proxy = TableModel(target.vocab_size, target.seed + 7, target.sharpness)
    tokens, parents, src = [prefix[-1]], [-1], [NodeSource.ROOT]
    frontier = [(0, prefix)]
    if spine:
        par, pre = 0, prefix
        for t in spine:
            tokens.append(int(t))
            parents.append(par)
            src.append(NodeSource.SPINE)
            par, pre = len(tokens) - 1, pre + (int(t),)
    for _ in range(depth):
        nxt = []
        for node, pre in frontier:
            top = np.argsort(-proxy.probs(pre), kind="stable")[:width]
            for t in top:
                tokens.append(int(t))
                parents.append(node)
                src.append(NodeSource.BRANCH)
                nxt.append((len(tokens) - 1, pre + (int(t),)))
        frontier = nxt
    return DraftTree(tokens=tokens, parents=parents, sources=src)
