"""Compiled per-step plans of the tree attention (``kernels.load("plan")``), each one call for the
whole step: ``scheduled_prefixes``, each pending tree cut to the drafts vLLM scheduled and
checked against them, and ``gather_prefix``, the cut trees' node arrays
(``integration/vllm/engine/drafter.py``, ``take_step``); ``step_rows``,
where the step's draft nodes sit in the query and at which positions, and each tree's leading
chain (``integration/vllm/engine/runner.py``, ``_prepare_inputs``); ``main_rows``, the CPU first
attention call's rows without the tree rows off the leading chain, and ``path_rounds``, the CPU
path rounds (``integration/vllm/kernels/attention.py``, ``_main_plan`` and ``_path_plan``: which
root-to-leaf paths cover the tree nodes, and every index and slot the rounds of vLLM's causal
kernel read and write); ``split_plan``, the
CUDA split's node rows, ancestor masks and context lengths (``attention/tree_attention.py``,
``TreeAttentionPlan``)."""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["gather_prefix", "main_rows", "path_rounds", "scheduled_prefixes", "split_plan", "step_rows"]


@numba.njit(cache=True, nogil=True)
def scheduled_prefixes(offsets, tokens, counts, flat, keep, bad):
    """vLLM scheduled ``counts[t]`` drafts of tree t, back to back in ``flat``: ``keep[t]`` is the
    nodes of its cut (root included: ``min(counts[t], its draft nodes) + 1``), ``bad[t]`` whether
    the drafts are not its first draft tokens (more drafts than it has, or one that differs).
    Returns ``(number of bad trees, whether any tree is cut)``.

    Example: trees ``[1, 2, 3 | 4, 5]`` (offsets ``[0, 3, 5]``), counts ``[1, 2]``, flat
    ``[2, 5, 6]`` -> keep ``[2, 2]``, bad ``[False, True]`` (tree 1 has one draft), ``(1, True)``."""
    pos = 0
    num_bad = 0
    cut = False
    for t in range(offsets.shape[0] - 1):
        a = offsets[t]
        room = offsets[t + 1] - a - 1
        c = counts[t]
        k = min(c, room)
        keep[t] = k + 1
        if k < room:
            cut = True
        wrong = c > room
        for j in range(k):
            if tokens[a + 1 + j] != flat[pos + j]:
                wrong = True
                break
        bad[t] = wrong
        if wrong:
            num_bad += 1
        pos += c
    return num_bad, cut


@numba.njit(cache=True, nogil=True)
def gather_prefix(offsets, keep, tokens, parents, sources, values, depths):
    """The first ``keep[t]`` nodes of each tree t (``1 <= keep[t] <=`` its size; ``scheduled_prefixes``'
    keep): ``FlatTrees.prefix`` of a batch without multiplicities or draft laws, in one call.
    Returns the cut batch's ``(offsets, tokens, parents, sources, values, depths)``.

    Example: offsets ``[0, 3, 5]``, tokens ``[1, 2, 3 | 4, 5]``, keep ``[2, 1]`` -> offsets
    ``[0, 2, 3]``, tokens ``[1, 2, 4]``."""
    num = offsets.shape[0] - 1
    out_offsets = np.empty(num + 1, np.int64)
    out_offsets[0] = 0
    for t in range(num):
        out_offsets[t + 1] = out_offsets[t] + keep[t]
    n = out_offsets[num]
    out_tokens, out_parents = np.empty(n, tokens.dtype), np.empty(n, parents.dtype)
    out_sources, out_values, out_depths = np.empty(n, sources.dtype), np.empty(n, values.dtype), np.empty(n, depths.dtype)
    for t in range(num):
        a, b = offsets[t], out_offsets[t]
        for j in range(keep[t]):
            out_tokens[b + j] = tokens[a + j]
            out_parents[b + j] = parents[a + j]
            out_sources[b + j] = sources[a + j]
            out_values[b + j] = values[a + j]
            out_depths[b + j] = depths[a + j]
    return out_offsets, out_tokens, out_parents, out_sources, out_values, out_depths


