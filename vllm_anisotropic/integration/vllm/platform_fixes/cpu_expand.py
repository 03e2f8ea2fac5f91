"""vLLM's rejection sampler on a CPU: per-request sampling parameters expanded to draft rows, in any dtype.

Why: vLLM 0.32's rejection sampler expands each request's temperature and top-p to its draft
rows (``rejection_sampler.expand_batch_to_tokens``: ``x.new_empty(num_tokens)`` filled by
``expand_kernel``). Without Triton's CPU backend, vLLM runs a C++ replacement
(``utils/cpu_triton_utils._expand_kernel_impl``) that reads and writes int64 only: it passes
``output.to(torch.int64)``, a copy for any other dtype, and never copies the result back. A
float32 temperature or top-p row is left as the uninitialised memory ``new_empty`` returned, so
vLLM's own speculative methods (``ngram``, ``draft_model``, EAGLE) verify sampled requests
against a law scaled by whatever that memory held. Measured (SmolLM2-135M drafting for itself,
T = 0.7, docs/measurements/cpu/draft_model_*_probe_2026_12_04): an infinite logit in 55 of 96
draft rows, 7-18 % of the drafts accepted (57-70 % with this fix); on the tiny test model the
sampled output fails the exact-law test at z 26.6 (tests/test_engine_sampling.py). Tree methods verify with
their own sampler and never reach this kernel with draft rows.

The fix (patches.py patch 11): ``expanding_any_dtype(original)``, vLLM's function for int64
outputs (top-k) and ``expand_rows`` for every other dtype, installed before the CPU platform
registers its kernel replacements.

No vLLM import here.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["expand_rows", "expanding_any_dtype"]


def expand_rows(output: torch.Tensor, values: torch.Tensor, cu_num_tokens: torch.Tensor,
                replace_from, replace_to) -> None:
    """``output[start:cu[i]] = values[i]`` for every request ``i``, ``start`` being ``cu[i - 1]``
    (0 for the first request) and a value equal to ``replace_from`` written as ``replace_to``:
    what vLLM's ``expand_kernel`` writes. Rows past ``cu_num_tokens[-1]`` are left as they are."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    filled = values.masked_fill(values == replace_from, replace_to)
    total = int(cu_num_tokens[-1]) if cu_num_tokens.numel() else 0
    output[:total] = torch.repeat_interleave(filled, counts, output_size=total).to(output.dtype)


def expanding_any_dtype(original):
    """vLLM's CPU ``_expand_kernel_impl`` for int64 outputs, ``expand_rows`` for any other."""

    @functools.wraps(original)
    def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        if output.dtype == torch.int64:
            return original(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)
        expand_rows(output, input_val, cu_num_tokens, replace_from, replace_to)

    return _expand_kernel_impl
