"""vLLM's CPU draw of a sampled row, without sorting the vocabulary where the top-p cannot matter.

Why: the NSS walk (``sampler._walk_sampled``) samples every row it visits with vLLM's own
``TopKTopPSampler``. On x86 and ARM CPUs that is ``forward_cpu`` (vLLM 0.32): top-k / top-p
applied by sorting each row's whole vocabulary (``apply_top_k_top_p_pytorch``: ~2.8 ms a
49,152-token row on one Xeon core), then ``fused_gumbel_argmax(logits, seeds)``, the argmax of
the row plus Gumbel noise that depends only on (the row's seed, the token). In a sampled GOOSE
step at 8 requests those sorts were most of the plugin's host work (profile-host at T = 0.7,
top-p 0.95: the walk 18 ms a step).

How (``draw``), exactly vLLM's token, row by row:

1. the seeds as ``forward_cpu`` draws them: one global ``torch.randint`` of the batch, then one
   draw from each request's generator, in the generators' order;
2. ``w``, the draw from the unmasked row (``fused_gumbel_argmax`` on it, same seeds);
3. a mask only removes tokens, so the masked draw is ``w`` whenever vLLM's mask keeps ``w``.
   vLLM's top-p keeps the tokens whose ascending cumulative probability exceeds ``1 - p``:
   ``w`` is kept when the probability of the tokens above it, with those tied with it (the sort
   may put them above), is below ``p - margin(V)``: the margin bounds the float32 rounding of this
   test's sums and of vLLM's softmax and cumulative sum (at most ~V x 6e-8 each: 3e-3 at V =
   49,152; ``margin`` is 1.2e-2 there), so the test never keeps a token vLLM masks;
4. the other rows (the test failed, or a top-k below the vocabulary) are masked by vLLM's own
   ``apply_top_k_top_p`` and drawn by ``fused_gumbel_argmax`` with their seeds from step 1.

Rows without a top-p and top-k take step 2 alone (vLLM sorts nothing for them either).

Scope: ``checked(sampler)`` returns ``draw`` only where vLLM's sampler is ``forward_cpu`` with
float32 Gumbel noise and ``draw`` equals it on probe rows (seeded, top-p 0.5-1.0, top-k, flat
and peaked rows, ties); otherwise vLLM's sampler itself (with the reason logged), so another
vLLM release falls back rather than drawing other tokens.
"""

from __future__ import annotations

import logging

import torch
from vllm import _custom_ops  # noqa: F401 - loads vLLM's ops (torch.ops._C)
from vllm.v1.sample.ops import topk_topp_sampler

__all__ = ["MARGIN", "checked", "draw", "margin"]

logger = logging.getLogger(__name__)

MARGIN = 1e-2


def margin(vocab: int) -> float:
    """How far inside the nucleus a draw must be to skip vLLM's mask: ``MARGIN``, or four times
    a float32 sum's worst-case error over ``vocab`` terms (``vocab x 2**-24``, relative) where
    that is more: two sums here (the mass above the draw, the row's total) and two in vLLM
    (its softmax's total, its cumulative sum), each a float32 sum over the row."""
    return max(MARGIN, 4 * vocab * 2.0**-24)


def draw(logits: torch.Tensor, generators: dict, k: torch.Tensor | None,
         p: torch.Tensor | None) -> tuple[torch.Tensor, None]:
    """The token of each row of ``logits`` ``[n, V]`` float32 (temperature applied; the rows may
    be edited in place) that vLLM's ``TopKTopPSampler.forward_cpu`` draws with the same
    ``generators`` (row -> generator), top-k ``k`` and top-p ``p`` (``[n]`` or None); ``(tokens
    [n] int64, None)`` as the sampler returns."""
    n, vocab = logits.shape
    seeds = torch.randint(0, 2**31, (n,), dtype=torch.long)
    for i, generator in generators.items():
        seeds[i] = torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long).item()
    tokens = torch.ops._C.fused_gumbel_argmax(logits, seeds)
    if p is None and k is None:
        return tokens, None
    masked = torch.zeros(n, dtype=torch.bool)  # rows whose top-p / top-k may move the draw
    if k is not None:
        masked |= k.to(torch.long) < vocab
    if p is not None:
        nucleus = (p < 1.0) & ~masked
        rows = torch.nonzero(nucleus).flatten()
        if rows.numel():
            x = logits.index_select(0, rows)
            e = (x - x.max(dim=1, keepdim=True).values).exp_()
            w = tokens.index_select(0, rows).unsqueeze(1)
            above = torch.where(x >= x.gather(1, w), e, 0.0).sum(dim=1) - e.gather(1, w).squeeze(1)  # ties: above
            kept = above / e.sum(dim=1) < p.index_select(0, rows) - margin(vocab)
            masked[rows[~kept]] = True
    if bool(masked.any()):
        rows = torch.nonzero(masked).flatten()
        edited = topk_topp_sampler.apply_top_k_top_p(logits.index_select(0, rows),
                                                     None if k is None else k.index_select(0, rows),
                                                     None if p is None else p.index_select(0, rows))
        tokens[rows] = torch.ops._C.fused_gumbel_argmax(edited, seeds.index_select(0, rows))
    return tokens, None


def _probe_rows(vocab: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows where the mask matters and where it does not: peaked, flat, and bf16-rounded (ties)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(24, vocab, generator=g)
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0]).repeat(6).unsqueeze(1)
    rows = base * scale
    rows[12:] = rows[12:].to(torch.bfloat16).float()
    p = torch.tensor([0.5, 0.8, 0.9, 0.95, 0.99, 1.0]).repeat_interleave(4)
    k = torch.full((24,), vocab, dtype=torch.long)
    k[::5] = 7
    return rows, p, k


def checked(sampler):
    """``draw`` where it equals ``sampler`` (vLLM's ``TopKTopPSampler``; module docstring), else
    ``sampler``."""
    if getattr(getattr(sampler, "forward", None), "__func__", None) is not getattr(type(sampler), "forward_cpu", None):
        return sampler  # a GPU's sampler: vLLM's kernels there do not sort
    why = None
    if getattr(sampler, "use_fp64_gumbel", False):
        why = "vLLM samples with float64 Gumbel noise"
    elif not hasattr(torch.ops._C, "fused_gumbel_argmax"):
        why = "vLLM has no fused_gumbel_argmax op"
    else:
        rows, p, k = _probe_rows()
        with torch.random.fork_rng(devices=[]):  # the probes' draws leave torch's global stream as it was
            for trial in range(4):
                gens = lambda: {i: torch.Generator().manual_seed(1000 * trial + i) for i in range(rows.shape[0])}  # noqa: E731
                want, _ = sampler(rows.clone(), gens(), k, p)
                got, _ = draw(rows.clone(), gens(), k, p)
                if not torch.equal(want.long(), got.long()):
                    why = (f"the probe rows drew other tokens than vLLM's sampler "
                           f"({int((want != got).sum())} of {rows.shape[0]})")
                    break
    if why is not None:
        logger.warning("sampled trees: each visited row sorted by vLLM's sampler (%s)", why)
        return sampler
    return draw
