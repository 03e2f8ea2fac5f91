"""``TreeDrafter`` (integration/vllm/engine/drafter.py) without an engine: a real drafter built
from a vLLM-shaped config (GOOSE, vocabulary 64) over vLLM-shaped token arrays, through the
step protocol the tree runner drives: ``propose_trees`` -> the allocator's reads
(``pending_*``) -> ``take_step`` -> ``observe_step`` -> ``run_deferred``, and the request
lifecycle (``rest``, ``contain``, ``drop``, ``drop_tree``).

Contexts repeat a six-token cycle, so GOOSE's context match gives every request a spine (and
its adjacency table branches once it has learned)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_anisotropic.integration.vllm.engine.drafter import (
    OFFER_MEMORY, OFFER_MIN_DRAFTS, TreeDrafter, _scheduled_prefixes)
from vllm_anisotropic.integration.vllm.frontdoor.config import TreeSpecConfig
from vllm_anisotropic.proposers.adjacency import TopKRows
from vllm_anisotropic.tree import DraftTree, FlatTrees, NodeSource

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
    assert ranked.unlabelled.requests() == {"a", "b"}  # a root-only tree waits for no label
    # GOOSE's budget within the speculative cap (no cut needed while every request has room):
    # the request near the model length is still cut to its room, whatever the others have
    fits = _drafter(allocator="off", num_speculative_tokens=5, budget=6)
    drafts = fits.propose_trees(["a", "b", "c"], [True] * 3, [[1]] * 3, lengths, tokens)
    assert [len(x) for x in drafts] == [5, 2, 0]
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
    assert d.pending_chains(["a", "b", "zz"])[1:] == [int(proposal.trees._chain_prefix()[k]), 0]  # the definition
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


def test_under_tensor_parallelism_drafts_without_a_matching_tree_get_a_void_chain():
    """TP > 1: drafts scheduled from rank 0's tree that this rank lacks (a fault here), or
    whose tree here differs or runs short, become void chains of the drafts themselves (no rank
    verifies them: the sampler's ``faults.agree``); the matching trees are taken as usual, and
    only they move the allocator's kept marks."""
    d = _drafter()
    d.tp_size = 2
    tokens, lengths = _tokens([30, 30, 31])
    drafts = d.propose_trees(["a", "b", "c"], [True, True, True], [[1]] * 3, lengths, tokens)
    del d.pending["b"]  # b's proposal failed on this rank
    bad = [63] + drafts[2][1:3]
    step = d.take_step(["a", "b", "c", "x"], {"a": drafts[0][:3], "b": [4, 5], "c": bad, "x": [1]})
    assert step.req_ids == ["a", "b", "c", "x"] and step.rows.tolist() == [0, 1, 2, 3]
    assert step.void.tolist() == [False, True, True, True]
    assert step.trees.tree(0).tokens[1:].tolist() == drafts[0][:3]
    for t, want in ((1, [4, 5]), (2, bad), (3, [1])):
        tree = step.trees.tree(t)
        assert tree.tokens.tolist() == [0] + want and tree.parents.tolist() == list(range(-1, len(want)))
    assert step.chains.tolist() == [False, True, True, True] and step.prev_roots[1:].tolist() == [-1] * 3
    assert set(d.kept_mark) == {"a"} and d.kept_mark["a"] == 3.0
    drafts = d.propose_trees(["a"], [True], [[1]], lengths[:1], tokens[:1])
    step = d.take_step(["a"], {"a": drafts[0] + [7]})  # one draft more than its tree
    assert step.void.tolist() == [True] and step.trees.tree(0).tokens.tolist() == [0] + drafts[0] + [7]
    drafts = d.propose_trees(["a"], [True], [[1]], lengths[:1], tokens[:1])
    assert d.take_step(["a"], {"a": drafts[0][:2]}).void is None  # none void: None (the sampler's fast path)
    sub = step.select(np.array([0]))
    assert sub.void.tolist() == [True] and sub.req_ids == ["a"]


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
    assert d.pending_probs(["a"]) == [None] and not d.unlabelled


def test_a_chain_steps_request_without_a_draft_stays_a_plain_row_counted_as_its_root_only_tree():
    """A chain step where a request's context has no match: no tree pending for it (the reply,
    the step's inputs and the harvest skip it; a step where no request drafted is plain), yet
    the metrics count it as the verified root-only tree of a tree step (steps, plain steps,
    the trace). Catches: the request left pending, every request dropped, or the count lost."""
    tokens, lengths = _tokens([30, 30])
    tokens[1, :30] = np.arange(20, 50)  # no repeated n-gram: nothing to draft
    chain = _drafter(allocator_chain_drafts=3)
    chain.sink.trace = True
    drafts = chain.propose_trees(["a", "b"], [True, True], [[1], [1]], lengths, tokens, chains=True)
    assert drafts == [[5, 6, 7], []] and set(chain.pending) == {"a"}
    assert chain.pending_chains(["a", "b"]) == [3, 0] and chain.pending_probs(["b"]) == [None]
    step = chain.take_step(["a", "b"], {"a": [5, 6, 7]})
    assert step.req_ids == ["a"] and step.rows.tolist() == [0]
    chain.propose_trees(["b"], [True], [[1]], lengths[1:], tokens[1:], chains=True)
    assert chain.take_step(["b"], {}) is None  # nothing pending: vLLM's plain step
    # the same request through a tree step: pending, verified, harvested as a root-only tree
    tree = _drafter(allocator_chain_drafts=3)
    tree.sink.trace = True
    for _ in range(2):
        tree.propose_trees(["b"], [True], [[1]], lengths[1:], tokens[1:])
        only = tree.take_step(["b"], {})
        assert only.trees.sizes().tolist() == [1]
        tree.observe_step(only, np.full((1, 1), -1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64),
                          torch.zeros(1, V))
    counts = ("steps", "plain_steps", "bypass_steps", "verified_trees", "max_nodes", "accepted_nodes")
    assert [getattr(chain.metrics, c) for c in counts] == [getattr(tree.metrics, c) for c in counts] == [2, 2, 0, 0,
                                                                                                         0, 0]
    assert chain.metrics.requests == tree.metrics.requests == {"b": [0, 0]}


def test_rest_drops_pending_trees_and_drafts_nothing():
    d = _drafter(allocator="off")
    tokens, lengths = _tokens([30, 30])
    d.propose_trees(["a", "b"], [True, True], [[1]] * 2, lengths, tokens)
    assert d.rest(["a", "zz"]) == [[], []] and set(d.pending) == {"b"}


def test_requests_the_gate_rested_resume_drafting_marked_until_they_draft():
    """A request the gate rested is marked ``resuming`` when it next drafts (a draft model's
    catch-up then is a resume, not the speculative arm's cost); one not rested is not; the mark
    waits while the request does not draft and goes with a finished request. Catches: every
    request marked, the mark never set, or dropped before the request drafts."""
    d = _stubbed(lambda n: _chain(n % V, 2), allocator="off")
    tokens, lengths = _tokens([30, 31, 32])
    d.propose_trees(["a", "b", "c"], [True] * 3, [[1]] * 3, lengths, tokens)
    assert not any(d.states[r].resuming for r in "abc") and not d.rested
    d.rest(["a", "c"])
    d.propose_trees(["a", "b", "c"], [True, True, False], [[1]] * 3, lengths, tokens)  # c not eligible
    assert [d.states[r].resuming for r in "ab"] == [True, False] and d.rested == {"c"}
    d.states["a"].resuming = False  # (the proposer clears the mark when q catches up)
    d.propose_trees(["a"], [True], [[1]], lengths, tokens)
    assert not d.states["a"].resuming
    d.drop("c")
    assert not d.rested


def test_a_draft_model_gets_the_repay_ratio_and_each_drafting_requests_remaining_tokens():
    """``propose_trees(repay=, remaining=)``: a proposer with a ``repay`` (a draft model) gets the
    ratio and each drafting request's state its remaining tokens by batch row; without the
    remainders the ratio is dropped (no rule), and a proposer without ``repay`` (GOOSE) gets
    nothing. Catches: remainders by drafting index instead of batch row, a ratio kept from the
    step before, the ratio sent without remainders."""
    d = _stubbed(lambda n: _chain(n % V, 2), allocator="off")
    d.proposer.repay = None
    tokens, lengths = _tokens([30, 31, 32])
    d.propose_trees(["a", "b", "c"], [False, True, True], [[1]] * 3, lengths, tokens, repay=7.5,
                    remaining=[3, 20, 40])
    assert d.proposer.repay == 7.5 and [d.states[r].remaining for r in "bc"] == [20, 40] and "a" not in d.states
    d.propose_trees(["a", "b", "c"], [True] * 3, [[1]] * 3, lengths, tokens, repay=7.5)
    assert d.proposer.repay is None
    g = _stubbed(lambda n: _chain(n % V, 2), allocator="off")
    g.propose_trees(["a"], [True], [[1]], lengths, tokens, repay=7.5, remaining=[3])
    assert not hasattr(g.proposer, "repay") and not hasattr(g.states["a"], "remaining")


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
    assert "a" not in d.zero_streak and "a" not in d.skip and "a" not in d.kept_mark and "a" not in d.unlabelled.requests()
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
    assert d.unlabelled.waiting("a") == 3 and d._deferred == []
    d.propose_trees(["a"], [True], [[1]], lengths, tokens)  # the 4th: the first three are labelled
    assert [p for p, _, _ in d._deferred] == ["label"] and d.acceptance.count.sum() == 0
    d.run_deferred()
    assert d.acceptance.count.sum() > 0 and d.unlabelled.waiting("a") == 1  # the 4th tree waits
    assert "label" in d.host_clock.seconds


def test_scheduled_prefixes_cut_each_tree_and_name_those_whose_drafts_differ_or_run_short():
    trees = FlatTrees.from_trees([DraftTree([1, 2, 3], [-1, 0, 1]), DraftTree([4, 5], [-1, 0]),
                                  DraftTree([6, 7, 8], [-1, 0, 0])])
    three = np.array([2, 1, 2])

    def bad(t, counts, lists):
        b = _scheduled_prefixes(t, counts, lists)[1]
        return None if b is None else b.tolist()

    assert bad(trees, three, [[2, 3], [5], [7, 8]]) is None
    assert bad(trees, np.array([1, 0, 1]), [[2], [], [7]]) is None  # prefixes
    assert bad(trees, np.zeros(3, np.int64), [[], [], []]) is None
    assert bad(trees, three, [[2, 3], [5], [7, 9]]) == [False, False, True]
    assert bad(trees, three, [[2, 3], [0], [7, 8]]) == [False, True, False]
    assert bad(trees, three, [[9, 3], [5], [8, 7]]) == [True, False, True]
    # more drafts than nodes (its first ones match)
    assert bad(trees, np.array([2, 2, 2]), [[2, 3], [5, 1], [7, 8]]) == [False, True, False]
    root_only = FlatTrees.from_trees([DraftTree([1], [-1]), DraftTree([4, 5], [-1, 0])])
    assert bad(root_only, np.array([1, 0]), [[2], []]) == [True, False]
    # the cut: each tree's first counts[t] draft nodes (at most all of them), roots kept
    cut = _scheduled_prefixes(trees, np.array([1, 0, 2]), [[2], [], [7, 8]])[0]
    assert cut.offsets.tolist() == [0, 2, 3, 6] and cut.tokens.tolist() == [1, 2, 4, 6, 7, 8]
    cut = _scheduled_prefixes(root_only, np.array([1, 1]), [[2], [5]])[0]
    assert cut.tokens.tolist() == [1, 4, 5]


def test_scheduled_prefixes_against_their_definition_on_random_batches():
    """``_scheduled_prefixes`` (one compiled pass, ``kernels.plan.scheduled_prefixes``) against
    its definition: each tree cut to ``min(counts, its drafts)`` draft nodes (``FlatTrees.prefix``),
    and a tree is bad when it has fewer drafts than scheduled or its first ones differ; random
    trees, counts under, at and over each tree's drafts, lists that match or differ anywhere."""
    from random_trees import random_trees

    from vllm_anisotropic import kernels

    rng = np.random.default_rng(31)
    for _ in range(400):
        flat = FlatTrees.from_trees(random_trees(rng, sources=True))
        flat = FlatTrees(flat.offsets, flat.tokens, flat.parents, flat.sources, rng.random(flat.num_nodes), flat.depths)
        room = flat.sizes() - 1
        counts = np.maximum(room + rng.integers(-3, 2, flat.num_trees), 0)
        lists = []
        for t in range(flat.num_trees):
            drafts = flat.tree(t).tokens[1:].tolist()[: counts[t]]
            drafts += [int(x) for x in rng.integers(0, 50, counts[t] - len(drafts))]  # beyond its drafts
            if drafts and rng.random() < 0.3:
                drafts[int(rng.integers(0, len(drafts)))] += 1  # one that differs
            lists.append(drafts)
        cut, bad = _scheduled_prefixes(flat, counts, lists)
        want = flat.prefix(np.minimum(counts, room) + 1)
        assert cut.offsets.tolist() == want.offsets.tolist() and cut.tokens.tolist() == want.tokens.tolist()
        for name in ("parents", "sources", "values", "depths"):
            np.testing.assert_array_equal(getattr(cut, name), getattr(want, name), err_msg=name)
            assert getattr(cut, name).dtype == getattr(want, name).dtype
        wrong = [counts[t] > room[t] or lists[t][: room[t]] != flat.tree(t).tokens[1: 1 + min(counts[t], room[t])].tolist()
                 for t in range(flat.num_trees)]
        assert (None if not any(wrong) else wrong) == (None if bad is None else bad.tolist())
        # the kernel's own returns: the number of bad trees, and whether any tree is cut at all
        # (without a cut the trees are taken as they are)
        keep, flags = np.empty(flat.num_trees, np.int64), np.empty(flat.num_trees, bool)
        got = kernels.load("plan").scheduled_prefixes(flat.offsets, flat.tokens, counts,
                                                      np.asarray([x for d in lists for x in d], np.int64), keep, flags)
        assert got == (sum(wrong), bool((counts < room).any()))


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


# ---------------------------------------------------------------------------------------------
# A recording proposer without ``propose_batch`` (the per-request path of PLD, Token Recycling
# and draft_tree): its trees are given, so caps, labels, offers and the harvested rows can be
# checked exactly.


class _State:
    resuming = False  # as DraftTreeState's (the drafter marks the gate's rested requests)

    def __init__(self, owner, tenant):
        self.owner, self.tenant, self.law = owner, tenant, None
        self.harvest_top_k = owner.top_k
        self.offers, self.observed = [], []

    def set_sampling(self, law, seed):
        self.law = (law, seed)

    def propose(self, context, offer):
        self.offers.append(offer)
        return self.owner.make(len(context))

    def propose_chain(self, context, max_drafts):
        return _chain(len(context) % V, max_drafts)

    def observe(self, tree, accepted, rows, prev_root=None):
        self.observed.append((tree.tokens.tolist(), accepted, rows, prev_root))

    def finish(self, context):
        pass


class _Proposer:
    def __init__(self, make, top_k=None):
        self.make, self.top_k = make, top_k

    def new_request(self, tenant=None):
        return _State(self, tenant)

    def begin_step(self, n, batch=None):
        pass

    def take_resume_seconds(self):
        return 0.0

    def take_catchup(self):
        return 0.0, 0, 0


def _chain(root, n):
    """Root ``root`` and the n tokens after it (mod V), one chain."""
    return DraftTree.chain((root + np.arange(1, n + 1)) % V, root_token=root)


def _stubbed(make, top_k=None, **options):
    d = _drafter("pld", **options)
    d.proposer = _Proposer(make, top_k)
    return d


def test_sampled_draft_trees_are_ranked_by_shape_not_by_their_values():
    """draft_tree's sampled trees: the allocator's probabilities come from the tree's shape and
    the acceptance model alone (a cut that looked at the samples would break the i.i.d.
    branches, docs/verifiers.md); context trees (GOOSE's) are ranked by their values."""
    rng = np.random.default_rng(0)
    q = torch.full((4, V), 1.0 / V)

    def sampled(n):
        return DraftTree([1, 2, 3, 4], [-1, 0, 0, 1], values=rng.uniform(0.05, 0.95, 4), draft_probs=q)

    def context(n):
        return DraftTree([1, 2, 3, 4], [-1, 0, 0, 1], values=rng.uniform(0.05, 0.95, 4))

    tokens, lengths = _tokens([30, 30])
    d = _stubbed(sampled)
    d.propose_trees(["a", "b"], [True] * 2, [[1]] * 2, lengths, tokens)
    pa, pb = d.pending_probs(["a", "b"])
    assert np.allclose(pa, pb) and d.pending["a"][0].trees.draft_probs is not None
    c = _stubbed(context)
    c.propose_trees(["a", "b"], [True] * 2, [[1]] * 2, lengths, tokens)
    pa, pb = c.pending_probs(["a", "b"])
    assert not np.allclose(pa, pb)
    off = _stubbed(sampled, allocator="off")  # no allocator: nothing ranked, the values kept
    off.propose_trees(["a"], [True], [[1]], lengths[:1], tokens[:1])
    assert off.pending_probs(["a"]) == [None]


def test_a_request_state_takes_its_sampling_law_and_its_offer():
    d = _stubbed(lambda n: _chain(1, 12), allocator_offer_factor=2.0, num_speculative_tokens=20)
    tokens, lengths = _tokens([30, 30, 30])
    d.kept_mark = {"a": 6.0, "c": 0.0}
    d.propose_trees(["a", "b", "c"], [True] * 3, [[1]] * 3, lengths, tokens,
                    laws=[("law-a", 7), None, ("law-c", 9)])
    assert [d.states[r].law for r in "abc"] == [("law-a", 7), None, ("law-c", 9)]
    # ceil(2.0 x 6) drafts + the root; no mark: the proposer's own (None); a mark of 0 (cut to
    # nothing before): the smallest offer
    assert [d.states[r].offers for r in "abc"] == [[13], [None], [OFFER_MIN_DRAFTS + 1]]
    d.propose_trees(["a"], [True], [[1]], lengths, tokens, laws=[("other", 1)])
    assert d.states["a"].law == ("law-a", 7)  # set once, when the state is created
    d.propose_trees(["b"], [True], [[1]], lengths, tokens, chains=True)
    assert d.states["b"].offers == [None]  # a chain step offers nothing


def test_goose_gets_offers_on_tree_steps_and_limits_on_chain_steps(monkeypatch):
    d = _drafter(allocator_chain_drafts=3, allocator_offer_factor=2.0, num_speculative_tokens=16)
    calls = []
    real = d.proposer.propose_batch
    monkeypatch.setattr(d.proposer, "propose_batch", lambda *a: calls.append(a[4:]) or real(*a))
    tokens, lengths = _tokens([30, 30])
    d.kept_mark = {"a": 5.0}
    d.propose_trees(["a", "b"], [True] * 2, [[1]] * 2, lengths, tokens)
    d.propose_trees(["a", "b"], [True] * 2, [[1]] * 2, lengths, tokens, chains=True)
    (offers, limits), (offers2, limits2) = calls
    assert offers.tolist() == [11, 0] and limits is None
    assert offers2 is None and limits2.tolist() == [3, 3]


def test_trees_with_one_draft_are_labelled_and_counted_root_only_ones_are_not():
    d = _drafter(num_speculative_tokens=5)
    tokens, lengths = _tokens([40, MAX_LEN - 2, MAX_LEN - 1])
    drafts = d.propose_trees(["a", "b", "c"], [True] * 3, [[1]] * 3, lengths, tokens)
    assert [len(x) for x in drafts] == [5, 1, 0]
    assert d.unlabelled.requests() == {"a", "b"}
    d.take_step(["a", "b", "c"], {})  # all cut to nothing
    # a one-draft tree cut to nothing counts toward the backoff; a root-only tree offered nothing
    assert d.zero_streak == {"a": 1, "b": 1} and set(d.kept_mark) == {"a", "b"}


def test_labels_wait_for_each_trees_own_depth_and_label_up_to_the_models_depth():
    """Two trees of one proposal: a chain of 10 (deeper than the acceptance model's 8 depth
    buckets) and, after it, a chain of 2. The short one is labelled as soon as 2 tokens follow
    its root; the long one once 8 do, its 8 shallowest drafts only."""
    shapes = iter([10, 2])
    d = _stubbed(lambda n: _chain(3, next(shapes)), num_speculative_tokens=10)
    tokens, lengths = _tokens([40, 40])
    d.propose_trees(["a", "b"], [True] * 2, [[1]] * 2, lengths, tokens)
    assert d.label_depth == 8
    d._label(["a", "b"], lengths + 2, tokens)
    assert d.unlabelled.waiting("a") == 1 and d.unlabelled.waiting("b") == 0 and d.acceptance.count.sum() == 2
    d._label(["a", "b"], lengths + 7, tokens)
    assert d.unlabelled.waiting("a") == 1 and d.acceptance.count.sum() == 2
    d._label(["a", "b"], lengths + 8, tokens)
    assert d.unlabelled.waiting("a") == 0 and d.acceptance.count.sum() == 2 + 8


def test_a_grammar_reorder_that_is_not_a_prefix_of_the_draft_order():
    """Kept node 3 (a branch of the root) of ``[r, A, B, C]``, parents ``[-1, 0, 1, 0]``:
    vLLM schedules ``[C]``, which only the reordered tree ``[r, C, A, B]`` starts with."""
    d = _stubbed(lambda n: DraftTree([1, 11, 12, 13], [-1, 0, 1, 0]), allocator="off")
    tokens, lengths = _tokens([30, 30])
    d.propose_trees(["a", "b"], [True] * 2, [[1]] * 2, lengths, tokens)
    d.reorders = {"b": [3]}
    step = d.take_step(["a", "b"], {"a": [11], "b": [13]})
    assert step.trees.tree(0).tokens.tolist() == [1, 11]
    assert step.trees.tree(1).tokens.tolist() == [1, 13] and d.reorders == {}


def test_a_step_mixing_a_chain_and_trees_harvests_each_trees_own_rows():
    """The per-request path (``observe``): trees a, d (dropped before the reply) and c harvest
    their rows, b's chain (proposed in a chain step) does not; rows start with gaps between trees
    (``row_starts``), each state gets the top-k of its own tree's rows, at the widest k any
    harvesting state asks for."""
    sizes = {30: 3, 31: 4, 33: 2}  # context length -> tree size (root included)
    d = _stubbed(lambda n: _chain(n % V, sizes[n] - 1), top_k=3, allocator="off")
    tokens, lengths = _tokens([30, 31, 32, 33], shift=(0, 0, 0, 0))
    d.propose_trees(["a", "d", "b", "c"], [True, True, False, True], [[1]] * 4, lengths, tokens)
    d.propose_trees(["b"], [True], [[1]], lengths[2:3], tokens[2:3], chains=True)
    d.states["c"].harvest_top_k = 5
    d.states["d"].harvest_top_k = None
    ids = ["a", "d", "b", "c"]
    step = d.take_step(ids, {"a": [31, 32], "d": [32, 33, 34], "b": [33, 34], "c": [34]})
    assert step.chains.tolist() == [False, False, True, False] and step.trees.sizes().tolist() == [3, 4, 3, 2]
    states = {r: d.states[r] for r in ids}
    d.drop("d")
    d._deferred.clear()
    row_starts = np.array([1, 6, 12, 17])
    logits = torch.randn(20, V, generator=torch.Generator().manual_seed(3))
    accepted = np.array([[1, 2, -1], [1, -1, -1], [1, 2, -1], [-1, -1, -1]])
    num_accepted = np.array([2, 1, 2, 0])
    d.observe_step(step, accepted, num_accepted, row_starts, logits)
    d.run_deferred()
    assert d.disabled == set() and d.metrics.faults == {}
    assert 0 < d.host_clock.seconds["topk"] < 5.0  # the top-k's own seconds

    def top(start, n):
        return torch.topk(logits[start:start + n].float(), 5).indices.numpy()

    (tree_a, acc_a, rows_a, prev_a), = states["a"].observed
    assert tree_a == [30, 31, 32] and acc_a == [1, 2] and prev_a == tokens[0, 28]  # the token before its root
    assert np.array_equal(np.sort(rows_a.ids, 1), np.sort(top(1, 3), 1))
    (tree_b, acc_b, rows_b, _), = states["b"].observed
    assert tree_b == [32, 33, 34] and acc_b == [1, 2] and rows_b is None
    (tree_c, acc_c, rows_c, _), = states["c"].observed
    assert tree_c == [33, 34] and acc_c == [] and np.array_equal(np.sort(rows_c.ids, 1), np.sort(top(17, 2), 1))
    assert states["d"].observed == []  # dropped: nothing learns for it


def test_states_that_harvest_nothing_get_no_rows():
    """A proposer whose states read no logits (``harvest_top_k`` None, PLD's): no top-k pass,
    each state learns from its tree alone."""
    d = _stubbed(lambda n: _chain(n % V, 2), top_k=None, allocator="off")
    tokens, lengths = _tokens([30, 31], shift=(0, 0))
    d.propose_trees(["a", "b"], [True, True], [[1]] * 2, lengths, tokens)
    step = d.take_step(["a", "b"], {"a": [31], "b": [32, 33]})
    d.observe_step(step, np.array([[1, -1], [-1, -1]]), np.array([1, 0]), step.trees.offsets[:-1], torch.randn(5, V))
    d.run_deferred()
    assert [o[2] for r in "ab" for o in d.states[r].observed] == [None, None]


def test_forget_writes_starts_every_tables_window_over():
    """``TreeDrafter.forget_writes`` (every tensor-parallel rank, when their trees differ): every
    adjacency table in use, the tenants' and a request's own, takes each entry as never written,
    so the next row of a key is harvested on every rank alike. Catches: the tenants' tables or
    the requests' own ones left out."""
    from vllm_anisotropic import kernels

    never = kernels.load("table").NEVER
    for shared in (True, False):
        d = _drafter(allocator="off", shared_table=shared, refresh_steps=4)
        tokens, lengths = _tokens([30, 31])
        drafts = d.propose_trees(["a", "b"], [True, True], [[1]] * 2, lengths, tokens)
        step = d.take_step(["a", "b"], {"a": drafts[0][:1], "b": drafts[1][:1]})
        d.observe_step(step, np.array([[-1], [-1]]), np.array([0, 0]), step.trees.offsets[:-1],
                       torch.randn(step.trees.num_nodes, V))
        d.run_deferred()
        tables = {id(s.table): s.table for s in d.states.values()}
        assert len(tables) == (1 if shared else 2)
        assert all((t.unigram_written != never).any() for t in tables.values())
        d.forget_writes()
        assert all((t.unigram_written == never).all() and (t.bigram_written == never).all() for t in tables.values())


def test_goose_learns_a_mixed_step_in_two_batched_calls(monkeypatch):
    """GOOSE's ``learn_batch``: the trees harvesting rows in one call with their top-k rows
    (asked of the drafter by node), the chain step's chains in another without rows; a step of
    chains alone, one call, no rows."""
    d = _drafter(allocator="off")
    tokens, lengths = _tokens([30, 30, 30])
    drafts = d.propose_trees(["a", "b", "c"], [True, False, True], [[1]] * 3, lengths, tokens)
    chain = d.propose_trees(["b"], [True], [[1]], lengths[1:2], tokens[1:2], chains=True)[0]
    step = d.take_step(["a", "b", "c"], {"a": drafts[0][:2], "b": chain[:1], "c": drafts[2][:1]})
    calls = []
    real = d.proposer.learn_batch
    names = {id(s): r for r, s in d.states.items()}
    monkeypatch.setattr(d.proposer, "learn_batch", lambda states, trees, on_path, prev_roots, top: calls.append(
        ([names[id(s)] for s in states], trees.sizes().tolist(), on_path.tolist(), prev_roots.tolist(),
         None if top is None else top(np.arange(trees.num_nodes)).ids.copy()))
        or real(states, trees, on_path, prev_roots, top))
    logits = torch.randn(step.trees.num_nodes, V, generator=torch.Generator().manual_seed(1))
    d.observe_step(step, np.array([[1, -1], [1, -1], [-1, -1]]), np.array([1, 1, 0]), step.trees.offsets[:-1], logits)
    d.run_deferred()
    k = d.states["a"].harvest_top_k
    want = torch.topk(logits[[0, 1, 2, 5, 6]].float(), k).indices.numpy()
    (ids1, sizes1, path1, prev1, top1), (ids2, sizes2, path2, prev2, top2) = calls
    assert ids1 == ["a", "c"] and sizes1 == [3, 2] and path1 == [False, True, False, False, False]
    assert np.array_equal(np.sort(top1, 1), np.sort(want, 1)) and prev1 == step.prev_roots[[0, 2]].tolist()
    assert ids2 == ["b"] and sizes2 == [2] and path2 == [False, True] and top2 is None
    calls.clear()
    chain = d.propose_trees(["a", "b"], [True, True], [[1]] * 2, lengths[:2], tokens[:2], chains=True)
    step = d.take_step(["a", "b"], {"a": chain[0][:1], "b": chain[1][:1]})
    d.observe_step(step, np.array([[-1], [-1]]), np.array([0, 0]), step.trees.offsets[:-1],
                   torch.zeros(step.trees.num_nodes, V))
    d.run_deferred()
    assert [(c[0], c[4]) for c in calls] == [(["a", "b"], None)]


def test_the_harvest_holds_cpu_logits_in_place_and_gathers_device_rows(monkeypatch):
    """On the CPU the deferred top-k reads the step's logits tensor itself (no copy); off the
    CPU the harvested rows are gathered on the device now (their memory back to vLLM's
    allocator), in tree order."""
    d = _drafter(allocator="off")
    tokens, lengths = _tokens([30, 30], shift=(0, 3))  # no table key in both trees: every row is read
    drafts = d.propose_trees(["a", "b"], [True, True], [[1]] * 2, lengths, tokens)
    seen = []
    real = TopKRows.of
    monkeypatch.setattr("vllm_anisotropic.integration.vllm.engine.drafter.TopKRows.of",
                        lambda x, k, rows=None: seen.append((x, None if rows is None else rows.tolist())) or real(
                            x, k, rows))
    step = d.take_step(["a", "b"], {"a": drafts[0][:1], "b": drafts[1][:2]})
    logits = torch.randn(12, V)
    d.observe_step(step, np.full((2, 1), -1), np.zeros(2, np.int64), np.array([2, 7]), logits)
    work = d._deferred[-1][2]
    d._deferred.clear()
    work()
    (x, rows), = seen
    assert x is logits and rows == [2, 3, 7, 8, 9]
    meta = torch.empty(12, V, device="meta")
    d.observe_step(step, np.full((2, 1), -1), np.zeros(2, np.int64), np.array([2, 7]), meta)
    _, _, _, _, _, _, _, picked, index, k = d._deferred[-1][2].args
    assert picked.device.type == "meta" and tuple(picked.shape) == (5, V) and index is None and k > 0


def test_the_harvest_reads_no_row_whose_key_a_later_row_writes_again(monkeypatch):
    """a's context ends ... 9, 10 and its draft is 5; b's ends ... 10, 5: a's draft row (key
    (10, 5), logits row 3) is written again by b's root (row 7), so its top-k is not taken; the
    other rows are read where they are in the step's logits."""
    d = _drafter(allocator="off")
    tokens, lengths = _tokens([30, 30])
    drafts = d.propose_trees(["a", "b"], [True, True], [[1]] * 2, lengths, tokens)
    assert drafts[0][0] == 5 and tokens[1, 28:30].tolist() == [10, 5]
    seen = []
    real = TopKRows.of
    monkeypatch.setattr("vllm_anisotropic.integration.vllm.engine.drafter.TopKRows.of",
                        lambda x, k, rows=None: seen.append(rows.tolist()) or real(x, k, rows))
    step = d.take_step(["a", "b"], {"a": drafts[0][:1], "b": drafts[1][:2]})
    d.observe_step(step, np.full((2, 1), -1), np.zeros(2, np.int64), np.array([2, 7]), torch.randn(12, V))
    d.run_deferred()
    assert seen == [[2, 7, 8, 9]]


def test_deferred_phases_count_their_own_time_without_the_top_k_inside():
    d = _drafter(allocator="off")
    clock = d.host_clock

    def work(seconds, topk):
        def run():
            time.sleep(seconds)
            if topk:
                clock.add("topk", topk)
        return run

    # 0.3 s of work, 0.25 of it the top-k's: 0.05 s of the phase's own (the first phase runs
    # before any top-k was counted)
    d._deferred = [("stats", [], work(0.02, 0.0)), ("label", [], work(0.3, 0.25)), ("harvest", [], work(0.3, 0.25))]
    d.run_deferred()
    # upper bounds with room for a loaded machine's late wake-ups; a clock that added the top-k
    # instead (0.55 s) or counted the earlier phases' top-k again (-0.45 s) is still caught
    assert 0.018 <= clock.seconds["stats"] < 0.8
    assert 0.045 <= clock.seconds["label"] < 0.45 and 0.045 <= clock.seconds["harvest"] < 0.45
    assert clock.seconds["topk"] == pytest.approx(0.5)


def test_a_failing_deferred_work_disables_only_requests_that_still_hold_state(monkeypatch, caplog):
    # the first fault of a stage logs its traceback once per process: this one, not a later test's
    monkeypatch.setattr("vllm_anisotropic.integration.vllm.engine.faults._logged", set())
    d = _drafter(allocator="off")
    tokens, lengths = _tokens([30])
    d.propose_trees(["a"], [True], [[1]], lengths, tokens)

    def fail():
        raise ValueError("boom")

    d._deferred = [("harvest", ["a", "gone"], fail)]
    with caplog.at_level("ERROR"):
        d.run_deferred()
    assert "['a', 'gone']" in caplog.text and "boom" in caplog.text
    assert d.disabled == {"a"} and d.metrics.faults == {"harvest": 1} and d.metrics.disabled_requests == 1
    assert d._deferred == [] and "harvest" in d.host_clock.seconds


def test_the_drafter_reads_its_method_from_the_stored_config():
    """While vLLM builds the drafter its speculative config reads method "custom_class"; the
    real method is stored in additional_config. Without a stored entry the config's own method
    and the tunables' defaults apply."""
    spec = TreeSpecConfig.build("goose", {"budget": 12})
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(method="custom_class", num_speculative_tokens=8),
        additional_config={"vllm_anisotropic": spec.to_additional_config()},
        model_config=SimpleNamespace(get_vocab_size=lambda: V, max_model_len=MAX_LEN))
    d = TreeDrafter(cfg)
    assert d.config.proposer_name == "goose" and d.config == spec
    for additional in (None, {}, {"vllm_anisotropic": None}):
        cfg.speculative_config.method, cfg.additional_config = "pld", additional
        assert TreeDrafter(cfg).config == TreeSpecConfig.build("pld", {})


