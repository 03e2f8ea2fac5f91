"""``TreeDrafter`` (integration/vllm/engine/drafter.py) without an engine: a real drafter built
from a vLLM-shaped config (GOOSE, vocabulary 64) over vLLM-shaped token arrays, through the
step protocol the tree runner drives: ``propose_trees`` -> the allocator's reads
(``pending_*``) -> ``take_step`` -> ``observe_step`` -> ``run_deferred``, and the request
lifecycle (``rest``, ``contain``, ``drop``, ``drop_tree``).

Contexts repeat a six-token cycle, so GOOSE's context match gives every request a spine (and
its adjacency table branches once it has learned)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_anisotropic.integration.vllm.engine.drafter import (
    OFFER_MEMORY, OFFER_MIN_DRAFTS, TreeDrafter, _first_mismatch)
from vllm_anisotropic.integration.vllm.frontdoor.config import TreeSpecConfig
from vllm_anisotropic.tree import DraftTree, FlatTrees

V = 64
MAX_LEN = 96
CYCLE = [5, 6, 7, 8, 9, 10]


def _drafter(method="goose", num_speculative_tokens=8, max_model_len=MAX_LEN, **options) -> TreeDrafter:
    spec = TreeSpecConfig.build(method, options)
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(method=method, num_speculative_tokens=num_speculative_tokens),
        additional_config={"vllm_anisotropic": spec.to_additional_config()},
        model_config=SimpleNamespace(get_vocab_size=lambda: V, max_model_len=max_model_len))
    return TreeDrafter(cfg)


def _tokens(lengths, shift=(0, 1, 2, 3)):
    """vLLM's token array: row i holds the cycle shifted by ``shift[i]`` up to ``lengths[i]``."""
    tokens = np.zeros((len(lengths), MAX_LEN), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = [CYCLE[(j + shift[i]) % 6] for j in range(n)]
    return tokens, np.asarray(lengths, np.int64)


def test_only_rows_with_a_sampled_token_eligible_and_not_disabled_draft():
    d = _drafter(allocator="off")
    tokens, lengths = _tokens([20, 20, 20, 20])
    d.disabled.add("d")
    drafts = d.propose_trees(["a", "b", "c", "d"], [True, False, True, True], [[1], [1], [], [1]], lengths, tokens)
    assert drafts[1] == drafts[2] == drafts[3] == [] and len(drafts[0]) > 0
    assert set(d.pending) == {"a"} and set(d.states) == {"a"}
    # the spine continues the cycle from the last token (row 0 ends with CYCLE[19 % 6] = 6)
    assert drafts[0][:3] == [7, 8, 9]
    assert d.metrics.live_requests == 1
    # the next call drops every batch row's old tree before drafting again
    drafts = d.propose_trees(["a", "b"], [False, True], [[1], [1]], lengths, tokens)
    assert drafts[0] == [] and len(drafts[1]) > 0 and set(d.pending) == {"b"}


def test_drafts_fit_the_speculative_cap_and_the_model_length():
    d = _drafter(allocator="off", num_speculative_tokens=5)
    tokens, lengths = _tokens([40, MAX_LEN - 3, MAX_LEN - 1])
    drafts = d.propose_trees(["a", "b", "c"], [True] * 3, [[1]] * 3, lengths, tokens)
    assert len(drafts[0]) == 5  # the spine is longer: cut to num_speculative_tokens
    assert len(drafts[1]) == 2  # room for 2 tokens after the root (max_model_len - length - 1)
    assert drafts[2] == []  # at the limit: a root-only tree
    ranked = _drafter(num_speculative_tokens=5)
    ranked.propose_trees(["a", "b", "c"], [True] * 3, [[1]] * 3, lengths, tokens)
    assert set(ranked.unlabelled) == {"a", "b"}  # a root-only tree waits for no label
    assert d.pending["c"][0].trees.tree(d.pending["c"][1]).num_nodes == 1


def test_pending_reads_of_the_allocator():
    d = _drafter()  # allocator auto: ranked trees with probabilities
    tokens, lengths = _tokens([30, 31])
    d.reorders = {"a": [1], "zz": [2]}
    drafts = d.propose_trees(["a", "b"], [True, True], [[1], [1]], lengths, tokens)
    assert d.reorders == {"zz": [2]}  # a new tree for "a": its old grammar order is gone
    probs = d.pending_probs(["a", "b", "zz"])
    assert [len(p) for p in probs[:2]] == [len(x) for x in drafts] and probs[2] is None
    assert all(((p > 0) & (p <= 1)).all() for p in probs[:2])
    parents = d.pending_parents(["a", "zz"])
    assert parents["zz"] == [] and len(parents["a"]) == len(drafts[0]) and parents["a"][0] == 0
    assert all(0 <= p <= j for j, p in enumerate(parents["a"]))  # local parents, root 0, before the node
    proposal, k = d.pending["b"]
    assert d.pending_chains(["a", "b", "zz"])[1:] == [int(proposal.trees.chain_prefix()[k]), 0]
    assert d.pending_chains(["a"])[0] >= 1
    off = _drafter(allocator="off")
    off.propose_trees(["a"], [True], [[1]], lengths[:1], tokens[:1])
    assert off.pending_probs(["a"]) == [None]


def test_take_step_cuts_each_tree_to_its_scheduled_prefix_in_batch_row_order():
    d = _drafter(allocator="off")
    tokens, lengths = _tokens([30, 30, 31])
    drafts = d.propose_trees(["a", "b", "c"], [True, True, True], [[1]] * 3, lengths, tokens)
    full_b = d.pending["b"][0].trees.tree(d.pending["b"][1])
    step = d.take_step(["x", "c", "b", "a"], {"a": drafts[0][:2], "b": [], "c": drafts[2]})
    assert step.req_ids == ["c", "b", "a"] and step.rows.tolist() == [1, 2, 3]
    assert step.trees.sizes().tolist() == [len(drafts[2]) + 1, 1, 3]
    assert step.trees.tree(2).tokens[1:].tolist() == drafts[0][:2]
    assert step.trees.tree(1).tokens.tolist() == full_b.tokens[:1].tolist()
    assert step.chains.tolist() == [False] * 3 and step.prev_roots.tolist() == [6, 10, 9]
    assert d.pending == {}
    assert d.take_step(["a"], {}) is None  # taken once


def test_take_step_refuses_what_is_not_a_pending_prefix():
    d = _drafter(allocator="off")
    tokens, lengths = _tokens([30, 30])
    with pytest.raises(RuntimeError, match="request a: 2 drafts scheduled but no tree pending"):
        d.take_step(["a"], {"a": [1, 2]})
    drafts = d.propose_trees(["a", "b"], [True, True], [[1]] * 2, lengths, tokens)
    with pytest.raises(RuntimeError, match=f"request b: {len(drafts[1]) + 1} drafts scheduled, its tree has {len(drafts[1])}"):
        d.take_step(["a", "b"], {"a": drafts[0], "b": drafts[1] + [3]})
    drafts = d.propose_trees(["a", "b"], [True, True], [[1]] * 2, lengths, tokens)
    bad = list(drafts[1])
    bad[0] = 63
    with pytest.raises(RuntimeError, match=r"request b: scheduled drafts \[63"):
        d.take_step(["a", "b"], {"a": drafts[0], "b": bad})


def test_zero_cuts_back_off_and_kept_drafts_set_the_next_offer():
    """Allocator on: a request cut to no draft k times in a row skips min(2^(k-1), backoff)
    proposals; one whose drafts are kept is offered max(8, factor x its decaying kept mark)."""
    d = _drafter(allocator_backoff=4, allocator_offer_factor=3.0)
    tokens, lengths = _tokens([30, 30])
    ids = ["a", "b"]

    def step(kept_a, kept_b):
        drafts = d.propose_trees(ids, [True, True], [[1]] * 2, lengths, tokens)
        scheduled = {r: x[:n] for r, x, n in zip(ids, drafts, (kept_a, kept_b)) if x}
        if scheduled:
            d.take_step(ids, scheduled)
        return drafts

    step(0, 3)
    assert d.zero_streak == {"a": 1} and d.skip == {"a": 1}
    assert d.kept_mark == {"a": 0.0, "b": 3.0}
    drafts = step(0, 2)  # a skips this proposal (its skip counts down), b is kept 2
    assert drafts[0] == [] and d.skip["a"] == 0 and d.zero_streak["a"] == 1
    assert d.kept_mark["b"] == pytest.approx(max(2.0, OFFER_MEMORY * 3.0))
    step(0, 0)  # a offers again and is cut to none: a second zero cut in a row, skip 2
    assert d.zero_streak == {"a": 2, "b": 1} and d.skip == {"a": 2, "b": 1}
    step(0, 0)
    assert d.skip["a"] == 1
    d.kept_mark["b"] = 5.0
    room = np.array([60, 20])
    offers = d._offers(["b", "new"], room)
    assert offers.tolist() == [max(OFFER_MIN_DRAFTS, 15) + 1, 0]  # ceil(3.0 x 5) drafts + the root; unknown: own
    assert d._offers(["b"], np.array([15])).tolist() == [0]  # the offer reaches the room: the proposer's own
    d.kept_mark["b"] = 1.0
    assert d._offer("b", 60) == OFFER_MIN_DRAFTS + 1 and d._offer("zz", 60) is None
    d.zero_streak.clear()
    d.skip.clear()
    d.take_step(ids, {})  # nothing pending now: no counts
    drafts = step(4, 4)
    assert d.zero_streak == {} and d.kept_mark["a"] == 4.0
    off = _drafter(allocator="off")
    assert off._offers(["a"], np.array([60])) is None


def test_a_chain_step_does_not_count_toward_the_backoff():
    d = _drafter(allocator_chain_drafts=2)
    tokens, lengths = _tokens([30])
    d.skip["a"] = 3
    drafts = d.propose_trees(["a"], [True], [[1]], lengths, tokens, chains=True)
    assert drafts == [[5, 6]] and d.skip["a"] == 3  # drafted despite the backoff, which waits
    assert d.pending_probs(["a"]) == [None] and d.unlabelled == {}


def test_rest_drops_pending_trees_and_drafts_nothing():
    d = _drafter(allocator="off")
    tokens, lengths = _tokens([30, 30])
    d.propose_trees(["a", "b"], [True, True], [[1]] * 2, lengths, tokens)
    assert d.rest(["a", "zz"]) == [[], []] and set(d.pending) == {"b"}


def test_contain_disables_requests_once_and_counts_every_fault():
    d = _drafter(allocator="off")
    tokens, lengths = _tokens([30])
    d.propose_trees(["a"], [True], [[1]], lengths, tokens)
    d.contain("verify", ["a", "b"])
    assert d.disabled == {"a", "b"} and d.metrics.faults == {"verify": 1} and d.metrics.disabled_requests == 2
    d.contain("verify", ["a"])
    assert d.metrics.faults == {"verify": 2} and d.metrics.disabled_requests == 2  # already off
    d.contain("harvest", ["a", "gone", "c"], live=False)  # deferred work: only requests with state
    assert d.disabled == {"a", "b"} and d.metrics.faults == {"verify": 2, "harvest": 1}
    assert d.pending  # a tree already proposed stays pending


def test_drop_forgets_a_request_and_its_tokens_reach_the_store_after_the_reply():
    d = _drafter()
    tokens, lengths = _tokens([30, 30])
    d.tenants = {"a": "t1"}
    d.propose_trees(["a", "b"], [True, True], [[1]] * 2, lengths, tokens)
    d.take_step(["a", "b"], {})
    d.disabled.add("a")
    finished = []
    d.states["a"].finish = lambda context: finished.append(context)
    d.drop("a", tokens[0, :30])
    assert "a" not in d.states and "a" not in d.tenants and "a" not in d.disabled
    assert "a" not in d.zero_streak and "a" not in d.skip and "a" not in d.kept_mark and "a" not in d.unlabelled
    assert d.metrics.live_requests == 1 and finished == []
    d.run_deferred()
    assert len(finished) == 1 and finished[0].tolist() == tokens[0, :30].tolist()
    d.drop("never-seen")  # no state: nothing deferred
    assert d._deferred == []


def test_drop_tree_forgets_the_pending_tree_and_releases_a_draft_models_cache():
    d = _drafter(allocator="off")
    tokens, lengths = _tokens([30])
    d.propose_trees(["a"], [True], [[1]], lengths, tokens)
    released = []
    d.states["a"].release = lambda: released.append(1)
    d.reorders["a"] = [1]
    d.drop_tree("a")
    assert "a" not in d.pending and "a" not in d.reorders and released == [1] and "a" in d.states
    d.drop_tree("zz")


def test_observe_step_counts_now_and_learns_after_the_reply():
    d = _drafter(allocator="off")
    tokens, lengths = _tokens([30, 30])
    drafts = d.propose_trees(["a", "b"], [True, True], [[1]] * 2, lengths, tokens)
    step = d.take_step(["a", "b"], {"a": drafts[0][:3], "b": drafts[1][:2]})
    accepted = np.array([[1, 2, -1], [-1, -1, -1]])
    n = step.trees.num_nodes
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(0))
    before = d.states["a"].spine_acceptance
    d.observe_step(step, accepted, np.array([2, 0]), step.trees.offsets[:-1], logits)
    assert d.metrics.steps == 2 and d.metrics.accepted_nodes == 2 and d.metrics.draft_nodes == 5
    assert [p for p, _, _ in d._deferred] == ["stats", "harvest"]
    assert d.states["a"].spine_acceptance == before  # learning waits for the reply
    d.run_deferred()
    assert d._deferred == [] and d.states["a"].spine_acceptance > before
    assert {"harvest", "stats", "topk"} <= set(d.host_clock.seconds)
    assert d.states["a"].table.num_harvested > 0


