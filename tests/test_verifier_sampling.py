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


def _vllm_probs(logits, temp, k, p):
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    vocab = logits.shape[1]
    k_vllm = torch.where((k > 0) & (k < vocab), k, torch.full_like(k, vocab))
    return ops.apply_top_k_top_p_pytorch(logits.float() / temp.unsqueeze(1), k_vllm, p).softmax(-1)


@pytest.mark.parametrize("vocab", [64, 4096, 151_936])
def test_the_unsorted_nucleus_is_vllms_mask_bit_for_bit(vocab):
    """Rows of every kind in one call (peaked and flat, top-k with top-p, top-p of 1.0, bf16 ties
    at the top): the probabilities are vLLM's, bit for bit, and both ways were taken (most rows
    without the sort, some by it)."""
    from vllm_anisotropic.verifiers.sampling import _nucleus_unsorted, _top_k_only

    g = torch.Generator().manual_seed(vocab)
    n = 48
    scale = torch.linspace(0.5, 12.0, n).unsqueeze(1)  # flat to peaked
    logits = (torch.randn(n, vocab, generator=g) * scale).to(torch.bfloat16)
    temp = torch.rand(n, generator=g) * 1.2 + 0.3
    k = torch.where(torch.rand(n, generator=g) < 0.3, torch.randint(1, 80, (n,), generator=g), torch.full((n,), -1))
    p = torch.rand(n, generator=g) * 0.9 + 0.05
    p[::5] = 1.0
    ours = target_probs(logits, temp, k, p)
    assert torch.equal(ours, _vllm_probs(logits, temp, k, p))
    x = logits.float() / temp.unsqueeze(1)
    use_k = (k > 0) & (k < vocab)
    rows = p < 1.0
    *_, exact = _nucleus_unsorted(_top_k_only(x, k, use_k)[rows], p[rows])
    assert exact.float().mean() > 0.5 and not exact.all(), exact


def test_rows_within_the_margin_of_the_nucleus_edge_are_sorted():
    """A row whose boundary token's tail mass lies within ``nucleus_margin`` of ``1 - top_p`` is
    left to the sort, one 3 margins away is not; so are a tie at the edge and a nucleus wider than
    the candidates. Two tokens A > B, the rest of the mass spread evenly: B's tail mass is set to
    ``(1 - top_p) (1 + f margin)``."""
    from vllm_anisotropic.verifiers.sampling import NUCLEUS_CANDIDATES, _nucleus_unsorted, nucleus_margin

    vocab, top_p = 4096, 0.9
    limit = float(torch.tensor(1.0 - top_p, dtype=torch.float32))
    eps = nucleus_margin(vocab)
    rows, want = [], []
    for f in (-3.0, -0.6, -0.2, 0.2, 0.6, 3.0):
        tail_b = limit * (1 + f * eps)
        rest = 0.02
        probs = torch.full((vocab,), rest / (vocab - 2), dtype=torch.float64)
        probs[5], probs[9] = 1 - tail_b, tail_b - rest
        rows.append(probs.log())
        want.append(abs(f) > 1)
    tie = rows[-1].clone()
    tie[11] = tie[9]  # B's twin: the edge is a tie
    flat = torch.zeros(vocab, dtype=torch.float64)  # every token tied: the nucleus holds 90 % of them
    x = torch.stack(rows + [tie, flat]).float()
    vals, idx, kept, exact = _nucleus_unsorted(x, torch.full((len(x),), top_p))
    assert exact.tolist() == want + [False, False]
    assert kept.tolist()[:6] == [1, 1, 1, 2, 2, 2] and kept[-1] == NUCLEUS_CANDIDATES
    assert torch.equal(target_probs(x, torch.ones(len(x)), torch.full((len(x),), -1), torch.full((len(x),), top_p)),
                       _vllm_probs(x, torch.ones(len(x)), torch.full((len(x),), -1), torch.full((len(x),), top_p)))


def test_the_nucleus_margin_covers_four_float32_sums():
    """The margin (relative) covers, per side, a softmax normaliser and a tail sum of up to
    ``vocab`` positive float32 terms in any order ((V - 1) 2**-24 each) and a few roundings."""
    from vllm_anisotropic.verifiers.sampling import nucleus_margin

    for vocab in (64, 49_152, 151_936):
        assert nucleus_margin(vocab) >= 4 * (vocab - 1) * 2.0**-24 + 8 * 2.0**-24
        assert nucleus_margin(vocab) < 8 * vocab * 2.0**-24 + 1e-5  # not so wide that no row is exact


def test_peaked_rows_never_reach_the_sort(monkeypatch):
    """float32 (vLLM's dtype) rows whose nucleus edge is clear take no vocabulary sort; float64
    rows (the offline verifiers' exact laws) always do."""
    from vllm_anisotropic.verifiers import sampling

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 4096, generator=g)
    logits[:, 7] += 14.0  # one token holds > 99 % of every row
    args = (torch.full((16,), 0.8), torch.full((16,), -1), torch.full((16,), 0.9))
    want = target_probs(logits, *args)
    monkeypatch.setattr(sampling, "_sorted_top_k_top_p", lambda *a: pytest.fail("sorted a peaked row"))
    assert torch.equal(target_probs(logits, *args), want) and (want[:, 7] == 1.0).all()
    with pytest.raises(pytest.fail.Exception):
        target_probs(logits, *args, dtype=torch.float64)


def test_vllms_thresholds_for_greedy_and_top_k():
    """``temperature < 1e-5`` is greedy (1e-5 itself samples); ``top_k`` 0 is off, as -1 is."""
    logits = torch.tensor([[0.0, 1.0, 1.0 - 1e-5, 0.2]])  # at T = 1e-5 the top two differ by ~1
    at_eps = target_probs(logits, torch.tensor([1e-5]), torch.tensor([-1]), torch.tensor([1.0]))
    assert torch.equal(at_eps, (logits / torch.tensor(1e-5)).softmax(-1)) and 0.1 < at_eps[0, 2] < 0.5
    for p in (1.0, 0.9):
        off = target_probs(logits, torch.tensor([1.0]), torch.tensor([-1]), torch.tensor([p]))
        assert torch.equal(target_probs(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([p])), off)
