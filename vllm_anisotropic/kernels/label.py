"""The label queue's two passes in one compiled call each (``integration/vllm/engine/labels.py``).

The queue holds the offered trees waiting for their labels as two flat stores: per tree a row of
``trees [capacity, 5]`` int64 (``TREE_*`` columns: its first node in the node store, its size,
its request's id, the tokens the request had when it was proposed, the tokens after the root it
needs), per node a row of ``nodes [capacity, 4]`` int64 (``NODE_*``: token, local parent, depth,
source) and ``values [capacity]`` float64. ``queue_trees`` appends a proposal's offered trees;
``take_labels`` labels every queued tree whose tokens are known, straight into the acceptance
model's three histograms (``allocator.AcceptanceModel``: the keys of its ``_keys``, the labels
of ``allocator.flat_continuation_labels``), and compacts the trees that still wait to the front
of both stores.

Worked example (label depth 8, the histograms' key omitted): a queued tree of request 0 proposed
at 10 tokens, nodes ``tokens [1, 8, 9]``, ``parents [-1, 0, 0]`` (needs 1 token); the request's
row holds token 9 at column 10 and 11 tokens: node 1 (token 8) is labelled not accepted, node 2
(token 9) accepted, and the queue is empty after.
"""

from __future__ import annotations

import math

import numba
import numpy as np

__all__ = ["NODE_COLUMNS", "TREE_COLUMNS", "queue_trees", "take_labels"]

_jit = numba.njit(cache=True, nogil=True)

# columns of the queue's ``trees`` store
TREE_FIRST, TREE_SIZE, TREE_REQUEST, TREE_START, TREE_NEED = range(5)
TREE_COLUMNS = 5
# columns of the queue's ``nodes`` store
NODE_TOKEN, NODE_PARENT, NODE_DEPTH, NODE_SOURCE = range(4)
NODE_COLUMNS = 4

_EPS = 1e-9  # the acceptance model's logit clip (allocator.acceptance.logit)


@_jit
def queue_trees(offsets, tokens, parents, depths, sources, values, index, requests, starts, label_depth,
                trees, num_trees, nodes, node_values, num_nodes, waiting):
    """Append trees ``index`` of a flat batch (``tree.FlatTrees``'s arrays) to the queue's stores
    after its ``num_trees`` trees and ``num_nodes`` nodes (the caller made room), tree k of
    ``index`` for request id ``requests[k]`` proposed at ``starts[k]`` tokens; each needs
    ``min(its deepest depth, label_depth)`` tokens after its root. ``waiting[id]`` counts the
    request's queued trees. ``index``: distinct trees, in range (the caller's room for the nodes
    is the whole batch's). Returns the node count after."""
    t = num_trees
    n = num_nodes
    for k in range(index.shape[0]):
        tree = index[k]
        first = offsets[tree]
        size = offsets[tree + 1] - first
        deepest = 0
        for j in range(size):
            src = first + j
            nodes[n + j, NODE_TOKEN] = tokens[src]
            nodes[n + j, NODE_PARENT] = parents[src]
            nodes[n + j, NODE_DEPTH] = depths[src]
            nodes[n + j, NODE_SOURCE] = sources[src]
            node_values[n + j] = values[src]
            deepest = max(deepest, depths[src])
        trees[t, TREE_FIRST] = n
        trees[t, TREE_SIZE] = size
        trees[t, TREE_REQUEST] = requests[k]
        trees[t, TREE_START] = starts[k]
        trees[t, TREE_NEED] = min(deepest, label_depth)
        waiting[requests[k]] += 1
        t += 1
        n += size
    return n


@_jit
def take_labels(trees, num_trees, nodes, node_values, batch_requests, num_tokens, token_ids, waiting,
                logit_min, logit_max, num_sources, max_depth, num_bins):
    """Label every queued tree whose request is in the batch (``batch_requests [rows]``: each
    batch row's request id, -1 for none; ``num_tokens [rows]``, ``token_ids [rows, max_len]``
    its row) and has ``need`` tokens after the tree's start, in queue order: a draft node at
    depth ``d <= need`` is accepted when its token is the row's ``start + d - 1``-th and its
    parent's is accepted (the root is); ``waiting[id]`` counts it off. Trees of requests with
    ``waiting[id]`` -1 (dropped) go unlabelled; the others wait, moved to the front of the stores.

    Returns ``(trees left, nodes left, any tree labelled, bad nodes, histograms)``: ``histograms
    [3, num_sources, max_depth + 1, num_bins]`` the labelled nodes' counts, accepted counts and
    sums of logit(value) by (source, depth bucket, logit bin), each node's value clipped to [0, 1]
    first (``AcceptanceModel._keys``); ``bad nodes`` the labelled nodes whose source is not a
    draft source, whose value is NaN or whose depth is below 1 (left out; the model's ``_keys``
    refuses them), and the ready trees whose tokens run past their row (a caller's bug)."""
    hist = np.zeros((3, num_sources, max_depth + 1, num_bins))
    row_of = np.full(waiting.shape[0], -1, np.int64)
    for i in range(batch_requests.shape[0]):
        r = batch_requests[i]
        if r >= 0:
            row_of[r] = i
    width = (logit_max - logit_min)
    bad = 0
    labelled = False
    kept = 0
    kept_nodes = 0
    on_path = np.zeros(64, np.bool_)
    for t in range(num_trees):
        first = trees[t, TREE_FIRST]
        size = trees[t, TREE_SIZE]
        req = trees[t, TREE_REQUEST]
        start = trees[t, TREE_START]
        need = trees[t, TREE_NEED]
        if waiting[req] < 0:
            continue
        row = row_of[req]
        if row >= 0 and num_tokens[row] - start >= need:
            labelled = True
            waiting[req] -= 1
            if start + need > token_ids.shape[1]:
                bad += 1  # tokens past the request's row: a caller's bug
                continue
            if on_path.shape[0] < size:
                on_path = np.zeros(2 * size, np.bool_)
            on_path[0] = True
            for j in range(1, size):
                node = first + j
                d = nodes[node, NODE_DEPTH]
                if d > need:
                    continue  # (nor is any node below it: on_path[j] is never read)
                s = nodes[node, NODE_SOURCE]
                v = node_values[node]
                if d < 1 or s <= 0 or s >= num_sources or v != v:
                    bad += 1
                    continue
                on_path[j] = on_path[nodes[node, NODE_PARENT]] and nodes[node, NODE_TOKEN] == token_ids[row, start + d - 1]
                v = min(max(v, _EPS), 1.0 - _EPS)  # (the clip to [0, 1] first changes nothing after it)
                x = math.log(v) - math.log1p(-v)
                b = math.floor((x - logit_min) / width * num_bins)
                b = int(min(max(b, 0.0), num_bins - 1.0))
                db = min(d, max_depth)
                hist[0, s, db, b] += 1.0
                if on_path[j]:
                    hist[1, s, db, b] += 1.0
                hist[2, s, db, b] += x
            continue
        # waits: move it (and its nodes) to the front; never ahead of where it is (the stores are
        # contiguous: a tree moves exactly when its nodes do)
        if kept != t:
            for c in range(trees.shape[1]):
                trees[kept, c] = trees[t, c]
            trees[kept, TREE_FIRST] = kept_nodes
            for j in range(size):
                for c in range(nodes.shape[1]):
                    nodes[kept_nodes + j, c] = nodes[first + j, c]
                node_values[kept_nodes + j] = node_values[first + j]
        kept += 1
        kept_nodes += size
    return kept, kept_nodes, labelled, bad, hist
