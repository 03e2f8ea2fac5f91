"""Baselines (AR, PLD, TR, Isotropic) behind the proposer interface; registry and configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from vllm_anisotropic.models.tiny import build_tiny_model
from vllm_anisotropic.proposers import PROPOSERS, GooseConfig, get_proposer, proposer_config
from vllm_anisotropic.proposers.isotropic import build_isotropic_tree
from vllm_anisotropic.proposers.pld import propose_prompt_lookup
from vllm_anisotropic.proposers.token_recycling import static_template
from vllm_anisotropic.tree import NodeSource


def test_registry_and_config_errors():
    with pytest.raises(ValueError, match="valid names: .*goose"):
        get_proposer("nope")
    with pytest.raises(ValueError, match="valid keys: .*budget"):
        get_proposer("goose", bugdet=10)
    with pytest.raises(ValidationError):
        GooseConfig(budget=0)
    c = GooseConfig()
    assert (c.budget, c.max_depth, c.top_k, c.spine_branch_ratio, c.min_branch_score, c.ngram_sizes, c.ema_coef) == (
        60, 6, 10, 0.5, 0.01, (3, 4, 5), 0.3)
    assert GooseConfig.model_fields["budget"].description  # docstring per field
    assert proposer_config("iso5").branching == 5
    assert proposer_config("goose-unigram").bigram is False
    for name in PROPOSERS:  # every registered method builds and drafts on an empty table
        options = {"model": str(build_tiny_model(seed=1))} if name == "draft_tree" else {}  # q: a draft model
        s = get_proposer(name, **options).new_request()
        t = s.propose(np.array([1, 2, 3, 1, 2, 3, 1, 2]))
        t.validate()


def test_pld_matches_oracle():
    rng = np.random.default_rng(0)
    s = get_proposer("pld").new_request()
    ctx = list(rng.integers(0, 5, 20))
    for _ in range(30):
        t = s.propose(np.array(ctx))
        assert t.tokens[1:].tolist() == propose_prompt_lookup(np.array(ctx), 20, 3, 5).tolist()
        assert np.all(t.parents[1:] == np.arange(t.num_nodes - 1))
        ctx.extend(rng.integers(0, 5, 3).tolist())


def test_ar_is_root_only():
    s = get_proposer("ar").new_request()
    assert s.propose(np.array([4, 5])).num_nodes == 1


def test_tr_template_shape():
    slots = static_template(60, 6, 10, 1.5)
    assert len(slots) == 60
    depth = [0]
    kids = [0] * 60
    for parent, rank in slots[1:]:
        depth.append(depth[parent] + 1)
        kids[parent] += 1
    assert max(depth) == 6  # deep along rank-0 chains
    assert kids[0] == max(kids)  # widest at the root: imbalanced, breadth-heavy near the root
    assert static_template(4, 2, 2, 1.5) == [(-1, -1), (0, 0), (1, 0), (0, 1)]


def test_tr_fills_from_table():
    prop = get_proposer("tr", vocab_size=32)
    s = prop.new_request()
    assert s.propose(np.array([1, 2])).num_nodes == 1  # cold table
    logits = torch.arange(32, dtype=torch.float32).repeat(32, 1)  # every row: 31 > 30 > ...
    prop.table.harvest(np.full(32, -1), np.arange(32), logits)
    t = s.propose(np.array([1, 2]))
    assert t.num_nodes == 60 and np.all(t.sources[1:] == NodeSource.BRANCH)
    assert sorted(t.tokens[k] for k in t.children_lists()[0])[-1] == 31


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 1000), k=st.sampled_from([3, 5]), budget=st.integers(1, 70), spine_len=st.integers(0, 10))
def test_isotropic_shape(seed, k, budget, spine_len):
    rng = np.random.default_rng(seed)

    def succ(prev, tok):
        return rng.permutation(50)[:10] + 100, np.sort(rng.dirichlet(np.ones(10)))[::-1]

    spine = rng.integers(0, 50, spine_len)
    t = build_isotropic_tree(7, -1, spine, succ, branching=k, budget=budget, max_depth=20, min_branch_score=0.0)
    assert t.num_nodes <= budget and t.num_children.max() <= k
    # balanced: BFS fill means leaves differ in depth by at most one
    if t.num_nodes == budget and budget > 1:
        leaf_depths = t.depths[t.is_leaf]
        assert leaf_depths.max() - leaf_depths.min() <= 1
    # the spine is the rank-0 chain below the root
    chain = [0]
    while True:
        kids = [c for c in t.children_lists()[chain[-1]] if t.sources[c] == NodeSource.SPINE]
        if not kids:
            break
        chain.append(kids[0])
    assert [int(t.tokens[c]) for c in chain[1:]] == spine[: len(chain) - 1].tolist()


@pytest.mark.parametrize("name", ["goose", "tr", "iso3", "pld"])
def test_max_nodes_lowers_the_budget_of_one_call(name):
    """``propose(context, max_nodes)``: the allocator's offer cap (drafter.TreeDrafter._offer).
    A proposer that ignored it would build (and the engine would ship) its whole budget."""
    prop = get_proposer(name, vocab_size=32)
    logits = torch.arange(32, dtype=torch.float32).repeat(32, 1)  # every row: 31 > 30 > ...
    if getattr(prop, "table", None) is not None:
        prop.table.harvest(np.full(32, -1), np.arange(32), logits)
    s = prop.new_request()
    # a context whose 3-gram recurs: PLD / GOOSE find a 12-token continuation
    context = np.array([5, 6, 7] + list(range(8, 20)) + [1, 5, 6, 7])
    if name == "iso3":
        s.table.harvest(np.full(32, -1), np.arange(32), logits)
    full = s.propose(context)
    assert full.num_nodes > 9, full.num_nodes  # the call below has something to cut
    for max_nodes in (1, 2, 9):
        t = s.propose(context, max_nodes=max_nodes)
        assert 1 <= t.num_nodes <= max_nodes and t.tokens[0] == context[-1], (max_nodes, t.num_nodes)
        assert (t.num_nodes == max_nodes) or name == "pld", (max_nodes, t.num_nodes)
    assert s.propose(context, max_nodes=1000).num_nodes == full.num_nodes
