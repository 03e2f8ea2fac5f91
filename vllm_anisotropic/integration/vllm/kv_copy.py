"""KV repair by copy (``kv_repair="copy"``): move accepted tree nodes' KV into place.

Scope: the alternative to ``scheduler.py``'s recompute. After verification, the accepted path
``p_1 < p_2 < ... < p_a`` (node indices, value order) has its KV at the slots of those nodes,
``slot(root) + p_j`` in the request's logical order, while the sequence needs it at
``slot(root) + j``. A node's K and V depend only on its own token, its position (tree position
= root position + depth = the true position j) and its hidden state, which attended exactly
its ancestors (= the accepted prefix): they are the sequential KV, so copying them is exact up
to float rounding of the tree rows' float32 attention recompute.

All sources are gathered before any destination is written, so overlapping moves are safe
(e.g. path ``[2, 3]``: slot 1 <- 2, slot 2 <- 3). Cache layout: ``attention.kv_layout`` (the
per-ISA element order probed through vLLM's own cache writer).

Worked example: root at logical slot 40, accepted nodes ``[1, 4, 9]`` -> moves ``41 <- 41``
(skipped), ``42 <- 44``, ``43 <- 49``; the scheduler then re-runs nothing.
"""

from __future__ import annotations

import torch

from vllm_anisotropic.integration.vllm.attention import kv_layout

__all__ = ["move_kv", "path_moves"]


def path_moves(root_slot_index: int, accepted: list[int]) -> list[tuple[int, int]]:
    """``(src, dst)`` query-token indices for one accepted path, in-place entries skipped."""
    return [(root_slot_index + p, root_slot_index + j) for j, p in enumerate(accepted, start=1) if p != j]


def move_kv(caches: list[tuple[torch.Tensor, str]], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy K and V of physical ``src_slots`` to ``dst_slots`` in every ``(cache, isa)`` layer.

    cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (vLLM CPU layout).
    """
    if src_slots.numel() == 0:
        return
    for cache, isa in caches:
        num_blocks, num_kv_heads, block_size, two_hs = cache.shape
        head_size = two_hs // 2
        k_off, v_off, _, _ = kv_layout(isa, cache.dtype, block_size, head_size)
        flat = cache.view(num_blocks, num_kv_heads, 2 * block_size * head_size)
        src_b, src_t = src_slots // block_size, src_slots % block_size
        dst_b, dst_t = dst_slots // block_size, dst_slots % block_size
        # [M, 2 * head_size] element offsets of each slot's K then V inside its block
        src_off = torch.cat([k_off[src_t], v_off[src_t]], dim=1)
        dst_off = torch.cat([k_off[dst_t], v_off[dst_t]], dim=1)
        values = flat[src_b.unsqueeze(1), :, src_off]  # [M, 2 * head_size, num_kv_heads], gathered first
        flat[dst_b.unsqueeze(1), :, dst_off] = values
