"""The exact-law reference of the engine law tests (``exact_law.py``): its processed law equals
vLLM's sampler's, and its statistic has the false-alarm rate and the power its docstring states."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exact_law import LawCheck, processed_probs


def _vllm_law(logits, temperature, top_p=None, top_k=None, min_p=None, logit_bias=None):
    """The same law through vLLM's own pieces: its min_p processor's rule and its full-sort
    ``apply_top_k_top_p_pytorch``."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = logits.clone()
    for token, bias in (logit_bias or {}).items():
        logits[:, token] += bias
    logits = logits / temperature
    if min_p:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -float("inf"))
    rows = logits.shape[0]
    k = None if top_k is None else torch.full((rows,), top_k, dtype=torch.long)
    p = None if top_p is None else torch.full((rows,), top_p, dtype=torch.float32)
    return apply_top_k_top_p_pytorch(logits, k, p).softmax(-1)


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.8, "top_p": 0.95}, {"temperature": 1.3, "top_p": 0.9}, {"temperature": 1.0, "top_k": 50},
    {"temperature": 0.8, "top_p": 0.95, "min_p": 0.15, "logit_bias": {3: -1.5, 7: 1.5}},
    {"temperature": 0.7, "top_p": 0.5, "top_k": 20},
])
def test_processed_law_is_vllms(sampling):
    """Sharp rows (the candidates hold p) and flat rows (they do not: vLLM's full sort)."""
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.3, 1.0, 4.0, 8.0]).repeat(16)[:, None]  # [64, 1]: flat to sharp rows
    logits = torch.randn(64, 2000, generator=gen) * scale
    ours = processed_probs(logits, candidates=64, **sampling)
    theirs = _vllm_law(logits, **sampling)
    assert torch.equal(ours > 0, theirs > 0)  # the same tokens kept
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_the_statistic_fails_a_biased_sampler_and_passes_the_right_one():
    """On simulated runs of 1,500 tokens with top probabilities like an engine run's (mean 0.8):
    the right law passes (|z| < 4 in 400 of 400), a sampler whose top token is 5 % too likely or
    too unlikely fails as often as ``rejection_rate`` predicts (0.92 and 0.96, within 0.05). Unweighted (all
    w_t = 1) the same runs would fail only ~40 % of the time: the weights buy the power."""
    rng = np.random.default_rng(5)
    top = np.clip(rng.beta(4, 1, size=1500), 0.05, 1.0)  # mean 0.8, like the law fixture's
    check = LawCheck(top=top, hit=np.zeros_like(top))
    assert check.power() >= 0.9
    for bias in (0.05, -0.05):
        predicted = check.rejection_rate(bias)
        q = np.clip(top * (1 + bias), 0, 1)
        failed = np.mean([abs(LawCheck(top=top, hit=(rng.random(top.size) < q).astype(float)).z) >= 4
                          for _ in range(400)])
        print(f"bias {bias:+.2f}: failed {failed:.3f}, predicted {predicted:.3f}")
        assert abs(failed - predicted) < 0.05, (bias, failed, predicted)
    right = [abs(LawCheck(top=top, hit=(rng.random(top.size) < top).astype(float)).z) for _ in range(400)]
    assert max(right) < 4
    assert check.false_alarm_rate() < 5e-4
