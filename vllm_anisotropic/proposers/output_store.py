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
    At most ``capacity`` tokens of documents; the oldest documents are evicted first. The store
    is arrays of a fixed size (``kernels.store``: a ring of the documents' tokens, one
    open-addressing hash table per n), allocated at the first document: ``max_bytes`` is exact.
    A step's lookups are one compiled call over vLLM's token array (``match_rows``).
"""

from __future__ import annotations

import numpy as np

from vllm_anisotropic import kernels

__all__ = ["OutputStore"]

_NONE = (np.zeros(0, np.int64), 0)
# the instance, its attributes and the arrays' headers beside their data (tracemalloc: 1,072 bytes with
# sizes (3, 4, 5)); bounded: nothing is allocated per document
_OBJECT_BYTES = 2048


def _slots(capacity: int) -> int:
    """Hash table slots per n: the power of two >= 2 ``capacity`` (at most half full after a rebuild)."""
    return 1 << max(1, (2 * int(capacity) - 1).bit_length())


class OutputStore:
    """n-gram index over finished requests' documents (see module docstring).

    Usage::

        store = OutputStore((3, 4, 5), capacity=1 << 14)
        store.add(document_tokens)
        draft, n = store.match(context_tail, limit=20)   # empty draft, n = 0: no match
    """

    def __init__(self, ngram_sizes: tuple[int, ...] = (3, 4, 5), capacity: int = 1 << 14) -> None:
        sizes = tuple(sorted({int(n) for n in ngram_sizes}, reverse=True))
        if not sizes or sizes[-1] < 1 or sizes[0] > 32:
            raise ValueError(f"ngram_sizes must be integers in 1..32, got {ngram_sizes}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 token, got {capacity}")
        self.ngram_sizes = sizes  # longest first
        self.capacity = int(capacity)
        self._sizes = np.asarray(sizes, np.int64)
        self._arrays: tuple | None = None  # (tokens, till, keys, follows, used): at the first document
        self._lo = self._hi = 0  # the live documents' absolute positions [lo, hi)
        self._docs = 0
        self.rebuilds = 0
        self.frozen = False  # True: stays empty, ``add`` does nothing (TenantTables' overflow tenant)

    def __len__(self) -> int:
        return self._docs

    @property
    def num_tokens(self) -> int:
        return self._hi - self._lo

    @staticmethod
    def max_bytes(capacity: int, ngram_sizes) -> int:
        """The bytes of a store with documents: its arrays (``kernels.store``) and the object."""
        sizes = len(set(ngram_sizes))
        return int(capacity) * 8 + sizes * (_slots(capacity) * 16 + 8) + _OBJECT_BYTES

    def memory_bytes(self) -> int:
        """What the store holds now: ``max_bytes`` once it has a document, else 0."""
        return 0 if self._arrays is None else self.max_bytes(self.capacity, self.ngram_sizes)

    def add(self, tokens) -> None:
        """Store one finished request's document; evict the oldest beyond ``capacity``."""
        if self.frozen:
            return
        toks = np.asarray(tokens).reshape(-1)[-self.capacity :]
        if toks.shape[0] <= self.ngram_sizes[-1] or int(toks.max()) >= 1 << 31 or int(toks.min()) < 0:
            return  # no n-gram with a token after it, or ids outside the ring's int32
        if self._arrays is None:
            sizes, slots = len(self.ngram_sizes), _slots(self.capacity)
            self._arrays = (np.zeros(self.capacity, np.int32), np.zeros(self.capacity, np.int32),
                            np.zeros((sizes, slots), np.uint64), np.zeros((sizes, slots), np.int64),
                            np.zeros(sizes, np.int64))
        lo, evicted, rebuilt = kernels.load("store").add_document(*self._arrays, self._sizes, toks.astype(np.int32),
                                                                  self._lo, self._hi)
        self._lo, self._hi = int(lo), self._hi + toks.shape[0]
        self._docs += 1 - int(evicted)
        self.rebuilds += bool(rebuilt)

    def match_rows(self, token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray, limits: np.ndarray,
                   which: np.ndarray, ngrams: np.ndarray, lens: np.ndarray, starts: np.ndarray, out: np.ndarray,
                   at: int) -> int:
        """``kernels.store.match_rows`` over this store: the drafts of requests ``which`` (int64;
        request r's context ``token_ids[rows[r], :lengths[r]]``) into ``out`` from ``at``; returns
        the new ``at``. Requests without a hit keep their ``ngrams`` / ``lens`` / ``starts``."""
        if self._arrays is None or which.shape[0] == 0:
            return at
        tokens, till, keys, follows, _ = self._arrays
        return int(kernels.load("store").match_rows(tokens, till, keys, follows, self._sizes, self._lo, token_ids, rows,
                                                    lengths, limits, which, ngrams, lens, starts, out, at))

    def match(self, context_tail, limit: int) -> tuple[np.ndarray, int]:
        """Continuation of the longest-n, most recent stored occurrence of the context's last n
        tokens (at most ``limit`` tokens) and that n; ``(empty, 0)`` when nothing matches."""
        tail = np.asarray(context_tail, np.int64).reshape(1, -1)[:, -self.ngram_sizes[0]:]
        if limit <= 0 or self._arrays is None or tail.shape[1] == 0:
            return _NONE
        one = np.zeros(1, np.int64)
        ngrams, lens, starts, out = one.copy(), one.copy(), one.copy(), np.zeros(int(limit), np.int64)
        self.match_rows(tail, one, np.full(1, tail.shape[1], np.int64), np.full(1, limit, np.int64), one, ngrams,
                        lens, starts, out, 0)
        return (out[: lens[0]], int(ngrams[0])) if ngrams[0] else _NONE
