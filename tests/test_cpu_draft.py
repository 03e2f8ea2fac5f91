"""draft_tree's q on vLLM's CPU kernels (``integration.vllm.kernels.cpu_draft`` and the padded
GEMM calls of ``cpu_gemm``), on the tiny Llama and Qwen2 models in float32.

What this would catch: a dropped q / k / v bias (Qwen2 has them), q, k and v taken from the
wrong slices of the fused output, RoPE of the wrong style (GPT-J instead of NeoX) or at the
wrong positions (a lane at its column instead of its depth), a RoPE cache read past its end
(positions beyond the config's ``max_position_embeddings``), the residual added twice or not
at all, gate and up swapped, a chunked MLP that writes a chunk at the wrong rows, padded rows
left in a GEMM's output, a GEMM call at a row count outside the buckets, and a model the fused
loop does not handle taken anyway; with ``draft_quantization: int8``, a fused GEMM left in
float or one whose quantization wrecks the logits.
"""

from __future__ import annotations

import pytest
import torch

from vllm_anisotropic.integration.vllm.kernels import cpu_gemm
from vllm_anisotropic.integration.vllm.kernels.cpu_draft import unsupported, use_vllm_cpu_layers, warm_up
from vllm_anisotropic.integration.vllm.kernels.cpu_gemm import BUCKETS, CHUNK_ROWS, bucket_rows, padded_linear, use_vllm_cpu_gemm
from vllm_anisotropic.models.tiny import build_tiny_model
from vllm_anisotropic.proposers.draft_kv import LONG_ROW, DraftKV
from vllm_anisotropic.proposers.draft_model import DraftLM


def _forwards(lm: DraftLM, contexts: list[list[int]]) -> list[torch.Tensor]:
    """q's logits through DraftKV: every token of a catch-up of rows of different lengths, one
    chain token per row, then two depths of 3 lanes per row."""
    kv = DraftKV(lm)
    sessions = [lm.new_session() for _ in contexts]
    rows, lengths = len(contexts), [len(c) for c in contexts]
    kv.place(sessions, [n + 16 for n in lengths])
    out = [kv.forward(rows, contexts, [0] * rows, [None] * rows, [0] * rows, want="all")]
    out.append(kv.forward(rows, [[7 + b] for b in range(rows)], lengths, [None] * rows, lengths))
    bases = [n + 1 for n in lengths]
    for depth, lanes in enumerate(([5, 77, 940], [19, 640, 28])):
        starts = [base + 3 * depth for base in bases]
        out.append(kv.forward(rows, [lanes] * rows, starts, [3] * rows, bases, want="all"))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_layers_give_transformers_logits(arch):
    path = build_tiny_model(arch=arch, seed=1, block_std=0.1)
    ref, lm = DraftLM(path), DraftLM(path)
    assert use_vllm_cpu_layers(lm) and use_vllm_cpu_gemm(lm.model) == 1  # the output head is all that is left
    assert warm_up(lm) > 0
    lm.layers_forward.cos_sin = lm.layers_forward.cos_sin[:8].clone()  # positions past the cache: it must grow
    with pytest.raises(RuntimeError, match="cpu_draft"):  # the weights live in the fused layers only
        lm.model.model.layers[0].mlp.up_proj(torch.zeros(1, lm.model.config.hidden_size))
    g = torch.Generator().manual_seed(2)
    # a prompt past CHUNK_ROWS (chunked GEMMs and MLP) and one past LONG_ROW (its own attention
    # call) next to short rows
    lengths = [CHUNK_ROWS + 44, 3, LONG_ROW + 9, 1]
    contexts = [torch.randint(1, lm.vocab_size, (n,), generator=g).tolist() for n in lengths]
    got, want = _forwards(lm, contexts), _forwards(ref, contexts)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got[-1][0], got[-1][1])  # lanes differ: a mix-up would show


def test_int8_fused_layers_stay_near_the_float_logits():
    """``draft_quantization: int8`` on the fused loop (every GEMM int8, the head too): the same
    forwards as above, logits within a few per cent of the float ones and the same argmax on
    nearly every row, but not the float logits (each layer quantized, not only the head)."""
    path = build_tiny_model(arch="qwen2", seed=1, block_std=0.1)
    ref, lm = DraftLM(path), DraftLM(path)
    assert use_vllm_cpu_layers(lm, "int8") and use_vllm_cpu_gemm(lm.model, "int8") == 1
    assert all(hasattr(gemm.layer, "int8_scales") for layer in lm.layers_forward.layers
               for gemm in (layer.qkv, layer.o, layer.gate_up, layer.down))
    g = torch.Generator().manual_seed(2)
    contexts = [torch.randint(1, lm.vocab_size, (n,), generator=g).tolist() for n in (CHUNK_ROWS + 44, 3, 40, 1)]
    for a, b in zip(_forwards(lm, contexts), _forwards(ref, contexts)):
        rel = (a - b).abs().amax(-1) / b.abs().amax(-1)
        assert 1e-4 < rel.median() < 0.05 and rel.max() < 0.15, rel
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_models_the_fused_loop_does_not_cover_keep_transformers():
    path = build_tiny_model(arch="qwen2", seed=1)
    for change, why in [(lambda m: setattr(m.config, "hidden_act", "gelu"), "hidden_act gelu"),
                        (lambda m: setattr(m.config, "use_sliding_window", True), "sliding window"),
                        (lambda m: setattr(m.model.rotary_emb, "rope_type", "dynamic"), "rope_type dynamic"),
                        (lambda m: setattr(m.config, "architectures", ["GPT2LMHeadModel"]), "GPT2LMHeadModel")]:
        lm = DraftLM(path)
        change(lm.model)
        assert why in unsupported(lm.model)
        assert not use_vllm_cpu_layers(lm) and lm.layers_forward is None


def test_padded_linear_runs_bucketed_chunks(monkeypatch):
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    assert [bucket_rows(r) for r in (1, 2, 3, 5, 64, 65, 200, 256)] == [1, 2, 4, 8, 64, 128, 256, 256]
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 80, bias=True)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    seen = []
    kernel = layer.cpu_linear
    monkeypatch.setattr(layer, "cpu_linear", lambda x, w, b: seen.append(x.shape[0]) or kernel(x, w, b))
    for rows in (1, 3, 5, 64, 65, CHUNK_ROWS, CHUNK_ROWS + 1, 2 * CHUNK_ROWS + 37):
        x = torch.randn(rows, 96)
        seen.clear()
        out = padded_linear(layer, x)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        assert set(seen) <= set(BUCKETS) and sum(min(s, CHUNK_ROWS) for s in seen) >= rows
        assert len(seen) == -(-rows // CHUNK_ROWS)
    assert cpu_gemm.CHUNK_ROWS in BUCKETS
