"""Tree attention as a log-sum-exp split: paged context attention + dense ancestor attention.

Scope: the math of the GPU tree-attention path (pure torch, no vLLM import), used by the vLLM
FLASH_ATTN adapter (``integration/vllm/kernels/gpu_attention.py``), by its CPU tests and by the GPU
kernel check (``bench/tree_attention_check.py``). It does not call FlashAttention itself.

Why a split: softmax over a union of key sets is the log-sum-exp merge of the softmaxes over
each part (the identity behind FlashAttention's tiling and vLLM's
``FlashAttentionImpl._forward_with_dcp``; merge rule of arXiv 2501.01005 Sec. 2.2). A tree node
i of request r attends

    context(r)   every KV position of r up to and including the root (the paged cache), and
    anc(i)       the draft nodes j with ``ancestor_mask[i, j]`` (i itself included), whose K/V
                 are this step's fresh ``key``/``value`` rows.

So (a) one paged attention over the context with ``causal=False`` and the row's log-sum-exp,
(b) a dense ancestor-masked attention over the step's node K/V (``ancestor_attention``), and
(c) ``merge_partials``:

    lse  = log(exp(lse_a) + exp(lse_b))
    out  = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

Terms and shapes (one fixed vocabulary):
    num_tree_reqs   R, requests with a tree this step
    max_nodes       N, most draft nodes of any tree request (root excluded); padding after
    num_heads       H query heads; num_kv_heads KVH (GQA: head h reads kv head h // (H // KVH))
    lse             natural-log sum of exp(scores) per (head, row), float32, ``-inf`` = no keys
Scores are ``s = scale * q.k``, soft-capped as ``cap * tanh(s / cap)`` when ``softcap > 0``.

Worked example (``TreeAttentionPlan``): two tree requests with 2 and 3 draft nodes whose node
rows are query rows [5, 6] and [9, 10, 11] -> ``node_rows [[5, 6, 0], [9, 10, 11]]``,
``node_valid [[1, 1, 0], [1, 1, 1]]``, packed order rows [5, 6, 9, 10, 11],
``cu_nodes [0, 2, 5]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = [
    "TreeAttentionPlan",
    "tree_rows_attention",
    "ancestor_attention",
    "merge_partials",
    "paged_context_attention",
    "dense_tree_reference",
    "soft_cap",
]


def soft_cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """``cap * tanh(s / cap)`` (Gemma-2 style logit soft-capping); identity when ``softcap <= 0``."""
    if softcap and softcap > 0:
        return softcap * torch.tanh(scores / softcap)
    return scores


@dataclass
class TreeAttentionPlan:
    """Node rows of one step, built once on the host and copied to the device once.

    ``node_rows[r, k]``: query row of draft node k+1 of tree request r (padding: 0);
    ``node_valid[r, k]``: real node; ``allowed[r, i, j]``: node i+1 may attend node j+1 (self
    and ancestors; padding rows attend nothing); ``ancestor_bits[r, i]``: the same row bit-packed
    (bit j set iff node i+1 may attend node j+1; trees of <= 64 draft nodes, else 0);
    ``req_index[r]``: batch row of tree request r;
    ``context_lens[r]``: KV positions up to and including the root; ``cu_nodes``: ``[R + 1]``
    cumulative node counts (the packed order: request by request, node by node).
    """

    req_index: torch.Tensor  # [R] int64
    node_rows: torch.Tensor  # [R, N] int64
    node_valid: torch.Tensor  # [R, N] bool
    allowed: torch.Tensor  # [R, N, N] bool
    ancestor_bits: torch.Tensor  # [R, N] int64
    context_lens: torch.Tensor  # [R] int32
    cu_nodes: torch.Tensor  # [R + 1] int32
    max_context: int = 0  # host copy of max(context_lens)
    cache: dict = field(default_factory=dict)  # per-step values the first layer computes for the others

    @property
    def num_tree_reqs(self) -> int:
        return int(self.node_rows.shape[0])

    @property
    def max_nodes(self) -> int:
        return int(self.node_rows.shape[1])

    @property
    def packed_rows(self) -> torch.Tensor:
        """``[sum of node counts]`` query rows in packed order."""
        return self.node_rows[self.node_valid]

    @staticmethod
    def build(
        req_index: list[int],
        masks: list[np.ndarray],
        query_end: list[int],
        seq_lens: list[int],
        device: torch.device | str = "cpu",
    ) -> "TreeAttentionPlan":
        """Plan for tree requests whose ``n_r = len(masks[r])`` node rows are the last ``n_r``
        query rows before ``query_end[r]`` and whose KV length after this step is
        ``seq_lens[r]`` (context length = ``seq_lens[r] - n_r``).

        ``masks[r]``: ``[n_r, n_r]`` bool ancestor mask among the draft nodes
        (``DraftTree.ancestor_mask[1:, 1:]``). Example: masks of sizes 2 and 3, query_end
        [7, 12], seq_lens [40, 9] -> rows [[5, 6, 0], [9, 10, 11]], context_lens [38, 6].
        """
        num = [int(m.shape[0]) for m in masks]
        if not num or min(num) < 1:
            raise ValueError(f"every tree request needs >= 1 draft node, got {num}")
        r, n = len(num), max(num)
        rows = np.zeros((r, n), np.int64)
        valid = np.zeros((r, n), bool)
        allowed = np.zeros((r, n, n), bool)
        for k, (m, end) in enumerate(zip(masks, query_end)):
            nk = m.shape[0]
            rows[k, :nk] = np.arange(end - nk, end)
            valid[k, :nk] = True
            allowed[k, :nk, :nk] = m
        # bit j of bits[r, i] = allowed[r, i, j]: [0b1, 0b11, 0b101] for parents [root, 0, 0]
        bits = np.zeros((r, n), np.uint64)
        if n <= 64:
            weights = np.left_shift(np.uint64(1), np.arange(n, dtype=np.uint64))
            bits = (allowed.astype(np.uint64) * weights).sum(axis=-1, dtype=np.uint64)
        return TreeAttentionPlan._packed(req_index, rows, valid, allowed, bits, np.asarray(seq_lens) - num, device)

    @staticmethod
    def _packed(req_index, rows, valid, allowed, bits, ctx, device) -> "TreeAttentionPlan":
        """The plan on ``device`` from its host arrays (``build``)."""
        ctx = np.asarray(ctx, np.int32)
        if (ctx < 0).any():
            raise ValueError(f"seq_lens shorter than the node counts (context lengths {ctx.tolist()})")
        r, n = rows.shape
        cu = np.zeros(r + 1, np.int32)
        np.cumsum(valid.sum(axis=1), out=cu[1:])
        flat = np.concatenate(
            [np.asarray(req_index, np.int64), rows.ravel(), valid.ravel(), allowed.ravel(),
             bits.view(np.int64).ravel(), ctx, cu]
        ).astype(np.int64)
        return TreeAttentionPlan.from_buffer(flat, r, n, int(ctx.max()), device)

    @staticmethod
    def from_buffer(flat: np.ndarray, r: int, n: int, max_context: int,
                    device: torch.device | str = "cpu") -> "TreeAttentionPlan":
        """The plan of ``r`` tree requests of at most ``n`` draft nodes from its host arrays packed
        in one int64 buffer (``req_index [r]``, ``node_rows [r, n]``, ``node_valid [r, n]``,
        ``allowed [r, n, n]``, ``ancestor_bits [r, n]``, ``context_lens [r]``, ``cu_nodes [r + 1]``;
        ``kernels/plan.py``'s ``split_plan`` writes it): one host-to-device copy."""
        dev = torch.from_numpy(flat).to(device, non_blocking=True)
        parts = torch.split(dev, [r, r * n, r * n, r * n * n, r * n, r, r + 1])
        return TreeAttentionPlan(
            req_index=parts[0],
            node_rows=parts[1].view(r, n),
            node_valid=parts[2].view(r, n).bool(),
            allowed=parts[3].view(r, n, n).bool(),
            ancestor_bits=parts[4].view(r, n),
            context_lens=parts[5].to(torch.int32),
            cu_nodes=parts[6].to(torch.int32),
            max_context=max_context,
        )


def tree_rows_attention(
    query: torch.Tensor,  # [num_tokens, H, D] the step's queries
    key: torch.Tensor,  # [num_tokens, KVH, D] the step's fresh keys
    value: torch.Tensor,  # [num_tokens, KVH, D]
    plan: TreeAttentionPlan,
    context_attention,
    scale: float,
    softcap: float = 0.0,
    merge=None,
) -> torch.Tensor:
    """Attention output of every tree node row, ``[sum of node counts, H, D]`` in packed order.

    ``context_attention(q_packed, cu_nodes, context_lens) -> (out [P, H, D], lse [H, P])`` is
    part (a) (FlashAttention inside vLLM, ``paged_context_attention`` elsewhere); ``merge``
    has ``merge_partials``' contract and defaults to it. Scatter the result with
    ``output[plan.packed_rows] = ...``.
    """
    rows = plan.packed_rows
    out_a, lse_a = context_attention(query[rows], plan.cu_nodes, plan.context_lens)
    # part (b) on the padded [R, N] layout; padding rows read row 0 and are masked out
    out_b, lse_b = ancestor_attention(
        query[plan.node_rows], key[plan.node_rows], value[plan.node_rows], plan.allowed, scale, softcap
    )
    out_b = out_b[plan.node_valid]  # [P, H, D]
    lse_b = lse_b.transpose(1, 2)[plan.node_valid].transpose(0, 1)  # [H, P]
    if merge is None:
        return merge_partials(out_a, lse_a, out_b, lse_b, out_dtype=query.dtype)[0]
    out = torch.empty_like(out_a)
    merge(out, out_a, lse_a.contiguous(), out_b.contiguous(), lse_b.contiguous())
    return out


def ancestor_attention(
    q: torch.Tensor,  # [R, N, H, D] queries of the node rows
    k: torch.Tensor,  # [R, N, KVH, D] this step's keys of the same nodes
    v: torch.Tensor,  # [R, N, KVH, D]
    allowed: torch.Tensor,  # [R, N, N] bool, allowed[r, i, j]: node i attends node j
    scale: float,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Part (b): attention of each node over its ancestors among the step's nodes (self incl.).

    Returns ``out [R, N, H, D]`` (q's dtype) and ``lse [R, H, N]`` (float32). Rows that attend
    nothing (padding) get ``out = 0`` and ``lse = -inf``, so a merge takes the other part whole.
    Computed in float32: at most 64 x 64 scores per (request, head).
    """
    r, n, h, d = q.shape
    kvh = k.shape[2]
    assert k.shape == (r, n, kvh, d) and v.shape == (r, n, kvh, d), (q.shape, k.shape, v.shape)
    assert allowed.shape == (r, n, n), allowed.shape
    assert h % kvh == 0, (h, kvh)
    group = h // kvh
    qf = q.float().view(r, n, kvh, group, d)
    # s[r, kv, g, i, j] = scale * q[r, i, kv*group + g] . k[r, j, kv]
    s = torch.einsum("rikgd,rjkd->rkgij", qf, k.float()) * scale
    s = soft_cap(s, softcap)
    s = s.masked_fill(~allowed.view(r, 1, 1, n, n), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [r, kv, g, i]
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
    p = torch.nan_to_num(p, nan=0.0)  # rows with no keys: exp(-inf - (-inf))
    out = torch.einsum("rkgij,rjkd->rikgd", p, v.float()).reshape(r, n, h, d)
    return out.to(q.dtype), lse.reshape(r, h, n)


def merge_partials(
    out_a: torch.Tensor,  # [T, H, D]
    lse_a: torch.Tensor,  # [H, T]
    out_b: torch.Tensor,  # [T, H, D]
    lse_b: torch.Tensor,  # [H, T]
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Part (c): ``out = wa * out_a + wb * out_b`` with ``wa = exp(lse_a - lse)``, ``lse =
    logaddexp(lse_a, lse_b)``; both empty -> 0, -inf. Same contract as vLLM's
    ``merge_attn_states`` (used instead of this inside vLLM); float32 arithmetic."""
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    ea, eb = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    tot = ea + eb
    empty = tot == 0
    tot = torch.where(empty, torch.ones_like(tot), tot)
    wa = (ea / tot).transpose(0, 1).unsqueeze(-1)  # [T, H, 1]
    wb = (eb / tot).transpose(0, 1).unsqueeze(-1)
    out = out_a.float() * wa + out_b.float() * wb
    lse = torch.where(empty, torch.full_like(m, float("-inf")), torch.log(tot) + m_safe)
    return out.to(out_dtype or out_a.dtype), lse


def paged_context_attention(
    q: torch.Tensor,  # [T, H, D] packed query rows
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] (FlashAttention's paged layout)
    value_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seqused_k: torch.Tensor,  # [B] int32 keys used per sequence
    block_table: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    softcap: float = 0.0,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Part (a) in torch: every query row of sequence b attends its first ``seqused_k[b]`` paged
    keys, no causal mask; returns ``out [T, H, D]`` (q's dtype) and ``lse [H, T]`` float32.

    What ``flash_attn_varlen_func(..., causal=False, return_softmax_lse=True)`` computes; the
    CPU tests' FlashAttention stand-in and the GPU check's reference. Token t of sequence b is
    at ``key_cache[block_table[b, t // block_size], t % block_size]``.
    """
    t, h, d = q.shape
    bs, kvh = key_cache.shape[1], key_cache.shape[2]
    group = h // kvh
    out = torch.zeros(t, h, d, dtype=compute_dtype, device=q.device)
    lse = torch.full((h, t), float("-inf"), dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    used = seqused_k.tolist()
    for b in range(len(used)):
        lo, hi, n_k = cu[b], cu[b + 1], used[b]
        if hi == lo or n_k == 0:
            continue
        pos = torch.arange(n_k, device=q.device)
        blocks = block_table[b].long()[pos // bs]
        kk = key_cache[blocks, pos % bs].to(compute_dtype)  # [n_k, KVH, D]
        vv = value_cache[blocks, pos % bs].to(compute_dtype)
        qq = q[lo:hi].to(compute_dtype).view(hi - lo, kvh, group, d)
        s = soft_cap(torch.einsum("ikgd,jkd->kgij", qq, kk) * scale, softcap)
        l_b = torch.logsumexp(s, dim=-1)  # [kvh, g, i]
        p = torch.exp(s - l_b.unsqueeze(-1))
        out[lo:hi] = torch.einsum("kgij,jkd->ikgd", p, vv).reshape(hi - lo, h, d)
        lse[:, lo:hi] = l_b.reshape(h, hi - lo).float()
    return out.to(q.dtype), lse


def dense_tree_reference(
    q: torch.Tensor,  # [n, H, D] node queries of one request
    ctx_k: torch.Tensor,  # [c, KVH, D] context keys (root included)
    ctx_v: torch.Tensor,  # [c, KVH, D]
    node_k: torch.Tensor,  # [n, KVH, D]
    node_v: torch.Tensor,  # [n, KVH, D]
    ancestor: np.ndarray | torch.Tensor,  # [n, n] bool
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """float64 attention of one request's node rows over ``context + ancestors`` in one softmax
    (no split): the ground truth of the tests and of the GPU check. Returns ``[n, H, D]`` float64."""
    n, h, d = q.shape
    c, kvh = ctx_k.shape[0], ctx_k.shape[1]
    group = h // kvh
    keys = torch.cat([ctx_k, node_k]).double()
    vals = torch.cat([ctx_v, node_v]).double()
    allowed = torch.ones(n, c + n, dtype=torch.bool, device=q.device)
    allowed[:, c:] = torch.as_tensor(np.asarray(ancestor, bool), device=q.device)
    qq = q.double().view(n, kvh, group, d)
    s = soft_cap(torch.einsum("ikgd,jkd->kgij", qq, keys) * scale, softcap)
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("kgij,jkd->ikgd", p, vals).reshape(n, h, d)
