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

Incremental index (amortized O(1) per appended token, no rescans)
-----------------------------------------------------------------
For each n, a dict maps the n-gram (a tuple of token ids) to its latest follow position. When
the context grows from L to L' tokens, exactly the n-grams with follow positions in
``[L, L' - 1]`` become eligible (those ending at positions ``L-1 .. L'-2``), so each appended
token inserts one key per n. Worked example, n = 2::

    tokens = [5, 6, 7, 5, 6]      L = 5
    indexed: (5,6)->2, (6,7)->3, (7,5)->4        # (5,6) ending at 4 is the suffix: not yet
    query suffix (5,6) -> f = 2 -> draft [7, 5, 6]
    append 9 -> L = 6: insert (5,6)->5 (the old suffix is now an earlier occurrence)

A rollback (context shorter than the index, or a different token at the boundary) rebuilds the
index from scratch (O(L)); the speculative decoding loop only ever appends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
    """Per-request n-gram index over the growing context (see module docstring).

    Usage::

        m = ContextMatcher((3, 4, 5), max_continuation=20)
        m.sync(context)        # appends only the new tail: amortized O(new tokens)
        hit = m.match()        # O(max_continuation + max_match_length)
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
        self.max_continuation = int(max_continuation)
        self.max_match_length = max(int(max_match_length), sizes[0])
        self.reset()

    def reset(self) -> None:
        # the context as a Python list: O(1) append, cheap tuple slices for keys
        self._tokens: list[int] = []
        # n -> {n-gram tuple: latest follow position f}
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in self.ngram_sizes}

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    # ------------------------------------------------------------------ updates
    def extend(self, new_tokens) -> None:
        """Append tokens; inserts one key per n-gram size per token (amortized O(1))."""
        toks = self._tokens
        old_len = len(toks)
        toks.extend(int(t) for t in new_tokens)
        new_len = len(toks)
        # follow positions f in [old_len, new_len - 1] become eligible; n-gram = toks[f-n : f]
        for n, index in self._index.items():
            for f in range(max(old_len, n), new_len):
                index[tuple(toks[f - n : f])] = f

    def sync(self, context) -> None:
        """Make the index describe ``context`` (a 1-D int sequence).

        Appends the new tail when ``context`` extends the indexed tokens (checked at the
        boundary token only, O(1)); otherwise rebuilds (O(len(context))).
        """
        n_old = len(self._tokens)
        n_new = len(context)
        if n_new >= n_old and (n_old == 0 or int(context[n_old - 1]) == self._tokens[n_old - 1]):
            if n_new > n_old:
                self.extend(np.asarray(context[n_old:]).tolist())
            return
        self.reset()
        self.extend(np.asarray(context).tolist())

    # ------------------------------------------------------------------ queries
    def lookup(self, n: int) -> int:
        """Follow position of the latest earlier occurrence of the last n tokens, or -1."""
        toks = self._tokens
        if len(toks) < n + 1:
            return -1
        return self._index[n].get(tuple(toks[len(toks) - n :]), -1)

    def match(self, max_continuation: int | None = None) -> ContextMatch:
        """Longest-n match, its draft, consensus flag and backward match length."""
        toks = self._tokens
        num_tokens = len(toks)
        limit = self.max_continuation if max_continuation is None else int(max_continuation)
        follows = [(n, self.lookup(n)) for n in self.ngram_sizes]
        hits = [(n, f) for n, f in follows if f >= 0]
        if not hits or limit <= 0:
            return _NO_MATCH
        n, f = hits[0]  # longest n first
        first = toks[f]
        agree = sum(1 for _, g in hits if toks[g] == first)
        # match length: extend the n-gram match backwards, j tokens before the suffix end
        length = n
        while length < self.max_match_length and f - 1 - length >= 0 and toks[f - 1 - length] == toks[num_tokens - 1 - length]:
            length += 1
        draft = np.asarray(toks[f : f + limit], dtype=np.int64)
        return ContextMatch(draft=draft, ngram=n, match_length=length, consensus=agree >= 2, position=f)
