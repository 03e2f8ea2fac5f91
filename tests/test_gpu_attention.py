"""GPU tree attention, tested on CPU: the LSE split against float64, vLLM's FLASH_ATTN layout and
call contract through a FlashAttention stand-in, vLLM's torch ``merge_attn_states`` fallback,
the fused Triton kernel under Triton's interpreter, the self-test, the refusals.

What each test would catch: a causal or scheduler-metadata FA call, a context length that
excludes the root or includes the nodes, a wrong block-table row, an ancestor mask transposed or
ignored, GQA heads mapped to the wrong KV head, soft-capping skipped in one part, an LSE merge
that drops a part or mishandles an empty context, rows written to the wrong output positions.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from vllm_anisotropic.attention.random_batch import random_batch, random_tree
from vllm_anisotropic.tree import DraftTree
from vllm_anisotropic.attention.tree_attention import (
    TreeAttentionPlan,
    ancestor_attention,
    dense_tree_reference,
    merge_partials,
    paged_context_attention,
    tree_rows_attention,
)

CASES = [  # (num_heads, num_kv_heads, head_size, block_size, softcap)
    (14, 2, 64, 16, 0.0),
    (8, 8, 32, 32, 0.0),
    (12, 4, 64, 64, 30.0),
]


def _batch(seed, h, kvh, hs, bs, softcap, num_reqs=5, dtype=torch.float32):
    return random_batch(np.random.default_rng(seed), num_reqs, h, kvh, hs, bs, dtype, "cpu", max_context=300,
                        softcap=softcap)


def _context_fn(b):
    def fn(q, cu, lens):
        return paged_context_attention(q, b["key_cache"], b["value_cache"], cu, lens, b["block_table"],
                                       b["scale"], b["softcap"])
    return fn


@pytest.mark.parametrize("h,kvh,hs,bs,softcap", CASES)
def test_split_with_vllm_merge_matches_float64(h, kvh, hs, bs, softcap):
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    for seed in range(3):
        b = _batch(seed, h, kvh, hs, bs, softcap)
        assert min(b["ctx"]) == 1 and max(b["nodes"]) == 64  # a root-only context, a 64-node tree
        out = tree_rows_attention(b["query"], b["key"], b["value"], b["plan"], _context_fn(b), b["scale"],
                                  b["softcap"], merge=merge_attn_states)
        err = (out.double() - b["reference"]).abs().max().item()
        assert err < 2e-5, err


def test_merge_with_an_empty_context_keeps_the_node_part():
    """A row with no context keys (lse -inf, FlashAttention may report +inf) is the node part alone."""
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    g = torch.Generator().manual_seed(0)
    out_b = torch.randn(3, 2, 8, generator=g)
    lse_b = torch.randn(2, 3, generator=g)
    out_a = torch.zeros(3, 2, 8)
    for empty in (float("-inf"), float("inf")):
        lse_a = torch.full((2, 3), empty)
        merged = torch.empty_like(out_a)
        merge_attn_states(merged, out_a, lse_a, out_b, lse_b)
        torch.testing.assert_close(merged, out_b)
    ours, lse = merge_partials(out_a, torch.full((2, 3), float("-inf")), out_b, lse_b)
    torch.testing.assert_close(ours, out_b)
    torch.testing.assert_close(lse, lse_b)


def test_ancestor_attention_is_the_masked_softmax():
    """Part (b) alone against a per-node float64 loop (GQA 4:2, one padded request)."""
    g = torch.Generator().manual_seed(1)
    trees = [random_tree(np.random.default_rng(s), n + 1) for s, n in enumerate([5, 3])]
    n = 5
    q = torch.randn(2, n, 4, 16, generator=g)
    k = torch.randn(2, n, 2, 16, generator=g)
    v = torch.randn(2, n, 2, 16, generator=g)
    allowed = torch.zeros(2, n, n, dtype=torch.bool)
    for r, t in enumerate(trees):
        m = t.num_nodes - 1
        allowed[r, :m, :m] = torch.from_numpy(t.ancestor_mask[1:, 1:])
    out, lse = ancestor_attention(q, k, v, allowed, 0.25)
    for r in range(2):
        for i in range(trees[r].num_nodes - 1):
            for hh in range(4):
                keys = [j for j in range(n) if allowed[r, i, j]]
                s = torch.stack([0.25 * q[r, i, hh].double() @ k[r, j, hh // 2].double() for j in keys])
                p = torch.softmax(s, 0)
                ref = sum(p[a] * v[r, j, hh // 2].double() for a, j in enumerate(keys))
                torch.testing.assert_close(out[r, i, hh].double(), ref, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(lse[r, hh, i].double(), torch.logsumexp(s, 0), rtol=1e-5, atol=1e-5)
    # the padded rows of request 1 attend nothing
    assert torch.isinf(lse[1, :, 3:]).all() and (out[1, 3:] == 0).all()


def test_plan_worked_example():
    masks = [np.eye(2, dtype=bool), DraftTree(tokens=[0] * 4, parents=[-1, 0, 0, 1]).ancestor_mask[1:, 1:]]
    plan = TreeAttentionPlan.build([0, 1], masks, [7, 12], [40, 9])
    assert plan.node_rows.tolist() == [[5, 6, 0], [9, 10, 11]]
    assert plan.node_valid.tolist() == [[True, True, False], [True, True, True]]
    assert plan.packed_rows.tolist() == [5, 6, 9, 10, 11]
    assert plan.cu_nodes.tolist() == [0, 2, 5] and plan.context_lens.tolist() == [38, 6]
    assert plan.ancestor_bits.tolist() == [[1, 2, 0], [1, 2, 5]] and plan.max_context == 38


# ---------------------------------------------------------------------- vLLM's FLASH_ATTN impl
class _FAStandIn:
    """Records every call; computes FlashAttention's non-causal paged attention with LSE."""

    def __init__(self, b):
        self.b, self.calls = b, []

    def __call__(self, **kw):
        self.calls.append(kw)
        return paged_context_attention(kw["q"], kw["k"], kw["v"], kw["cu_seqlens_q"], kw["seqused_k"],
                                       kw["block_table"], kw["softmax_scale"], kw["softcap"])


