"""Tree attention for vLLM's FLASH_ATTN backend (CUDA): FlashAttention + an exact LSE split.

Scope: decoder self-attention of the draft-tree rows on GPUs. vLLM 0.32's GPU backends have no
tree mask (tree attention was removed upstream in PR #42121), so ``TreeFlashAttentionImpl``
lets vLLM's kernel compute every row as usual (exact for prompts, re-run tokens and each tree's
root), then overwrites the rows of draft nodes with the split of ``tree_attention.py``:

    (a) one paged ``flash_attn_varlen_func`` call over the tree rows only, ``causal=False``,
        ``seqused_k`` = context length (every KV position up to and including the root),
        ``return_softmax_lse=True`` and no FA3 ``scheduler_metadata`` (the batch's is built for
        the causal call of other shapes);
    (b) + (c) attention of each node over its ancestors among the step's fresh K/V, merged with
        (a) by log-sum-exp: the fused Triton kernel (``tree_attention_triton``, tensor-core
        products for 16-bit dtypes) up to ``FUSED_MAX_ROWS`` node rows, the torch parts +
        vLLM's ``merge_attn_states`` beyond (docs/gpu.md: on an H200 the fused kernel is 14-30x
        cheaper than the torch parts at every measured shape, 1 to 64 requests x 4 to 64 nodes).

The identity is the one vLLM's own ``FlashAttentionImpl._forward_with_dcp`` relies on (a paged
non-causal part and a fresh part merged by LSE). The plan (``TreeAttentionPlan``) is built once
per step by the runner and copied to the device in one transfer; per layer this adds one FA call
and one or four small kernels, and no host synchronization.

Refused (``UnsupportedTreeAttention``, at model build time): sliding windows (FA aligns windows
by row index, not by ``root + depth``), ALiBi, attention sinks (FA's LSE with a sink is not yet
checked on a GPU), fp8 KV caches (the query reaching ``forward`` is already quantized), FA4's
head-size-256 kernel, encoder / cross attention, decode context parallelism, KV-sharing
layers (their ``key`` is None).

Not run on a GPU inside vLLM yet (the lent GPU machine has no vLLM): the CPU tests drive this
class with a stand-in for ``flash_attn_varlen_func`` that checks its arguments and computes (a)
in torch, and vLLM's torch ``merge_attn_states`` fallback; the worker's start-up self-test
(``self_test``) runs the real kernels against float64 on the device before serving.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from vllm.v1.attention.backends import flash_attn as fa_backend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from vllm_anisotropic.attention.random_batch import random_batch
from vllm_anisotropic.attention.tree_attention import TreeAttentionPlan, tree_rows_attention

logger = logging.getLogger(__name__)

__all__ = ["TreeFlashAttentionBackend", "TreeFlashAttentionImpl", "UnsupportedTreeAttention", "self_test",
           "TREE_FLASH_BACKEND_CLS", "FUSED_MAX_ROWS"]

TREE_FLASH_BACKEND_CLS = f"{__name__}.TreeFlashAttentionBackend"
# node rows (tree requests x padded nodes) up to which the fused Triton kernel runs: the largest
# shape measured (H200, bf16, Qwen2.5-1.5B heads 12:2 x 128, 64 requests x 64 nodes: 20.1 us a
# layer with tensor cores against 250 + 136 us for the torch parts; docs/gpu.md section 3)
FUSED_MAX_ROWS = 4096


class UnsupportedTreeAttention(NotImplementedError):
    """An attention feature the GPU tree path does not handle."""


def _refusal(impl) -> str | None:
    """Why ``impl`` cannot run tree attention, or None."""
    from vllm.v1.attention.backend import AttentionType

    if impl.attn_type != AttentionType.DECODER:
        return f"attention type {impl.attn_type}"
    if impl.sliding_window not in (None, (-1, -1)):
        return "sliding-window attention"
    if impl.alibi_slopes is not None:
        return "ALiBi"
    if impl.sinks is not None:
        return "attention sinks"
    if str(impl.kv_cache_dtype).startswith("fp8"):
        return f"kv_cache_dtype={impl.kv_cache_dtype}"
    if getattr(impl, "fa4_hd256", False):
        return "FlashAttention 4's head-size-256 kernel"
    if getattr(impl, "dcp_world_size", 1) > 1:
        return "decode context parallelism"
    if impl.kv_sharing_target_layer_name is not None:
        return "KV-sharing layers"
    return None


class TreeFlashAttentionImpl(FlashAttentionImpl):
    """``FlashAttentionImpl`` whose draft-node rows are recomputed with the tree mask."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        why = _refusal(self)
        if why is not None:
            raise UnsupportedTreeAttention(
                f"vllm-anisotropic GPU tree attention does not support {why}; use a model without it, "
                "or plain vLLM speculative decoding"
            )

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        plan = getattr(attn_metadata, "tree_plan", None) if attn_metadata is not None else None
        if plan is not None:
            self.tree_rows(query, key, value, kv_cache, attn_metadata.block_table, plan, output)
        return output

    def tree_rows(self, query, key, value, kv_cache, block_table, plan: TreeAttentionPlan, output) -> None:
        """Overwrite ``output``'s node rows (``plan.packed_rows``) with tree attention.

        ``kv_cache``: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (vLLM 0.32's
        FLASH_ATTN layout, the step's K/V already written); ``block_table``: ``[num_reqs,
        max_blocks]`` of the batch; ``output``: ``[num_tokens, num_heads * head_size]`` or
        ``[num_tokens, num_heads, head_size]``.
        """
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        # the tree requests' block-table rows: the same for every layer of a KV-cache group
        bt = plan.cache.get(("block_table", id(block_table)))
        if bt is None:
            bt = plan.cache[("block_table", id(block_table))] = block_table.index_select(0, plan.req_index)
        max_ctx = plan.max_context
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        out = output.view(num_tokens, self.num_heads, self.head_size)

        def context_attention(q_packed, cu_nodes, context_lens):
            o, lse = fa_backend.flash_attn_varlen_func(
                q=q_packed,
                k=key_cache,
                v=value_cache,
                max_seqlen_q=plan.max_nodes,
                cu_seqlens_q=cu_nodes,
                max_seqlen_k=max_ctx,
                seqused_k=context_lens,
                softmax_scale=self.scale,
                causal=False,
                softcap=self.logits_soft_cap,
                block_table=bt,
                return_softmax_lse=True,
                scheduler_metadata=None,
                fa_version=self.vllm_flash_attn_version,
            )
            return o, lse

        rows = plan.num_tree_reqs * plan.max_nodes
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        if q.is_cuda and rows <= FUSED_MAX_ROWS and plan.max_nodes <= 64:
            from vllm_anisotropic.attention.tree_attention_triton import fused_tree_rows_attention

            out_a, lse_a = context_attention(q[plan.packed_rows], plan.cu_nodes, plan.context_lens)
            fused_tree_rows_attention(q, k, v, out_a, lse_a, plan.node_rows, plan.ancestor_bits, plan.cu_nodes,
                                      out, self.scale, self.logits_soft_cap)
            return
        from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

        res = tree_rows_attention(q, k, v, plan, context_attention, self.scale, self.logits_soft_cap,
                                  merge=merge_attn_states)
        out[plan.packed_rows] = res


