"""Target distribution p from logits, exactly as vLLM's sampler builds it; inverse-CDF sampling.

Scope: turning raw target logits into the processed target distribution p that every lossless
verifier must reproduce, and drawing one token from an unnormalised weight vector with one
uniform. No verification logic.

Source: vLLM 0.32 ``v1/sample/rejection_sampler.py::apply_sampling_constraints`` and
``v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p_pytorch``:

1. temperature: ``temperature < 1e-5`` is greedy (``_SAMPLING_EPS`` in ``v1/sample/sampler.py``);
   otherwise ``logits / temperature``;
2. top-k: sort ascending, mask every logit ``<`` the k-th largest (ties at the threshold are
   kept); ``k <= 0`` or ``k >= vocab_size`` disables it (vLLM stores "off" as ``vocab_size``);
3. top-p: on the top-k-masked sorted logits, ``cumsum(softmax) <= 1 - top_p`` is masked, the
   largest token always kept; ``top_p >= 1`` disables it;
4. p = softmax. Greedy rows become the one-hot of ``argmax(raw logits)`` (first index on ties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SAMPLING_EPS", "TargetSampling", "SamplingTensors", "target_probs", "sample_inverse_cdf"]

SAMPLING_EPS = 1e-5  # vLLM v1/sample/sampler.py::_SAMPLING_EPS


@dataclass(frozen=True)
class TargetSampling:
    """Sampling parameters of one request, as vLLM applies them to the target logits."""

    temperature: float = 1.0  # < 1e-5 means greedy
    top_k: int = -1  # <= 0 or >= vocab_size: disabled
    top_p: float = 1.0  # >= 1: disabled

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


@dataclass(frozen=True)
class SamplingTensors:
    """Per-request sampling parameters of a batch."""

    # [batch_size] float32
    temperature: torch.Tensor
    # [batch_size] int64 (<= 0 disabled)
    top_k: torch.Tensor
    # [batch_size] float32
    top_p: torch.Tensor

    @staticmethod
    def from_params(params, batch_size: int, device="cpu") -> "SamplingTensors":
        """``params``: one ``TargetSampling`` for all requests, or a list of ``batch_size``."""
        if isinstance(params, SamplingTensors):
            return params.to(device)
        if isinstance(params, TargetSampling):
            params = [params] * batch_size
        if len(params) != batch_size:
            raise ValueError(f"need {batch_size} sampling params, got {len(params)}")
        return SamplingTensors(
            temperature=torch.tensor([s.temperature for s in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([s.top_k for s in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([s.top_p for s in params], dtype=torch.float32, device=device),
        )

    def to(self, device) -> "SamplingTensors":
        return SamplingTensors(self.temperature.to(device), self.top_k.to(device), self.top_p.to(device))

    def index(self, rows: torch.Tensor) -> "SamplingTensors":
        return SamplingTensors(self.temperature[rows], self.top_k[rows], self.top_p[rows])


def target_probs(
    logits: torch.Tensor,  # [num_rows, vocab_size] raw target logits (any float dtype)
    temperature: torch.Tensor,  # [num_rows]
    top_k: torch.Tensor,  # [num_rows]
    top_p: torch.Tensor,  # [num_rows]
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Processed target distribution p, [num_rows, vocab_size] in ``dtype`` (rows sum to 1)."""
    assert logits.ndim == 2 and temperature.shape == (logits.shape[0],)
    num_rows, vocab_size = logits.shape
    x = logits.to(dtype)
    greedy = temperature < SAMPLING_EPS
    # temperature: greedy rows divide by 1 (vLLM replaces 0 by 1 before the in-place divide)
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(dtype)
    x = (x / temp.unsqueeze(1)).contiguous()  # this call's own (the nucleus writes it in place)
    k = top_k.to(torch.int64)
    use_k = (k > 0) & (k < vocab_size)
    use_p = top_p.to(dtype) < 1.0
    if bool(use_p.any()):
        if dtype != torch.float32:
            x = _sorted_top_k_top_p(x, k, use_k, top_p.to(dtype), use_p)
        else:
            # vLLM's dtype: the nucleus without the vocabulary sort where it is unambiguous, the
            # other rows by vLLM's sort of their logits as vLLM sorts them (before the top-k)
            before_k = x
            if bool(use_k.any()):
                x = _top_k_only(x, k, use_k)
            every = bool(use_p.all())
            rows = torch.arange(num_rows) if every else torch.nonzero(use_p).flatten()
            vals, idx, kept, exact = _nucleus_unsorted(x if every else x[rows], top_p[rows].to(dtype))
            # exact rows: their kept logits, every other one masked (in place: ``x`` is this
            # call's own, and ``before_k``'s rows left to the sort are not these)
            done = rows[exact]
            x.index_fill_(0, done, float("-inf"))
            keep = torch.arange(idx.shape[1]).unsqueeze(0) < kept[exact].unsqueeze(1)
            x.view(-1)[(done.unsqueeze(1) * vocab_size + idx[exact])[keep]] = vals[exact][keep]
            rest = rows[~exact]
            if rest.numel():
                x[rest] = _sorted_top_k_top_p(before_k[rest], k[rest], use_k[rest], top_p[rest].to(dtype), use_p[rest])
    elif bool(use_k.any()):
        x = _top_k_only(x, k, use_k)
    p = x.softmax(dim=-1)
    if bool(greedy.any()):
        onehot = torch.zeros_like(p).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        p = torch.where(greedy.unsqueeze(1), onehot, p)
    return p


