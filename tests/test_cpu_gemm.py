"""draft_tree's q through vLLM's CPU GEMM (``integration.vllm.kernels.cpu_gemm``), on the tiny model.

What this would catch: a routed layer whose output is reshaped wrongly (a [batch, seq, out]
tensor laid out as [seq, batch, out] gives other logits for a batch of branches), a bias
dropped (the tiny Llama has none, so q/k/v biases come from a Qwen-style config here), a layer
left on torch's linear while its weight was removed (an empty weight: the forward raises), and
the dispatch reaching non-CPU or non-Linear modules. With ``draft_quantization: int8``: a layer
left in float (its error would be the float kernel's), scales taken per tensor or per column
instead of per output row, activations not quantized per row, a dropped bias, the weight
scales freed while the kernel still reads them, a weight quantized in passes of rows that skip
or overlap rows.
"""

from __future__ import annotations

import gc

import pytest
import torch

from vllm_anisotropic.integration.vllm.kernels import cpu_gemm
from vllm_anisotropic.integration.vllm.kernels.cpu_gemm import dispatch_linear, use_vllm_cpu_gemm
from vllm_anisotropic.models.tiny import build_tiny_model
from vllm_anisotropic.proposers.draft_model import DraftLM

CONTEXT = [1, 504, 3120, 28, 1711, 940, 77, 5012, 19, 640, 2201, 73]


def _logits(lm: DraftLM) -> tuple[torch.Tensor, torch.Tensor]:
    """q's logits after CONTEXT (a prefill) and for a batch of 3 branches one token later."""
    s = lm.new_session()
    root = s.root_logits(CONTEXT)
    branches = s.branch(3)
    step = branches.step(torch.tensor([5, 77, 940]))
    branches.close()
    return root, step


def test_routed_layers_give_torch_linear_logits():
    ref_lm, lm = (DraftLM(build_tiny_model(seed=1, block_std=0.1)) for _ in range(2))
    with torch.no_grad():  # biases on q, k, v as Qwen2 has them: a dropped bias changes logits
        for a, b in zip(ref_lm.model.modules(), lm.model.modules()):
            if isinstance(a, torch.nn.Linear) and a.out_features != ref_lm.vocab_size and a.bias is None:
                a.bias = torch.nn.Parameter(torch.randn(a.out_features) * 0.5)
                b.bias = torch.nn.Parameter(a.bias.detach().clone())
    linears = sum(type(m) is torch.nn.Linear for m in lm.model.modules())
    assert use_vllm_cpu_gemm(lm.model) == linears > 0
    # the weights went into the packed copies: only the routed path can run these layers
    assert all(m.weight.numel() == 0 for m in lm.model.modules() if type(m) is torch.nn.Linear)
    ref_root, ref_step = _logits(ref_lm)
    root, step = _logits(lm)
    assert step.shape == ref_step.shape == (3, lm.vocab_size)
    torch.testing.assert_close(root, ref_root, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step, ref_step, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(step[0], step[1])  # the branches differ: a batch mix-up would show


def _int8_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What ``draft_quantization: int8`` computes, in float64: the weight's rows and x's rows
    each rounded to int8 at their own largest magnitude / 127, multiplied, scaled back."""
    w, a = weight.double(), x.double()
    w_scale = w.abs().amax(1, keepdim=True) / 127
    a_scale = a.abs().amax(1, keepdim=True) / 127
    out = (torch.round(a / a_scale) @ torch.round(w / w_scale).T) * a_scale * w_scale.T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_layers_compute_the_int8_product(dtype, monkeypatch):
    """An int8 layer gives the product of the rounded weight and rows (to the float32
    accumulation's rounding), not the float product (its error is the quantization's, orders
    above the float kernel's), and keeps the bias; the scales it reads in place outlive the
    caller's references (a freed scale tensor reads garbage: a collection and fresh allocations
    between build and call would show it)."""
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(96, 64, generator=g) * torch.rand(96, 1, generator=g)).to(dtype)  # rows of different scales
    bias = torch.randn(96, generator=g).to(dtype)
    layer = torch.nn.Linear(64, 96, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    monkeypatch.setattr(cpu_gemm, "_ROWS_A_PASS", 40)  # the weight quantized in passes of 40, 40 and 16 rows
    dispatch_linear(layer, "int8")
    assert layer.weight.numel() == 0  # the kernel holds the only copy
    gc.collect()
    junk = [torch.full((96, 1), 1e30) for _ in range(64)]  # noqa: F841 (reuses freed memory, if any)
    x = (torch.randn(5, 64, generator=g) * torch.tensor([[0.01], [1.0], [30.0], [0.2], [5.0]])).to(dtype)
    got = layer.cpu_linear(x, layer.weight, layer.bias)
    assert got.dtype == dtype and got.shape == (5, 96)
    want = _int8_reference(x, weight, bias)
    exact = x.double() @ weight.double().T + bias.double()
    scale = exact.abs().amax(1, keepdim=True)
    err_int8 = ((got.double() - want).abs() / scale).max().item()
    err_float = ((got.double() - exact).abs() / scale).max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # a bf16 output rounds to 2^-8 of its magnitude (fp16 2^-11)
    assert err_int8 < tol, err_int8
    assert 1e-3 < err_float < 0.05, err_float  # quantized (not the float kernel), but close


def test_int8_routes_every_linear_and_unknown_quantizations_are_refused():
    lm = DraftLM(build_tiny_model(seed=1, block_std=0.1))
    linears = sum(type(m) is torch.nn.Linear for m in lm.model.modules())
    assert use_vllm_cpu_gemm(lm.model, "int8") == linears > 0
    assert all(hasattr(m, "int8_scales") for m in lm.model.modules() if type(m) is torch.nn.Linear)
    with pytest.raises(ValueError, match="draft_quantization 'int4': one of none, int8"):
        dispatch_linear(torch.nn.Linear(8, 8), "int4")


def test_auto_quantization_is_int8_on_a_cpu_with_vnni_only(monkeypatch):
    for vnni in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda vnni=vnni: vnni)
        assert cpu_gemm.resolve_quantization("auto", cpu_platform=True) == ("int8" if vnni else "none")
        assert cpu_gemm.resolve_quantization("auto", cpu_platform=False) == "none"
        assert cpu_gemm.resolve_quantization("none", cpu_platform=False) == "none"
        assert cpu_gemm.resolve_quantization("int8", cpu_platform=True) == "int8"
    with pytest.raises(ValueError, match="'int8' runs on vLLM's CPU platform with its oneDNN kernels only"):
        cpu_gemm.resolve_quantization("int8", cpu_platform=False)
    from vllm import _custom_ops as ops

    monkeypatch.setattr(ops, "_supports_onednn", False)  # a CPU build without oneDNN (e.g. POWER)
    assert cpu_gemm.resolve_quantization("auto", cpu_platform=True) == "none"
    with pytest.raises(ValueError, match="oneDNN kernels only"):
        cpu_gemm.resolve_quantization("int8", cpu_platform=True)
    with pytest.raises(ValueError, match="'fp8': one of auto, none, int8"):
        cpu_gemm.resolve_quantization("fp8", cpu_platform=True)