@numba.njit(cache=True, nogil=True)
def step_rows(offsets, parents, depths, ends, node_rows, positions, chain):
    """Tree t's ``n = size - 1`` draft nodes are the last n query rows of its request, which end
    at ``ends[t]``: ``node_rows[t] = ends[t] - n`` (node 1's row; the root's is the row before).
    Per draft node, tree after tree (``positions [3, num_nodes - T]``): its query row, its root's
    query row and its depth (its position is the root's plus its depth). ``chain[t]``: nodes
    ``1..c`` form a chain below the root (node j's parent is j - 1), as ``FlatTrees.chain_prefix``.
    Example: parents ``[-1, 0, 1, 0]``, depths ``[0, 1, 2, 1]``, end 10 -> node rows 7; rows
    ``[7, 8, 9]``, roots ``[6, 6, 6]``, depths ``[1, 2, 1]``; chain 2."""
    k = 0
    for t in range(offsets.shape[0] - 1):
        a = offsets[t]
        n = offsets[t + 1] - a - 1
        first = ends[t] - n
        node_rows[t] = first
        c = n
        for j in range(1, n + 1):
            positions[0, k] = first + j - 1
            positions[1, k] = first - 1
            positions[2, k] = depths[a + j]
            k += 1
            if c == n and parents[a + j] != j - 1:
                c = j - 1
        chain[t] = c


@numba.njit(cache=True, nogil=True)
def main_rows(query_start_loc, seq_lens, req_index, off, rows, query_start, lens):
    """The first attention call of a tree step without the last ``off[t]`` query rows (and KV
    positions) of tree request ``req_index[t]`` (its rows off the leading chain). Per batch
    row i (queries ``query_start_loc[i]..query_start_loc[i + 1]``, KV length ``seq_lens[i]``):
    the kept query rows go to ``rows`` (ascending), their ``query_start`` (``[B + 1]``) and the
    shortened ``lens`` (``[B]``). Returns ``(m, leading)``: the kept rows, and whether they are
    rows ``0..m-1`` (then the call reads views, no gather).

    Example: queries of 8, 1 and 6 rows, seq_lens 40, 30, 50, trees in rows 0 and 2 with 1 and 3
    rows off their chains -> rows 0-6, 8, 9-11; query_start ``[0, 7, 8, 11]``, lens
    ``[39, 30, 47]``; ``(11, False)``."""
    num_reqs = seq_lens.shape[0]
    drop = np.zeros(num_reqs, np.int64)
    for t in range(req_index.shape[0]):
        if req_index[t] < 0 or req_index[t] >= num_reqs:
            raise ValueError("a tree request's batch row is outside vLLM's metadata")
        drop[req_index[t]] = off[t]
    m = 0
    leading = True
    query_start[0] = 0
    for i in range(num_reqs):
        end = query_start_loc[i + 1] - drop[i]
        for row in range(query_start_loc[i], end):
            if row != m:
                leading = False
            rows[m] = row
            m += 1
        query_start[i + 1] = m
        lens[i] = seq_lens[i] - drop[i]
    return m, leading


