"""DraftTree / TreeBatch: golden examples and hypothesis property tests of every invariant."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_anisotropic.tree import DraftTree, NodeSource, TreeBatch, pack_trees


@st.composite
def trees(draw, max_nodes=70):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    srcs = [NodeSource.ROOT] + [draw(st.sampled_from([NodeSource.SPINE, NodeSource.BRANCH, NodeSource.DRAFT])) for _ in range(n - 1)]
    mult = [1] + [draw(st.integers(1, 3)) for _ in range(n - 1)]
    return DraftTree(tokens=tokens, parents=parents, sources=srcs, multiplicity=mult)


def test_golden_small_tree():
    t = DraftTree(tokens=[5, 17, 9, 23], parents=[-1, 0, 1, 0],
                  sources=[NodeSource.ROOT, NodeSource.SPINE, NodeSource.SPINE, NodeSource.BRANCH])
    assert t.depths.tolist() == [0, 1, 2, 1]
    assert t.positions(7).tolist() == [7, 8, 9, 8]
    assert t.ancestor_bits.tolist() == [1, 3, 7, 9]
    assert t.first_child.tolist() == [1, 2, -1, -1]
    assert t.next_sibling.tolist() == [-1, 3, -1, -1]
    assert t.path_to(2) == [1, 2]


def test_docstring_examples():
    t = DraftTree(tokens=[0, 1, 2, 3], parents=[-1, 0, 0, 1])
    assert t.positions(7).tolist() == [7, 8, 8, 9]
    assert t.ancestor_bits.tolist() == [1, 3, 5, 11]
    assert t.first_child.tolist() == [1, 3, -1, -1] and t.next_sibling.tolist() == [-1, 2, -1, -1]
    b = pack_trees([DraftTree([0, 1, 2], [-1, 0, 0]), DraftTree([0, 1], [-1, 0])], prompt_lens=[7, 4])
    assert b.node_offsets.tolist() == [0, 3, 5]
    assert b.parents.tolist() == [-1, 0, 0, -1, 3]
    assert b.local_parents.tolist() == [-1, 0, 0, -1, 0]
    assert b.positions.tolist() == [7, 8, 8, 4, 5]
    assert b.tree_index.tolist() == [0, 0, 0, 1, 1] and b.root_index.tolist() == [0, 3]
    m = DraftTree.from_paths([[1, 2], [1, 3]], merge=True)
    assert m.tokens.tolist() == [0, 1, 2, 3] and m.parents.tolist() == [-1, 0, 1, 1]
    assert m.multiplicity.tolist() == [1, 2, 1, 1]
    u = DraftTree.from_paths([[1, 2], [1, 3]])
    assert u.parents.tolist() == [-1, 0, 1, 0, 3]


def test_spine_priority_order():
    t = DraftTree(tokens=[0, 4, 4, 5], parents=[-1, 0, 0, 0],
                  sources=[NodeSource.ROOT, NodeSource.BRANCH, NodeSource.SPINE, NodeSource.BRANCH])
    assert t.children_lists()[0] == [2, 1, 3]  # spine first, then index order


@pytest.mark.parametrize("bad", [
    dict(tokens=[0, 1], parents=[0, 0]),
    dict(tokens=[0, 1, 2], parents=[-1, 2, 0]),
    dict(tokens=[0, 1], parents=[-1, 0], sources=[NodeSource.ROOT, NodeSource.ROOT]),
    dict(tokens=[0, 1], parents=[-1, 0], multiplicity=[1, 0]),
])
def test_invalid_trees_raise(bad):
    with pytest.raises(ValueError):
        DraftTree(**bad)


@settings(max_examples=60, deadline=None)
@given(trees())
def test_tree_invariants(t):
    n = t.num_nodes
    d = t.depths
    assert d[0] == 0 and all(d[i] == d[t.parents[i]] + 1 for i in range(1, n))
    m = t.ancestor_mask
    for i in range(n):  # mask row = {i} + ancestors
        anc = {i, *t.path_to(i), 0}
        assert set(np.nonzero(m[i])[0].tolist()) == anc
    if n <= 64:
        bits = t.ancestor_bits.view(np.uint64)
        for i in range(n):
            assert [(int(bits[i]) >> j) & 1 for j in range(n)] == m[i].astype(int).tolist()
    else:
        with pytest.raises(ValueError):
            t.ancestor_bits
    # first-child / next-sibling enumerate exactly the children, in priority order
    kids = t.children_lists()
    for c in range(n):
        walk, j = [], t.first_child[c]
        while j >= 0:
            walk.append(int(j))
            j = t.next_sibling[j]
        assert walk == kids[c]
        assert sorted(walk) == [j for j in range(1, n) if t.parents[j] == c]
        ranks = [0 if t.sources[j] == NodeSource.SPINE else 1 for j in walk]
        assert ranks == sorted(ranks)
    assert t.positions(3).tolist() == (d + 3).tolist()


@settings(max_examples=40, deadline=None)
@given(trees(), st.integers(1, 80))
def test_truncation_is_valid_prefix(t, k):
    s = t.truncate(k)
    k = min(k, t.num_nodes)
    assert s.num_nodes == k
    assert s.parents.tolist() == t.parents[:k].tolist()
    assert s.depths.tolist() == t.depths[:k].tolist()
    assert (s.ancestor_mask == t.ancestor_mask[:k, :k]).all()


@settings(max_examples=30, deadline=None)
@given(st.lists(trees(max_nodes=20), min_size=1, max_size=5), st.data())
def test_pack_roundtrip(ts, data):
    plens = [data.draw(st.integers(0, 100)) for _ in ts]
    b = pack_trees(ts, plens)
    off = b.node_offsets.tolist()
    assert off[0] == 0 and off[-1] == b.num_nodes
    for i, t in enumerate(ts):
        lo, hi = off[i], off[i + 1]
        assert b.tokens[lo:hi].tolist() == t.tokens.tolist()
        assert b.local_parents[lo:hi].tolist() == t.parents.tolist()
        assert b.parents[lo:hi].tolist() == [p + lo if p >= 0 else -1 for p in t.parents.tolist()]
        assert b.positions[lo:hi].tolist() == t.positions(plens[i]).tolist()
        assert (b.tree_index[lo:hi] == i).all() and b.root_index[i] == lo
        for c, kids in enumerate(t.children_lists()):
            row = [x - lo for x in b.children[lo + c].tolist() if x >= 0]
            assert row == kids
            slots = [x - lo for x in b.slots[lo + c].tolist() if x >= 0]
            assert slots == [k for k in kids for _ in range(int(t.multiplicity[k]))]
    r = b.repeat(3)
    ref = pack_trees(ts * 3, plens * 3)
    for f in ("node_offsets", "tokens", "parents", "local_parents", "depths", "positions", "tree_index",
              "root_index", "children", "slots"):
        assert torch.equal(getattr(r, f), getattr(ref, f)), f


def test_unchecked_spine_equals_the_checked_chain():
    # DraftTree.spine skips the checks (the engine's chain steps build one per request and step):
    # it must be the very tree the checked constructor builds, and pass its checks
    values = np.array([1.0, 0.5, 0.25, 0.125])
    fast = DraftTree.spine(7, np.array([3, 9, 4]), values)
    slow = DraftTree(tokens=[7, 3, 9, 4], parents=[-1, 0, 1, 2],
                     sources=[NodeSource.ROOT, NodeSource.SPINE, NodeSource.SPINE, NodeSource.SPINE], values=values)
    fast.validate()
    for name in ("tokens", "parents", "sources", "values", "multiplicity"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert fast.draft_probs is None and fast.depths.tolist() == [0, 1, 2, 3]
    root_only = DraftTree.spine(7, np.zeros(0, np.int64), np.ones(1))
    root_only.validate()
    assert root_only.num_nodes == 1 and root_only.sources.tolist() == [NodeSource.ROOT]
