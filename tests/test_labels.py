"""The label queue (``integration/vllm/engine/labels.py``, ``kernels/label.py``) against its
definition: each offered tree with at least one draft, once ``min(its depth, label_depth)`` tokens
follow its root in its request's row, is labelled by ``continuation_labels`` from exactly those
tokens, once, and taught to the acceptance model as ``AcceptanceModel.update`` would; the others
wait; a dropped request's trees are never labelled, not even under a later request that reuses
its id."""

from __future__ import annotations

import numpy as np
import pytest
from random_trees import random_trees

from vllm_anisotropic.allocator import AcceptanceConfig, AcceptanceModel, continuation_labels, flat_continuation_labels
from vllm_anisotropic.integration.vllm.engine import labels as labels_module
from vllm_anisotropic.integration.vllm.engine.labels import LabelQueue
from vllm_anisotropic.kernels import load
from vllm_anisotropic.tree import DraftTree, FlatTrees, NodeSource


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
    return (continuation_labels(trees, continuations) if trees else None), left


def _with_values(rng, tree):
    """``tree`` with random values: mostly in (0, 1), some 0, 1 and outside [0, 1] (clipped)."""
    v = rng.random(tree.num_nodes)
    v[rng.random(tree.num_nodes) < 0.1] = 0.0
    v[rng.random(tree.num_nodes) < 0.1] = 1.0
    v[rng.random(tree.num_nodes) < 0.05] = 1.5
    v[rng.random(tree.num_nodes) < 0.05] = -0.5
    return DraftTree(tokens=tree.tokens, parents=tree.parents, sources=tree.sources, values=v)


def _assert_same_model(got: AcceptanceModel, want: AcceptanceModel, where):
    assert np.array_equal(got.count, want.count), where
    assert np.array_equal(got.accepted, want.accepted), where
    np.testing.assert_allclose(got.logit_sum, want.logit_sum, rtol=1e-12, atol=1e-12, err_msg=str(where))
    assert (got._updates, got._stale_updates, got._params is None) == (want._updates, want._stale_updates, want._params is None)


@pytest.mark.parametrize("seed", range(40))
def test_the_queue_labels_what_one_tree_at_a_time_labels(seed):
    """Five proposals of random trees (mixed sources, random values, three tokens so that paths
    are accepted) for requests a-f (root-only trees offered in half the seeds, as the warm-up
    offers them: labelled at once, with nothing to label), then labelling passes with the
    batch missing a request, request c dropped while its trees wait and f arriving after (it gets
    c's id only once they are gone), rows growing by 0-4 tokens a pass: after every pass the
    model taught by the queue equals one taught the definition's labels by ``update`` (counts
    exactly; sums of logits to rounding), and the same trees wait."""
    rng = np.random.default_rng(seed)
    label_depth = int(rng.integers(1, 9))
    config = AcceptanceConfig(max_depth=int(rng.integers(1, 9)), num_bins=int(rng.integers(4, 64)),
                              logit_min=-float(rng.uniform(1, 10)), logit_max=float(rng.uniform(1, 10)),
                              decay=float(rng.choice([1.0, 0.9])))
    got_model, want_model = AcceptanceModel(config), AcceptanceModel(config)
    q = LabelQueue(label_depth)
    reqs = ["a", "b", "c", "d", "e", "f"]
    token_ids = rng.integers(0, 3, (len(reqs), 200))
    num_tokens = rng.integers(5, 40, len(reqs))
    waiting = []
    dropped = set()
    for step in range(8):
        if step == 3:
            q.drop("c")
            dropped.add("c")
            waiting = [w for w in waiting if w[0] != "c"]
        if step < 5:  # a proposal: one tree per request of a random subset
            ids = [r for r in reqs if rng.random() < 0.8 and r not in dropped and (r != "f" or step >= 3)]
            trees = [_with_values(rng, t) for t in (random_trees(rng, sources=True, vocab=3)[0] for _ in ids)]
            flat = FlatTrees.from_trees(trees)
            offered = np.flatnonzero(flat.sizes() > (seed % 2))
            starts = np.array([num_tokens[reqs.index(r)] for r in ids], np.int64)
            q.offer(flat, offered, [ids[k] for k in offered.tolist()], starts[offered])
            waiting += [(ids[k], trees[k], int(starts[k])) for k in offered.tolist()]
        num_tokens = num_tokens + rng.integers(0, 5, len(reqs))
        batch = [r for r in reqs if r != "e" or step >= 6]  # e outside the batch until pass 6
        order = rng.permutation(len(batch))
        batch = [batch[i] for i in order]
        rows = [reqs.index(r) for r in batch]
        rows_of_batch = token_ids[rows].astype(np.int32 if seed % 3 == 0 else np.int64)  # vLLM's rows are int32
        got = q.take(batch, num_tokens[rows], rows_of_batch, config)
        want, waiting = _labels_by_definition(waiting, {r: i for i, r in enumerate(batch)}, num_tokens[rows],
                                              token_ids[rows], label_depth)
        assert (got is None) == (want is None), (seed, step)
        if want is not None:
            got_model.add(got)
            want_model.update(*want)
        _assert_same_model(got_model, want_model, (seed, step))
        for r in reqs:
            assert q.waiting(r) == sum(1 for w in waiting if w[0] == r), (seed, step, r)
        # the stores hold exactly the waiting trees (a take compacts them: no gap, no leak)
        assert (q._num_trees, q._num_nodes) == (len(waiting), sum(w[1].num_nodes for w in waiting)), (seed, step)
        assert q.requests() == {w[0] for w in waiting}
        assert bool(q) == bool(waiting)


