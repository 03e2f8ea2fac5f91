"""The CPU tree attention's KV unpacking (``integration/vllm/attention.py``): every layout vLLM's
CPU kernels write (probed through vLLM's own ``cpu_attn_reshape_and_cache``) is recognised as a
bit permutation and unpacked by one strided copy to exactly what an element-by-element gather
reads; a layout that is not a bit permutation falls back to the gather."""

from __future__ import annotations

import pytest
import torch

from vllm_anisotropic.integration.vllm.attention import _unpack, bit_permutation, kv_layout


def _gathered(blk, off, num_reqs, block_size, head_size):
    """Reference: token t, dim d of each block at ``off[t, d]``; [R, kv_heads, B * block, head]."""
    n, kv_heads, _ = blk.shape
    x = blk[..., off.flatten()].view(n, kv_heads, block_size, head_size).float()
    x = x.reshape(num_reqs, n // num_reqs, kv_heads, block_size, head_size).permute(0, 2, 1, 3, 4)
    return x.reshape(num_reqs, kv_heads, -1, head_size)


def _layouts():
    out = []
    for isa in ("vec", "vec16", "amx"):
        for block_size in (32, 128):
            try:
                out.append((isa, block_size, kv_layout(isa, torch.bfloat16, block_size, 64)))
            except Exception:  # noqa: BLE001 - an ISA this CPU build does not have
                continue
    return out


@pytest.mark.parametrize("isa,block_size,layout", _layouts(), ids=lambda x: str(x) if not isinstance(x, tuple) else "")
def test_every_probed_layout_is_a_bit_permutation_and_unpacks_exactly(isa, block_size, layout):
    k_off, v_off, k_kind, v_kind = layout
    assert isinstance(k_kind, tuple) and isinstance(v_kind, tuple), (isa, k_kind, v_kind)
    torch.manual_seed(0)
    blk = torch.randn(6, 3, 2 * block_size * 64).bfloat16()  # 2 requests x 3 blocks, 3 kv heads
    for off, kind, base in ((k_off, k_kind, 0), (v_off, v_kind, block_size * 64)):
        want = _gathered(blk, off, 2, block_size, 64)
        assert torch.equal(_unpack(blk, off, kind, 2, block_size, 64, base), want)
        assert torch.equal(_unpack(blk, off, "permuted", 2, block_size, 64, base), want)


def test_bit_permutation_of_known_layouts_and_refusals():
    t = torch.arange(4).view(4, 1)
    d = torch.arange(8).view(1, 8)
    assert bit_permutation(t * 8 + d, 0, 4, 8) == (0, 1, 2, 3, 4)  # plain
    assert bit_permutation(d * 4 + t + 100, 100, 4, 8) == (2, 3, 4, 0, 1)  # transposed, offset base
    shuffled = (t * 8 + d).flatten()[torch.tensor([1, 0] + list(range(2, 32)))].view(4, 8)
    assert bit_permutation(shuffled, 0, 4, 8) is None  # a swap of two elements is no bit permutation
    assert bit_permutation(t * 6 + torch.arange(6).view(1, 6), 0, 4, 6) is None  # head size not 2^k
    # the fallback still unpacks a non-bit permutation exactly
    blk = torch.randn(2, 1, 2 * 32).bfloat16()
    off = torch.cat([shuffled, shuffled + 32])
    assert torch.equal(_unpack(blk, off[:4], "permuted", 1, 4, 8, 0), _gathered(blk, off[:4], 1, 4, 8))
