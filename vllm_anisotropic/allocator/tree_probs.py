"""From ``DraftTree`` objects to the allocator's per-request probability lists, and back.

Scope: glue between the one tree type and the allocator's flat arrays: calibrated node
probabilities for a batch of trees (one vectorised ``AcceptanceModel.predict`` call over every
node of every tree, then the tree constraint below), the labels a verified step feeds back to
the acceptance model, and the cuts applied to the trees. No allocation logic here.

The tree constraint (exact, not a model): at most one child of a node is on the accepted path,
and only if the node is, so for siblings c_1, c_2, ... of parent u in value order

    P(c_j on path) <= P(u on path) - sum_{l < j} P(c_l on path)

We cap each calibrated probability by that bound, level by level from the root (the root is on
the path with probability 1). Using the raw sums of the earlier siblings gives the same result
as capping sequentially (a sibling is only lowered once the running sum reaches the parent, and
every later one is then 0). Because the bound only looks at parents and *earlier* siblings, the
capped list is consistent with every prefix cut. It also makes a low probability at a gating
depth cap the whole subtree below it (ECHO arXiv 2604.09603, Sec. 3.2: truncate at the gate).

Worked example: parents [-1, 0, 0, 1], raw calibrated [-, 0.7, 0.5, 0.9] (root excluded)
-> node 1: min(0.7, 1 - 0) = 0.7; node 2: min(0.5, 1 - 0.7) = 0.3; node 3: min(0.9, 0.7) = 0.7.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..tree import DraftTree
from .acceptance import AcceptanceModel

__all__ = ["accepted_path_labels", "cap_by_tree", "cut_trees", "tree_probs"]


def cap_by_tree(raw: np.ndarray, parents: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """Apply the sibling/parent bound (module docstring) to flat arrays of many trees.

    ``raw`` [num_nodes] probabilities (roots' entries are ignored, set to 1); ``parents``
    [num_nodes] *global* parent index, -1 for roots; ``depths`` [num_nodes]. Nodes must be in
    parent-before-child order within each tree. Loops over depth levels only.
    ``raw [1, .7, .5, .9], parents [-1, 0, 0, 1], depths [0, 1, 1, 2] -> [1, .7, .3, .7]``.
    """
    n = raw.shape[0]
    assert parents.shape == (n,) and depths.shape == (n,)
    p = np.where(parents < 0, 1.0, np.asarray(raw, np.float64))
    idx = np.flatnonzero(parents >= 0)
    if idx.size == 0:
        return p
    # exclusive cumulative sum of raw probabilities over earlier siblings (same parent, lower index)
    order = idx[np.lexsort((idx, parents[idx]))]  # grouped by parent, value order inside
    vals = p[order]
    csum = np.cumsum(vals)
    par = parents[order]
    start = np.ones(order.size, bool)
    start[1:] = par[1:] != par[:-1]
    group_first = np.maximum.accumulate(np.where(start, np.arange(order.size), 0))  # [k] first slot of k's group
    before = csum - vals - (csum[group_first] - vals[group_first])  # [k] sum of earlier siblings
    earlier = np.zeros(n)
    earlier[order] = before
    for d in range(1, int(depths.max()) + 1):
        lvl = idx[depths[idx] == d]
        p[lvl] = np.clip(np.minimum(p[lvl], p[parents[lvl]] - earlier[lvl]), 0.0, 1.0)
    return p


def tree_probs(trees: Sequence[DraftTree], model: AcceptanceModel) -> list[np.ndarray]:
    """Per-request calibrated P(node on the accepted path), value order, root excluded.

    Returns ``[tree.num_nodes - 1]`` arrays, the allocator's ``probs``. One ``predict`` over
    the concatenated nodes of all trees, then ``cap_by_tree``.
    """
    if not trees:
        return []
    counts = np.array([t.num_nodes for t in trees], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])  # [batch_size] global index of each root
    parents = np.concatenate([t.parents for t in trees])  # [num_nodes] local parents
    parents = np.where(parents >= 0, parents + np.repeat(offsets, counts), -1)
    depths = np.concatenate([t.depths for t in trees])
    sources = np.concatenate([t.sources for t in trees])
    values = np.concatenate([t.values for t in trees])
    drafts = parents >= 0
    raw = np.ones(parents.shape[0])
    if drafts.any():
        raw[drafts] = model.predict(sources[drafts], depths[drafts], np.clip(values[drafts], 0.0, 1.0))
    p = cap_by_tree(raw, parents, depths)
    return [p[o + 1: o + c] for o, c in zip(offsets, counts)]


def accepted_path_labels(tree: DraftTree, last_accepted: int) -> np.ndarray:
    """[num_nodes - 1] bool: node k (k >= 1) is on the accepted path root -> ``last_accepted``.

    ``last_accepted = 0`` means no draft was accepted (all False).
    ``parents [-1, 0, 1, 0], last_accepted 2 -> [True, True, False]``.
    """
    labels = np.zeros(tree.num_nodes, bool)
    labels[tree.path_to(int(last_accepted))] = True
    return labels[1:]


def cut_trees(trees: Sequence[DraftTree], cuts) -> list[DraftTree]:
    """``tree.truncate(1 + n_i)`` per request (value order: every prefix is a subtree)."""
    cuts = np.asarray(cuts, np.int64)
    if cuts.shape != (len(trees),):
        raise ValueError("one cut per tree")
    return [t.truncate(1 + int(n)) for t, n in zip(trees, cuts)]
