"""K/V slot moves for every layer's paged cache in two Triton launches (issue 43, item 3).

``KVMover.move`` on a device did one gather and one scatter per layer. On an H200 (torch 2.11,
docs/measurements/h200/*_2026_12_04*) that cost host launch work, whatever the number of moved
tokens: 0.7-0.85, 3.5 and 6.3 ms a move for a 28-layer model in three runs (25-225 us a layer;
CUDA-event time equal to the host's), up to two GPU decode steps. Here every layer of one cache shape moves in one gather launch (sources into a buffer)
and one scatter launch (buffer into destinations): all sources are read before any destination
is written, as ``KVMover.move`` requires (a source may be a later destination).

Layout (vLLM 0.32's FLASH_ATTN cache, ``KVMover.plain_offsets``): a layer's cache is
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, contiguous; slot ``s`` = block
``s // block_size``, token ``t = s % block_size``; its K and V of head ``h`` are the
``2 * head_size`` consecutive elements at ``((block * num_kv_heads + h) * block_size + t) * 2 *
head_size``. The layers are addressed from the first cache's pointer plus each layer's element
offset (``layer_offsets``, int64, possibly negative): one pointer argument for all layers.

Program ``(layer, moved token, head)`` copies one ``2 * head_size`` run. Testable on CPU with
``TRITON_INTERPRET=1`` (tests/test_kv_moves.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["layer_offsets", "move_slots"]


@triton.jit
def _copy_runs(base, offsets, slots, buf, num_moves, num_heads, block_size, TO_BUF: tl.constexpr,
               RUN: tl.constexpr, RUN_POW2: tl.constexpr):
    layer = tl.program_id(0)
    move = tl.program_id(1)
    head = tl.program_id(2)
    slot = tl.load(slots + move).to(tl.int64)
    region = ((slot // block_size) * num_heads + head) * block_size + slot % block_size
    cache_at = tl.load(offsets + layer) + region * RUN
    buf_at = ((layer.to(tl.int64) * num_moves + move) * num_heads + head) * RUN
    d = tl.arange(0, RUN_POW2)
    keep = d < RUN
    if TO_BUF:
        tl.store(buf + buf_at + d, tl.load(base + cache_at + d, mask=keep), mask=keep)
    else:
        tl.store(base + cache_at + d, tl.load(buf + buf_at + d, mask=keep), mask=keep)


def layer_offsets(caches: list[torch.Tensor]) -> torch.Tensor:
    """Each cache's element offset from ``caches[0]``'s first element, int64 on their device.
    Raises ValueError unless the caches share device, dtype and shape and are contiguous."""
    first = caches[0]
    size = first.element_size()
    offsets = []
    for cache in caches:
        if cache.device != first.device or cache.dtype != first.dtype or cache.shape != first.shape:
            raise ValueError(f"kv_move_triton: caches differ ({cache.device}, {cache.dtype}, {tuple(cache.shape)}"
                             f" vs {first.device}, {first.dtype}, {tuple(first.shape)})")
        if not cache.is_contiguous():
            raise ValueError("kv_move_triton: a cache is not contiguous")
        delta = cache.data_ptr() - first.data_ptr()
        if delta % size:
            raise ValueError(f"kv_move_triton: cache offset {delta} bytes is not a multiple of {size}")
        offsets.append(delta // size)
    return torch.tensor(offsets, dtype=torch.int64, device=first.device)


def move_slots(caches: list[torch.Tensor], offsets: torch.Tensor, src_slots: torch.Tensor,
               dst_slots: torch.Tensor) -> None:
    """``slot[dst[m]] <- slot[src[m]]`` (K and V, every head) in every one of ``caches`` (one
    shape, ``offsets = layer_offsets(caches)``); ``src_slots``, ``dst_slots``: ``[M]`` integer
    tensors on the caches' device. Two launches, whatever the number of layers."""
    moves = int(src_slots.numel())
    if moves == 0:
        return
    base = caches[0]
    _, num_heads, block_size, run = base.shape
    grid = (len(caches), moves, num_heads)
    buf = torch.empty(len(caches) * moves * num_heads * run, dtype=base.dtype, device=base.device)
    pow2 = triton.next_power_of_2(run)
    _copy_runs[grid](base, offsets, src_slots, buf, moves, num_heads, block_size, TO_BUF=True, RUN=run,
                     RUN_POW2=pow2)
    _copy_runs[grid](base, offsets, dst_slots, buf, moves, num_heads, block_size, TO_BUF=False, RUN=run,
                     RUN_POW2=pow2)
