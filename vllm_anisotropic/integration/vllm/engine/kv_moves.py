"""K/V repair after tree acceptance by slot moves: accepted nodes' K/V copied to the slots the
accepted sequence needs, in every layer, right after the walk (before the step's reply).

Why (shared/notes/vllm-0.32-spec-decode-map.md section 3e, option C): vLLM assumes the accepted
drafts are a prefix of the draft list, so that after the step slots ``root + 1 .. root + a``
hold the K/V of the ``a`` accepted tokens. In a tree the accepted path is any root-to-node path
``n_1 -> n_2 -> ... -> n_a`` (local node indices, value order, so ``n_j >= j``), and node ``n_j``'s
K/V sits at slot ``root + n_j``. That K/V is already exact: node ``n_j`` was computed at
position ``root + j`` (its depth) attending exactly its context and ancestors. Only its slot is
wrong, so ``slot[root + j] <- slot[root + n_j]`` for every j with ``n_j != j`` repairs the
cache without running the token again (a leading run ``n_j = j`` needs nothing). All sources
are read before any destination is written (a source may be a later destination).

Worked example: root at slot 100, path ``[2, 3]`` (nodes 2 and 3, node 1 a rejected sibling)
-> moves ``102 -> 101``, ``103 -> 102``: slot 101 gets node 2's K/V, slot 102 node 3's. The
sampler lists a step's moves as query rows with its emitted tokens, in one compiled call
(``kernels/emit.py``, ``emit_rows``); ``KVMover.move`` maps them to slots and copies.

Layouts (``KVMover``): a layer's cache is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
(vLLM 0.32, CPU and FLASH_ATTN); each (block, kv head) region holds ``2 * block_size *
head_size`` elements. On CUDA (FLASH_ATTN) token t's K is ``[t, :head_size]`` and V
``[t, head_size:]`` of the region; on CPU the order depends on the ISA and is probed through
vLLM's own cache writer (``attention.kv_layout``). Layers sharing one cache tensor are moved
once (a second application would read sources already overwritten). On CPU every layer of one
layout moves in one compiled call (``kernels/kv.py``: element indices computed once, each
cache's bits copied through a buffer; the layers cut over the process's threads from
``MOVE_PART`` elements a part, ``kernels.split``); on CUDA every layer of one cache shape in
two Triton launches (``attention/kv_move_triton.py``: gather into a buffer, scatter from it); on
another device, each layer is one gather and one scatter of element indices (``gather_scatter``).

Prefix caching: the moves happen in the worker before the step's reply, so no block vLLM
caches after the reply (0.33's ``update_from_output`` caches right away) holds a node's K/V at
a wrong slot.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_anisotropic import kernels as _kernels
from vllm_anisotropic.kernels.split import row_threads, run_rows

__all__ = ["KVMover", "MOVE_PART", "gather_scatter"]

# moved elements (moves x heads x 2 head_size x its layers) a thread's part of the CPU moves holds at
# least (kernels.split.run_rows): ~10 us of copying with the slots warm, ~40 us cold; alone, from two
# such parts a second thread was faster (docs/measurements/cpu/kv_threads_alone_2026_12_05.txt)
MOVE_PART = 1 << 13


class KVMover:
    """Copies whole tokens' K/V between slots in every attention layer's paged cache."""

    def __init__(self, caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """``caches``: ``(kv_cache [num_blocks, num_kv_heads, block_size, 2 * head_size],
        k_offsets [block_size, head_size], v_offsets [block_size, head_size])``: where token t,
        dim d of one (block, kv head) region lives, as element offsets inside the region."""
        self.caches = caches
        self._host_groups: list[tuple] | None = None  # the CPU caches by layout (``_groups``), on the first move
        self._device_caches: list[tuple] = []  # device caches the Triton moves do not take: ``gather_scatter``
        self._triton_groups: list[tuple] = []  # (caches of one shape, their ``layer_offsets``): ``move_slots``

    @staticmethod
    def plain_offsets(block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FLASH_ATTN's region order: token t's K at ``t * 2 head_size + d``, V ``head_size`` after."""
        t = torch.arange(block_size).view(-1, 1) * (2 * head_size)
        d = torch.arange(head_size).view(1, -1)
        return t + d, t + d + head_size

    @classmethod
    def from_layers(cls, layers) -> "KVMover":
        """The mover of a model's attention layers (modules with a 4-dim ``kv_cache``; CPU
        layers carry vLLM's ``isa``, whose layout ``attention.kv_layout`` probes). Layers of one
        layout share its offset tensors (``move`` computes their element indices once)."""
        caches, seen, layouts = [], set(), {}
        for layer in layers:
            cache = getattr(layer, "kv_cache", None)
            if not isinstance(cache, torch.Tensor) or cache.dim() != 4 or cache.numel() == 0:
                continue
            key = (cache.untyped_storage().data_ptr(), cache.storage_offset())
            if key in seen:
                continue
            seen.add(key)
            _, _, block_size, two_hs = cache.shape
            isa = getattr(layer, "isa", None)
            layout = (isa, cache.dtype, block_size, two_hs // 2, cache.device)
            if layout not in layouts:
                if isa is not None:  # CPU: the ISA's layout, probed through vLLM's writer
                    from vllm_anisotropic.integration.vllm.kernels.attention import kv_layout

                    k_off, v_off, _, _ = kv_layout(isa, cache.dtype, block_size, two_hs // 2)
                else:
                    k_off, v_off = cls.plain_offsets(block_size, two_hs // 2)
                layouts[layout] = (k_off.to(cache.device), v_off.to(cache.device))
            caches.append((cache, *layouts[layout]))
        return cls(caches)

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """``slot[dst[m]] <- slot[src[m]]`` (K and V, every head) in every cache; sources read
        first. ``src_slots``, ``dst_slots``: ``[M]`` int64 on the caches' device. CPU caches: one
        compiled call per layout (``kernels/kv.py``); CUDA caches in FLASH_ATTN's layout: two
        Triton launches per cache shape (``attention/kv_move_triton.py``); other device caches:
        ``gather_scatter``."""
        if src_slots.numel() == 0:
            return
        if self._host_groups is None:
            self._host_groups = _groups([c for c in self.caches if c[0].device.type == "cpu"])
            self._triton_groups, self._device_caches = _triton_groups(
                [c for c in self.caches if c[0].device.type != "cpu"])
        if self._host_groups:
            kv = _kernels.load("kv")
            src, dst = src_slots.cpu().numpy().astype(np.int64), dst_slots.cpu().numpy().astype(np.int64)
            for views, k_off, v_off, shape in self._host_groups:
                num_heads, _, two_hs = shape
                # the layers in parts, one a thread, each MOVE_PART moved elements or more (kernels.split)
                per_layer = src.shape[0] * num_heads * two_hs
                run_rows(kv.move_slots, kv.move_slots_threads, len(views), -(-MOVE_PART // per_layer),
                         views, src, dst, k_off, v_off, *shape)
        if self._triton_groups:
            from vllm_anisotropic.attention.kv_move_triton import move_slots

            for caches, offsets in self._triton_groups:
                move_slots(caches, offsets, src_slots, dst_slots)
        if self._device_caches:
            gather_scatter(self._device_caches, src_slots, dst_slots)

    def warm_up(self) -> None:
        """Load the compiled moves (``kernels/kv.py``) for these caches' element types now: slot 0
        onto itself in every cache (nothing changes), by the one-thread kernel and, where the
        process has threads (``kernels.split``), by the threaded one in two parts (whichever a
        step of this model takes: a token of a large model is two parts alone)."""
        zero = torch.zeros(1, dtype=torch.int64)
        self.move(zero, zero)  # the device moves, and the CPU groups built
        kv, z = _kernels.load("kv"), zero.numpy()
        for views, k_off, v_off, shape in self._host_groups or ():
            kv.move_slots(views, z, z, k_off, v_off, *shape)
            if len(views) > 1 and row_threads(2, 1) > 1:  # numba's thread count set for two parts
                kv.move_slots_threads(views, z, z, k_off, v_off, *shape, 2)


def gather_scatter(caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], src_slots: torch.Tensor,
                   dst_slots: torch.Tensor) -> None:
    """``KVMover.move`` with torch operations, for caches on a device: the element indices are
    computed once per layout and cache shape (a model's layers share one), then a layer costs
    one gather and one scatter."""
    slots = torch.cat([src_slots, dst_slots])
    indices = {}
    for cache, k_off, v_off in caches:
        num_blocks, num_heads, block_size, two_hs = cache.shape
        key = (id(k_off), num_heads, block_size, two_hs)
        if key not in indices:
            both = _elements(slots, k_off, v_off, num_heads, block_size, two_hs)
            indices[key] = both[: both.numel() // 2], both[both.numel() // 2 :]
        src, dst = indices[key]
        flat = cache.view(-1)
        flat.index_copy_(0, dst, flat.index_select(0, src))  # ~2x faster than flat[dst] = flat[src]


def _triton_groups(caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[list[tuple], list[tuple]]:
    """Device caches split into those the Triton moves take, grouped by (device, dtype, shape)
    with their ``layer_offsets``, and the rest (for ``gather_scatter``). Taken: CUDA, contiguous,
    FLASH_ATTN's region order (``plain_offsets``), Triton importable. Measured on an H200
    (docs/measurements/h200/gpu_kv_sdpa_probe_2026_12_04.txt, 28 layers): 49-74 us a move for 8
    to 512 moved tokens, against 733-846 us for ``gather_scatter``'s per-layer launches."""
    groups: dict[tuple, list] = {}
    rest = []
    for cache, k_off, v_off in caches:
        _, _, block_size, two_hs = cache.shape
        plain_k, plain_v = KVMover.plain_offsets(block_size, two_hs // 2)
        if (cache.device.type == "cuda" and cache.is_contiguous() and torch.equal(k_off.cpu(), plain_k)
                and torch.equal(v_off.cpu(), plain_v)):
            groups.setdefault((cache.device, cache.dtype, tuple(cache.shape)), []).append((cache, k_off, v_off))
        else:
            rest.append((cache, k_off, v_off))
    if not groups:
        return [], rest
    try:
        from vllm_anisotropic.attention.kv_move_triton import layer_offsets
    except ImportError:  # no Triton: every device cache through torch
        return [], rest + [c for members in groups.values() for c in members]
    return [([c for c, _, _ in members], layer_offsets([c for c, _, _ in members])) for members in groups.values()], rest


def _groups(caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[tuple]:
    """CPU caches grouped for ``kernels/kv.py``: per (offsets, shape, element size), a numba
    typed list of the caches flattened as integers of their element size (views: the moves
    write the caches themselves), the offsets as int64 arrays, and ``(num_heads, block_size,
    two_hs)``."""
    from numba.typed import List

    by_key: dict[tuple, tuple] = {}
    for cache, k_off, v_off in caches:
        num_blocks, num_heads, block_size, two_hs = cache.shape
        key = (id(k_off), num_heads, block_size, two_hs, cache.element_size())
        if key not in by_key:
            by_key[key] = (List(), k_off.cpu().numpy().astype(np.int64), v_off.cpu().numpy().astype(np.int64),
                           (num_heads, block_size, two_hs))
        bits = _BITS[cache.element_size()]
        by_key[key][0].append(cache.view(-1).view(bits).numpy())
    return list(by_key.values())


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> integer of its bits


def _elements(slots: torch.Tensor, k_off: torch.Tensor, v_off: torch.Tensor, num_heads: int, block_size: int,
              two_hs: int) -> torch.Tensor:
    """Flat element indices ``[M * num_heads * 2 * head_size]`` of the K and V of ``slots``,
    slot after slot (a slot's heads, each head's K then V)."""
    region = block_size * two_hs
    heads = torch.arange(num_heads, device=slots.device) * region
    base = (slots // block_size * (num_heads * region)).view(-1, 1, 1, 1) + heads.view(1, -1, 1, 1)  # [M, H, 1, 1]
    t = slots % block_size
    kv = torch.stack([k_off[t], v_off[t]], dim=1)  # [M, 2, head_size]
    return (base + kv.unsqueeze(1)).reshape(-1)
