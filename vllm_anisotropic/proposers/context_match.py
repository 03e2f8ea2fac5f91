"""Incremental context matcher: the n-gram lookup that drafts the GOOSE spine.

Scope: an index over every token a request has (prompt + accepted output) answering "where did
the last n tokens occur before, and what followed?" for several n at once, longest n first. No
tree building, no adjacency table, no vLLM.

Source: ContextMatch of GOOSE (arXiv 2604.02047 Appendix B.2, Algorithm 2 line 5; Table 5: n-gram
lengths {3, 4, 5}, spine continuation up to 20 tokens, bypass threshold 8). The match rule is
that of Prompt Lookup Decoding (Saxena 2023; ``proposers.pld.propose_prompt_lookup`` is the
stateless oracle this index must agree with).

Terms
-----
context
    Every token of the request so far, ``tokens[0 .. L-1]``.
occurrence / follow position ``f``
    An earlier copy of the last ``n`` tokens ends at ``f - 1``; ``tokens[f:]`` is what followed.
    Only occurrences with ``f <= L - 1`` count (the suffix itself never matches itself), and
    among them the most recent (largest ``f``) wins.
draft (continuation)
    ``tokens[f : f + max_continuation]``, never empty when a match exists.
consensus
    At least two n-gram lengths have a match whose first draft token equals the first token of
    the chosen (longest-n) draft (arXiv 2604.02047 Sec. 4.3: ">= 2 lengths agree on the first token").
match length
    How far the match extends backwards: the number of trailing context tokens equal to the
    tokens ending at ``f - 1`` (>= n, capped at ``max_match_length``). GOOSE's "long match"
    signal can be read either as this or as the draft length; ``goose.GooseConfig.bypass_signal``
    picks one explicitly.

Lookup: one backward scan (a compiled kernel, ``kernels.match.match_tokens``)
----------------------------------------------------------------
From the last follow position down, the scan measures how many tokens before ``f`` equal the
context's last tokens (up to the longest n); the first ``f`` where that count reaches ``n`` is
n's latest occurrence, and the scan stops once the longest n is found (every shorter n is found
at the same or a later ``f``). O(L) per lookup with no index to keep: ~1 ns a token compiled,
and nothing to rebuild when a request's context is rolled back. ``kernels.goose.proposal_inputs`` runs it
for every request of an engine step over vLLM's token array in place (as vLLM's n-gram proposer
does). Worked example, n = 2::

    tokens = [5, 6, 7, 5, 6]      L = 5, suffix (5, 6)
    f = 4: tokens[3] = 5 != 6 -> 0 matched;  f = 3: tokens[2] = 7 != 6 -> 0
    f = 2: tokens[1] = 6, tokens[0] = 5 -> 2 matched -> n = 2 at f = 2 -> draft [7, 5, 6]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_anisotropic import kernels

__all__ = ["ContextMatch", "ContextMatcher"]


@dataclass(frozen=True)
class ContextMatch:
    """Result of one lookup. ``ngram == 0`` means no match (empty draft)."""

    # [num_draft_tokens] int64 continuation of the longest-n match; empty if none
    draft: np.ndarray
    # n of the longest matching n-gram, 0 when nothing matched
    ngram: int
    # backward-extended length of that match (>= ngram), 0 when nothing matched
    match_length: int
    # >= 2 n-gram lengths agree on the first draft token
    consensus: bool
    # follow position f of the chosen occurrence (-1 when nothing matched)
    position: int

    @property
    def found(self) -> bool:
        return self.ngram > 0


_NO_MATCH = ContextMatch(np.zeros(0, np.int64), 0, 0, False, -1)


class ContextMatcher:
    """Per-request context with the n-gram lookup (see module docstring).

    Usage::

        m = ContextMatcher((3, 4, 5), max_continuation=20)
        m.sync(context)        # keeps the context (appends the new tail)
        hit = m.match()        # one backward scan
    """

    def __init__(
        self,
        ngram_sizes: tuple[int, ...] = (3, 4, 5),
        max_continuation: int = 20,
        max_match_length: int = 32,
    ) -> None:
        sizes = tuple(sorted({int(n) for n in ngram_sizes}, reverse=True))
        if not sizes or sizes[-1] < 1:
            raise ValueError(f"ngram_sizes must be positive integers, got {ngram_sizes}")
        if max_continuation < 1:
            raise ValueError("max_continuation must be >= 1")
        self.ngram_sizes = sizes  # longest first
        self.sizes = np.asarray(sizes, np.int64)
        self.max_continuation = int(max_continuation)
        self.max_match_length = max(int(max_match_length), sizes[0])
        self.reset()

    def reset(self) -> None:
        self._buf = np.zeros(64, np.int64)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @property
    def tokens(self) -> list[int]:
        return self._buf[: self._len].tolist()

    def token_array(self) -> np.ndarray:
        """The context as a read-only view ``[len]`` int64."""
        view = self._buf[: self._len]
        view.flags.writeable = False
        return view

    # ------------------------------------------------------------------ updates
    def extend(self, new_tokens) -> None:
        """Append tokens."""
        new = np.asarray(new_tokens, np.int64).reshape(-1)
        need = self._len + new.shape[0]
        if need > self._buf.shape[0]:
            grown = np.zeros(max(need, 2 * self._buf.shape[0]), np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : need] = new
        self._len = need

    def sync(self, context) -> None:
        """Make the kept context equal ``context`` (a 1-D int sequence): appends the new tail
        when ``context`` extends it, else replaces it."""
        context = np.asarray(context)
        n_old, n_new = self._len, context.shape[0]
        if n_new >= n_old and (n_old == 0 or int(context[n_old - 1]) == int(self._buf[n_old - 1])):
            if n_new > n_old:
                self.extend(context[n_old:])
            return
        self.reset()
        self.extend(context)

    # ------------------------------------------------------------------ queries
    def lookup(self, n: int) -> int:
        """Follow position of the latest earlier occurrence of the last n tokens, or -1."""
        f, _, _, _ = kernels.load("match").match_tokens(self._buf, self._len, np.array([int(n)], np.int64), int(n))
        return int(f)

    def match(self, max_continuation: int | None = None) -> ContextMatch:
        """Longest-n match, its draft, consensus flag and backward match length."""
        limit = self.max_continuation if max_continuation is None else int(max_continuation)
        if limit <= 0:
            return _NO_MATCH
        f, n, length, consensus = kernels.load("match").match_tokens(self._buf, self._len, self.sizes,
                                                                     self.max_match_length)
        if n == 0:
            return _NO_MATCH
        draft = self._buf[f : min(f + limit, self._len)].copy()
        return ContextMatch(draft=draft, ngram=int(n), match_length=int(length), consensus=bool(consensus),
                            position=int(f))