def _top_k_only(x: torch.Tensor, k: torch.Tensor, use_k: torch.Tensor) -> torch.Tensor:
    """vLLM ``apply_top_k_only``: every logit ``<`` the row's k-th largest masked (ties kept)."""
    kk = torch.where(use_k, k, torch.ones_like(k))
    kmax = int(kk.max())
    thresh = x.topk(kmax, dim=1).values.gather(1, (kk - 1).unsqueeze(1))
    thresh = thresh.masked_fill(~use_k.unsqueeze(1), float("-inf"))
    return x.masked_fill(x < thresh, float("-inf"))


def _sorted_top_k_top_p(x: torch.Tensor, k: torch.Tensor, use_k: torch.Tensor, top_p: torch.Tensor,
                        use_p: torch.Tensor) -> torch.Tensor:
    """vLLM ``apply_top_k_top_p_pytorch``: ascending sort, top-k, the low tail whose cumulative
    mass is ``<= 1 - top_p`` masked (the largest always kept), scattered back."""
    vocab_size = x.shape[1]
    xs, idx = x.sort(dim=-1, descending=False)
    if bool(use_k.any()):
        kk = torch.where(use_k, k, torch.full_like(k, vocab_size))
        thresh = xs.gather(1, (vocab_size - kk).unsqueeze(1))  # k-th largest logit
        xs = xs.masked_fill(xs < thresh, float("-inf"))
    probs_sum = xs.softmax(dim=-1).cumsum(dim=-1)
    mask = probs_sum <= (1.0 - top_p).unsqueeze(1)
    mask[:, -1] = False
    mask &= use_p.unsqueeze(1)
    xs = xs.masked_fill(mask, float("-inf"))
    return torch.empty_like(x).scatter_(1, idx, xs)


NUCLEUS_CANDIDATES = 64  # the largest logits a row's nucleus is looked for among, without a sort


def nucleus_margin(vocab_size: int) -> float:
    """Relative bound on the difference between the tail mass ``_nucleus_unsorted`` computes and
    the cumulative sum vLLM compares with ``1 - top_p``: each side's softmax normaliser and tail
    sum, float32 sums of up to ``vocab_size`` positive terms (``(V - 1) u`` relative each, any
    order), and a few roundings per element (u = 2**-24)."""
    return (4 * vocab_size + 16) * 2.0**-24


def _nucleus_unsorted(x: torch.Tensor, top_p: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's top-p mask (``_sorted_top_k_top_p``) without sorting the vocabulary, where the
    float32 rounding of its cumulative sum cannot change it: ``(vals, idx, kept, exact)``, each
    row's ``NUCLEUS_CANDIDATES`` largest logits and their token ids (descending), how many of
    them the nucleus keeps (every other token masked) and whether that is vLLM's mask (``exact``,
    [rows] bool; the other rows are to be masked by the sort).

    vLLM masks token j when the mass of j and of every token sorted below it, ``T(j)``, is
    ``<= 1 - top_p``; ``T`` falls as the logit grows, so the kept tokens are the largest logits
    down to the last one with ``T > 1 - top_p``. Here ``T`` of the row's largest
    ``NUCLEUS_CANDIDATES`` logits is the mass outside them plus their own mass from j down. A row
    is exact when its boundary lies among them and is clear by ``nucleus_margin`` on both sides
    (the last kept token's ``T`` above, the first masked one's below) and the two logits differ
    (a tie there is ordered by the sort). The kept logits are the row's own, so the softmax
    after it is vLLM's, bit for bit."""
    n, vocab_size = x.shape
    cand = min(NUCLEUS_CANDIDATES, vocab_size)
    vals, idx = x.topk(cand, dim=1)  # descending
    probs = x.softmax(dim=-1)
    inside = probs.gather(1, idx).double()
    outside = probs.scatter_(1, idx, 0.0).sum(dim=1).double()
    tail = outside.unsqueeze(1) + inside.flip(1).cumsum(1).flip(1)
    limit = (1.0 - top_p).double().unsqueeze(1)  # vLLM's float32 1 - top_p
    kept = (tail > limit).sum(dim=1).clamp(min=1)  # the largest logit is always kept
    rows = torch.arange(n)
    last, first = kept - 1, kept.clamp(max=cand - 1)
    eps = nucleus_margin(vocab_size)
    exact = (kept < cand) & (tail[rows, first] * (1 + eps) < limit[:, 0])
    exact &= (last == 0) | (tail[rows, last] * (1 - eps) > limit[:, 0])
    exact &= vals[rows, last] != vals[rows, first]
    return vals, idx, kept, exact


def sample_inverse_cdf(
    weights: torch.Tensor,  # [num_rows, vocab_size] non-negative, unnormalised
    u: torch.Tensor,  # [num_rows] uniforms in [0, 1)
) -> torch.Tensor:
    """One token per row: the smallest index i with cumsum(w)[i] > u * sum(w). [num_rows] int64.

    Zero-weight tokens are never returned while the row has positive mass (the cumulative sum
    does not grow over them); a row of all zeros returns its argmax (index 0), which callers
    only reach on probability-zero events.
    """
    assert weights.ndim == 2 and u.shape == (weights.shape[0],)
    cdf = weights.cumsum(dim=-1)  # [num_rows, vocab_size]
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # guard the float edge u*total rounding up to total: fall back to the last positive token
    last_pos = (weights.shape[1] - 1) - (weights > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.minimum(idx, last_pos)
