"""Cross-request spine store: n-gram matches into the finished requests of a tenant.

Scope: an index over the tokens of finished requests (each a separate document, so a
continuation never runs from one request into another), answering the same question as
``context_match.ContextMatcher`` for a request's own context: "where did the last n tokens occur,
and what followed?", longest n first, most recent occurrence. GOOSE asks it only when the
request's own context has no match. No tree building, no vLLM.

Why: a request's own context cannot propose the phrases every answer of a workload shares
(the opening of an answer, a formula layout, boilerplate code) until it has produced them once
itself. Suffix Decoding (arXiv 2411.04975) keeps a global suffix tree over previous outputs for
this; here the index is GOOSE's n-gram rule (Table 5 sizes) over a bounded window of documents.

Document
    The last ``prompt_tail`` tokens of a finished request's prompt, then its output (so the
    request's opening, which follows the chat template's assistant header, is matchable).
Bound
    At most ``capacity`` tokens of documents; the oldest documents are evicted first. Index
    entries of evicted documents are skipped on lookup and purged by a rebuild once the index
    holds twice the live entries (amortized O(1) per stored token).
"""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["OutputStore"]

# An n-gram key is one int: token t_k of the n-gram ending at position f - 1 sits at bits
# [21 k, 21 (k + 1)), k = 0 for the last token (ids below 2^21; documents with larger ids are not
# stored). An entry (document, follow position) is one int too: ~3x less memory than tuples.
_TOKEN_BITS = 21
_POS_BITS = 32
_MASKS = {n: (1 << (_TOKEN_BITS * n)) - 1 for n in range(1, 12)}
_NONE = (np.zeros(0, np.int64), 0)
# Python objects per stored token, bytes: the token in its document (a list slot and an int,
# ~40) and, per n-gram size, up to two index entries before a rebuild (dict slot, key and value
# ints, ~230). tracemalloc, 200 documents of 400 random tokens into a 16,384-token store with
# sizes (3, 4, 5): at most 10.65 MiB held (681 bytes a token); the bound below gives 730.
_BYTES_PER_TOKEN = 40
_BYTES_PER_TOKEN_AND_SIZE = 230


def _rolling_keys(toks: list[int], width: int) -> list[int]:
    """``keys[f]``: the packed last ``width`` tokens before position f (fewer near the start);
    ``keys[f] & _MASKS[n]`` is the packed n-gram ``toks[f - n : f]`` for any n <= width."""
    keys = [0] * (len(toks) + 1)
    key, full = 0, _MASKS[width]
    for f, tok in enumerate(toks, start=1):
        key = ((key << _TOKEN_BITS) | tok) & full
        keys[f] = key
    return keys


class OutputStore:
    """n-gram index over finished requests' documents (see module docstring).

    Usage::

        store = OutputStore((3, 4, 5), capacity=1 << 14)
        store.add(document_tokens)
        draft, n = store.match(context_tail, limit=20)   # empty draft, n = 0: no match
    """

    def __init__(self, ngram_sizes: tuple[int, ...] = (3, 4, 5), capacity: int = 1 << 14) -> None:
        sizes = tuple(sorted({int(n) for n in ngram_sizes}, reverse=True))
        if not sizes or sizes[-1] < 1 or sizes[0] > 11:
            raise ValueError(f"ngram_sizes must be integers in 1..11, got {ngram_sizes}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 token, got {capacity}")
        self.ngram_sizes = sizes  # longest first
        self.capacity = int(capacity)
        self._docs: dict[int, list[int]] = {}
        self._order: deque[int] = deque()
        self._next_id = 0
        self.num_tokens = 0
        self.frozen = False  # True: stays empty, ``add`` does nothing (TenantTables' overflow tenant)
        # n -> {packed n-gram: packed (document id, follow position)}
        self._index: dict[int, dict[int, int]] = {n: {} for n in sizes}

    def __len__(self) -> int:
        return len(self._docs)

    @staticmethod
    def max_bytes(capacity: int, ngram_sizes) -> int:
        """An upper bound of a full store's Python objects (module constants: measured)."""
        return int(capacity) * (_BYTES_PER_TOKEN + _BYTES_PER_TOKEN_AND_SIZE * len(set(ngram_sizes)))

    def memory_bytes(self) -> int:
        """The same bound for the tokens held now."""
        return self.max_bytes(self.num_tokens, self.ngram_sizes)

    def _insert(self, doc_id: int, toks: list[int]) -> None:
        keys = _rolling_keys(toks, self.ngram_sizes[0])
        for n, index in self._index.items():
            for f in range(n, len(toks)):  # f < len: a non-empty continuation follows
                index[keys[f] & _MASKS[n]] = (doc_id << _POS_BITS) | f

    def add(self, tokens) -> None:
        """Store one finished request's document; evict the oldest beyond ``capacity``."""
        if self.frozen:
            return
        toks = [int(t) for t in tokens][-self.capacity :]
        if len(toks) <= self.ngram_sizes[-1] or max(toks) >= 1 << _TOKEN_BITS or min(toks) < 0:
            return
        doc_id = self._next_id
        self._next_id += 1
        self._docs[doc_id] = toks
        self._order.append(doc_id)
        self.num_tokens += len(toks)
        self._insert(doc_id, toks)
        while self.num_tokens > self.capacity:
            old = self._order.popleft()
            self.num_tokens -= len(self._docs.pop(old))
        entries = sum(len(index) for index in self._index.values())
        if entries > 2 * len(self.ngram_sizes) * max(self.num_tokens, 1):
            self._rebuild()

    def _rebuild(self) -> None:
        self._index = {n: {} for n in self.ngram_sizes}
        for doc_id in self._order:  # oldest first: the most recent occurrence wins
            self._insert(doc_id, self._docs[doc_id])

    def match(self, context_tail, limit: int) -> tuple[np.ndarray, int]:
        """Continuation of the longest-n, most recent stored occurrence of the context's last n
        tokens (at most ``limit`` tokens) and that n; ``(empty, 0)`` when nothing matches."""
        if limit <= 0 or not self._docs:
            return _NONE
        tail = [int(t) for t in context_tail[-self.ngram_sizes[0]:]]
        # packed n-grams of the tail, one per n: token k from the end at bits [21 k, 21 (k + 1))
        packed, key = {}, 0
        for k in range(min(len(tail), self.ngram_sizes[0])):
            tok = tail[len(tail) - 1 - k]
            if tok >= 1 << _TOKEN_BITS or tok < 0:
                break
            key |= tok << (_TOKEN_BITS * k)
            packed[k + 1] = key
        for n in self.ngram_sizes:
            if n not in packed:
                continue
            hit = self._index[n].get(packed[n])
            if hit is None or (hit >> _POS_BITS) not in self._docs:
                continue
            doc_id, f = hit >> _POS_BITS, hit & ((1 << _POS_BITS) - 1)
            return np.asarray(self._docs[doc_id][f : f + limit], dtype=np.int64), n
        return _NONE
