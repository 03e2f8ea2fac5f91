"""The draft model's linear layers through vLLM's own CPU GEMM (oneDNN / sgl-kernel / zentorch).

Why: ``draft_tree``'s q is a transformers model (``proposers.draft_model.DraftLM``) whose
``nn.Linear`` layers run ``torch.nn.functional.linear``. vLLM's CPU layers instead pick a kernel
per weight at load time (``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``:
zentorch on AMD Zen, sgl-kernel's packed GEMM for small weights on AMX CPUs, else a oneDNN
matmul on a pre-packed weight). Measured on this project's 2-core Xeon (avx512_bf16, no AMX),
one thread as vLLM's CPU worker runs, Qwen2.5-Coder-0.5B bf16, one decode token after 200:
133.6 ms a forward with torch's linear, 96.8 ms with the dispatched kernel, logits identical.
q's forwards are most of a ``draft_tree`` step on a CPU (docs/draft_tree.md), so q takes the
kernels vLLM's own ``draft_model`` gets.

Scope: CPU platform only (on GPUs torch's linear is cuBLAS already; nothing changes), plain
``nn.Linear`` modules (subclasses and quantized layers untouched). Each layer keeps its
module and bias; its weight is replaced by the packed copy (``remove_weight``), so memory does
not double, except a weight shared with another module (q's tied embedding and output head):
that one stays for the other module, and the packed copy is extra (151,936 x 896 bf16 = 272 MB
for Qwen2.5-0.5B).

**int8** (``draft_quantization: int8``, and ``auto`` on a CPU with VNNI): each weight quantized once to int8 per output channel
(symmetric, the row's largest magnitude at 127) and each call's rows to int8 per row (vLLM's
dynamic per-token quantization), multiplied by vLLM's oneDNN int8 GEMM
(``create_onednn_scaled_mm`` / ``onednn_scaled_mm``, the kernel of vLLM's own W8A8 checkpoints on
CPUs), output in the activations' dtype. A decode forward of q reads every weight once, so
it is bound by memory: half the bytes of bf16. Only q's drafts change (the target verifies every
one, so the output does not); how many the target accepts is measured (docs/draft_tree.md).
"""

from __future__ import annotations

import logging

import torch

__all__ = ["BUCKETS", "CHUNK_ROWS", "QUANTIZATIONS", "bucket_rows", "dispatch_linear", "padded_linear",
           "resolve_quantization", "use_vllm_cpu_gemm"]

logger = logging.getLogger(__name__)


QUANTIZATIONS = ("none", "int8")  # what draft_tree's ``draft_quantization`` resolves to (module docstring)
_ROWS_A_PASS = 16_384  # weight rows quantized at a time (the float32 copy of a 151,936-row head: 545 MB)


