"""Prompt Lookup Decoding (PLD): a linear draft copied from an earlier n-gram match.

Source: Saxena 2023, "Prompt Lookup Decoding" (the baseline the GOOSE paper calls PLD,
GOOSE arXiv 2604.02047 Sec. 5.1). The last ``n`` context tokens are searched for earlier in the context
(prompt + generated tokens), longest ``n`` first; the tokens that followed the most recent
earlier occurrence are the draft.

Terms: *context* is every token the request has so far (prompt + accepted output); a *draft* is
the proposed continuation, verified by the target model afterwards.

This module is the stateless reference kernel (a full scan per call). The GOOSE context matcher
keeps an incremental index instead; this one stays as the PLD baseline and as its oracle.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_prompt_lookup(
    context: np.ndarray,
    num_draft_tokens: int,
    min_ngram: int = 3,
    max_ngram: int = 5,
) -> np.ndarray:
    """Return up to ``num_draft_tokens`` tokens that followed the latest earlier match.

    Worked example: context ``[5, 6, 7, 8, 5, 6, 7]``, ``min_ngram=2``: the suffix ``[5, 6, 7]``
    (n=3) occurred at index 0, followed by ``[8, 5, 6, 7]`` -> draft ``[8, 5]`` for 2 tokens.

    Args:
        context: ``[num_tokens]`` integer token ids.
        num_draft_tokens: maximum draft length ``k >= 0``.
        min_ngram, max_ngram: n-gram lengths tried, longest first.

    Returns:
        ``[<= num_draft_tokens]`` int64 token ids; empty when nothing matches.
    """
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram=}, {max_ngram=}")
    context = np.asarray(context)
    num_tokens = context.shape[0]
    empty = np.zeros(0, dtype=np.int64)
    if num_draft_tokens <= 0:
        return empty
    for n in range(min(max_ngram, num_tokens - 1), min_ngram - 1, -1):
        suffix = context[num_tokens - n :]
        # windows[i] == context[i : i + n] for every start i whose window ends before the suffix
        # starts to overlap itself at the end: i + n <= num_tokens - 1.
        windows = sliding_window_view(context[: num_tokens - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n  # most recent earlier occurrence
            return context[follow : follow + num_draft_tokens].astype(np.int64)
    return empty