def _impl(h, kvh, hs, softcap):
    from vllm_anisotropic.integration.vllm.kernels.gpu_attention import TreeFlashAttentionImpl

    impl = object.__new__(TreeFlashAttentionImpl)  # the real __init__ needs a CUDA FlashAttention
    impl.num_heads, impl.num_kv_heads, impl.head_size = h, kvh, hs
    impl.scale, impl.logits_soft_cap, impl.vllm_flash_attn_version = hs**-0.5, softcap, 3
    return impl


def _vllm_kv_cache(b):
    # vLLM 0.32 FLASH_ATTN: [num_blocks, num_kv_heads, block_size, 2 * head_size]
    return torch.cat([b["key_cache"], b["value_cache"]], dim=-1).transpose(1, 2).contiguous()


@pytest.mark.parametrize("h,kvh,hs,bs,softcap", CASES)
def test_impl_tree_rows_through_the_flash_attention_contract(monkeypatch, h, kvh, hs, bs, softcap):
    from vllm.v1.attention.backends import flash_attn as fa_backend

    b = _batch(7, h, kvh, hs, bs, softcap)
    plan = b["plan"]
    # the step's batch: tree requests are rows 1, 3, 5, ... of a wider block table
    wide = torch.full((2 * plan.num_tree_reqs + 1, b["block_table"].shape[1]), 10_000, dtype=torch.int32)
    wide[1::2] = b["block_table"]
    plan.req_index = torch.arange(1, 2 * plan.num_tree_reqs, 2)
    fa = _FAStandIn(b)
    monkeypatch.setattr(fa_backend, "flash_attn_varlen_func", fa, raising=False)
    output = torch.full((b["query"].shape[0], h * hs), 7.0)
    impl = _impl(h, kvh, hs, softcap)
    impl.tree_rows(b["query"], b["key"], b["value"], _vllm_kv_cache(b), wide, plan, output)
    out = output.view(-1, h, hs)
    err = (out[plan.packed_rows].double() - b["reference"]).abs().max().item()
    assert err < 2e-5, err
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[plan.packed_rows] = False
    assert (out[others] == 7.0).all()  # rows that are not draft nodes are vLLM's, untouched
    (call,) = fa.calls
    assert call["causal"] is False and call["return_softmax_lse"] is True and call["scheduler_metadata"] is None
    assert call["seqused_k"].tolist() == b["ctx"]  # context = up to and including the root
    assert torch.equal(call["block_table"], b["block_table"])  # the tree requests' rows only
    assert call["cu_seqlens_q"].tolist() == np.concatenate([[0], np.cumsum(b["nodes"])]).tolist()
    assert call["max_seqlen_q"] == max(b["nodes"]) and call["max_seqlen_k"] == max(b["ctx"])
    assert call["k"].shape == (b["key_cache"].shape[0], bs, kvh, hs)  # FA's paged layout (a view)


def test_self_test_passes_and_catches_a_broken_mask(monkeypatch):
    from vllm.v1.attention.backends import flash_attn as fa_backend

    from vllm_anisotropic.attention import tree_attention
    from vllm_anisotropic.integration.vllm.kernels import gpu_attention

    def fa(**kw):
        return paged_context_attention(kw["q"], kw["k"], kw["v"], kw["cu_seqlens_q"], kw["seqused_k"],
                                       kw["block_table"], kw["softmax_scale"], kw["softcap"])

    monkeypatch.setattr(fa_backend, "flash_attn_varlen_func", fa, raising=False)
    impl = _impl(4, 2, 32, 0.0)
    assert gpu_attention.self_test(impl, torch.float32, "cpu") < 1e-5
    real = tree_attention.ancestor_attention

    def causal_instead_of_tree(q, k, v, allowed, scale, softcap=0.0):  # a plausible bug
        n = allowed.shape[-1]
        tril = torch.tril(torch.ones(n, n, dtype=torch.bool)).expand_as(allowed) & allowed.any(-1, keepdim=True)
        return real(q, k, v, tril, scale, softcap)

    monkeypatch.setattr(tree_attention, "ancestor_attention", causal_instead_of_tree)
    with pytest.raises(RuntimeError, match="self-test failed"):
        gpu_attention.self_test(impl, torch.float32, "cpu")


