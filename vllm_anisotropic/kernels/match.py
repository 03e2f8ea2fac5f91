"""Compiled context matching (``kernels.load("match")``): the backward n-gram scan of
``proposers.context_match`` (its module docstring has the rule and a worked example), for one
context; ``kernels.goose.proposal_inputs`` runs it for every request of a step over vLLM's token
array in place."""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["match_tokens"]

_jit = numba.njit(cache=True, nogil=True)


@_jit
def match_tokens(tokens, length, sizes, max_match_length):
    """The longest-n match of ``tokens[:length]`` (module docstring).

    ``sizes``: n-gram lengths, longest first. Returns ``(f, n, match_length, consensus)``:
    follow position (-1: no match), n (0), backward match length (capped at
    ``max_match_length``, >= n), and whether >= 2 lengths' latest occurrences agree on the
    token at ``f``."""
    num = sizes.shape[0]
    found = np.full(num, -1, np.int64)
    longest = sizes[0]
    shortest = sizes[num - 1]
    for f in range(length - 1, shortest - 1, -1):
        m = 0
        while m < longest and f - 1 - m >= 0 and tokens[f - 1 - m] == tokens[length - 1 - m]:
            m += 1
        if m < shortest:
            continue
        for i in range(num):
            if found[i] < 0 and m >= sizes[i]:
                found[i] = f
        if found[0] >= 0:
            break
    best = -1
    for i in range(num):
        if found[i] >= 0:
            best = i
            break
    if best < 0:
        return -1, 0, 0, False
    f = found[best]
    n = sizes[best]
    agree = 0
    for i in range(num):
        if found[i] >= 0 and tokens[found[i]] == tokens[f]:
            agree += 1
    m = n
    while m < max_match_length and f - 1 - m >= 0 and tokens[f - 1 - m] == tokens[length - 1 - m]:
        m += 1
    return f, n, m, agree >= 2
