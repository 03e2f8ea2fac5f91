"""The label queue (``integration/vllm/engine/labels.py``) against its definition: each offered
tree with at least one draft, once ``min(its depth, label_depth)`` tokens follow its root in its
request's row, is labelled by ``continuation_labels`` from exactly those tokens, once; the
others wait; a dropped request's trees are never labelled."""

from __future__ import annotations

import numpy as np
import pytest
from random_trees import random_trees

from vllm_anisotropic.allocator import continuation_labels
from vllm_anisotropic.integration.vllm.engine.labels import LabelQueue
from vllm_anisotropic.tree import FlatTrees


def _labels_by_definition(waiting, row_of, num_tokens, token_ids, label_depth):
    """The labels of the ready trees of ``waiting`` [(request, tree, start)], one tree at a
    time, and the trees left waiting."""
    trees, continuations, left = [], [], []
    for req, tree, start in waiting:
        need = min(int(tree.depths.max()), label_depth)
        i = row_of.get(req)
        if i is not None and num_tokens[i] - start >= need:
            trees.append(tree)
            continuations.append(token_ids[i, start : start + need])
        else:
            left.append((req, tree, start))
    return continuation_labels(trees, continuations), left


@pytest.mark.parametrize("seed", range(40))
def test_the_queue_labels_what_one_tree_at_a_time_labels(seed):
    """Four proposals of random trees for requests a-e (root-only trees not offered), then
    labelling passes with the batch missing a request, a request dropped, and rows growing by
    0-4 tokens a pass: every pass's labels equal the definition's (same nodes, same order by
    proposal and tree), and the same trees wait."""
    rng = np.random.default_rng(seed)
    label_depth = int(rng.integers(1, 9))
    q = LabelQueue(label_depth)
    reqs = ["a", "b", "c", "d", "e"]
    token_ids = rng.integers(0, 50, (len(reqs), 200))
    num_tokens = rng.integers(5, 40, len(reqs))
    waiting = []
    dropped = set()
    for step in range(7):
        if step < 4:  # a proposal: one tree per request of a random subset
            ids = [r for r in reqs if rng.random() < 0.8 and r not in dropped]
            trees = [random_trees(rng)[0] for _ in ids]
            flat = FlatTrees.from_trees(trees)
            offered = np.flatnonzero(flat.sizes() > 1)
            starts = np.array([num_tokens[reqs.index(r)] for r in ids], np.int64)
            q.offer(flat, offered, [ids[k] for k in offered.tolist()], starts[offered])
            waiting += [(ids[k], trees[k], int(starts[k])) for k in offered.tolist()]
        if step == 3:
            q.drop("c")
            dropped.add("c")
            waiting = [w for w in waiting if w[0] != "c"]
        num_tokens = num_tokens + rng.integers(0, 5, len(reqs))
        batch = [r for r in reqs if r != "e" or step >= 5]  # e outside the batch until pass 5
        order = rng.permutation(len(batch))
        batch = [batch[i] for i in order]
        rows = [reqs.index(r) for r in batch]
        got = q.take(batch, num_tokens[rows], token_ids[rows])
        want, waiting = _labels_by_definition(waiting, {r: i for i, r in enumerate(batch)}, num_tokens[rows],
                                              token_ids[rows], label_depth)
        if len(want[0]) == 0 and got is None:
            pass
        else:
            assert got is not None
            for g, w in zip(got, want):
                assert g.tolist() == w.tolist(), (seed, step)
        for r in reqs:
            assert q.waiting(r) == sum(1 for w in waiting if w[0] == r), (seed, step, r)
        assert q.requests() == {w[0] for w in waiting}
        assert bool(q) == bool(waiting)


def test_worked_example():
    """The module docstring's: a's tree of depth 3 waits at 2 known tokens, b's of depth 2 is
    labelled from tokens 20..21 of its row."""
    from vllm_anisotropic.tree import DraftTree

    a = DraftTree(tokens=[1, 5, 6, 7], parents=[-1, 0, 1, 2])
    b = DraftTree(tokens=[1, 8, 9], parents=[-1, 0, 0])
    q = LabelQueue(8)
    q.offer(FlatTrees.from_trees([a, b]), np.array([0, 1]), ["a", "b"], np.array([10, 20]))
    rows = np.zeros((2, 40), np.int64)
    rows[1, 20:22] = [9, 3]
    sources, depths, values, labels = q.take(["a", "b"], np.array([12, 22]), rows)
    assert depths.tolist() == [1, 1] and labels.tolist() == [False, True]
    assert q.waiting("a") == 1 and q.waiting("b") == 0 and q.requests() == {"a"}
    rows[0, 10:13] = [5, 6, 0]
    assert q.take(["a", "b"], np.array([13, 22]), rows)[3].tolist() == [True, True, False]
    assert not q and q.take(["a"], np.array([50]), rows) is None
