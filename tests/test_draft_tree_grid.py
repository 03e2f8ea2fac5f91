"""The (K, L1, L2) grid measurement (bench/draft_tree_grid.py): sub-tree bookkeeping, and, with
the target as its own draft (p = q at every node), every lossless verifier accepts every node
of every action while NSS (which ignores q) and Khisti with several branches do not: a node whose p row were taken from
another node, or an action holding the wrong nodes, would show up as E < 1 + L1 + L2."""

import numpy as np
import pytest
import torch

from vllm_anisotropic.bench.draft_tree_grid import Target, branch_nodes, merge, root_record, select, time_passes
from vllm_anisotropic.models import build_tiny_model
from vllm_anisotropic.proposers.draft_model import DelayedShape, DraftLM, shape_parents
from vllm_anisotropic.tree import DraftTree


def test_branch_nodes_pick_the_trunk_and_the_first_branches():
    # (K_max 3, L1 1, L2_max 2): root 0, trunk 1, depth 0 -> 2 3 4, depth 1 -> 5 6 7
    assert branch_nodes(1, 3, 2, 2).tolist() == [0, 1, 2, 3, 5, 6]
    assert branch_nodes(1, 3, 1, 1).tolist() == [0, 1, 2]
    assert branch_nodes(2, 3, 3, 0).tolist() == [0, 1, 2]
    full = DraftTree(tokens=np.arange(8), parents=shape_parents(DelayedShape(3, 1, 2)))
    sub = select(full, branch_nodes(1, 3, 2, 2))
    assert sub.parents.tolist() == shape_parents(DelayedShape(2, 1, 2)).tolist()
    assert sub.tokens.tolist() == [0, 1, 2, 3, 5, 6]


def test_merge_keeps_every_path():
    a = DraftTree(tokens=[9, 1, 2], parents=[-1, 0, 1])
    b = DraftTree(tokens=[9, 3, 4, 5], parents=[-1, 0, 0, 1])
    union, ids = merge([a, b])
    for tree, own in zip([a, b], ids):
        for node in range(tree.num_nodes):
            want = [int(tree.tokens[n]) for n in tree.path_to(node)]
            assert [int(union.tokens[n]) for n in union.path_to(int(own[node]))] == want


@pytest.fixture(scope="module")
def models():
    path = build_tiny_model(seed=1, block_std=0.1, lm_head_alpha=0.2)  # a peaked law: NSS misses often
    return Target(str(path), torch.float32), DraftLM(path)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_self_draft_accepts_every_node(models, temperature):
    target, draft = models
    context = list(range(300, 340))
    target.reset(context)
    rec, emitted = root_record(target, draft, context, temperature, 3, 2, 2, torch.Generator().manual_seed(0), 1e-12)
    assert len(rec["values"]) == 3 + 3 * 3 * 2  # (1, L1, 0) for L1 = 0..2, then every K and L1 at L2 = 1, 2
    for action, vals in rec["values"].items():
        k, l1, l2 = (int(x) for x in action.split(","))
        full = 1 + l1 + l2
        for name, v in vals.items():
            if name == "nss" or (name == "khisti" and k > 1 and l2 > 0):
                # NSS ignores q; Khisti's tournament picks a draft from a law r != q, and
                # accepts it with sum min(p, r) < 1 even when p = q
                assert v <= full + 1e-9
            else:
                assert abs(v - full) < 1e-4, (action, name, v)
    if temperature > 0:
        assert rec["values"]["3,2,2"]["nss"] < 5 - 0.1  # NSS ignores q: it loses nodes even here
        assert rec["dropped"] < 1e-6
    assert 1 <= len(emitted) <= 1 + 2 + 2


def test_time_passes_records_every_forward_the_batch_labels_need(models):
    """The timing record holds q's forward at b and b K rows and the target's at b tree sizes,
    so that Eq. 11 prices every action of the capped grid at every batch size (the selector's
    labels, ``selector.train.step_time``); a record without q's batched rows makes that raise."""
    from vllm_anisotropic.selector.policy import action_grid
    from vllm_anisotropic.selector.train import step_time

    target, draft = models
    timing = time_passes(target, draft, list(range(300, 340)), 4, 8, 8, repeats=1, batch_sizes=(1, 2, 4),
                         max_drafts=4)
    assert sorted(timing["t_q"]) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert all(v > 0 for v in timing["t_q"].values())
    for b in (1, 2, 4):
        assert all(step_time(a, timing, b) > 0 for a in action_grid(4))
    with pytest.raises(ValueError, match="no draft forward of 16 rows"):
        step_time((4, 0, 1), {**timing, "t_q": {m: t for m, t in timing["t_q"].items() if m <= 4}}, 4)
