"""``DraftTree.truncate`` and ``pack_trees``: golden cases for the edges that
``scripts/mutate.py`` found untested (docs/testing.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_anisotropic.tree import DraftTree, NodeSource, pack_trees


def _tree():
    #  0 -> 1 -> 3,  0 -> 2 (multiplicity 2), values descending
    return DraftTree(tokens=[5, 6, 7, 8], parents=[-1, 0, 0, 1], values=[1.0, 0.5, 0.4, 0.2],
                     sources=[NodeSource.ROOT, NodeSource.SPINE, NodeSource.BRANCH, NodeSource.SPINE],
                     multiplicity=[1, 1, 2, 1], draft_probs=torch.arange(40.0).reshape(4, 10))


def test_truncate_slices_every_field_and_cache():
    t = _tree()
    _ = t.depths, t.ancestor_bits, t.ancestor_mask  # fill the caches that truncate slices
    s = t.truncate(3)
    assert s.tokens.tolist() == [5, 6, 7] and s.parents.tolist() == [-1, 0, 0]
    assert s.sources.tolist() == [NodeSource.ROOT, NodeSource.SPINE, NodeSource.BRANCH]
    assert s.values.tolist() == [1.0, 0.5, 0.4] and s.multiplicity.tolist() == [1, 1, 2]
    assert torch.equal(s.draft_probs, torch.arange(30.0).reshape(3, 10))
    fresh = DraftTree(tokens=[5, 6, 7], parents=[-1, 0, 0])
    assert s._cache["depths"].tolist() == fresh.depths.tolist() == [0, 1, 1]
    assert s._cache["abits"].tolist() == fresh.ancestor_bits.tolist() == [1, 3, 5]
    assert s._cache["amask"].shape == (3, 3) and (s._cache["amask"] == fresh.ancestor_mask).all()
    assert t.truncate(4) is t and t.truncate(9) is t
    assert t.truncate(1).tokens.tolist() == [5]
    with pytest.raises(ValueError):
        t.truncate(0)
    u = DraftTree(tokens=[5, 6], parents=[-1, 0])
    assert u.truncate(1).draft_probs is None and "depths" not in u.truncate(1)._cache


def test_pack_trees_shapes_flags_and_positions():
    b = pack_trees([_tree(), DraftTree(tokens=[1], parents=[-1])], prompt_lens=[10, 3])
    assert b.positions.tolist() == [10, 11, 11, 12, 3]
    assert b.depths.tolist() == [0, 1, 1, 2, 0] and b.max_depth == 2
    assert b.children.shape == (5, 2) and b.children[0].tolist() == [1, 2]  # widest node: 2 children
    assert b.slots.shape == (5, 3) and b.slots[0].tolist() == [1, 2, 2]  # 1 once, 2 twice
    assert b.slots[1].tolist() == [3, -1, -1] and b.children[2].tolist() == [-1, -1]  # -1 padded
    assert b.parents.tolist() == [-1, 0, 0, 1, -1] and b.root_index.tolist() == [0, 4]
    assert not b.unmerged
    assert pack_trees([DraftTree(tokens=[1, 2], parents=[-1, 0]), DraftTree(tokens=[3], parents=[-1])]).unmerged
    leaves = pack_trees([DraftTree(tokens=[1], parents=[-1])])
    assert leaves.children.shape == (1, 1) and leaves.slots.shape == (1, 1) and leaves.max_depth == 0
    assert leaves.positions.tolist() == [0]
    with pytest.raises(ValueError):
        pack_trees([])
    with pytest.raises(ValueError):
        pack_trees([_tree()], prompt_lens=[1, 2])


def test_pack_trees_ancestor_bits_up_to_64_nodes():
    chain = lambda n: DraftTree.chain(list(range(1, n)))  # noqa: E731  n nodes
    b64 = pack_trees([chain(64), chain(2)])
    assert b64.ancestor_bits is not None and int(b64.ancestor_bits[63]) == -1  # all 64 bits set
    assert pack_trees([chain(65)]).ancestor_bits is None
    assert pack_trees([chain(2), chain(65)]).ancestor_bits is None  # any tree over 64 nodes
    assert pack_trees([chain(3), chain(2)]).ancestor_bits.tolist() == [1, 3, 7, 1, 3]
    assert np.array_equal(pack_trees([chain(3)]).children.numpy(), [[1], [2], [-1]])