def use_vllm_cpu_gemm(model: torch.nn.Module, quantization: str = "none") -> int:
    """Route every plain ``nn.Linear`` of ``model`` through vLLM's CPU GEMM (``dispatch_linear``);
    returns how many layers were routed (0 off the CPU platform)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    routed = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.device.type != "cpu":
            continue
        dispatch_linear(module, quantization)
        module.forward = _routed_forward(module)
        routed += 1
    logger.info("draft model: %d linear layers use vLLM's CPU GEMM%s", routed,
                " (int8)" if quantization == "int8" else "")
    return routed


def resolve_quantization(key: str, cpu_platform: bool) -> str:
    """What q's linear layers run in for draft_tree's ``draft_quantization`` ``key``: ``auto`` is
    ``int8`` on vLLM's CPU platform where the CPU has VNNI (``torch.cpu._is_vnni_supported``)
    and vLLM's build its oneDNN kernels (``_supports_onednn``; not on every architecture), else
    ``none``; ``int8`` without both is refused."""
    from vllm import _custom_ops as ops

    onednn = bool(getattr(ops, "_supports_onednn", False))
    if key == "auto":
        return "int8" if cpu_platform and onednn and torch.cpu._is_vnni_supported() else "none"
    if key not in QUANTIZATIONS:
        raise ValueError(f"draft_quantization {key!r}: one of auto, {', '.join(QUANTIZATIONS)}")
    if key != "none" and not (cpu_platform and onednn):
        raise ValueError(f"draft_tree's draft_quantization {key!r} runs on vLLM's CPU platform with its oneDNN "
                         f"kernels only; use \"none\" or \"auto\"")
    return key


def dispatch_linear(layer: torch.nn.Linear, quantization: str = "none") -> None:
    """Give ``layer`` vLLM's CPU kernel as ``layer.cpu_linear(x, weight, bias)`` and drop its
    weight (the kernel holds its own packed copy): ``none`` vLLM's unquantized dispatch
    (``dispatch_cpu_unquantized_gemm``), ``int8`` its oneDNN int8 GEMM (module docstring)."""
    if quantization == "none":
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    elif quantization == "int8":
        _dispatch_int8(layer)
    else:
        raise ValueError(f"draft_quantization {quantization!r}: one of {', '.join(QUANTIZATIONS)}")


@torch.no_grad()
def _dispatch_int8(layer: torch.nn.Linear) -> None:
    from vllm import _custom_ops as ops

    weight = layer.weight.detach()
    dtype, out_features = weight.dtype, weight.shape[0]
    quantized = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(out_features, 1, dtype=torch.float32)
    for i in range(0, out_features, _ROWS_A_PASS):
        rows = weight[i : i + _ROWS_A_PASS].float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
        quantized[i : i + _ROWS_A_PASS] = torch.round(rows / scale).clamp(-127, 127).to(torch.int8)
        scales[i : i + _ROWS_A_PASS] = scale
    # the kernel packs the weight [in, out] (a transposed view) but reads the scales in place:
    # they live as long as the layer
    handler = ops.create_onednn_scaled_mm(quantized.t(), scales, dtype, True, False, 32)
    layer.int8_scales = scales

    def cpu_linear(x: torch.Tensor, _weight, bias: torch.Tensor | None) -> torch.Tensor:
        x_q, x_scales, _ = ops.onednn_scaled_int8_quant(x.contiguous())
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
        return ops.onednn_scaled_mm(handler, x_q, out, x_scales, None, None, bias)

    layer.cpu_linear = cpu_linear
    layer.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)


CHUNK_ROWS = 256  # most rows per GEMM call (``padded_linear``)


def bucket_rows(rows: int) -> int:
    """The row count a GEMM call of ``rows`` (<= ``CHUNK_ROWS``) rows runs at (``padded_linear``):
    the next power of two, so that q's GEMMs see nine row counts in all (``BUCKETS``)."""
    return 1 << max(rows - 1, 0).bit_length()


BUCKETS = tuple(1 << i for i in range(CHUNK_ROWS.bit_length()))  # 1, 2, 4, ..., CHUNK_ROWS


def padded_linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer.cpu_linear`` (vLLM's dispatched kernel) of ``x`` [rows, in_features] in calls of
    at most ``CHUNK_ROWS`` rows, each run at ``bucket_rows`` rows (zero rows appended, their
    outputs dropped). Both measured on this project's Xeon (bf16, 2 threads, vLLM's oneDNN
    matmul):

    * vLLM's oneDNN matmul builds a primitive the first time it sees a row count, per weight: a
      new count costs about 0.35 ms more at <= 32 rows, 1 ms more at 33-49 and 3.5 ms more at
      ~300 rows (a 9,728 x 896 weight). q's packed forwards see a different count nearly every
      step (a prompt's length, each request's accepted tokens), ~100 GEMMs per forward. Padded
      to powers of two they see ``BUCKETS`` only, built once at start-up
      (``cpu_draft.warm_up``); at most 64 rows a GEMM here reads weights more than it computes,
      so padding costs little there.
    * 1,024 rows in one call took 685 ms over q's 24 layers (Qwen2.5-0.5B's four GEMM shapes),
      in calls of 256 rows 386 ms: a prompt's catch-up runs in chunks."""
    rows = x.shape[0]
    if rows > CHUNK_ROWS:
        return torch.cat([padded_linear(layer, x[i : i + CHUNK_ROWS]) for i in range(0, rows, CHUNK_ROWS)])
    padded = bucket_rows(rows)
    if padded != rows:
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
    return layer.cpu_linear(x, layer.weight, layer.bias)[:rows]


def _routed_forward(module: torch.nn.Module):
    out_features = module.out_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        # vLLM's kernels take [tokens, in_features]; transformers passes [batch, seq, in_features]
        y = padded_linear(module, x.reshape(-1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], out_features)

    return forward