@numba.njit(cache=True, nogil=True)
def path_rounds(parents, offsets, chain, query_start_loc, seq_lens, req_index, table, block_size, num_tokens,
                max_mean):
    """The root-to-leaf paths that cover every draft node of every tree, in rounds.

    Paths are taken leaf by leaf in node order; a path is kept only when it holds a node no
    earlier path of its tree (nor the tree's leading chain) covered; those uncovered nodes are a
    suffix of the path (the covered set is closed under ancestors): its ``need`` last nodes, the
    rows it queries. Round k holds the k-th kept path of every tree that has one (paths of one
    tree use the same KV positions, right after its context). Inputs: the trees as ``FlatTrees``
    holds them (``parents``, ``offsets``: roots included, local parents, the root's -1); per
    tree t, ``chain[t]`` (nodes ``1..chain[t]`` form a chain below the root: their rows are
    right already) and its batch row ``req_index[t]``, whose ``n`` draft nodes are the last n of
    its query rows (``query_start_loc``, vLLM's) and the last n of its KV (``seq_lens``): node
    j's query row is ``first + j - 1`` and its position ``ctx + j - 1``, ``first =
    query_start_loc[row + 1] - n``, ``ctx = seq_lens[row] - n``; ``table`` (vLLM's block table,
    row = batch row), ``block_size``; ``num_tokens``, the rows of the layer's K/V; ``max_mean``:
    past ``max_mean`` context reads per context position (below) the rounds are not built (every
    array empty: the caller takes the recompute). A batch row, query row or block outside the
    arrays raises ValueError (the kernel's writes are not bounds-checked).

    Returns, paths in round order (trees in order within a round): ``round_paths,
    round_queries [R]`` (ends of each round's paths and queried nodes); ``queried`` (the query
    rows, the paths' suffixes); ``query_start [P + R]`` int32 (each round's
    ``query_start_loc``, a leading 0 each); ``path_lens [P]`` int32 (``ctx`` + path length, the
    round's ``seq_lens``); ``path_tree [P]``; ``slots [R + 1, num_tokens]``: row k the slot of
    every query row round k writes (a path node at depth d to position ``ctx + d - 1`` of its
    tree), -1 elsewhere; the last row every draft node's own slot (position ``ctx + j - 1``),
    which puts the tree back; ``reads``, ``context``: the context positions the rounds read (each
    path its tree's ``ctx``) and those of the trees (each once).
    Example: one tree, parents ``[-1, 0, 1, 0, 3]`` (two chains of two), chain 2: one round,
    path nodes 3, 4 written at the first two positions after the context, querying both."""
    num_trees = offsets.shape[0] - 1
    total = offsets[num_trees] - num_trees  # draft nodes; node j of tree t at offsets[t] - t + j - 1
    has_child = np.zeros(total, np.bool_)
    depth = np.zeros(total, np.int64)
    first = np.empty(num_trees, np.int64)
    ctx = np.empty(num_trees, np.int64)
    for t in range(num_trees):
        a = offsets[t] - t
        n = offsets[t + 1] - offsets[t] - 1
        row = req_index[t]
        if row < 0 or row >= seq_lens.shape[0] or row + 1 >= query_start_loc.shape[0]:
            raise ValueError("a tree request's batch row is outside vLLM's metadata")
        first[t] = query_start_loc[row + 1] - n
        ctx[t] = seq_lens[row] - n
        if (first[t] < query_start_loc[row] or query_start_loc[row + 1] > num_tokens or ctx[t] < 0
                or (seq_lens[row] + block_size - 1) // block_size > table.shape[1]):
            raise ValueError("a tree's query rows, KV positions or blocks lie outside the step's arrays")
        for j in range(n):
            p = parents[offsets[t] + j + 1]
            if p > 0:
                has_child[a + p - 1] = True
                depth[a + j] = depth[a + p - 1] + 1
            else:
                depth[a + j] = 1
    # the cover, tree by tree: kept leaves (local, 0-based) and their need
    covered = np.zeros(total, np.bool_)
    kept_leaf = np.empty(total, np.int64)
    kept_need = np.empty(total, np.int64)
    tree_paths = np.zeros(num_trees, np.int64)
    num_paths = 0
    for t in range(num_trees):
        a = offsets[t] - t
        n = offsets[t + 1] - offsets[t] - 1
        for j in range(min(chain[t], n)):
            covered[a + j] = True
        for leaf in range(n):
            if has_child[a + leaf]:
                continue
            x = leaf
            need = 0
            while x >= 0 and not covered[a + x]:
                covered[a + x] = True
                need += 1
                x = parents[offsets[t] + x + 1] - 1
            if need:
                kept_leaf[a + tree_paths[t]] = leaf
                kept_need[a + tree_paths[t]] = need
                tree_paths[t] += 1
                num_paths += 1
        for j in range(n):
            if not covered[a + j]:
                raise ValueError("a draft node lies on no root-to-leaf path (parents not in node order)")
    reads = 0
    context = 0
    for t in range(num_trees):
        reads += tree_paths[t] * ctx[t]
        context += ctx[t]
    if reads > max_mean * context:
        return (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64), np.zeros(0, np.int32),
                np.empty(0, np.int32), np.empty(0, np.int64), np.full((0, num_tokens), -1, np.int64), reads, context)
    num_rounds = 0
    num_queries = 0
    for t in range(num_trees):
        num_rounds = max(num_rounds, tree_paths[t])
        for k in range(tree_paths[t]):
            num_queries += kept_need[offsets[t] - t + k]
    round_paths = np.empty(num_rounds, np.int64)
    round_queries = np.empty(num_rounds, np.int64)
    queried = np.empty(num_queries, np.int64)
    query_start = np.zeros(num_paths + num_rounds, np.int32)
    path_lens = np.empty(num_paths, np.int32)
    path_tree = np.empty(num_paths, np.int64)
    slots = np.full((num_rounds + 1, num_tokens), -1, np.int64)
    p = 0
    q = 0
    for k in range(num_rounds):
        q_round = 0
        for t in range(num_trees):
            if k >= tree_paths[t]:
                continue
            a = offsets[t] - t
            row = req_index[t]
            leaf = kept_leaf[a + k]
            length = depth[a + leaf]
            need = kept_need[a + k]
            x = leaf
            for d in range(length - 1, -1, -1):  # leaf up to the root's child
                pos = ctx[t] + d
                slots[k, first[t] + x] = table[row, pos // block_size] * block_size + pos % block_size
                if d >= length - need:
                    queried[q + d - (length - need)] = first[t] + x
                x = parents[offsets[t] + x + 1] - 1
            q += need
            q_round += need
            query_start[p + k + 1] = q_round
            path_lens[p] = ctx[t] + length
            path_tree[p] = t
            p += 1
        round_paths[k] = p
        round_queries[k] = q
    for t in range(num_trees):
        row = req_index[t]
        for j in range(offsets[t + 1] - offsets[t] - 1):
            pos = ctx[t] + j
            slots[num_rounds, first[t] + j] = table[row, pos // block_size] * block_size + pos % block_size
    return round_paths, round_queries, queried, query_start, path_lens, path_tree, slots, reads, context


@numba.njit(cache=True, nogil=True)
def split_plan(parents, offsets, req_index, query_end, seq_lens):
    """``TreeAttentionPlan``'s host arrays for trees of at most 64 draft nodes, packed in one int64
    buffer in ``TreeAttentionPlan.from_buffer``'s order: ``req_index [R]``, ``node_rows [R, N]``,
    ``node_valid [R, N]``, ``allowed [R, N, N]``, ``ancestor_bits [R, N]`` (the uint64 bits as
    int64), ``context_lens [R]``, ``cu_nodes [R + 1]``; N = most draft nodes of a tree.

    ``parents``, ``offsets``: the trees as ``FlatTrees`` holds them (roots included, local
    parents, the root's -1); tree r's draft nodes are the last n_r query rows before
    ``query_end[r]`` and its KV length after the step is ``seq_lens[r]``. Draft node i (local
    node i + 1) has bit j of its row set iff node j + 1 is itself or an ancestor. Example: one
    tree, parents ``[-1, 0, 0, 1]``, query_end 7, seq_len 40 -> rows ``[4, 5, 6]``, bits
    ``[0b1, 0b10, 0b101]``, context 37."""
    r = offsets.shape[0] - 1
    n = 0
    for t in range(r):
        n = max(n, offsets[t + 1] - offsets[t] - 1)
    if n > 64:
        raise ValueError("split_plan packs at most 64 draft nodes a tree")
    o_rows = r
    o_valid = o_rows + r * n
    o_allowed = o_valid + r * n
    o_bits = o_allowed + r * n * n
    o_ctx = o_bits + r * n
    o_cu = o_ctx + r
    out = np.zeros(o_cu + r + 1, np.int64)
    as_bits = out.view(np.uint64)
    bits = np.zeros(max(n, 1), np.uint64)
    for t in range(r):
        a = offsets[t]
        k = offsets[t + 1] - a - 1  # draft nodes
        out[t] = req_index[t]
        ctx = seq_lens[t] - k
        if ctx < 0:
            raise ValueError("a tree request's KV length is shorter than its draft nodes")
        out[o_ctx + t] = ctx
        out[o_cu + t + 1] = out[o_cu + t] + k
        for i in range(k):
            p = parents[a + i + 1]  # local: 0 is the root
            b = np.uint64(1) << np.uint64(i)
            if p > 0:
                b |= bits[p - 1]
            bits[i] = b
            row = t * n + i
            out[o_rows + row] = query_end[t] - k + i
            out[o_valid + row] = 1
            as_bits[o_bits + row] = b
            for j in range(i + 1):
                if (b >> np.uint64(j)) & np.uint64(1):
                    out[o_allowed + row * n + j] = 1
    return out
