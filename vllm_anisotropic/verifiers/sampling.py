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
    x = x / temp.unsqueeze(1)
    k = top_k.to(torch.int64)
    use_k = (k > 0) & (k < vocab_size)
    use_p = top_p.to(dtype) < 1.0
    if bool(use_p.any()):
        # sort-based path (vLLM apply_top_k_top_p_pytorch): ascending sort, mask, scatter back
        xs, idx = x.sort(dim=-1, descending=False)
        if bool(use_k.any()):
            kk = torch.where(use_k, k, torch.full_like(k, vocab_size))
            thresh = xs.gather(1, (vocab_size - kk).unsqueeze(1))  # k-th largest logit
            xs = xs.masked_fill(xs < thresh, float("-inf"))
        probs_sum = xs.softmax(dim=-1).cumsum(dim=-1)
        # mask the low tail whose cumulative mass is <= 1 - top_p; always keep the largest
        mask = probs_sum <= (1.0 - top_p.to(dtype)).unsqueeze(1)
        mask[:, -1] = False
        mask &= use_p.unsqueeze(1)
        xs = xs.masked_fill(mask, float("-inf"))
        x = torch.empty_like(x).scatter_(1, idx, xs)
    elif bool(use_k.any()):
        # top-k only (vLLM apply_top_k_only): threshold = k-th largest, strict < masked
        kk = torch.where(use_k, k, torch.ones_like(k))
        kmax = int(kk.max())
        thresh = x.topk(kmax, dim=1).values.gather(1, (kk - 1).unsqueeze(1))
        thresh = thresh.masked_fill(~use_k.unsqueeze(1), float("-inf"))
        x = x.masked_fill(x < thresh, float("-inf"))
    p = x.softmax(dim=-1)
    if bool(greedy.any()):
        onehot = torch.zeros_like(p).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        p = torch.where(greedy.unsqueeze(1), onehot, p)
    return p


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
