"""draft_tree's q as one loop over its decoder layers on vLLM's CPU kernels (Llama / Qwen2 family).

Why: the engine runs q's batched forwards (``proposers.draft_kv.DraftKV.forward``) through
transformers' decoder, about 45 small torch ops and a dozen module calls per layer (RMSNorm
in float32 by hand, RoPE by ``rotate_half`` and ``cat``, separate q / k / v and gate / up
GEMMs). vLLM's own ``draft_model`` runs the same q as an inductor-compiled graph. Here a layer
is its seven linear layers in four GEMM calls plus vLLM's fused ops:

* ``fused_add_rms_norm`` (the residual add and the norm in one pass) and ``rms_norm``;
* one GEMM for q, k and v (weights and biases concatenated), one for gate and up, each through
  vLLM's CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm``: oneDNN, sgl-kernel or
  zentorch, as vLLM picks for its own layers), and o / down the same way;
* ``rotary_embedding`` in place on the q and k views of the fused output (a cos / sin cache
  built from the model's own ``inv_freq`` and ``attention_scaling``, so static RoPE variants
  such as Llama 3's come out as transformers computes them);
* SiLU(gate) * up as two torch ops (vLLM's ``silu_and_mul`` CPU op measured slower than that
  on this project's Xeon: 5.3 ms against 1.8 ms at 1,000 tokens, bf16);
* the attention through the forward's plan (``DraftKV``'s ``_Forward.write`` / ``attend``),
  exactly as the transformers path calls it.

Scope: CPU platform; ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM``
configs with SiLU, no sliding window and a RoPE whose frequencies do not depend on the
sequence (``default``, ``linear``, ``llama3``). Anything else keeps the transformers path
(``use_vllm_cpu_layers`` returns False). Once fused, the decoder's linear modules hold no
weights (the packed copies replace them, memory does not grow) and raise if called: q then
runs only through ``DraftKV`` (the engine's only path), never the one-request transformers
path. Logits differ from transformers' by rounding only (tests/test_cpu_draft.py).
"""

from __future__ import annotations

import logging

import torch

from vllm_anisotropic.integration.vllm.kernels.cpu_gemm import BUCKETS, CHUNK_ROWS, dispatch_linear, padded_linear
from vllm_anisotropic.proposers.draft_common import attention_dims

__all__ = ["use_vllm_cpu_layers", "warm_up"]

logger = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
STATIC_ROPE = ("default", "linear", "llama3")


def unsupported(model) -> str | None:
    """Why ``model`` (a transformers causal LM) cannot take the fused layers, None if it can."""
    config = model.config
    arch = (getattr(config, "architectures", None) or [type(model).__name__])[0]
    if arch not in ARCHITECTURES:
        return f"architecture {arch} (fused: {', '.join(ARCHITECTURES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act}"
    window = getattr(config, "use_sliding_window", False) or (arch == "MistralForCausalLM"
                                                               and getattr(config, "sliding_window", None))
    if window:
        return "a sliding window"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"rope_type {rope} (fused: {', '.join(STATIC_ROPE)})"
    if model.device.type != "cpu":
        return f"device {model.device}"
    return None


class _Gemm:
    """One linear layer ``x @ weight.T + bias`` through vLLM's CPU GEMM (the weight packed once;
    ``quantization``: ``cpu_gemm.dispatch_linear``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantization: str = "none") -> None:
        self.layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                                     dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            self.layer.weight.copy_(weight)
            if bias is not None:
                self.layer.bias.copy_(bias)
        dispatch_linear(self.layer, quantization)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return padded_linear(self.layer, x)  # at a few row counts (cpu_gemm.bucket_rows)


class _Unfused(torch.nn.Module):
    """Stands where a fused linear was: its weight is in the fused layers now."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("q's decoder runs through vLLM's CPU kernels (integration/vllm/kernels/cpu_draft.py): "
                           "this linear layer has no weight of its own; run q through DraftKV.forward")


class _Layer:
    def __init__(self, layer, quantization: str = "none") -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _Gemm(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                         None if attn.q_proj.bias is None
                         else torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]), quantization)
        self.o = _Gemm(attn.o_proj.weight, attn.o_proj.bias, quantization)
        self.gate_up = _Gemm(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None, quantization)
        self.down = _Gemm(mlp.down_proj.weight, None, quantization)
        self.sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        self.intermediate = mlp.gate_proj.out_features
        self.scaling = attn.scaling
        self.index = attn.layer_idx
        self.norm1 = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        self.norm2 = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        for module, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                setattr(module, name, _Unfused())