def test_warm_up_runs_one_throwaway_proposal_and_keeps_nothing(monkeypatch):
    d = _drafter(allocator="off")
    cls = type(d.proposer)
    seen = []
    real = cls.propose_batch
    def propose_batch(self, states, tokens, *a):
        out = real(self, states, tokens, *a)
        seen.append((self, tokens.dtype, out.trees.num_nodes))
        return out

    monkeypatch.setattr(cls, "propose_batch", propose_batch)
    d.warm_up(np.int64)
    (proposer, dtype, nodes), (again, dtype2, _) = seen  # the match path, then a request asking the store
    assert proposer is again and proposer is not d.proposer and dtype == dtype2 == np.int64 and nodes > 1
    assert len(proposer.stores.default) == 1  # the throwaway's store got the first request's document
    assert d.states == {} and d.pending == {}
    _drafter("pld", allocator="off").warm_up()  # no batched proposer: nothing to load


def test_table_gauges_count_zero_without_tables_and_follow_own_tables(monkeypatch):
    d = _drafter("pld", allocator="off")
    tokens, lengths = _tokens([30, 30])
    d.metrics.tenant_tables = d.metrics.state_budget_bytes = d.metrics.store_bytes = -1
    d.propose_trees(["a"], [True], [[1]], lengths[:1], tokens[:1])
    m = d.metrics
    assert (m.tenant_tables, m.state_budget_bytes, m.store_bytes, m.table_bytes) == (0, 0, 0, 0)
    own = _drafter(allocator="off", shared_table=False)
    own.propose_trees(["a", "b"], [True, True], [[1]] * 2, lengths, tokens)
    both = own.metrics.table_bytes
    assert both > 0
    own.drop("a")
    assert 0 < own.metrics.table_bytes < both  # its own table is gone
    shared = _drafter(allocator="off")
    shared.propose_trees(["a", "b"], [True, True], [[1]] * 2, lengths, tokens)
    counted = []
    monkeypatch.setattr(shared, "_count_tables", lambda: counted.append(1))
    shared.drop("a")
    monkeypatch.setattr(d, "_count_tables", lambda: counted.append(1))
    d.drop("a")  # PLD: no tables at all
    assert counted == []  # a shared table stays, and no table: nothing to recount