def test_worked_example():
    """The module docstring's: a's tree of depth 3 waits at 2 known tokens, b's of depth 2 is
    labelled from tokens 20..21 of its row (its depth-1 nodes: token 8 rejected, token 9
    accepted)."""
    a = DraftTree(tokens=[1, 5, 6, 7], parents=[-1, 0, 1, 2])
    b = DraftTree(tokens=[1, 8, 9], parents=[-1, 0, 0])
    config = AcceptanceConfig()
    q = LabelQueue(8)
    q.offer(FlatTrees.from_trees([a, b]), np.array([0, 1]), ["a", "b"], np.array([10, 20]))
    rows = np.zeros((2, 40), np.int64)
    rows[1, 20:22] = [9, 3]
    hist = q.take(["a", "b"], np.array([12, 22]), rows, config)
    count, accepted = hist[0].sum(axis=-1), hist[1].sum(axis=-1)  # [source, depth]
    assert count.sum() == 2 and count[:, 1].sum() == 2 and accepted.sum() == 1
    assert q.waiting("a") == 1 and q.waiting("b") == 0 and q.requests() == {"a"}
    rows[0, 10:13] = [5, 6, 0]
    hist = q.take(["a", "b"], np.array([13, 22]), rows, config)
    assert hist[1].sum(axis=(0, 2)).tolist()[:4] == [0, 1, 1, 0] and hist[0].sum() == 3  # 5, 6 accepted; 7 not
    assert not q and q.take(["a"], np.array([50]), rows, config) is None


