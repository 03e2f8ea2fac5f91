"""Compiled ranking of a step's trees for the allocator (``kernels.load("rank")``):
``allocator.rank_flat`` in one pass per tree.

Scope: per draft node the acceptance model's calibrated probability
``sigmoid(alpha[s, d] + beta[s, d] logit(v))`` (``allocator.acceptance``: source s, depth bucket
``d = min(depth, max_depth)``, value v clipped to [1e-9, 1 - 1e-9] inside the logit), then the
tree bound of ``allocator.tree_probs.cap_by_tree`` (a node never above its parent minus its
earlier siblings), then each tree's nodes sorted by (-probability, depth, index) -- the root
first, parents before children -- and the bound again in the new sibling order.

Worked example (one tree, parents [-1, 0, 0, 2], raw [-, 0.2, 0.6, 0.5]): capped
[1, 0.2, 0.6, 0.5] (node 2: min(0.6, 1 - 0.2)); order [0, 2, 3, 1]; in the new order the
siblings are (old 2, old 1): old 1's bound becomes 1 - 0.6 = 0.4, still above 0.2.
"""

from __future__ import annotations

import math

import numba
import numpy as np

__all__ = ["rank_trees"]

_jit = numba.njit(cache=True, nogil=True)


@_jit
def _cap(raw, parents, a, n, out, running):
    """The tree bound for nodes a..a+n-1 (local ``parents``), in node order."""
    for i in range(n):
        running[i] = 0.0
    out[a] = 1.0
    for i in range(1, n):
        par = parents[a + i]
        earlier = running[par]
        running[par] = earlier + raw[a + i]
        out[a + i] = min(max(min(raw[a + i], out[a + par] - max(earlier, 0.0)), 0.0), 1.0)


@_jit
def rank_trees(offsets, tokens, parents, sources, values, depths, alpha, beta, max_depth,
               out_order, out_probs, out_tokens, out_parents, out_sources, out_values, out_depths, out_chains):
    """Rank every tree (module docstring). Writes ``out_order [N]`` (the new node order as flat
    indices, each tree in its own range), ``out_probs [N]`` (the probabilities in the new
    order, roots 1) and the ranked trees' node arrays (``out_tokens``, ``out_parents`` local,
    ``out_sources``, ``out_values``, ``out_depths``: ``FlatTrees.permuted(out_order)``'s; a
    tree that keeps its order is copied) and ``out_chains [T]``, each ranked tree's leading
    chain (``FlatTrees.chain_prefix``). Returns whether any tree's order changed."""
    n_all = tokens.shape[0]
    raw = np.empty(n_all, np.float64)
    capped = np.empty(n_all, np.float64)
    running = np.empty(max(n_all, 1), np.float64)
    for g in range(n_all):
        if parents[g] < 0:
            raw[g] = 1.0
            continue
        v = min(max(values[g], 1e-9), 1.0 - 1e-9)
        x = math.log(v) - math.log1p(-v)
        s = sources[g]
        d = min(depths[g], max_depth)
        z = alpha[s, d] + beta[s, d] * x
        if z >= 0:
            raw[g] = 1.0 / (1.0 + math.exp(-z))
        else:
            e = math.exp(z)
            raw[g] = e / (1.0 + e)
    changed = False
    raw2 = np.empty(n_all, np.float64)
    for t in range(offsets.shape[0] - 1):
        a, b = offsets[t], offsets[t + 1]
        n = b - a
        _cap(raw, parents, a, n, capped, running)
        # by (-p, depth, index): stable sorts, last key first; the root (p = inf) first
        idx = np.argsort(depths[a:b], kind="mergesort")
        key = np.empty(n, np.float64)
        for i in range(n):
            key[i] = -np.inf if i == 0 else -capped[a + idx[i]]
        order = idx[np.argsort(key, kind="mergesort")]
        moved = False
        for i in range(n):
            if order[i] != i:
                moved = True
                break
        for i in range(n):
            out_order[a + i] = a + order[i]
        if not moved:
            for i in range(n):
                out_probs[a + i] = capped[a + i]
                out_tokens[a + i] = tokens[a + i]
                out_parents[a + i] = parents[a + i]
                out_sources[a + i] = sources[a + i]
                out_values[a + i] = values[a + i]
                out_depths[a + i] = depths[a + i]
            continue
        changed = True
        inverse = np.empty(n, np.int64)
        for i in range(n):
            inverse[order[i]] = i
        for i in range(n):
            old = order[i]
            out_parents[a + i] = -1 if parents[a + old] < 0 else inverse[parents[a + old]]
            raw2[a + i] = raw[a + old]
            out_tokens[a + i] = tokens[a + old]
            out_sources[a + i] = sources[a + old]
            out_values[a + i] = values[a + old]
            out_depths[a + i] = depths[a + old]
        _cap(raw2, out_parents, a, n, out_probs, running)
    for t in range(offsets.shape[0] - 1):
        a, b = offsets[t], offsets[t + 1]
        c = 0
        while a + c + 1 < b and out_parents[a + c + 1] == c:
            c += 1
        out_chains[t] = c
    return changed
