"""``target_probs`` reproduces vLLM's processed target distribution (temperature, top-k, top-p)."""

import pytest
import torch

from vllm_anisotropic.verifiers.sampling import sample_inverse_cdf, target_probs


def test_matches_vllm_sampler():
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    logits[:, 7] = logits[:, 3]  # ties at the top-k threshold
    temp = torch.rand(64, generator=g) * 1.5 + 0.1
    k = torch.randint(1, 50, (64,), generator=g)
    k[::3] = 50  # vLLM encodes "no top-k" as vocab_size
    p = torch.rand(64, generator=g) * 0.9 + 0.05
    p[::4] = 1.0
    ours = target_probs(logits, temp, torch.where(k == 50, -1, k), p)
    ref = ops.apply_top_k_top_p_pytorch(logits.clone() / temp.unsqueeze(1), k, p).softmax(-1)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    ref_k = ops.apply_top_k_only(logits.clone() / temp.unsqueeze(1), k.clone()).softmax(-1)
    ours_k = target_probs(logits, temp, torch.where(k == 50, -1, k), torch.ones(64))
    torch.testing.assert_close(ours_k, ref_k, rtol=1e-5, atol=1e-6)


def test_greedy_rows_are_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    p = target_probs(logits, torch.tensor([0.0, 1.0]), torch.tensor([-1, -1]), torch.tensor([1.0, 1.0]))
    assert p[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(p[1], logits[1].softmax(-1))


def test_inverse_cdf_never_picks_zero_weight():
    w = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(1000, 1)
    u = torch.linspace(0, 1 - 1e-12, 1000, dtype=torch.float64)
    y = sample_inverse_cdf(w, u)
    assert set(y.tolist()) == {1, 3}
    assert (y == 1).sum() == 500