def test_tp_rank_is_vllms_and_zero_outside_a_process_group(monkeypatch):
    import vllm.distributed

    from vllm_anisotropic.integration.vllm.engine.drafter import _tp_rank

    rank = _tp_rank()
    assert rank == 0 and type(rank) is int
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: 3)
    assert _tp_rank() == 3


def _random_verified_step(rng):
    """Random trees with random sources, each with a random accepted path: ``(trees, flat,
    paths, on_path)``."""
    from random_trees import random_paths, random_trees

    trees_list = random_trees(rng, sources=True)
    flat = FlatTrees.from_trees(trees_list)
    paths = random_paths(rng, trees_list)
    depth = max(1, max(len(p) for p in paths))
    accepted = np.array([p + [-1] * (depth - len(p)) for p in paths], np.int64)
    return trees_list, flat, paths, flat.path_mask(accepted, np.array([len(p) for p in paths], np.int64))


def test_learn_keys_against_their_definitions_on_random_batches():
    """``kernels.goose.learn_keys`` (GOOSE's ``learn_batch``): each node's key token is its
    parent's token (a root's: the token before it), and each tree's spine nodes and accepted
    spine nodes are counted, against numpy over random trees, sources and paths."""
    from vllm_anisotropic import kernels

    rng = np.random.default_rng(21)
    for _ in range(300):
        _, flat, _, on_path = _random_verified_step(rng)
        prev_roots = rng.integers(-1, 50, flat.num_trees)
        prev, counts = np.full(flat.num_nodes, -9, np.int64), np.full((flat.num_trees, 2), -9, np.int64)
        kernels.load("goose").learn_keys(flat.tokens, flat.parents, flat.sources, flat.offsets, on_path,
                                         prev_roots, prev, counts)
        want = flat.tokens[np.maximum(flat.global_parents(), 0)]
        want[flat.offsets[:-1]] = prev_roots
        assert prev.tolist() == want.tolist()
        spine = flat.sources == NodeSource.SPINE
        assert counts[:, 0].tolist() == np.add.reduceat(spine, flat.offsets[:-1]).tolist()
        assert counts[:, 1].tolist() == np.add.reduceat(spine & on_path, flat.offsets[:-1]).tolist()


