"""draft_tree's q through vLLM's CPU GEMM (``integration.vllm.kernels.cpu_gemm``), on the tiny model.

What this would catch: a routed layer whose output is reshaped wrongly (a [batch, seq, out]
tensor laid out as [seq, batch, out] gives other logits for a batch of branches), a bias
dropped (the tiny Llama has none, so q/k/v biases come from a Qwen-style config here), a layer
left on torch's linear while its weight was removed (an empty weight: the forward raises), and
the dispatch reaching non-CPU or non-Linear modules.
"""

from __future__ import annotations

import torch

from vllm_anisotropic.integration.vllm.kernels.cpu_gemm import use_vllm_cpu_gemm
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