@pytest.mark.parametrize("bad", ["nan", "root source", "unknown source", "depth 0"])
def test_a_bad_node_is_refused_as_the_model_refuses_it(bad):
    """A labelled node with a NaN value, a source that is not a draft's (the root's, or past
    the last) or a depth below 1 raises ValueError naming how many (``AcceptanceModel.update``
    raises too); an infinite value is clipped to 1, as the definition clips it."""
    values = np.array([1.0, np.nan if bad == "nan" else 0.5, 0.5])
    sources = np.array([0, 1, 2], np.int8)
    if bad.endswith("source"):
        sources[1] = 0 if bad == "root source" else len(NodeSource)
    depths = np.array([0, 0 if bad == "depth 0" else 1, 1])
    flat = FlatTrees(np.array([0, 3]), np.array([1, 2, 3]), np.array([-1, 0, 0]), sources, values, depths)
    q = LabelQueue(8)
    q.offer(flat, np.array([0]), ["a"], np.array([0]))
    with pytest.raises(ValueError, match="^label queue: 1 labelled node"):
        q.take(["a"], np.array([1]), np.array([[2]]), AcceptanceConfig())
    with pytest.raises(ValueError):
        AcceptanceModel().update(*flat_continuation_labels(flat, np.array([2]), np.array([1])))
    inf = DraftTree(tokens=[1, 2], parents=[-1, 0], values=[1.0, np.inf])
    q.offer(FlatTrees.from_trees([inf]), np.array([0]), ["a"], np.array([0]))
    got, want = AcceptanceModel(), AcceptanceModel()
    got.add(q.take(["a"], np.array([1]), np.array([[2]]), AcceptanceConfig()))
    want.update(*continuation_labels([inf], [np.array([2])]))
    _assert_same_model(got, want, "inf")


def test_the_queue_grows_and_its_columns_are_the_kernels():
    """Many proposals before a pass: the stores grow (their first sizes are 64 trees, 512
    nodes) and every tree is labelled once, a tree of 100 nodes too (past the kernel's first
    scratch of 64); the column counts are the kernel module's."""
    kernels = load("label")
    assert (labels_module._TREE_COLUMNS, labels_module._NODE_COLUMNS) == (kernels.TREE_COLUMNS, kernels.NODE_COLUMNS)
    config = AcceptanceConfig()
    q = LabelQueue(4)
    chain = DraftTree(tokens=[0, 1, 1, 1, 1, 1, 1, 1, 1, 1], parents=[-1, 0, 1, 2, 3, 4, 5, 6, 7, 8])
    for k in range(100):
        q.offer(FlatTrees.from_trees([chain]), np.array([0]), [f"r{k}"], np.array([0]))
    assert q.waiting("r99") == 1 and q._nodes.shape[0] >= 1000 and q._trees.shape[0] >= 100
    hist = q.take([f"r{k}" for k in range(100)], np.full(100, 4), np.ones((100, 4), np.int64), config)
    assert hist[0].sum() == 400 and hist[1].sum() == 400 and not q
    long = DraftTree(tokens=[0] + [1] * 99, parents=list(range(-1, 99)))
    q = LabelQueue(200)
    q.offer(FlatTrees.from_trees([long]), np.array([0]), ["r"], np.array([0]))
    row = np.ones((1, 120), np.int64)
    row[0, 97] = 0  # depths 1..97 accepted, 98 and 99 not
    got, want = AcceptanceModel(), AcceptanceModel()
    got.add(q.take(["r"], np.array([99]), row, got.config))
    want.update(*continuation_labels([long], [row[0, :99]]))
    _assert_same_model(got, want, "long")
    assert got.accepted.sum() == 97


def test_one_proposal_larger_than_twice_the_stores():
    """One proposal of 150 trees of 10 nodes (1,500 nodes; the stores start at 64 trees and 512
    nodes, so doubling once is not enough): every tree is queued and labelled."""
    chain = DraftTree(tokens=[0] + [1] * 9, parents=list(range(-1, 9)))
    q = LabelQueue(9)
    q.offer(FlatTrees.from_trees([chain] * 150), np.arange(150), [f"r{k}" for k in range(150)], np.zeros(150, np.int64))
    assert q.waiting("r149") == 1 and q._num_nodes == 1500
    hist = q.take([f"r{k}" for k in range(150)], np.full(150, 9), np.ones((150, 9), np.int64), AcceptanceConfig())
    assert hist[0].sum() == 1350 == hist[1].sum() and not q


