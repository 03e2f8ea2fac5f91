"""The offered trees that wait for their labels, kept as flat arrays (issue 43: one compiled call
to queue a proposal's trees, one to label every ready tree into the acceptance model; what stays
per tree in Python is the lookup of its request's id).

Every tree the drafter offers (cut or not) teaches the allocator's acceptance model once the
tokens that follow its root are known (``allocator.flat_continuation_labels`` is the definition):
a tree whose deepest node is at depth ``d`` needs ``min(d, label_depth)`` of them.
``LabelQueue.offer`` appends one proposal's offered trees to the queue's node and tree stores
(``kernels.label.queue_trees``); ``LabelQueue.take`` labels every waiting tree whose tokens are
now known and returns the labelled nodes' histograms, binned as ``AcceptanceModel.update`` bins
them (``kernels.label.take_labels``; ``AcceptanceModel.add`` takes them), and keeps the others.
A request has an integer id while it has a tree queued or may get one; a finished request's
trees are dropped (``drop``), and its labels are lost.

Worked example: proposal 1 offers trees for requests ``a`` (10 tokens, a tree of depth 3) and
``b`` (20 tokens, depth 2). At ``take`` with ``a`` at 12 tokens and ``b`` at 22, ``b``'s tree is
labelled from tokens 20..21 of its row; ``a``'s waits (it needs 3).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_anisotropic.kernels import load
from vllm_anisotropic.tree import FlatTrees, NodeSource

__all__ = ["LabelQueue"]

_TREE_COLUMNS, _NODE_COLUMNS = 5, 4  # kernels.label.TREE_COLUMNS, NODE_COLUMNS (checked by the tests)
_NUM_SOURCES = len(NodeSource)  # the histograms' first key


def _grown(arr: np.ndarray, rows: int = 0) -> np.ndarray:
    """``arr`` with twice its rows, or ``rows`` if more, its contents kept."""
    out = np.zeros((max(rows, 2 * arr.shape[0]),) + arr.shape[1:], arr.dtype)
    out[: arr.shape[0]] = arr
    return out


class LabelQueue:
    """Offered trees waiting for their labels (module docstring)."""

    def __init__(self, label_depth: int) -> None:
        self.label_depth = int(label_depth)
        self._trees = np.zeros((64, _TREE_COLUMNS), np.int64)
        self._nodes = np.zeros((512, _NODE_COLUMNS), np.int64)
        self._values = np.zeros(512)
        self._num_trees = 0
        self._num_nodes = 0
        self._ids: dict[str, int] = {}  # request -> its id while it may have trees queued
        self._free: list[int] = []  # ids to reuse
        self._dead: list[int] = []  # ids of dropped requests whose trees are still queued
        self._waiting = np.zeros(16, np.int64)  # [id] its queued trees; -1: dropped, trees still queued

    def __bool__(self) -> bool:
        return self._num_trees > 0

    def waiting(self, req_id: str) -> int:
        """How many of ``req_id``'s trees wait for their labels."""
        i = self._ids.get(req_id)
        return 0 if i is None else int(self._waiting[i])  # (never -1: a dropped request has no id)

    def requests(self) -> set[str]:
        """The requests with a tree waiting."""
        return {r for r, i in self._ids.items() if self._waiting[i] > 0}

    def _id(self, req_id: str) -> int:
        i = self._ids.get(req_id)
        if i is None:
            if self._free:
                i = self._free.pop()
            else:
                i = len(self._ids) + len(self._dead)  # (ids are handed out in order: one past the last)
                if i >= self._waiting.shape[0]:
                    self._waiting = _grown(self._waiting)
            self._ids[req_id] = i
            self._waiting[i] = 0
        return i

    def offer(self, trees: FlatTrees, index: np.ndarray, req_ids: Sequence[str], starts: np.ndarray) -> None:
        """Trees ``index`` of ``trees`` (distinct), of requests ``req_ids`` that had ``starts``
        tokens when they were proposed, wait for ``min(their depth, label_depth)`` more tokens."""
        count = len(req_ids)
        if len(index) != count or len(starts) != count:
            raise ValueError(f"one request and one start per tree: {len(index)} trees, {count} requests, "
                             f"{len(starts)} starts")
        if count == 0:
            return
        ids = np.fromiter(map(self._id, req_ids), np.int64, count)
        if self._num_trees + count > self._trees.shape[0]:
            self._trees = _grown(self._trees, self._num_trees + count)
        if self._num_nodes + trees.num_nodes > self._nodes.shape[0]:  # at most the whole proposal
            self._nodes = _grown(self._nodes, self._num_nodes + trees.num_nodes)
            self._values = _grown(self._values, self._num_nodes + trees.num_nodes)
        self._num_nodes = load("label").queue_trees(
            trees.offsets, trees.tokens, trees.parents, trees.depths, trees.sources, trees.values,
            np.asarray(index, np.int64), ids, np.asarray(starts, np.int64), self.label_depth,
            self._trees, self._num_trees, self._nodes, self._values, self._num_nodes, self._waiting)
        self._num_trees += count

    def drop(self, req_id: str) -> None:
        """The request finished: its waiting trees are forgotten (removed at the next ``take``)."""
        i = self._ids.pop(req_id, None)
        if i is None:
            return
        if self._waiting[i]:
            self._waiting[i] = -1
            self._dead.append(i)  # reused once a take has removed its trees
        else:
            self._free.append(i)

    def take(self, req_ids: Sequence[str], num_tokens: np.ndarray, token_ids: np.ndarray, config):
        """The labels of every waiting tree of the batch's requests (``req_ids`` in batch-row order,
        ``num_tokens [rows]`` and ``token_ids [rows, max_len]`` their rows) whose tokens are known,
        as histograms ``[3, sources, max_depth + 1, num_bins]`` (counts, accepted, sums of logits)
        by ``config``'s (an ``AcceptanceConfig``) keys, or None when no tree is ready. Trees of
        requests outside the batch keep waiting; dropped ones go. Raises ValueError (as
        ``AcceptanceModel.update`` does) on a labelled node with a NaN value, a source that is
        not a draft's or a depth below 1, or a ready tree whose tokens run past its row; the
        pass's labels are lost then."""
        if len(num_tokens) < len(req_ids) or len(token_ids) < len(req_ids):
            raise ValueError(f"{len(req_ids)} requests, {len(num_tokens)} token counts, {len(token_ids)} token rows")
        get = self._ids.get
        batch = np.fromiter((get(r, -1) for r in req_ids), np.int64, len(req_ids))
        kept, kept_nodes, labelled, bad, hist = load("label").take_labels(
            self._trees, self._num_trees, self._nodes, self._values, batch, num_tokens, token_ids, self._waiting,
            config.logit_min, config.logit_max, _NUM_SOURCES, config.max_depth, config.num_bins)
        self._num_trees, self._num_nodes = kept, kept_nodes
        if self._dead:
            self._free += self._dead
            self._dead = []
        if bad:
            raise ValueError(f"label queue: {bad} labelled node(s) with a NaN value, a source that is not a draft's "
                             f"(SPINE, BRANCH, DRAFT) or a depth below 1, or tree(s) whose tokens run past their row")
        return hist if labelled else None