def test_last_writes_against_a_plain_loop_on_random_batches():
    """``kernels.table.last_writes``: a row is live unless its tree's table number is negative or
    a later node (node order) of a tree with the same number repeats its key (prev, token),
    against a plain loop over random trees whose keys collide often (5 tokens), a third of the
    trees without a table; and the docstring's example."""
    from random_trees import random_trees
    from vllm_anisotropic import kernels

    last_writes = kernels.load("table").last_writes
    live = np.empty(4, bool)
    assert last_writes(np.array([5, 1, 5, 1]), np.array([1, 2, 1, 3]), np.array([0, 2, 4]), np.array([0, 0]), live) == 3
    assert live.tolist() == [False, True, True, True]
    rng = np.random.default_rng(5)
    for _ in range(400):
        flat = FlatTrees.from_trees(random_trees(rng, vocab=5))
        prev = rng.integers(-1, 4, flat.num_nodes)
        tables = rng.integers(-1, 2, flat.num_trees)
        owner = np.repeat(tables, flat.sizes())
        keys = list(zip(owner.tolist(), prev.tolist(), flat.tokens.tolist()))
        want = [owner[k] >= 0 and keys[k] not in keys[k + 1:] for k in range(flat.num_nodes)]
        live = np.ones(flat.num_nodes, bool)
        assert last_writes(prev, flat.tokens.astype(np.int64), flat.offsets, tables, live) == sum(want)
        assert live.tolist() == want