def test_a_dropped_requests_id_waits_for_its_trees_to_go():
    """c is dropped while its tree waits: a request arriving before the next pass gets a new id
    (neither c's nor a live request's), the pass labels a's and d's trees, never c's, and the
    request after it reuses c's id."""
    tree = DraftTree(tokens=[0, 1, 1], parents=[-1, 0, 1])  # needs 2 tokens
    flat = FlatTrees.from_trees([tree] * 3)
    q = LabelQueue(8)
    q.offer(flat, np.arange(3), ["a", "b", "c"], np.zeros(3, np.int64))
    c_id = q._ids["c"]
    q.drop("c")
    q.offer(FlatTrees.from_trees([tree]), np.array([0]), ["d"], np.zeros(1, np.int64))
    assert len({q._ids[r] for r in "abd"} | {c_id}) == 4
    assert (q.waiting("a"), q.waiting("b"), q.waiting("c"), q.waiting("d")) == (1, 1, 0, 1)
    rows = np.ones((4, 8), np.int64)
    hist = q.take(["a", "b", "c", "d"], np.array([2, 1, 2, 2]), rows, AcceptanceConfig())  # b has 1 token: waits
    assert hist[0].sum() == 4 and hist[1].sum() == 4  # a's and d's nodes, both accepted
    assert q.requests() == {"b"} and q._num_trees == 1
    q.offer(FlatTrees.from_trees([tree]), np.array([0]), ["e"], np.zeros(1, np.int64))
    assert q._ids["e"] == c_id


def test_calls_that_do_not_fit_are_refused():
    """An offer whose trees, requests and starts differ in number, a pass with fewer token counts
    or rows than requests, and a ready tree whose tokens would run past its row: ValueError,
    never a read or write outside the arrays."""
    tree = DraftTree(tokens=[0, 1, 1], parents=[-1, 0, 1])  # needs 2 tokens
    q = LabelQueue(8)
    with pytest.raises(ValueError, match="one request and one start per tree"):
        q.offer(FlatTrees.from_trees([tree]), np.array([0]), ["a", "b"], np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="one request and one start per tree"):
        q.offer(FlatTrees.from_trees([tree]), np.array([0]), ["a"], np.zeros(2, np.int64))
    q.offer(FlatTrees.from_trees([tree]), np.array([0]), ["a"], np.array([3]))
    with pytest.raises(ValueError, match="2 requests, 1 token counts"):
        q.take(["a", "b"], np.array([5]), np.ones((2, 8), np.int64), AcceptanceConfig())
    with pytest.raises(ValueError, match="2 requests, 2 token counts, 1 token rows"):
        q.take(["a", "b"], np.array([5, 5]), np.ones((1, 8), np.int64), AcceptanceConfig())
    with pytest.raises(ValueError, match="^label queue: 1 labelled .*past their row"):
        q.take(["a"], np.array([5]), np.ones((1, 4), np.int64), AcceptanceConfig())  # needs columns 3..4


def test_a_request_dropped_and_offered_again_under_its_name():
    """a's tree waits, a is dropped and a tree is offered again for "a" before the pass: only the
    new tree is labelled (the old one never against the new request's row)."""
    old = DraftTree(tokens=[0, 5, 5], parents=[-1, 0, 1])
    new = DraftTree(tokens=[0, 1], parents=[-1, 0])
    q = LabelQueue(8)
    q.offer(FlatTrees.from_trees([old]), np.array([0]), ["a"], np.array([0]))
    q.drop("a")
    q.offer(FlatTrees.from_trees([new]), np.array([0]), ["a"], np.array([0]))
    assert q.waiting("a") == 1
    hist = q.take(["a"], np.array([2]), np.array([[1, 5]]), AcceptanceConfig())
    assert hist[0].sum() == 1 and hist[1].sum() == 1 and not q  # new's one node, accepted
