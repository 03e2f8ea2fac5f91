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
"""

from __future__ import annotations

import logging

import torch

__all__ = ["use_vllm_cpu_gemm"]

logger = logging.getLogger(__name__)


def use_vllm_cpu_gemm(model: torch.nn.Module) -> int:
    """Route every plain ``nn.Linear`` of ``model`` through vLLM's CPU GEMM dispatch; returns how
    many layers were routed (0 off the CPU platform)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    routed = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.device.type != "cpu":
            continue
        dispatch_cpu_unquantized_gemm(module, remove_weight=True)
        module.forward = _routed_forward(module)
        routed += 1
    logger.info("draft model: %d linear layers use vLLM's CPU GEMM", routed)
    return routed


def _routed_forward(module: torch.nn.Module):
    out_features = module.out_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        # vLLM's kernels take [tokens, in_features]; transformers passes [batch, seq, in_features]
        y = module.cpu_linear(x.reshape(-1, x.shape[-1]), module.weight, module.bias)
        return y.reshape(*x.shape[:-1], out_features)

    return forward
