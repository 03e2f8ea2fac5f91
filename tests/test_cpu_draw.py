"""``integration/vllm/engine/cpu_draw.py``: vLLM's CPU draw of a sampled row, the vocabulary
sorted only where the top-p could move the draw. Against vLLM's own ``TopKTopPSampler`` (its
``forward_cpu``, as the engine's sampler runs on this machine), token for token."""

from __future__ import annotations

import pytest
import torch

from vllm_anisotropic.integration.vllm.engine import cpu_draw


def _vllm():
    from vllm import _custom_ops  # noqa: F401 - vLLM's ops, as the engine has them loaded
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    sampler = TopKTopPSampler("raw_logprobs")
    assert sampler.forward.__func__ is TopKTopPSampler.forward_cpu  # what the engine's sampler runs here
    return sampler


def _rows(n: int, vocab: int, seed: int) -> torch.Tensor:
    """Peaked to flat rows (the scale of a row's logits after the temperature), a third of them
    rounded to bf16 (ties, as the engine's bf16 logits have)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.empty(n, 1).uniform_(-2.0, 2.5, generator=g))
    rows = torch.randn(n, vocab, generator=g) * scale
    rows[: n // 3] = rows[: n // 3].to(torch.bfloat16).float()
    return rows


@pytest.mark.parametrize("vocab", [64, 4096, 49152])
def test_draw_is_vllms_cpu_draw_row_for_row(vocab, monkeypatch):
    """Seeded rows at top-p 0.2-1.0, some with a top-k, one row without a generator (the global
    stream, drawn the same way): every token equals vLLM's. Both of ``draw``'s ways are taken:
    rows whose draw the top-p cannot move (no sort) and rows sorted by vLLM's own mask (the
    unmasked draw outside the nucleus, or too near its edge, or a top-k)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    sampler = _vllm()
    n = 96
    sorted_rows = []
    real = topk_topp_sampler.apply_top_k_top_p

    def counting(logits, k, p):
        sorted_rows.append(logits.shape[0])
        return real(logits, k, p)

    monkeypatch.setattr(topk_topp_sampler, "apply_top_k_top_p", counting)
    for trial in range(3):
        rows = _rows(n, vocab, trial)
        g = torch.Generator().manual_seed(100 + trial)
        p = torch.empty(n).uniform_(0.2, 1.0, generator=g)
        p[::7] = 1.0
        k = torch.full((n,), vocab, dtype=torch.long)
        k[3::11] = torch.randint(1, 40, (len(range(3, n, 11)),), generator=g)
        gens = lambda: {i: torch.Generator().manual_seed(7 * trial + 31 * i) for i in range(1, n)}  # noqa: E731
        torch.manual_seed(trial)
        want, _ = sampler(rows.clone(), gens(), k, p)
        sorted_rows.clear()
        torch.manual_seed(trial)
        got, _ = cpu_draw.draw(rows.clone(), gens(), k, p)
        assert torch.equal(got.long(), want.long()), (trial, (got != want).nonzero().flatten().tolist())
        assert 0 < sum(sorted_rows) < n - n // 4, sorted_rows  # most rows unsorted, some sorted


