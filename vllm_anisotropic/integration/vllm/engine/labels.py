"""The offered trees that wait for their labels, kept as arrays per proposal (issue 43: no
``DraftTree`` or continuation slice per tree; what stays per tree in Python is the lookup of its
request's batch row and count).

Every tree the drafter offers (cut or not) teaches the allocator's acceptance model once the
tokens that follow its root are known (``allocator.flat_continuation_labels``): a tree whose
deepest node is at depth ``d`` needs ``min(d, label_depth)`` of them. ``LabelQueue.offer`` keeps
one proposal's trees as they are (the proposal's ``FlatTrees``, which trees, their requests,
how many tokens each request had, how many each tree needs); ``LabelQueue.take`` labels every
waiting tree whose tokens are now known in one batched call, and keeps the others. A finished
request's trees are dropped (``drop``), and its label is lost.

Worked example: proposal 1 offers trees for requests ``a`` (10 tokens, a tree of depth 3) and
``b`` (20 tokens, depth 2). At ``take`` with ``a`` at 12 tokens and ``b`` at 22, ``b``'s tree is
labelled from tokens 20..21 of its row; ``a``'s waits (it needs 3). One pass over 4 proposals'
trees, before (one ``DraftTree`` and one continuation slice per tree) and after, on an AMD EPYC
(docs/measurements/cpu/label_pass_bench{,_grow}_2026_12_04.txt): ~395 -> ~285 us at 8 requests,
~2,200 -> ~330-570 us at 64. In the engine a pass costs ~1 ms either way at 8 requests (every
4th step; the cold caches after a CPU forward, not the per-tree work:
label_queue_engine_ab_2026_12_04.txt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_anisotropic.allocator import flat_continuation_labels
from vllm_anisotropic.tree import FlatTrees

__all__ = ["LabelQueue"]


@dataclass
class _Offer:
    trees: FlatTrees  # the proposal's trees (all of them; ``index`` picks the waiting ones)
    index: np.ndarray  # [n] int64 tree indices into ``trees``
    req_ids: list  # [n] the request of each
    starts: np.ndarray  # [n] int64 tokens the request had when the tree was proposed (its root's end)
    needs: np.ndarray  # [n] int64 tokens after the root each tree needs for its labels


class LabelQueue:
    """Offered trees waiting for their labels (module docstring)."""

    def __init__(self, label_depth: int) -> None:
        self.label_depth = int(label_depth)
        self._offers: list[_Offer] = []
        self._waiting: dict[str, int] = {}  # request -> trees waiting (absent: none)

    def __bool__(self) -> bool:
        return bool(self._offers)

    def waiting(self, req_id: str) -> int:
        """How many of ``req_id``'s trees wait for their labels."""
        return self._waiting.get(req_id, 0)

    def requests(self) -> set[str]:
        """The requests with a tree waiting."""
        return set(self._waiting)

    def offer(self, trees: FlatTrees, index: np.ndarray, req_ids: Sequence[str], starts: np.ndarray) -> None:
        """Trees ``index`` of ``trees``, of requests ``req_ids`` that had ``starts`` tokens when they
        were proposed, wait for ``min(their depth, label_depth)`` more tokens."""
        index = np.asarray(index, np.int64)
        if index.shape[0] == 0:
            return
        deepest = np.maximum.reduceat(trees.depths, trees.offsets[:-1])[index]  # every tree has its root
        needs = np.minimum(deepest, self.label_depth).astype(np.int64)
        self._offers.append(_Offer(trees, index, list(req_ids), np.asarray(starts, np.int64), needs))
        for r in req_ids:
            self._waiting[r] = self._waiting.get(r, 0) + 1

    def drop(self, req_id: str) -> None:
        """The request finished: its waiting trees are forgotten (removed at the next ``take``)."""
        self._waiting.pop(req_id, None)

    def take(self, req_ids: Sequence[str], num_tokens: np.ndarray, token_ids: np.ndarray):
        """Labels of every waiting tree of the batch's requests (``req_ids`` in batch-row order,
        ``num_tokens [rows]`` and ``token_ids [rows, max_len]`` their rows) whose tokens are known,
        as ``flat_continuation_labels`` returns them (one call over every queued proposal's), or None when
        no tree is ready. Trees of requests outside the batch keep waiting; dropped ones go."""
        row_of = {r: i for i, r in enumerate(req_ids)}
        ready_trees, tokens, counts, kept = [], [], [], []
        for offer in self._offers:
            alive = np.fromiter((r in self._waiting for r in offer.req_ids), bool, len(offer.req_ids))
            rows = np.fromiter((row_of.get(r, -1) for r in offer.req_ids), np.int64, len(offer.req_ids))
            have = np.where(rows >= 0, np.asarray(num_tokens, np.int64)[np.maximum(rows, 0)] - offer.starts, -1)
            ready = alive & (rows >= 0) & (have >= offer.needs)
            wait = alive & ~ready
            if ready.any():
                pick = np.flatnonzero(ready)
                needs = offer.needs[pick]
                first = np.repeat(offer.starts[pick] - np.concatenate([[0], np.cumsum(needs)[:-1]]), needs)
                columns = first + np.arange(int(needs.sum()))
                tokens.append(token_ids[np.repeat(rows[pick], needs), columns])
                ready_trees.append(offer.trees.select(offer.index[pick]))
                counts.append(needs)
                for r in (offer.req_ids[i] for i in pick.tolist()):
                    self._waiting[r] -= 1
                    if not self._waiting[r]:
                        del self._waiting[r]  # (no queued tree of it is left)
            if wait.all():
                kept.append(offer)
            elif wait.any():
                keep = np.flatnonzero(wait)
                kept.append(_Offer(offer.trees, offer.index[keep], [offer.req_ids[i] for i in keep.tolist()],
                                   offer.starts[keep], offer.needs[keep]))
        self._offers = kept
        if not ready_trees:
            return None
        return flat_continuation_labels(FlatTrees.concat(ready_trees), np.concatenate(tokens), np.concatenate(counts))
