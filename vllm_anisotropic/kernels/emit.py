"""Compiled bookkeeping around the walk (``kernels.load("emit")``), one call each per step:
``logits_starts`` finds each tree's logits rows and the trees to walk (and checks vLLM's draft
counts against the trees); ``emit_rows`` turns the step's accepted paths into what the step
emits (each walked tree's output row, its nodes on the accepted path, the K/V moves of accepted
nodes off the leading chain: ``integration/vllm/engine/sampler.py``, ``kv_moves.py``);
``count_step`` counts the step's trees for the metrics (``integration/vllm/engine/metrics.py``,
``TreeMetrics.record_step``); ``harvest_rows`` lists the logits rows the harvest reads
(``TreeDrafter.observe_step``).

Terms: tree t's accepted path is ``accepted[t, :num_accepted[t]]`` (local node indices, node
``n_j`` at depth j + 1, increasing); its *leading chain* is the run of path entries with
``n_j = j + 1`` (nodes 1, 2, ..., c, whose K/V already sits in the slots the sequence needs)."""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["count_step", "emit_rows", "harvest_rows", "logits_starts"]

_jit = numba.njit(cache=True, nogil=True)


@_jit
def logits_starts(num_draft, rows, offsets, starts, walked):
    """Where each tree's logits rows start, from vLLM's per-row draft counts ``num_draft``
    ``[batch]`` (row i owns ``num_draft[i] + 1`` consecutive logits rows: vLLM's
    ``cu_num_sampled_tokens`` is their running sum): ``starts[t]`` is the first row of batch row
    ``rows[t]`` (tree t's root row); ``walked`` gets the trees with a draft node, ascending.
    Returns ``(number walked, bad)``: ``bad`` the first batch row whose draft count is not its
    tree's draft nodes (0 for a row without a tree), -1 when every row agrees.

    Example: drafts ``[3, 0, 2]``, trees of 4 and 3 nodes at rows ``[0, 2]`` -> starts ``[0, 5]``,
    walked ``[0, 1]``, bad -1."""
    batch = num_draft.shape[0]
    first = np.empty(batch, np.int64)  # each batch row's first logits row
    expected = np.zeros(batch, np.int64)
    at = 0
    for i in range(batch):
        first[i] = at
        at += num_draft[i] + 1
    m = 0
    for t in range(rows.shape[0]):
        n = offsets[t + 1] - offsets[t] - 1
        starts[t] = first[rows[t]]
        expected[rows[t]] = n
        if n > 0:
            walked[m] = t
            m += 1
    bad = -1
    for i in range(batch):
        if num_draft[i] != expected[i]:
            bad = i
            break
    return m, bad


@_jit
def emit_rows(tokens, offsets, walked, rows, accepted, num_accepted, bonus, node_rows, out, on_path, src, dst):
    """For every tree ``t`` in ``walked``: batch row ``rows[t]`` of ``out`` ``[batch, width]``
    becomes its emitted tokens (the path's tokens, then ``bonus[t]``, then -1), its path's nodes
    are marked in ``on_path`` ``[num_nodes]``, and each path entry j off the leading chain is a
    K/V move of query row ``node_rows[t] + n_j - 1`` (node ``n_j``'s row; ``node_rows[t]`` is
    node 1's) to ``node_rows[t] + j`` (written to ``src`` / ``dst``, each >= the step's accepted
    count long). Returns the number of moves.

    Example: tokens ``[r, 5, 6, 7]``, parents ``[-1, 0, 1, 0]``, path ``[3]``, bonus 9, node 1 at
    query row 40 -> row ``[7, 9, -1, ...]``, node 3 on the path, one move 42 -> 40."""
    m = 0
    width = out.shape[1]
    for i in range(walked.shape[0]):
        t = walked[i]
        a = offsets[t]
        r = rows[t]
        n = num_accepted[t]
        for j in range(n):
            node = accepted[t, j]
            out[r, j] = tokens[a + node]
            on_path[a + node] = True
            if node != j + 1:
                src[m] = node_rows[t] + node - 1
                dst[m] = node_rows[t] + j
                m += 1
        out[r, n] = bonus[t]
        for j in range(n + 1, width):
            out[r, j] = -1
    return m


@_jit
def harvest_rows(row_starts, offsets, keep, out):
    """The logits rows of the trees with ``keep[t]``, tree by tree: tree t's ``num_nodes`` rows
    from ``row_starts[t]`` on, into ``out`` (>= the kept trees' nodes long). Returns their number.

    Example: row starts ``[0, 5]``, trees of 3 and 2 nodes, both kept -> ``[0, 1, 2, 5, 6]``."""
    m = 0
    for t in range(row_starts.shape[0]):
        if keep[t]:
            for j in range(offsets[t + 1] - offsets[t]):
                out[m] = row_starts[t] + j
                m += 1
    return m


@_jit
def count_step(parents, sources, depths, offsets, on_path, num_accepted, modes, bypass, num_sources):
    """The step's counters, in this order: root-only trees (plain), trees of mode ``bypass``, trees
    with a draft node (verified), those with a node of >= 2 children (branching), draft nodes,
    the largest tree, accepted nodes, trees whose accepted path leaves the leading chain (off
    chain), the accepted nodes after it (moved); then ``2 * num_sources`` bins, each node in bin
    ``2 * source + on_path``. The leading chain of tree t is the run of nodes k = 1, 2, ...
    on the path at depth k (``on_path`` marks the path; parents precede children)."""
    num = offsets.shape[0] - 1
    counts = np.zeros(9 + 2 * num_sources, np.int64)
    largest = 0
    has_child = np.zeros(offsets[num], np.bool_)  # by global node: a child seen so far
    for t in range(num):
        a = offsets[t]
        n = offsets[t + 1] - a
        largest = max(largest, n)
        if modes[t] == bypass:
            counts[1] += 1
        if n == 1:
            counts[0] += 1
        else:
            counts[2] += 1
        for k in range(1, n):  # a second child of a node: branching
            if has_child[a + parents[a + k]]:
                counts[3] += 1
                break
            has_child[a + parents[a + k]] = True
        chain = 0
        while chain + 1 < n and on_path[a + chain + 1] and depths[a + chain + 1] == chain + 1:
            chain += 1
        counts[6] += num_accepted[t]
        if chain != num_accepted[t]:
            counts[7] += 1
            counts[8] += num_accepted[t] - chain
        for k in range(n):
            counts[9 + 2 * sources[a + k] + (1 if on_path[a + k] else 0)] += 1
    counts[4] = offsets[num] - num
    counts[5] = largest
    return counts