def test_a_draw_the_mask_would_move_is_drawn_from_the_masked_row(monkeypatch):
    """Flat rows at top-p 0.3: the unmasked draw is often a token vLLM's top-p removes. Those
    rows must come from the masked row (vLLM's token), not the unmasked draw; a row at top-p
    1.0 or without any top-p / top-k is the unmasked draw, as vLLM's; a top-k alone is vLLM's
    top-k. Peaked rows (the draw their top token, ~99.7 % of the mass) at top-p 0.5 are not
    sorted at all: nothing lies above their draw."""
    from vllm.v1.sample.ops import topk_topp_sampler

    sampler = _vllm()
    n, vocab = 64, 1000
    rows = torch.randn(n, vocab, generator=torch.Generator().manual_seed(5)) * 0.5
    gens = lambda: {i: torch.Generator().manual_seed(i) for i in range(n)}  # noqa: E731
    p = torch.full((n,), 0.3)
    unmasked, _ = cpu_draw.draw(rows.clone(), gens(), None, None)
    want, _ = sampler(rows.clone(), gens(), None, p)
    assert int((unmasked != want).sum()) > n // 4  # the mask moves many of these draws
    got, _ = cpu_draw.draw(rows.clone(), gens(), None, p)
    assert torch.equal(got, want)
    for top_p in (None, torch.ones(n)):
        plain, _ = sampler(rows.clone(), gens(), None, top_p)
        assert torch.equal(cpu_draw.draw(rows.clone(), gens(), None, top_p)[0], plain)
        assert torch.equal(plain, unmasked)
    k = torch.full((n,), vocab, dtype=torch.long)
    k[::2] = 3
    want, _ = sampler(rows.clone(), gens(), k, None)
    assert torch.equal(cpu_draw.draw(rows.clone(), gens(), k, None)[0], want)
    assert int((want != unmasked).sum()) > n // 4  # the top-k moved them
    sorted_rows = []
    real = topk_topp_sampler.apply_top_k_top_p
    monkeypatch.setattr(topk_topp_sampler, "apply_top_k_top_p", lambda x, k, p: (sorted_rows.append(x.shape[0]),
                                                                                  real(x, k, p))[1])
    peaked = torch.zeros(n, 64)
    peaked[:, 5] = 10.0
    got, _ = cpu_draw.draw(peaked.clone(), gens(), None, torch.full((n,), 0.5))
    assert got.tolist() == [5] * n and sorted_rows == []


def test_a_token_tied_with_the_edge_of_the_nucleus_is_sorted_by_vllm():
    """A row whose draw is tied (equal logit) with tokens at the nucleus' edge: the sort may put
    the ties on either side, so ``draw`` counts their mass as above the draw and leaves such a
    row to vLLM's mask. Built so that, ties counted below, the draw would look safely inside."""
    sampler = _vllm()
    vocab = 40
    row = torch.full((vocab,), -4.0)
    row[:20] = 1.0  # 20 tied tokens hold ~all the mass: each 5 %
    n = 200
    rows = row.repeat(n, 1)
    gens = lambda: {i: torch.Generator().manual_seed(3 * i + 1) for i in range(n)}  # noqa: E731
    p = torch.full((n,), 0.5)
    want, _ = sampler(rows.clone(), gens(), None, p)
    got, _ = cpu_draw.draw(rows.clone(), gens(), None, p)
    assert torch.equal(got, want)
    assert len(set(want.tolist())) < 20  # vLLM's top-p 0.5 keeps about half of the ties


def test_checked_takes_draw_only_where_it_equals_vllms_sampler():
    """And its probe draws leave torch's global random stream (unseeded requests) as it was."""
    sampler = _vllm()
    torch.manual_seed(11)
    before = torch.rand(3)
    torch.manual_seed(11)
    assert cpu_draw.checked(sampler) is cpu_draw.draw
    assert torch.equal(torch.rand(3), before)

    class Other(type(sampler)):  # vLLM's sampler drawing other tokens (another release)
        def forward_cpu(self, logits, generators, k, p):
            tokens, rest = super().forward_cpu(logits, generators, k, p)
            return (tokens + 1) % logits.shape[1], rest

    other = Other("raw_logprobs")
    other.forward = other.forward_cpu
    assert cpu_draw.checked(other) is other
    fp64 = type(sampler)("raw_logprobs", use_fp64_gumbel=True)
    assert cpu_draw.checked(fp64) is fp64
    gpu_like = type(sampler)("raw_logprobs")
    gpu_like.forward = gpu_like.forward_native
    assert cpu_draw.checked(gpu_like) is gpu_like


def test_the_margin_covers_four_float32_sums_worst_case_error():
    """The nucleus test's margin (``cpu_draw.margin``) is at least four float32 sums' worst-case
    relative error over the vocabulary (``V x 2**-24`` each: this test's two sums and vLLM's
    softmax total and cumulative sum), and at least ``MARGIN``: real rounding is ~1e-7 here, so
    no draw can show a margin too thin; this pins the bound itself. Not wider than needed: at
    most 1.25 x the larger of the two (each row beyond it is sorted for nothing)."""
    for vocab in (64, 49152, 151936, 262144):
        bound = max(cpu_draw.MARGIN, 4 * vocab * 2.0**-24)
        assert bound <= cpu_draw.margin(vocab) <= 1.25 * bound, vocab
    assert cpu_draw.margin(151936) > 0.036 and cpu_draw.MARGIN == 0.01