class TreeFlashAttentionBackend(FlashAttentionBackend):
    """``FLASH_ATTN`` with ``TreeFlashAttentionImpl``; registered by the tree GPU worker."""

    @staticmethod
    def get_impl_cls():
        return TreeFlashAttentionImpl


# ---------------------------------------------------------------------- start-up self-test
def self_test(impl: TreeFlashAttentionImpl, dtype: torch.dtype, device, block_size: int = 16, seed: int = 0,
              tolerance: float | None = None) -> float:
    """Run a random tree batch (contexts 1..600 incl. a root-only one, trees up to 64 nodes)
    through ``impl.tree_rows`` with the real kernels on ``device``; compare with the float64
    one-softmax reference. Returns the max |error|; raises ``RuntimeError`` above ``tolerance``
    (default: 4x the worst error measured on an H100 for the dtype, docs/gpu.md)."""
    tol = tolerance if tolerance is not None else {torch.bfloat16: 6e-2, torch.float16: 8e-3}.get(dtype, 1e-4)
    rng = np.random.default_rng(seed)
    b = random_batch(rng, 5, impl.num_heads, impl.num_kv_heads, impl.head_size, block_size, dtype, device,
                     max_context=600, softcap=impl.logits_soft_cap or 0.0)
    kv_cache = torch.cat([b["key_cache"], b["value_cache"]], dim=-1).transpose(1, 2).contiguous()
    output = torch.zeros_like(b["query"])
    impl.tree_rows(b["query"], b["key"], b["value"], kv_cache, b["block_table"], b["plan"], output)
    err = float((output[b["plan"].packed_rows].double() - b["reference"]).abs().max())
    if not err <= tol:
        raise RuntimeError(
            f"vllm-anisotropic tree-attention self-test failed on {device}: max |error| {err:.3g} > {tol:.3g} "
            f"against the float64 reference (dtype {dtype}, heads {impl.num_heads}:{impl.num_kv_heads}, "
            f"head size {impl.head_size}); refusing to serve wrong tokens"
        )
    return err

