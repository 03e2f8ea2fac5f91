"""Compiled GOOSE tree building (``kernels.load("goose")``): Algorithm 1 (BuildSpineTree) for every request of a step at once.

Scope: the arithmetic of ``goose.py``'s module docstring as numba code over flat arrays: one
call builds the trees (or the linear bypass chains) of all the step's requests that read one
adjacency table, and writes them back to back in value order. ``spine_trees`` (the engine's
path) also takes each request's spine from its context match or the store's draft and applies
Algorithm 2's routing (bypass test, spine ratio tier of p_s) with the caller's policy values
(``proposers.goose.propose_spine_trees``); ``build_trees`` is given spines and modes.

Source: GOOSE (arXiv 2604.02047) Algorithm 1 lines 1-13 and Appendix C.1: spine laid first
(values p_s ** i), first-level branches (root: its top b_r successors; spine node i: its top a_i,
harmonic), then every remaining slot spent extending branch leaves through the table in order of
path value (a max-heap of each node's next candidate, ties by push order), branch depth <= D.

Output per request (``build_trees``): nodes sorted by value descending, ties by depth then
build order, so parents precede children and any prefix is a subtree; ``build`` gives each
node's build index (tests read the build order from it). Worked example (budget 6, no spine,
rho 0.5, table 0 -> [1 (0.6), 2 (0.3)], 1 -> [3 (0.5), 4 (0.4)], 2 -> [5 (0.9)]): build order
1, 2, 3, 5, 4 (heap keys 0.30, 0.27, 0.24), output tokens [0, 1, 2, 3, 5, 4], parents
[-1, 0, 0, 1, 2, 1], values [1, .6, .3, .3, .27, .24] (2 before 3: equal values, smaller depth).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from vllm_anisotropic.kernels import table as tk
from vllm_anisotropic.kernels.match import match_tokens

__all__ = ["build_trees", "harmonic_widths", "learn_keys", "proposal_inputs", "spine_trees", "TREE", "CHAIN"]

TREE, CHAIN = 0, 1  # per-request mode of ``build_trees``: a spine tree, or the spine alone
_ROOT, _SPINE, _BRANCH = 0, 1, 2  # NodeSource codes (tree.NodeSource)

_jit = numba.njit(cache=True, nogil=True)


@_jit
def harmonic_widths(total, m):
    """Algorithm 1 line 10: ``a_i = floor(total * (1/i) / H(m))``, i = 1..m (``[m]`` int64)."""
    out = np.zeros(m, np.int64)
    if m <= 0 or total <= 0:
        return out
    h = 0.0
    for j in range(1, m + 1):
        h += 1.0 / j
    for i in range(1, m + 1):
        out[i - 1] = np.int64(math.floor(total * (1.0 / i) / h))
    return out


@_jit
def _candidates(table, prev, token, min_score, exclude, vocab, use_bigram, out_tok, out_score):
    """The filtered successors of ``(prev, token)`` (best first: filled, score >= min_score and
    > 0, not ``exclude``) into ``out_*``; returns how many. The threshold is compared at the
    table's precision (float32): a stored 0.01 passes a 0.01 threshold."""
    uni_ids, uni_scores, bi_keys, bi_stamps, bi_ids, bi_scores, counters = table
    tier, row = tk.lookup(uni_ids, uni_scores, bi_keys, bi_stamps, bi_ids, bi_scores, counters, prev, token, vocab,
                          use_bigram)
    n = 0
    if tier == tk.NONE:
        return 0
    k = uni_ids.shape[1]
    for j in range(k):
        if tier == tk.BIGRAM:
            t = bi_ids[row, j]
            s = bi_scores[row, j]
        else:
            t = uni_ids[row, j]
            s = uni_scores[row, j]
        if t < 0:
            continue
        if s >= np.float32(min_score) and s > 0.0 and t != exclude:
            out_tok[n] = t
            out_score[n] = np.float64(s)
            n += 1
    return n


@_jit
def _heap_push(keys, ties, nodes, ranks, size, key, tie, node, rank):
    """Max-heap on (key desc, tie asc): sift the new entry up; returns the new size."""
    i = size
    while i > 0:
        p = (i - 1) // 2
        if keys[p] > key or (keys[p] == key and ties[p] < tie):
            break
        keys[i], ties[i], nodes[i], ranks[i] = keys[p], ties[p], nodes[p], ranks[p]
        i = p
    keys[i], ties[i], nodes[i], ranks[i] = key, tie, node, rank
    return size + 1