def test_labels_teach_the_acceptance_model_every_fourth_proposal():
    """Every offered tree waits for the tokens that follow its root; every fourth proposal
    queues the labelling (run after the reply) of those whose tokens are now known."""
    d = _drafter()
    tokens, lengths = _tokens([60])
    for call in range(3):
        drafts = d.propose_trees(["a"], [True], [[1]], lengths - 30 + call, tokens)
        d.take_step(["a"], {"a": drafts[0]})
    assert len(d.unlabelled["a"]) == 3 and d._deferred == []
    d.propose_trees(["a"], [True], [[1]], lengths, tokens)  # the 4th: the first three are labelled
    assert [p for p, _, _ in d._deferred] == ["label"] and d.acceptance.count.sum() == 0
    d.run_deferred()
    assert d.acceptance.count.sum() > 0 and len(d.unlabelled["a"]) == 1  # the 4th tree waits
    assert "label" in d.host_clock.seconds


def test_first_mismatch_names_the_tree_whose_drafts_differ():
    trees = FlatTrees.from_trees([DraftTree([1, 2, 3], [-1, 0, 1]), DraftTree([4, 5], [-1, 0]),
                                  DraftTree([6, 7, 8], [-1, 0, 0])])
    assert _first_mismatch(trees, [2, 3, 5, 7, 9]) == 2
    assert _first_mismatch(trees, [2, 3, 0, 7, 8]) == 1
    assert _first_mismatch(trees, [9, 3, 5, 7, 8]) == 0