class FusedLayers:
    """q's decoder (embedding, layers, final norm) as ``DraftLM.layers_forward``: ``(ids [T],
    positions [T], plan) -> hidden [T, hidden]`` (module docstring)."""

    def __init__(self, model, quantization: str = "none") -> None:
        config = model.config
        decoder = model.model
        self.embed = decoder.embed_tokens
        self.heads, self.kv_heads, self.head_dim = attention_dims(config)
        self.norm = (decoder.norm.weight, decoder.norm.variance_epsilon)
        self.inv_freq = decoder.rotary_emb.inv_freq.float().cpu()
        self.rope_scale = float(getattr(decoder.rotary_emb, "attention_scaling", 1.0))
        self.dtype = model.dtype
        self.cos_sin = self._rope(int(config.max_position_embeddings))
        self.layers = [_Layer(layer, quantization) for layer in decoder.layers]

    def _rope(self, positions: int) -> torch.Tensor:
        """vLLM's cos / sin cache for positions 0..``positions`` - 1: ``[positions, rotary_dim]``,
        the cos half then the sin half, in the model's dtype (as transformers casts its cos / sin
        before applying them)."""
        freqs = torch.arange(positions, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        rope = torch.cat([freqs.cos() * self.rope_scale, freqs.sin() * self.rope_scale], dim=-1)
        return rope.to(dtype=self.dtype, device=self.embed.weight.device)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, plan) -> torch.Tensor:
        from vllm import _custom_ops as ops

        tokens = ids.shape[0]
        if tokens and int(positions.max()) >= self.cos_sin.shape[0]:
            # past the config's max_position_embeddings (the target's max_model_len can be longer):
            # vLLM's op reads its cache without a bound check, so the cache grows, as transformers'
            # RoPE computes any position
            self.cos_sin = self._rope(2 * (int(positions.max()) + 1))
        hidden = self.embed(ids)
        residual = hidden
        hidden = torch.empty_like(residual)
        ops.rms_norm(hidden, residual, *self.layers[0].norm1)
        for i, layer in enumerate(self.layers):
            if i:
                ops.fused_add_rms_norm(hidden, residual, *layer.norm1)  # hidden: norm(h + r), residual: h + r
            q, k, v = layer.qkv(hidden).split(layer.sizes, dim=-1)
            ops.rotary_embedding(positions, q, k, self.head_dim, self.cos_sin, True)
            plan.write(layer.index, k.view(tokens, self.kv_heads, self.head_dim).transpose(0, 1)[None],
                       v.view(tokens, self.kv_heads, self.head_dim).transpose(0, 1)[None])
            out, _ = plan.attend(layer.index, q.view(tokens, self.heads, self.head_dim).transpose(0, 1)[None],
                                 layer.scaling)
            hidden = layer.o(out.reshape(tokens, self.heads * self.head_dim))
            ops.fused_add_rms_norm(hidden, residual, *layer.norm2)
            hidden = self._mlp(layer, hidden)
        ops.fused_add_rms_norm(hidden, residual, *self.norm)
        return hidden


    @staticmethod
    def _mlp(layer: _Layer, hidden: torch.Tensor) -> torch.Tensor:
        """down(SiLU(gate) * up), ``CHUNK_ROWS`` tokens at a time (the GEMMs' best size here, and
        gate / up's wide output never held for a whole prompt)."""
        if hidden.shape[0] <= CHUNK_ROWS:
            gate, up = layer.gate_up(hidden).split(layer.intermediate, dim=-1)
            return layer.down(torch.nn.functional.silu(gate) * up)
        out = torch.empty_like(hidden)
        for i in range(0, hidden.shape[0], CHUNK_ROWS):
            gate, up = layer.gate_up(hidden[i : i + CHUNK_ROWS]).split(layer.intermediate, dim=-1)
            out[i : i + CHUNK_ROWS] = layer.down(torch.nn.functional.silu(gate) * up)
        return out


def use_vllm_cpu_layers(lm, quantization: str = "none") -> bool:
    """q's (``proposers.draft_model.DraftLM``) decoder through ``FusedLayers`` when it can
    (module docstring; ``quantization``: ``cpu_gemm.dispatch_linear``); False, with the reason
    logged, where it keeps transformers' path."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    why = unsupported(lm.model)
    if why is not None:
        logger.info("draft model: transformers' decoder (no fused CPU layers for %s)", why)
        return False
    with torch.no_grad():
        lm.layers_forward = FusedLayers(lm.model, quantization)
    logger.info("draft model: %d decoder layers on vLLM's CPU kernels", len(lm.layers_forward.layers))
    return True


@torch.inference_mode()
def warm_up(lm) -> float:
    """Run each of q's GEMMs (the fused layers' and the output head) once at every row count of
    ``cpu_gemm.BUCKETS``, so that vLLM's oneDNN matmul builds its primitives at start-up rather
    than in the first steps that need them (cpu_gemm.padded_linear); seconds taken."""
    import time

    start = time.perf_counter()
    layers = getattr(lm.layers_forward, "layers", [])
    head = lm.model.get_output_embeddings()
    hidden = int(lm.model.config.hidden_size)
    for rows in BUCKETS:
        x = torch.zeros(rows, hidden, dtype=lm.dtype, device=lm.device)
        for layer in layers:
            layer.qkv(x)
            layer.o(torch.zeros(rows, layer.sizes[0], dtype=lm.dtype, device=lm.device))
            layer.gate_up(x)
            layer.down(torch.zeros(rows, layer.intermediate, dtype=lm.dtype, device=lm.device))
        head(x)
    return time.perf_counter() - start