def _softmax_top3(logits, rows):
    """Torch's top-3 of the softmax of ``logits``' rows ``rows`` as ``TopKRows`` (what the
    drafter's ``rows`` callback gives ``learn_batch``; the compiled top-k has its own tests)."""
    probs, ids = torch.topk(torch.softmax(logits[torch.from_numpy(rows)], -1), 3)
    return TopKRows(ids.numpy().astype(np.int32), probs.numpy(), int(logits.shape[-1]))


def test_a_step_teaches_every_table_what_all_its_rows_teach_without_the_overwritten_ones():
    """GOOSE's ``learn_batch`` asks for the top-k rows of the nodes whose key no later node of the
    step writes to the same table again, not of a finished request's tree nor of a frozen
    table's, and leaves each table holding what harvesting every row in node order leaves (the
    unigram rows; every bigram key's successors: no window evicts here), over random steps with
    many repeated keys, and steps whose rows two tables keep all."""
    from random_trees import random_trees
    from vllm_anisotropic.proposers.adjacency import AdjacencyTable
    from vllm_anisotropic.proposers.config import GooseConfig
    from vllm_anisotropic.proposers.goose import GooseProposer

    vocab, rng = 8, np.random.default_rng(9)
    skipped = tables_kept_whole = 0
    for _ in range(100):
        proposer = GooseProposer(GooseConfig(top_k=3), vocab_size=vocab)
        trees_list = random_trees(rng, vocab=4 if rng.random() < 0.6 else vocab)  # 4 tokens: keys repeat often
        flat = FlatTrees.from_trees(trees_list)
        tenants = rng.choice([None, "x"], flat.num_trees)
        states = [proposer.new_request(t) for t in tenants]
        if flat.num_trees > 1 and rng.random() < 0.5:
            states[0] = None  # a request that finished
        frozen = proposer.tables.overflow()
        if flat.num_trees > 2 and rng.random() < 0.5:
            states[1].table = frozen
        prev_roots = rng.integers(-1, 4, flat.num_trees)
        logits = torch.randn(flat.num_nodes, vocab, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
        asked = []

        def top(rows):
            return _softmax_top3(logits, rows)

        def ask(nodes):  # None: every node
            nodes = np.arange(flat.num_nodes) if nodes is None else nodes
            asked.append(nodes.tolist())
            return top(nodes)

        proposer.learn_batch(states, flat, np.zeros(flat.num_nodes, bool), prev_roots, ask)
        prev = flat.tokens[np.maximum(flat.global_parents(), 0)].astype(np.int64)
        prev[flat.offsets[:-1]] = prev_roots
        owner = np.repeat([-1 if s is None else id(s.table) for s in states], flat.sizes())
        for table in {id(s.table): s.table for s in states if s is not None and s.table is not frozen}.values():
            mine = np.flatnonzero(owner == id(table))
            want = AdjacencyTable(vocab, proposer.config.top_k)
            want.harvest(prev[mine], flat.tokens[mine], top(mine))
            assert np.array_equal(table.unigram_ids, want.unigram_ids)
            assert np.array_equal(table.unigram_scores, want.unigram_scores)
            for p, t in zip(prev[mine].tolist(), flat.tokens[mine].tolist()):
                if p >= 0:
                    got, exp = table.successors(p, t), want.successors(p, t)
                    assert got[0].tolist() == exp[0].tolist() and got[1].tolist() == exp[1].tolist()
        assert frozen.num_harvested == 0
        read = sorted(asked[0]) if asked else []
        keys = [(owner[k], prev[k], flat.tokens[k]) for k in range(flat.num_nodes)]
        learnt = [k for k in range(flat.num_nodes) if owner[k] != -1 and owner[k] != id(frozen)]
        assert read == [k for k in learnt if keys[k] not in keys[k + 1:]] and len(asked) <= 1
        skipped += len(learnt) - len(read)
        tables_kept_whole += len({owner[k] for k in learnt}) > 1 and len(read) == flat.num_nodes
    assert skipped > 60 and tables_kept_whole >= 3  # steps repeated keys; others kept all rows of two tables


def test_refresh_steps_skip_the_rows_their_table_wrote_within_the_window_step_after_step():
    """GOOSE's ``learn_batch`` with ``refresh_steps``: over consecutive steps of two tenants, it
    asks for the top-k of the rows a plain model keeps (the last write of each key in the step,
    then not written by its table in the table's last W steps: unigram row and, with a previous
    token, bigram), and each table ends holding what harvesting exactly those rows leaves. Each
    table's clock ticks once a step it takes part in, whether or not a row is kept. Catches:
    every row asked (the window ignored), a clock per write or per call of both tables, the
    tenants' clocks or stamps mixed, rows of a skipped step counted as written."""
    from random_trees import random_trees
    from vllm_anisotropic.proposers.adjacency import AdjacencyTable
    from vllm_anisotropic.proposers.config import GooseConfig
    from vllm_anisotropic.proposers.goose import GooseProposer

    vocab, rng = 8, np.random.default_rng(13)
    fresh = 0
    for window in (1, 3):
        proposer = GooseProposer(GooseConfig(top_k=3, refresh_steps=window), vocab_size=vocab)
        want = {t: AdjacencyTable(vocab, 3) for t in (None, "x")}  # harvests exactly the kept rows
        clock = {t: 0 for t in want}
        uni_last, bi_last = {t: {} for t in want}, {t: {} for t in want}
        for _ in range(40):
            flat = FlatTrees.from_trees(random_trees(rng, vocab=4))
            tenants = rng.choice([None, "x"], flat.num_trees).tolist()
            states = [proposer.new_request(t) for t in tenants]
            prev_roots = rng.integers(-1, 4, flat.num_trees)
            logits = torch.randn(flat.num_nodes, vocab, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
            asked = []

            def top(rows):
                return _softmax_top3(logits, rows)

            def ask(nodes):
                nodes = np.arange(flat.num_nodes) if nodes is None else nodes
                asked.extend(nodes.tolist())
                return top(nodes)

            proposer.learn_batch(states, flat, np.zeros(flat.num_nodes, bool), prev_roots, ask)
            prev = flat.tokens[np.maximum(flat.global_parents(), 0)].astype(np.int64)
            prev[flat.offsets[:-1]] = prev_roots
            owner = np.repeat(tenants, flat.sizes()).tolist()
            keys = [(owner[k], int(prev[k]), int(flat.tokens[k])) for k in range(flat.num_nodes)]
            kept = []
            for t in set(tenants):
                clock[t] += 1
                now = clock[t]
                mine = [k for k in range(flat.num_nodes) if owner[k] == t and keys[k] not in keys[k + 1:]]
                for k in mine:
                    _, p, tok = keys[k]
                    old = now - uni_last[t].get(tok, -99) <= window and (
                        p < 0 or now - bi_last[t].get((p, tok), -99) <= window)
                    fresh += old
                    if not old:
                        kept.append(k)
                for k in kept:
                    if owner[k] == t:
                        uni_last[t][keys[k][2]] = now
                        if keys[k][1] >= 0:
                            bi_last[t][keys[k][1:]] = now
                mine_kept = np.array([k for k in kept if owner[k] == t], np.int64)
                if len(mine_kept):
                    want[t].harvest(prev[mine_kept], flat.tokens[mine_kept], top(mine_kept))
            assert sorted(asked) == sorted(kept)
            for t, table in ((None, proposer.tables.default), ("x", proposer.new_request("x").table)):
                assert np.array_equal(table.unigram_ids, want[t].unigram_ids)
                assert np.array_equal(table.unigram_scores, want[t].unigram_scores)
                assert table.bigram_key_set() == want[t].bigram_key_set()
                for key in want[t].bigram_key_set():
                    p, tok = divmod(key, vocab)
                    assert table.successors(p, tok)[0].tolist() == want[t].successors(p, tok)[0].tolist()
            del states
    assert fresh > 100  # the window skipped rows


def test_a_steps_spine_acceptance_moves_as_each_requests_own_observe_moves_it():
    """GOOSE's ``learn_batch`` updates each request's spine acceptance p_s (Algorithm 2 line 16)
    as ``GooseState.observe`` does for that request's tree alone, over random trees, sources,
    accepted paths and starting values; a finished request (None) is passed over."""
    from vllm_anisotropic.proposers.config import GooseConfig
    from vllm_anisotropic.proposers.goose import GooseProposer

    rng = np.random.default_rng(13)
    for _ in range(100):
        proposer = GooseProposer(GooseConfig(ema_coef=float(rng.uniform(0.1, 0.9))), vocab_size=50)
        trees_list, flat, paths, on_path = _random_verified_step(rng)
        states, twins = [proposer.new_request() for _ in trees_list], [proposer.new_request() for _ in trees_list]
        for s, w in zip(states, twins):
            s.spine_acceptance = w.spine_acceptance = float(rng.uniform())
        states[-1] = None
        proposer.learn_batch(states, flat, on_path, np.zeros(flat.num_trees, np.int64), None)
        for s, w, tree, path in zip(states[:-1], twins, trees_list, paths):
            w.observe(tree, path, None)
            assert s.spine_acceptance == pytest.approx(w.spine_acceptance, abs=1e-12)


def test_the_draft_kv_reserve_comes_out_of_the_workers_kv_memory_where_q_lives():
    """``reserve_draft_kv`` (the workers' ``determine_available_memory``): by default q's share of
    the KV bytes a token (q's / (q's + the target's)) of the worker's KV memory, or
    ``draft_kv_bytes``; a reserve that leaves nothing is refused by name; q on the host beside a
    GPU worker takes nothing from the device and keeps ``draft_kv_bytes`` as its bound; GOOSE
    reserves nothing."""
    from vllm_anisotropic.models import build_tiny_model

    q = str(build_tiny_model(block_std=0.12, lm_head_alpha=0.25))

    def drafter(**options):
        spec = TreeSpecConfig.build("draft_tree", {"model": q, **options})
        cfg = SimpleNamespace(
            speculative_config=SimpleNamespace(method="draft_tree", num_speculative_tokens=8),
            additional_config={"vllm_anisotropic": spec.to_additional_config()},
            model_config=SimpleNamespace(get_vocab_size=lambda: None, max_model_len=MAX_LEN, dtype=torch.float32),
            device_config=SimpleNamespace(device=torch.device("cpu")))
        return TreeDrafter(cfg)

    d = drafter()
    per_token = d.proposer.lm.kv_bytes_per_token  # the tiny q in float32: 1 KiB
    assert d.reserve_draft_kv(1 << 30, 3 * per_token, "cpu") == (1 << 30) - (1 << 28)  # a quarter for q
    assert d.proposer.kv_bound == d.metrics.draft_kv_bound_bytes == 1 << 28
    d = drafter(draft_kv_bytes=5 << 20)
    assert d.reserve_draft_kv(1 << 30, per_token, "cpu") == (1 << 30) - (5 << 20) and d.proposer.kv_bound == 5 << 20
    with pytest.raises(ValueError, match=r"draft_kv_bytes 5242880 leaves nothing of the 4194304 bytes"):
        d.reserve_draft_kv(4 << 20, per_token, "cpu")
    d = drafter(draft_kv_bytes=5 << 20, draft_device="cpu")
    assert d.reserve_draft_kv(1 << 30, per_token, "cuda") == 1 << 30 and d.proposer.kv_bound == 5 << 20
    assert drafter(draft_device="cpu").reserve_draft_kv(1 << 30, per_token, "cuda:0") == 1 << 30
    assert _drafter().reserve_draft_kv(1 << 30, 1.0, "cpu") == 1 << 30