@pytest.mark.parametrize(
    "attr,value,needle",
    [
        ("sliding_window", (127, 0), "sliding-window"),
        ("alibi_slopes", torch.ones(4), "ALiBi"),
        ("sinks", torch.ones(4), "sinks"),
        ("kv_cache_dtype", "fp8_e4m3", "fp8"),
        ("kv_sharing_target_layer_name", "model.layers.0.attn", "KV-sharing"),
        ("fa4_hd256", True, "256"),
    ],
)
def test_unsupported_features_are_refused_by_name(attr, value, needle):
    from vllm.v1.attention.backend import AttentionType

    from vllm_anisotropic.integration.vllm.kernels.gpu_attention import _refusal

    impl = _impl(4, 2, 32, 0.0)
    impl.attn_type, impl.sliding_window, impl.alibi_slopes, impl.sinks = AttentionType.DECODER, (-1, -1), None, None
    impl.kv_cache_dtype, impl.kv_sharing_target_layer_name, impl.fa4_hd256 = "auto", None, False
    assert _refusal(impl) is None
    setattr(impl, attr, value)
    assert needle in _refusal(impl)


FUSED_SCRIPT = r"""
import numpy as np, torch
from vllm_anisotropic.attention.random_batch import random_batch
from vllm_anisotropic.attention.tree_attention import paged_context_attention
from vllm_anisotropic.attention.tree_attention_triton import fused_tree_rows_attention
# float32: IEEE products; float16: tensor-core products (16-bit operands, float32 accumulation).
# bfloat16 is not run here: Triton 3.9's interpreter multiplies bfloat16 tiles as raw 16-bit
# integers in tl.dot (errors ~1e10 on a 16 x 16 product of randn); the H100/H200 check and the
# start-up self-test cover it on a GPU.
for dtype in (torch.float32, torch.float16):
    worst = 0.0
    for seed, (h, kvh, hs, softcap) in enumerate([(4, 2, 32, 0.0), (6, 6, 24, 20.0)]):
        b = random_batch(np.random.default_rng(seed), 3, h, kvh, hs, 16, dtype, "cpu", max_context=80,
                         softcap=softcap, max_nodes=20)
        p = b["plan"]
        out_a, lse_a = paged_context_attention(b["query"][p.packed_rows], b["key_cache"], b["value_cache"],
                                               p.cu_nodes, p.context_lens, b["block_table"], b["scale"], softcap)
        out = torch.full_like(b["query"], 7.0)
        fused_tree_rows_attention(b["query"], b["key"], b["value"], out_a, lse_a, p.node_rows, p.ancestor_bits,
                                  p.cu_nodes, out, b["scale"], softcap)
        worst = max(worst, (out[p.packed_rows].double() - b["reference"]).abs().max().item())
        rest = torch.ones(out.shape[0], dtype=torch.bool); rest[p.packed_rows] = False
        assert (out[rest] == 7.0).all()
    print(worst)
"""


def test_fused_triton_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", FUSED_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    err_f32, err_f16 = (float(x) for x in res.stdout.strip().splitlines()[-2:])
    assert err_f32 < 2e-5
    assert err_f16 < 4e-3  # fp16 rounding of q, k, v, p (the one-pass fp16 error on an H100: 9.8e-4)


def test_fused_kernel_refuses_tensor_cores_for_float32():
    pytest.importorskip("triton")
    from vllm_anisotropic.attention.tree_attention_triton import fused_tree_rows_attention

    x = torch.zeros(2, 1, 16)
    rows = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        fused_tree_rows_attention(x, x, x, x[:1], torch.zeros(1, 1), rows, rows, torch.tensor([0, 1], dtype=torch.int32),
                                  x, 1.0, tensor_cores=True)


def test_dense_reference_is_one_softmax():
    """The reference itself: two tokens of context, one node; by hand."""
    q = torch.tensor([[[1.0, 0.0]]])  # [n=1, H=1, D=2]
    ck = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    cv = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    nk, nv = torch.tensor([[[2.0, 0.0]]]), torch.tensor([[[0.0, 0.0]]])
    out = dense_tree_reference(q, ck, cv, nk, nv, np.ones((1, 1), bool), 1.0)
    w = torch.softmax(torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64), 0)
    torch.testing.assert_close(out[0, 0], torch.stack([w[0], w[1]]))