def test_the_drafter_refuses_vllms_chain_propose():
    with pytest.raises(RuntimeError, match="tree model runner"):
        _drafter(allocator="off").propose()


@pytest.mark.parametrize("method", ["pld", "token_recycling"])
def test_proposers_without_a_batch_call_propose_request_by_request(method):
    """PLD and Token Recycling have no ``propose_batch``: one ``propose`` per drafting request,
    its mode and the token before its root (the bigram key) carried with the tree."""
    d = _drafter(method, allocator="off")
    tokens, lengths = _tokens([30, 1, 2])
    drafts = d.propose_trees(["a", "b", "c"], [True, True, True], [[1]] * 3, lengths, tokens)
    step = d.take_step(["a", "b", "c"], {"a": drafts[0], "b": drafts[1], "c": drafts[2]})
    assert step.prev_roots.tolist() == [9, -1, 7]  # a one-token context has no token before its root
    assert step.modes.dtype == np.int8 and step.trees.num_trees == 3
    if method == "pld":
        assert drafts[0][:2] == [5, 6]  # the context's continuation


def test_a_grammar_pruned_tree_schedules_its_kept_nodes_first():
    """The scheduler's ``tree_kept`` (tree_grammar.py): the kept draft nodes go first, so vLLM's
    scheduled drafts (the kept ones) are a prefix of the reordered tree."""
    d = _drafter(allocator="off")
    tokens, lengths = _tokens([30])
    drafts = d.propose_trees(["a"], [True], [[1]], lengths, tokens)
    tree = d.pending["a"][0].trees.tree(d.pending["a"][1])
    leaves = [j for j in range(1, tree.num_nodes) if j not in tree.parents.tolist()]
    kept = sorted({leaves[-1]} | {int(p) for p in _ancestors(tree, leaves[-1])} - {0})
    d.reorders["a"] = kept
    step = d.take_step(["a"], {"a": [int(tree.tokens[j]) for j in kept]})
    assert step.trees.tree(0).tokens[1:].tolist() == [int(tree.tokens[j]) for j in kept]
    assert "a" not in d.reorders and len(drafts[0]) == tree.num_nodes - 1


def _ancestors(tree, j):
    out = []
    while tree.parents[j] > 0:
        j = int(tree.parents[j])
        out.append(j)
    return out
