"""Fused Triton kernel for parts (b) + (c) of the tree-attention split, scattered in place.

Scope: one kernel launch per layer replaces ``tree_attention.ancestor_attention`` (about fifteen
small torch kernels), ``merge_partials`` and the scatter into the output rows: measured on an
H100, the torch path costs 40-130 us + ~40 us per layer (docs/notebook/gpu.md). It does not compute part
(a), the paged context attention (FlashAttention inside vLLM).

Per program (tree request r, query head h), with ``n`` draft nodes (n <= 64):

    s[i, j]   = scale * q_i . k_j, soft-capped ``cap * tanh(s / cap)`` when cap > 0,
                kept iff bit j of ``ancestor_bits[r, i]`` is set (self and ancestors), else -inf
    lse_b[i]  = logsumexp_j s[i, j];   o_b[i] = softmax(s[i]) @ v
    lse[i]    = logaddexp(lse_a[i], lse_b[i])
    out[row_i] = exp(lse_a[i] - lse[i]) * o_a[i] + exp(lse_b[i] - lse[i]) * o_b[i]

Inputs are the step's fresh ``query``/``key``/``value`` (rows ``node_rows``), part (a)'s packed
``out_a [P, H, D]`` / ``lse_a [H, P]`` (packed order = ``cu_nodes``), GQA by ``h // (H / KVH)``.
Two precisions (``TENSOR_CORES``): for 16-bit inputs (the default there) both products take
16-bit operands on tensor cores with float32 accumulation, ``p`` rounded to the value dtype
before ``p @ v``, as FlashAttention does; otherwise (float32 inputs, or ``tensor_cores=False``)
every product is IEEE float32 (``input_precision="ieee"``: no TF32). The float32 products of a
64 x 64 tile spill registers: measured on an H100, 906 us a layer at 32 requests x 64 nodes
against 133 + 59 us for the torch parts (docs/notebook/gpu.md). ``lse_a = +inf`` (an empty context,
FlashAttention's convention) is read as ``-inf``, as vLLM's ``merge_attn_states`` does.
Testable on CPU with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fused_tree_rows_attention"]


@triton.jit
def _tanh(x):
    # tanh(x) = 2 * sigmoid(2x) - 1 (stable for large |x|)
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _tree_rows_kernel(
    q_ptr, k_ptr, v_ptr, oa_ptr, la_ptr, out_ptr,
    rows_ptr, bits_ptr, cu_ptr,
    scale, softcap,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_at, s_ah, s_lh, s_ot, s_oh,
    MAX_NODES: tl.constexpr, GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SOFTCAP: tl.constexpr, TENSOR_CORES: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    start = tl.load(cu_ptr + r)
    n = tl.load(cu_ptr + r + 1) - start
    i = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    valid = i < n
    dmask = d < HEAD_SIZE
    m2 = valid[:, None] & dmask[None, :]
    rows = tl.load(rows_ptr + r * MAX_NODES + i, mask=valid, other=0)
    q = tl.load(q_ptr + rows[:, None] * s_qt + h * s_qh + d[None, :], mask=m2, other=0.0)
    k = tl.load(k_ptr + rows[:, None] * s_kt + kvh * s_kh + d[None, :], mask=m2, other=0.0)
    v = tl.load(v_ptr + rows[:, None] * s_vt + kvh * s_vh + d[None, :], mask=m2, other=0.0)
    if TENSOR_CORES:
        s = tl.dot(q, tl.trans(k), out_dtype=tl.float32) * scale  # [BLOCK_N, BLOCK_N]
    else:
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    bits = tl.load(bits_ptr + r * MAX_NODES + i, mask=valid, other=0)  # int64, bit j = may attend j
    j = tl.arange(0, BLOCK_N)
    allowed = (((bits[:, None] >> j[None, :].to(tl.int64)) & 1) != 0) & valid[:, None] & (j < n)[None, :]
    s = tl.where(allowed, s, float("-inf"))
    m_b = tl.max(s, axis=1)
    m_b = tl.where(valid, m_b, 0.0)  # every real node attends itself: finite there
    p = tl.exp(s - m_b[:, None])
    l_b = tl.sum(p, axis=1)
    l_b = tl.where(valid, l_b, 1.0)
    if TENSOR_CORES:
        o_b = tl.dot(p.to(v.dtype), v, out_dtype=tl.float32) / l_b[:, None]
    else:
        o_b = tl.dot(p, v, input_precision="ieee") / l_b[:, None]
    lse_b = m_b + tl.log(l_b)
    packed = start + i
    la = tl.load(la_ptr + h * s_lh + packed, mask=valid, other=float("-inf")).to(tl.float32)
    la = tl.where(la == float("inf"), float("-inf"), la)
    oa = tl.load(oa_ptr + packed[:, None] * s_at + h * s_ah + d[None, :], mask=m2, other=0.0).to(tl.float32)
    m = tl.maximum(la, lse_b)
    wa = tl.exp(la - m)
    wb = tl.exp(lse_b - m)
    o = (oa * wa[:, None] + o_b * wb[:, None]) / (wa + wb)[:, None]
    tl.store(out_ptr + rows[:, None] * s_ot + h * s_oh + d[None, :], o.to(out_ptr.dtype.element_ty), mask=m2)


def fused_tree_rows_attention(
    query: torch.Tensor,  # [num_tokens, H, D]
    key: torch.Tensor,  # [num_tokens, KVH, D]
    value: torch.Tensor,  # [num_tokens, KVH, D]
    out_a: torch.Tensor,  # [P, H, D] part (a), packed node order
    lse_a: torch.Tensor,  # [H, P] float32
    node_rows: torch.Tensor,  # [R, N] int64
    ancestor_bits: torch.Tensor,  # [R, N] int64, bit j of [r, i]: node i+1 may attend node j+1
    cu_nodes: torch.Tensor,  # [R + 1] int32
    output: torch.Tensor,  # [num_tokens, H, D], node rows overwritten in place
    scale: float,
    softcap: float = 0.0,
    tensor_cores: bool | None = None,
    num_warps: int = 4,
) -> None:
    """Parts (b) + (c) and the scatter in one launch (grid: tree requests x query heads).

    ``tensor_cores``: 16-bit products with float32 accumulation; default on for float16 and
    bfloat16 inputs, and refused for float32 inputs (no 16-bit operands to feed them)."""
    num_reqs, max_nodes = node_rows.shape
    if max_nodes > 64:
        raise ValueError(f"the fused tree kernel handles at most 64 draft nodes per request, got {max_nodes}")
    h, dsize = query.shape[1], query.shape[2]
    kvh = key.shape[1]
    for t in (query, key, value, out_a, output):
        assert t.stride(-1) == 1, "last dimension must be contiguous"
    sixteen_bit = query.dtype in (torch.float16, torch.bfloat16)
    if tensor_cores is None:
        tensor_cores = sixteen_bit
    elif tensor_cores and not sixteen_bit:
        raise ValueError(f"tensor_cores=True needs float16 or bfloat16 inputs, got {query.dtype}")
    block_n = max(16, triton.next_power_of_2(max_nodes))
    block_d = max(16, triton.next_power_of_2(dsize))
    _tree_rows_kernel[(num_reqs, h)](
        query, key, value, out_a, lse_a, output,
        node_rows.contiguous(), ancestor_bits.contiguous(), cu_nodes,
        float(scale), float(softcap or 0.0),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        out_a.stride(0), out_a.stride(1), lse_a.stride(0), output.stride(0), output.stride(1),
        MAX_NODES=max_nodes, GROUP=h // kvh, HEAD_SIZE=dsize, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_SOFTCAP=bool(softcap and softcap > 0), TENSOR_CORES=bool(tensor_cores), num_warps=num_warps,
    )
