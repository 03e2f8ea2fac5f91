"""From ``DraftTree`` objects to the allocator's per-request probability lists, and back.

Scope: glue between the one tree type and the allocator's flat arrays: calibrated node
probabilities for a batch of trees (one vectorised ``AcceptanceModel.predict`` call over every
node of every tree, then the tree constraint below), the labels the emitted tokens feed back to
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

from ..tree import DraftTree, FlatTrees
from .acceptance import AcceptanceModel

__all__ = ["cap_by_tree", "capped", "continuation_labels", "cut_trees", "flat_continuation_labels",
           "order_by_probability", "rank_flat", "rank_trees", "raw_probs", "tree_probs"]


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
    # [k] sum of earlier siblings; >= 0 (the difference of two running sums can round below 0,
    # and a child must never come out above its parent: order_by_probability relies on it)
    before = np.maximum(csum - vals - (csum[group_first] - vals[group_first]), 0.0)
    earlier = np.zeros(n)
    earlier[order] = before
    for d in range(1, int(depths.max()) + 1):
        lvl = idx[depths[idx] == d]
        p[lvl] = np.clip(np.minimum(p[lvl], p[parents[lvl]] - earlier[lvl]), 0.0, 1.0)
    return p


def tree_probs(trees: Sequence[DraftTree], model: AcceptanceModel) -> list[np.ndarray]:
    """Per-request calibrated P(node on the accepted path), value order, root excluded.

    Returns ``[tree.num_nodes - 1]`` arrays, the allocator's ``probs``. One ``predict`` over
    the concatenated nodes of all trees (``raw_probs``), then ``cap_by_tree`` (``capped``).
    """
    return capped(trees, raw_probs(trees, model))


def raw_probs(trees: Sequence[DraftTree], model: AcceptanceModel) -> list[np.ndarray]:
    """Per tree, the acceptance model's P(on path) of each draft node before the tree bound,
    ``[tree.num_nodes - 1]``, from one ``predict`` over every node of every tree. A node's raw
    probability depends on its own source, depth and value only, so it moves with the node when
    a tree is reordered (``raw[order[1:] - 1]``) while its capped one does not."""
    if not trees:
        return []
    counts = np.array([t.num_nodes - 1 for t in trees], np.int64)
    sources = np.concatenate([t.sources[1:] for t in trees])  # node 0 is the root
    depths = np.concatenate([t.depths[1:] for t in trees])
    values = np.concatenate([t.values[1:] for t in trees])
    raw = model.predict(sources, depths, np.clip(values, 0.0, 1.0)) if sources.size else np.zeros(0)
    return np.split(np.asarray(raw, np.float64), np.cumsum(counts)[:-1])


def capped(trees: Sequence[DraftTree], raw: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``cap_by_tree`` of every tree's raw draft-node probabilities (``raw_probs``), in one
    pass over the concatenated trees; same shapes as ``raw``."""
    if not trees:
        return []
    counts = np.array([t.num_nodes for t in trees], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])  # [batch_size] global index of each root
    parents = np.concatenate([t.parents for t in trees])  # [num_nodes] local parents
    parents = np.where(parents >= 0, parents + np.repeat(offsets, counts), -1)
    depths = np.concatenate([t.depths for t in trees])
    full = np.ones(parents.shape[0])
    full[parents >= 0] = np.concatenate([np.asarray(r, np.float64) for r in raw])
    p = cap_by_tree(full, parents, depths)
    return [p[o + 1: o + c] for o, c in zip(offsets, counts)]


def continuation_labels(trees: Sequence[DraftTree], continuations: Sequence[np.ndarray]):
    """Labels of every draft node of every tree from the tokens that followed its root.

    ``continuations[k]``: the tokens the request emitted after tree k's root, in order (from
    this step's verification and the later ones). Node i is *on the path* when those tokens
    begin with node i's root-to-node path. Only nodes with ``depth <= len(continuation)`` are
    labelled. Returns flat ``(sources, depths, values, labels)`` over the labelled nodes, ready
    for ``AcceptanceModel.update``.

    Why this is the label the allocator needs, for *every* proposed node and not only the
    verified ones: for a verified node it is the verifier's own label (the greedy walk accepts
    exactly the path that agrees with the emitted argmax tokens; a one-hot SpecInfer walk can
    only emit a rejected child's token from a residual that excludes it). For a node the
    allocator cut, it is what verifying it would have said: under greedy decoding exactly, and
    under a lossless sampling verifier in law, because the emitted tokens follow the target's
    law whatever was verified. Learning only from verified nodes traps the model: nodes it
    under-rates are cut, so it never sees them accepted.

    ``tokens [r, 5, 9, 7]``, parents ``[-1, 0, 0, 1]``, continuation ``[5, 7, 2]`` ->
    labels ``[True, False, True]``; continuation ``[5]`` labels nodes 1 and 2 only.
    """
    if len(trees) == 0:
        empty = np.zeros(0)
        return empty.astype(np.int8), empty.astype(np.int64), empty, empty.astype(bool)
    lengths = np.fromiter((len(c) for c in continuations), np.int64, len(continuations))
    if lengths.shape[0] != len(trees):
        raise ValueError("one continuation per tree")
    flat = np.concatenate([np.asarray(c, np.int64).reshape(-1) for c in continuations])
    return flat_continuation_labels(FlatTrees.from_trees(list(trees)), flat, lengths)


