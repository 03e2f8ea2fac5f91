"""Random steps of tree requests in FlashAttention's paged KV layout, with their float64 reference.

Scope: inputs for checking a tree-attention implementation against ``dense_tree_reference``:
the engine's start-up self-test (``integration/vllm/kernels/gpu_attention.self_test``), the
kernel check (``vllm-anisotropic tree-attention-check``) and the tests. Pure torch and numpy.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_anisotropic.attention.tree_attention import TreeAttentionPlan, dense_tree_reference
from vllm_anisotropic.tree import DraftTree

__all__ = ["random_tree", "random_batch"]


def random_tree(rng: np.random.Generator, num_nodes: int) -> DraftTree:
    """A random tree of ``num_nodes`` nodes (root included), parents before children."""
    parents = np.full(num_nodes, -1, np.int64)
    for i in range(1, num_nodes):
        # favour recent parents (deep trees) half of the time, any earlier node otherwise
        parents[i] = i - 1 if rng.random() < 0.4 else int(rng.integers(0, i))
    return DraftTree(tokens=np.zeros(num_nodes, np.int64), parents=parents)


def random_batch(rng, num_reqs, num_heads, num_kv_heads, head_size, block_size, dtype, device,
                 max_context=1500, softcap=0.0, max_nodes=64):
    """A step of ``num_reqs`` tree requests: queries/keys/values of the step's rows, a paged
    cache already holding every request's context and node K/V (as ``do_kv_cache_update``
    leaves it), the plan and the float64 reference of every node row.

    Request 0 has a context of the root alone (context length 1) when ``num_reqs > 1``.
    """
    nodes = [int(rng.integers(1, max_nodes + 1)) for _ in range(num_reqs)]
    nodes[-1] = max_nodes
    ctx = [int(rng.integers(1, max_context + 1)) for _ in range(num_reqs)]
    if num_reqs > 1:
        ctx[0] = 1
    # each request's query: a few re-run rows, the root, its draft nodes
    extra = [int(rng.integers(0, 3)) for _ in range(num_reqs)]
    q_lens = [e + 1 + n for e, n in zip(extra, nodes)]
    num_tokens = sum(q_lens)
    seq_lens = [c + n for c, n in zip(ctx, nodes)]
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    perm = rng.permutation(num_blocks)
    block_table = np.zeros((num_reqs, max_blocks), np.int32)
    used = 0
    for r, s in enumerate(seq_lens):
        nb = -(-s // block_size)
        block_table[r, :nb] = perm[used : used + nb]
        used += nb
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    query = randn(num_tokens, num_heads, head_size)
    key = randn(num_tokens, num_kv_heads, head_size)
    value = randn(num_tokens, num_kv_heads, head_size)
    key_cache = randn(num_blocks, block_size, num_kv_heads, head_size)
    value_cache = randn(num_blocks, block_size, num_kv_heads, head_size)
    bt = torch.from_numpy(block_table).to(device)
    q_end = np.cumsum(q_lens).tolist()
    # write the step's rows' K/V at their slots: the query's rows are the last q_len positions
    for r in range(num_reqs):
        for k in range(q_lens[r]):
            pos = seq_lens[r] - q_lens[r] + k
            row = q_end[r] - q_lens[r] + k
            key_cache[block_table[r, pos // block_size], pos % block_size] = key[row]
            value_cache[block_table[r, pos // block_size], pos % block_size] = value[row]
    trees = [random_tree(rng, n + 1) for n in nodes]
    masks = [t.ancestor_mask[1:, 1:] for t in trees]
    plan = TreeAttentionPlan.build(list(range(num_reqs)), masks, q_end, seq_lens, device=device)
    scale = head_size**-0.5
    refs = []
    for r in range(num_reqs):
        pos = torch.arange(ctx[r], device=device)
        blocks = bt[r].long()[pos // block_size]
        rows = slice(q_end[r] - nodes[r], q_end[r])
        refs.append(
            dense_tree_reference(
                query[rows], key_cache[blocks, pos % block_size], value_cache[blocks, pos % block_size],
                key[rows], value[rows], masks[r], scale, softcap,
            )
        )
    return dict(query=query, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                block_table=bt, plan=plan, scale=scale, softcap=softcap, reference=torch.cat(refs),
                masks=masks, ctx=ctx, nodes=nodes, q_end=q_end)