@_jit
def _heap_pop(keys, ties, nodes, ranks, size):
    """Remove the top entry (the caller read it at index 0); returns the new size."""
    size -= 1
    key, tie, node, rank = keys[size], ties[size], nodes[size], ranks[size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and (keys[c + 1] > keys[c] or (keys[c + 1] == keys[c] and ties[c + 1] < ties[c])):
            c += 1
        if key > keys[c] or (key == keys[c] and tie < ties[c]):
            break
        keys[i], ties[i], nodes[i], ranks[i] = keys[c], ties[c], nodes[c], ranks[c]
        i = c
    keys[i], ties[i], nodes[i], ranks[i] = key, tie, node, rank
    return size


@_jit
def _build_one(table, vocab, use_bigram, root, prev_token, spine, budget, max_depth, spine_ratio, rho, min_score,
               p_s, spine_branches, tok, par, src, val, dep, bdep):
    """Algorithm 1 for one request into build-order arrays (each of length >= budget); returns
    the node count (root included)."""
    k = table[0].shape[1]
    tok[0], par[0], src[0], val[0], dep[0], bdep[0] = root, -1, _ROOT, 1.0, 0, 0
    n = 1
    draft_budget = budget - 1
    if draft_budget <= 0:
        return n
    v = min(max(p_s, 1e-3), 1.0)
    m = spine.shape[0]
    # lines 1-3: split the budget
    b_s = min(m, np.int64(math.floor(budget * spine_ratio)), draft_budget)
    rest = draft_budget - b_s
    if spine_branches:
        b_r = np.int64(math.ceil(rest * (1.0 - rho)))
        b_sigma = rest - b_r
    else:
        b_r = rest
        b_sigma = 0
    # lines 4-7: the spine; spine_nodes[i] = node of d_i (spine_nodes[0] = the root)
    spine_nodes = np.zeros(b_s + 1, np.int64)
    for i in range(b_s):
        tok[n], par[n], src[n], val[n] = spine[i], spine_nodes[i], _SPINE, math.pow(v, i + 1.0)
        dep[n], bdep[n] = dep[spine_nodes[i]] + 1, 0
        spine_nodes[i + 1] = n
        n += 1
    # per-node candidate lists and the heap of "next best candidate of each node"
    cand_tok = np.empty((budget, k), np.int64)
    cand_score = np.empty((budget, k), np.float64)
    cand_n = np.zeros(budget, np.int64)
    h_keys = np.empty(budget + 1, np.float64)
    h_ties = np.empty(budget + 1, np.int64)
    h_nodes = np.empty(budget + 1, np.int64)
    h_ranks = np.empty(budget + 1, np.int64)
    size = 0
    tie = 0
    # lines 8-12: first-level branches (root: b_r, spine node i: a_i), best first
    widths = harmonic_widths(b_sigma, b_s)
    first_tok = np.empty(k, np.int64)
    first_score = np.empty(k, np.float64)
    for i in range(b_s + 1):
        width = b_r if i == 0 else widths[i - 1]
        if width <= 0:
            continue
        node = spine_nodes[i]
        prev = prev_token if i == 0 else tok[spine_nodes[i - 1]]
        exclude = spine[i] if i < b_s else -1  # the spine child is no branch (a duplicate)
        c = _candidates(table, prev, tok[node], min_score, exclude, vocab, use_bigram, first_tok, first_score)
        for j in range(min(c, width)):
            if n - 1 >= draft_budget:
                break
            child = n
            tok[child], par[child], src[child], val[child] = first_tok[j], node, _BRANCH, val[node] * first_score[j]
            dep[child], bdep[child] = dep[node] + 1, 1
            n += 1
            # push_children(child)
            if bdep[child] < max_depth:
                cn = _candidates(table, tok[node], tok[child], min_score, -1, vocab, use_bigram, cand_tok[child],
                                 cand_score[child])
                cand_n[child] = cn
                if cn > 0:
                    size = _heap_push(h_keys, h_ties, h_nodes, h_ranks, size, val[child] * cand_score[child, 0], tie,
                                      child, 0)
                    tie += 1
    # line 13: extend branch leaves, best path value first, branch depth <= D
    while size > 0 and n - 1 < draft_budget:
        node, rank = h_nodes[0], h_ranks[0]
        size = _heap_pop(h_keys, h_ties, h_nodes, h_ranks, size)
        child = n
        tok[child], par[child], src[child] = cand_tok[node, rank], node, _BRANCH
        val[child] = val[node] * cand_score[node, rank]
        dep[child], bdep[child] = dep[node] + 1, bdep[node] + 1
        n += 1
        if rank + 1 < cand_n[node]:
            size = _heap_push(h_keys, h_ties, h_nodes, h_ranks, size, val[node] * cand_score[node, rank + 1], tie, node,
                              rank + 1)
            tie += 1
        if bdep[child] < max_depth:
            cn = _candidates(table, tok[node], tok[child], min_score, -1, vocab, use_bigram, cand_tok[child],
                             cand_score[child])
            cand_n[child] = cn
            if cn > 0:
                size = _heap_push(h_keys, h_ties, h_nodes, h_ranks, size, val[child] * cand_score[child, 0], tie, child, 0)
                tie += 1
    return n


@_jit
def _place(table, vocab, use_bigram, root, prev, spine, mode, budget, max_depth, ratio, rho, min_score, p_s,
           spine_branches, tok, par, src, val, dep, bdep, out_tokens, out_parents, out_sources, out_values, out_depths,
           out_build, pos):
    """One request's tree (``TREE``: Algorithm 1) or chain (``CHAIN``: the root and its spine,
    values p_s ** i) written at ``out_*[pos:]`` in value order, through the build-order scratch
    arrays ``tok`` .. ``bdep``; returns its node count."""
    if mode == CHAIN:
        v = min(max(p_s, 1e-3), 1.0)
        n = spine.shape[0] + 1
        out_tokens[pos], out_parents[pos], out_sources[pos], out_values[pos], out_depths[pos], out_build[pos] = (
            root, -1, _ROOT, 1.0, 0, 0)
        for i in range(1, n):
            out_tokens[pos + i], out_parents[pos + i], out_sources[pos + i] = spine[i - 1], i - 1, _SPINE
            out_values[pos + i], out_depths[pos + i], out_build[pos + i] = math.pow(v, float(i)), i, i
        return n
    n = _build_one(table, vocab, use_bigram, root, prev, spine, budget, max_depth, ratio, rho, min_score, p_s,
                   spine_branches, tok, par, src, val, dep, bdep)
    # value order: value desc, then depth asc, then build order (stable sorts, last key first)
    order = np.argsort(dep[:n], kind="mergesort")
    order = order[np.argsort(-val[:n][order], kind="mergesort")]
    new_index = np.empty(n, np.int64)
    for i in range(n):
        new_index[order[i]] = i
    for i in range(n):
        b = order[i]
        out_tokens[pos + i] = tok[b]
        out_parents[pos + i] = -1 if par[b] < 0 else new_index[par[b]]
        out_sources[pos + i] = src[b]
        out_values[pos + i] = val[b]
        out_depths[pos + i] = dep[b]
        out_build[pos + i] = b
    return n


@_jit
def build_trees(uni_ids, uni_scores, bi_keys, bi_stamps, bi_ids, bi_scores, counters, vocab, use_bigram,
                roots, prevs, spines, spine_offsets, modes, budgets, spine_ratios, p_s, max_depth, rho, min_score,
                spine_branches, out_tokens, out_parents, out_sources, out_values, out_depths, out_build, out_offsets):
    """Trees of R requests reading one table, back to back in value order.

    Per request r: ``roots[r]``, ``prevs[r]`` (the token before the root, -1: none), spine
    ``spines[spine_offsets[r]:spine_offsets[r + 1]]``, ``modes[r]`` (``TREE``: Algorithm 1 with
    node budget ``budgets[r]`` (root included), spine ratio ``spine_ratios[r]``, spine acceptance
    ``p_s[r]``; ``CHAIN``: the root and its spine, values p_s ** i). Outputs: ``out_*`` of length
    >= sum of budgets (a chain: spine length + 1), ``out_offsets [R + 1]``; ``out_parents``
    local to each tree, ``out_build`` the node's index in build order. Returns the node total.
    """
    table = (uni_ids, uni_scores, bi_keys, bi_stamps, bi_ids, bi_scores, counters)
    cap = 1
    for r in range(roots.shape[0]):
        cap = max(cap, budgets[r], spine_offsets[r + 1] - spine_offsets[r] + 1)
    tok, par, src, val, dep, bdep = _scratch(cap)
    pos = 0
    out_offsets[0] = 0
    for r in range(roots.shape[0]):
        pos += _place(table, vocab, use_bigram, roots[r], prevs[r], spines[spine_offsets[r]:spine_offsets[r + 1]],
                      modes[r], budgets[r], max_depth, spine_ratios[r], rho, min_score, p_s[r], spine_branches,
                      tok, par, src, val, dep, bdep, out_tokens, out_parents, out_sources, out_values, out_depths,
                      out_build, pos)
        out_offsets[r + 1] = pos
    return pos


@_jit
def _scratch(cap):
    """Build-order arrays of one tree of at most ``cap`` nodes: tokens, parents, sources, values,
    depths, branch depths."""
    return (np.empty(cap, np.int64), np.empty(cap, np.int64), np.empty(cap, np.int8), np.empty(cap, np.float64),
            np.empty(cap, np.int64), np.empty(cap, np.int64))


@_jit
def proposal_inputs(token_ids, rows, lengths, given, chain_drafts, budget, max_continuation, sizes, max_match,
                    context_spine):
    """``spine_trees``' per-request inputs of a step's R requests, in one call.

    Request r's context is ``token_ids[rows[r], :lengths[r]]``. Returns ``(budgets, limits,
    roots, prevs, match, asking)``: node budgets (``budget``; ``given[r]`` clamped to [1,
    budget] where > 0; ``given`` empty: none given), draft limits (``chain_drafts`` non-empty, a
    chain step: ``min(max_continuation, max(chain_drafts[r], 0))``; else ``min(max_continuation,
    budgets[r] - 1)``), roots (the last token), prevs (the token before it, -1: none), the
    context match ``[R, 4]`` (``kernels.match.match_tokens``' ``(f, n, match_length,
    consensus)``; zeros when ``context_spine`` is off) and how many requests have no match of their own but room to
    draft (they ask the tenant store).

    Example: budget 8, max_continuation 5, given ``[0, 3]``, no chain step -> budgets ``[8, 3]``,
    limits ``[5, 2]``."""
    num = rows.shape[0]
    budgets = np.empty(num, np.int64)
    limits = np.empty(num, np.int64)
    roots = np.empty(num, np.int64)
    prevs = np.empty(num, np.int64)
    match = np.zeros((num, 4), np.int64)
    asking = 0
    for r in range(num):
        b = budget
        if given.shape[0] > 0 and given[r] > 0:
            b = max(1, min(budget, given[r]))
        budgets[r] = b
        if chain_drafts.shape[0] > 0:
            limits[r] = min(max_continuation, max(chain_drafts[r], 0))
        else:
            limits[r] = min(max_continuation, b - 1)
        n = lengths[r]
        roots[r] = token_ids[rows[r], n - 1]
        prevs[r] = token_ids[rows[r], n - 2] if n >= 2 else -1
        if context_spine:
            f, ngram, m, c = match_tokens(token_ids[rows[r]], n, sizes, max_match)
            match[r, 0], match[r, 1], match[r, 2], match[r, 3] = f, ngram, m, 1 if c else 0
        if match[r, 1] <= 0 and limits[r] > 0:
            asking += 1
    return budgets, limits, roots, prevs, match, asking


@_jit
def spine_trees(uni_ids, uni_scores, bi_keys, bi_stamps, bi_ids, bi_scores, counters, vocab, use_bigram,
                token_ids, rows, lengths, roots, prevs, match, store_ngrams, store_lens, store_starts, store_tokens,
                limits, budgets, p_s, chains, policy, tiers, codes, max_depth, rho, min_score, spine_branches):
    """GOOSE's proposals (Algorithm 2 routing + Algorithm 1) of R requests reading one table:
    spine, route, tree, in one call (``proposers.goose.propose_spine_trees``).

    Per request r, context ``token_ids[rows[r], :lengths[r]]``: its spine is its own context
    match (``match[r]``, ``proposal_inputs``' ``(f, n, match_length, consensus)``,
    taken when ``n > 0`` and ``limits[r] > 0``: ``min(limits[r], lengths[r] - f)`` tokens from
    position f), else the tenant store's draft (``store_ngrams[r] > 0``: ``store_lens[r]``
    tokens at ``store_tokens[store_starts[r]:]``), else none. Routing (``chains``: every request
    a chain; else a bypass chain when the own match has consensus (``policy[1]``) or its signal,
    spine length (``policy[2]``) or match length, is >= ``policy[3]``, with ``policy[0]`` the
    bypass switch; else a tree with budget ``budgets[r]``); the spine ratio from p_s's tier
    (``tiers`` = threshold 1, threshold 2, ratio 0, 1, 2). Outputs: the trees as
    ``build_trees``' (parents local, value order), ``out_stats [R, 5]`` int64: proposal mode
    (``codes`` = plain, tree, bypass; plain when the tree is the root alone), spine tokens
    drafted (a chain's size - 1; a tree's spine nodes, at most the spine), n-gram, match length,
    consensus; ``out_ratios [R]`` the spine ratio (nan for chains). Returns ``(out_offsets,
    out_tokens, out_parents, out_sources, out_values, out_depths, out_stats, out_ratios)``, the
    node arrays cut to the node total."""
    table = (uni_ids, uni_scores, bi_keys, bi_stamps, bi_ids, bi_scores, counters)
    num = rows.shape[0]
    cap = 1
    total_cap = 0
    for r in range(num):
        cap = max(cap, budgets[r], limits[r] + 1)
        total_cap += max(budgets[r], limits[r] + 1)
    tok, par, src, val, dep, bdep = _scratch(cap)
    # the sixth array holds each node's build order, not an output here
    out_tokens, out_parents, out_sources, out_values, out_depths, build = _scratch(total_cap)
    out_offsets = np.empty(num + 1, np.int64)
    out_stats = np.empty((num, 5), np.int64)
    out_ratios = np.empty(num, np.float64)
    spine = np.empty(cap, np.int64)
    pos = 0
    out_offsets[0] = 0
    for r in range(num):
        found = match[r, 1] > 0 and limits[r] > 0
        from_store = not found and store_ngrams[r] > 0
        consensus = found and match[r, 3] > 0
        if found:
            m = min(limits[r], lengths[r] - match[r, 0])
            for i in range(m):
                spine[i] = token_ids[rows[r], match[r, 0] + i]
            ngram, match_len = match[r, 1], match[r, 2]
        elif from_store:
            m = store_lens[r]
            for i in range(m):
                spine[i] = store_tokens[store_starts[r] + i]
            ngram = match_len = store_ngrams[r]
        else:
            m = ngram = match_len = 0
        signal = m if policy[2] != 0 else match_len
        bypass = found and policy[0] != 0 and ((policy[1] != 0 and consensus) or signal >= policy[3])
        mode = CHAIN if chains or bypass else TREE
        info = codes[2] if (bypass or (chains and (found or from_store))) else (codes[0] if chains else codes[1])
        ratio = tiers[2] if p_s[r] < tiers[0] else (tiers[3] if p_s[r] < tiers[1] else tiers[4])
        n = _place(table, vocab, use_bigram, roots[r], prevs[r], spine[:m], mode, budgets[r], max_depth, ratio, rho,
                   min_score, p_s[r], spine_branches, tok, par, src, val, dep, bdep, out_tokens, out_parents,
                   out_sources, out_values, out_depths, build, pos)
        if mode == CHAIN:
            spine_len = n - 1
        else:
            spine_len = 0
            for i in range(n):
                if out_sources[pos + i] == _SPINE:
                    spine_len += 1
            spine_len = min(spine_len, m)
        out_stats[r, 0] = info if n > 1 else codes[0]
        out_stats[r, 1] = spine_len
        out_stats[r, 2] = ngram
        out_stats[r, 3] = match_len
        out_stats[r, 4] = 1 if consensus else 0
        out_ratios[r] = np.nan if chains else ratio
        pos += n
        out_offsets[r + 1] = pos
    return (out_offsets, out_tokens[:pos], out_parents[:pos], out_sources[:pos], out_values[:pos], out_depths[:pos],
            out_stats, out_ratios)


@_jit
def learn_keys(tokens, parents, sources, offsets, on_path, prev_roots, prev, spine_counts):
    """What a step's verified trees teach (Algorithm 2 lines 15-16), in one pass: ``prev[k]`` the
    first token of node k's table key (its parent's token; a root's: ``prev_roots[t]``, the token
    before it), and ``spine_counts[t]`` tree t's (spine nodes, spine nodes on the accepted path)
    for the spine-acceptance EMA.

    Example: tokens ``[4, 5, 6]``, parents ``[-1, 0, 1]``, sources ``[ROOT, SPINE, BRANCH]``, node
    1 on the path, prev root 3 -> prev ``[3, 4, 5]``, counts ``[1, 1]``."""
    for t in range(offsets.shape[0] - 1):
        a = offsets[t]
        prev[a] = prev_roots[t]
        n_spine = 0
        n_acc = 0
        for k in range(a, offsets[t + 1]):
            if k > a:
                prev[k] = tokens[a + parents[k]]
            if sources[k] == _SPINE:
                n_spine += 1
                if on_path[k]:
                    n_acc += 1
        spine_counts[t, 0] = n_spine
        spine_counts[t, 1] = n_acc