def flat_continuation_labels(trees: FlatTrees, continuations: np.ndarray, lengths: np.ndarray):
    """``continuation_labels`` of a batch of trees: tree k's continuation is
    ``continuations[sum(lengths[:k]) : sum(lengths[:k + 1])]`` (one flat array for the batch,
    as the engine gathers it from its token rows in one indexing). Same return."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.shape != (trees.num_trees,):
        raise ValueError("one continuation per tree")
    if trees.num_trees == 0:
        empty = np.zeros(0)
        return empty.astype(np.int8), empty.astype(np.int64), empty, empty.astype(bool)
    tree_of = trees.tree_index()
    parents = trees.global_parents()
    depths = trees.depths
    flat = np.concatenate([np.asarray(continuations, np.int64).reshape(-1), np.zeros(1, np.int64)])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    known = depths <= lengths[tree_of]  # roots (depth 0) included
    draft = parents >= 0
    expected = flat[np.where(known & draft, starts[tree_of] + depths - 1, len(flat) - 1)]
    on_path = ~draft | (known & (trees.tokens == expected))
    for d in range(2, int(depths[known].max(initial=0)) + 1):  # a node is on the path only if its parent is
        lvl = np.flatnonzero((depths == d) & known)
        on_path[lvl] &= on_path[parents[lvl]]
    keep = known & draft
    values = np.clip(trees.values, 0.0, 1.0)
    return trees.sources[keep], depths[keep], values[keep], on_path[keep]


def order_by_probability(tree: DraftTree, probs: np.ndarray) -> np.ndarray:
    """A node order for ``tree`` (root first) by descending probability of being on the path.

    ``probs`` [num_nodes - 1]: ``tree_probs`` of the tree's draft nodes, which never exceed
    their parent's (``cap_by_tree``), so sorting by (-probability, depth, current index) lists
    every parent before its children. A prefix cut of the reordered tree then keeps the nodes
    the acceptance model rates highest (the proposer's own values may rank them otherwise, e.g.
    GOOSE values spine node i at ``p_s ** i`` with ``p_s`` a per-request rate). ``probs
    [0.2, 0.6, 0.5]``, parents ``[-1, 0, 0, 2]`` -> ``[0, 2, 3, 1]``.
    """
    n = tree.num_nodes
    p = np.concatenate([[np.inf], np.asarray(probs, np.float64)])
    if p.shape != (n,):
        raise ValueError(f"need {n - 1} probabilities, got {p.shape[0] - 1}")
    return np.lexsort((np.arange(n), tree.depths, -p))


def rank_trees(trees: Sequence[DraftTree], model: AcceptanceModel) -> tuple[list[DraftTree], list[np.ndarray]]:
    """Each tree reordered by its calibrated probabilities (``order_by_probability``), and those
    probabilities in the new order: ``(trees, probs)``, the drafter's offer to the allocator.

    One acceptance-model call (``raw_probs``): a node's raw probability moves with the node,
    and only the tree bound (``capped``), which depends on the order of siblings, is computed
    again for the trees whose order changed. Equal to ``tree_probs`` of the returned trees.
    """
    raw = raw_probs(trees, model)
    out, probs, moved = list(trees), capped(trees, raw), []
    for k, (tree, r, p) in enumerate(zip(trees, raw, probs)):
        order = order_by_probability(tree, p)
        if np.any(order != np.arange(tree.num_nodes)):
            out[k] = tree.reordered(order)
            moved.append((k, r[order[1:] - 1]))
    if moved:  # the sibling bound depends on the order: recompute it for the reordered trees
        again = capped([out[k] for k, _ in moved], [r for _, r in moved])
        for (k, _), p in zip(moved, again):
            probs[k] = p
    return out, probs


def rank_flat(trees: FlatTrees, model: AcceptanceModel) -> tuple[FlatTrees, np.ndarray]:
    """``rank_trees`` for a flat batch in one compiled pass (``kernels.rank``): the acceptance
    model's probability of every draft node, the tree bound (``cap_by_tree``), each tree's nodes
    sorted by (-probability, depth, index) (roots first), the bound again in the new sibling
    order. Returns the reordered trees and ``[num_nodes]`` probabilities (roots 1): the trees and
    probabilities of ``rank_trees`` one tree at a time (to rounding)."""
    from vllm_anisotropic import kernels

    n = trees.num_nodes
    alpha, beta = model.parameters()
    order = np.empty(n, np.int64)
    probs = np.empty(n, np.float64)
    ranked = (np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, trees.sources.dtype), np.empty(n, np.float64),
              np.empty(n, np.int64))
    chains = np.empty(trees.num_trees, np.int64)
    changed = kernels.load("rank").rank_trees(
        trees.offsets, trees.tokens, trees.parents, trees.sources, trees.values, trees.depths,
        alpha, beta, int(model.config.max_depth), order, probs, *ranked, chains)
    if not changed:
        out = trees
    elif trees.multiplicity is None and trees.draft_probs is None:
        out = FlatTrees(trees.offsets, *ranked)  # the kernel's node arrays: permuted(order)'s
    else:
        out = trees.permuted(order)
    out.__dict__["_chain_lens"] = chains  # chain_prefix() of the ranked trees, known here
    return out, probs


def cut_trees(trees: Sequence[DraftTree], cuts) -> list[DraftTree]:
    """``tree.truncate(1 + n_i)`` per request (value order: every prefix is a subtree)."""
    cuts = np.asarray(cuts, np.int64)
    if cuts.shape != (len(trees),):
        raise ValueError("one cut per tree")
    return [t.truncate(1 + int(n)) for t, n in zip(trees, cuts)]
