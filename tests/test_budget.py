"""The allocator's scheduler hook (``integration/vllm/engine/budget.py``) on stand-in requests: what it
cuts, when it probes, what it learns from a step, and the drafter's backoff.

What each test would catch: cuts applied to the wrong request or not as a prefix, caps from the
wrong request field (tokens owed, headroom), a cost model never refined online or refined with
the wrong step composition, realized acceptance counted for requests the allocator did not cut,
a probe that never fires or fires while drafts are kept, a backoff that never ends.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_anisotropic.allocator import TREE, CostModel
from vllm_anisotropic.integration.vllm.engine.budget import BatchBudget
from vllm_anisotropic.integration.vllm.engine.labels import LabelQueue
from vllm_anisotropic.integration.vllm.frontdoor.config import EngineTreeConfig


class Req(SimpleNamespace):
    pass


def _budget(tmp_path=None, cost: CostModel | None = None, **engine):
    sched = SimpleNamespace(max_num_batched_tokens=64)
    model = SimpleNamespace(max_model_len=1000)
    engine.setdefault("allocator_gate", False)  # the gate has its own tests below
    cfg = EngineTreeConfig(**engine)
    if cost is not None:
        path = tmp_path / "cost.json"
        path.write_text(cost.to_json())
        cfg = EngineTreeConfig(**{**engine, "cost_model": str(path)})
    return BatchBudget(sched, model, 10, cfg, stats_path=None)


def _req(rid, drafts, num_tokens=100, computed=99):
    return Req(request_id=rid, spec_token_ids=list(range(1, drafts + 1)), num_tokens=num_tokens,
               num_computed_tokens=computed, num_prompt_tokens=10)


def _offer(budget, probs: dict):
    budget.on_draft_ids(SimpleNamespace(req_ids=list(probs), tree_probs=list(probs.values())))


def test_cuts_follow_the_cost_model(tmp_path):
    # flat cost: every offered node (up to the per-request cap 10) is kept
    flat = CostModel.from_coefficients([0.0], base=0.01)
    b = _budget(tmp_path, flat, cost_model_online=False)
    reqs = [_req("a", 12), _req("b", 3)]
    _offer(b, {"a": [0.9] * 12, "b": [0.5, 0.4, 0.3]})
    b.cut(reqs)
    assert [len(r.spec_token_ids) for r in reqs] == [10, 3]
    assert reqs[0].spec_token_ids == list(range(1, 11))  # a prefix
    # steep cost: nothing is kept
    steep = CostModel.from_coefficients([0.0], base=0.01, tree_row=1.0)
    b = _budget(tmp_path, steep, cost_model_online=False, allocator_probe_every=0)
    reqs = [_req("a", 12), _req("b", 3)]
    _offer(b, {"a": [0.9] * 12, "b": [0.5, 0.4, 0.3]})
    b.cut(reqs)
    assert [len(r.spec_token_ids) for r in reqs] == [0, 0]
    assert b.metrics.steps_without_drafts == 1


def test_moderate_cost_keeps_the_likely_nodes(tmp_path):
    # 2 base tokens / 0.02 s; a node of probability p costs 0.002 s: worth it iff p > ~0.1 x rate
    cost = CostModel.from_coefficients([0.0], base=0.02, tree_row=0.002)
    b = _budget(tmp_path, cost, cost_model_online=False)
    reqs = [_req("a", 4), _req("b", 4)]
    _offer(b, {"a": [0.95, 0.9, 0.05, 0.01], "b": [0.02, 0.01, 0.01, 0.01]})
    b.cut(reqs)
    assert [len(r.spec_token_ids) for r in reqs] == [2, 0]


def test_caps_tokens_owed_and_headroom(tmp_path):
    flat = CostModel.from_coefficients([0.0], base=0.01)
    b = _budget(tmp_path, flat, cost_model_online=False)
    # a owes 60 tokens (re-run + root): only 4 of the 64-token step budget remain
    reqs = [_req("a", 8, num_tokens=160, computed=100), _req("b", 8, num_tokens=996, computed=995)]
    _offer(b, {"a": [0.9] * 8, "b": [0.8] * 8})
    b.cut(reqs)
    assert len(reqs[1].spec_token_ids) <= 1000 - 996 - 1  # max_model_len headroom
    assert sum(len(r.spec_token_ids) for r in reqs) <= 64 - 60 - 1


def test_probe_every_nth_step_without_drafts(tmp_path):
    steep = CostModel.from_coefficients([0.0], base=0.01, tree_row=1.0)
    b = _budget(tmp_path, steep, cost_model_online=False, allocator_probe_every=3)
    kept, expected = [], []
    for _ in range(6):
        reqs = [_req("a", 4), _req("b", 4)]
        _offer(b, {"a": [0.3, 0.2, 0.1, 0.1], "b": [0.6, 0.1, 0.1, 0.1]})
        b.cut(reqs)
        kept.append([len(r.spec_token_ids) for r in reqs])
        expected.append(dict(b._kept))
    # steps 3 and 6 probe the single most likely first node (request b's), its expected
    # accepted drafts its probability
    assert kept == [[0, 0], [0, 0], [0, 1], [0, 0], [0, 0], [0, 1]]
    assert expected == [{}, {}, {"b": 0.6}, {}, {}, {"b": 0.6}]
    assert b.metrics.probe_steps == 2 and b.metrics.tree_rows == 2


def test_off_cuts_nothing(tmp_path):
    b = _budget(allocator="off")
    reqs = [_req("a", 12)]
    _offer(b, {"a": [0.01] * 12})
    b.cut(reqs)
    assert len(reqs[0].spec_token_ids) == 12


def test_the_gate_tunables_reach_the_gate():
    """``allocator_gate_margin`` and ``allocator_gate_explore_every`` are the gate's, not left at
    its defaults (a key validated and then dropped would read as tuned)."""
    default = _budget(allocator_gate=True).gate.config
    b = _budget(allocator_gate=True, allocator_gate_margin=default.margin + 0.2,
                allocator_gate_explore_every=default.explore_every + 3)
    assert b.gate.config.margin == pytest.approx(default.margin + 0.2)
    assert b.gate.config.explore_every == default.explore_every + 3
    assert _budget(allocator_gate=False).gate is None


def test_a_step_refines_the_cost_model_and_counts_acceptance(tmp_path):
    b = _budget(tmp_path, CostModel.from_coefficients([0.0], base=0.01, tree_row=1e-4))
    reqs = [_req("a", 4, num_tokens=51, computed=50), _req("b", 2, num_tokens=71, computed=70)]
    _offer(b, {"a": [0.9, 0.8, 0.1, 0.1], "b": [0.7, 0.1]})
    b.cut(reqs)
    kept = {r.request_id: len(r.spec_token_ids) for r in reqs}
    assert kept["a"] >= 2  # cheap tree rows: the confident nodes are kept
    spec = {r.request_id: r.spec_token_ids for r in reqs if r.spec_token_ids}
    out = SimpleNamespace(num_scheduled_tokens={"a": 1 + kept["a"], "b": 1 + kept["b"]},
                          total_num_scheduled_tokens=2 + sum(kept.values()), scheduled_spec_decode_tokens=spec,
                          scheduled_new_reqs=[])
    b.on_scheduled(out)
    r, q, t, c, d, _, arm = b._step
    assert arm == TREE  # a decode step with drafts: the gate's speculative (tree) arm
    assert (r, q, t) == (2, 2 + sum(kept.values()), sum(kept.values()))
    assert d == sum(1 for n in kept.values() if n) >= 1  # requests that speculate
    assert c == kept["a"] * 50 + kept["b"] * 70
    runner_out = SimpleNamespace(sampled_token_ids=[[5, 6, 7], [8]], req_id_to_index={"a": 0, "b": 1})
    b.on_output(out, runner_out)
    assert b.metrics.cost_samples == 0 and len(b.cost._online) == 1  # scored when the stats are written
    b.tick()  # the scheduler's tick after on_output (TreeScheduler.update_from_output): the first writes
    assert b.metrics.cost_samples == 1
    assert b.metrics.realized_accepted == (2 if kept["a"] else 0)
    want = sum(sum([0.9, 0.8, 0.1, 0.1][:kept["a"]]) for _ in [0]) + sum([0.7, 0.1][:kept["b"]])
    assert b.metrics.predicted_accepted == pytest.approx(want)


def test_calibration_arrives_with_the_first_output():
    b = _budget()
    assert not b.calibrated
    sweep = [(q, q, 0, 0, 0, 0.002 + 1e-4 * q) for q in (1, 2, 4, 8, 16, 32)]
    b.on_output(SimpleNamespace(scheduled_spec_decode_tokens={}),
                SimpleNamespace(cost_calibration=sweep, sampled_token_ids=[], req_id_to_index={}))
    assert b.calibrated and b.cost.predict(16, 16, 0) == pytest.approx(0.002 + 1e-4 * 16, rel=0.05)


def _bare_drafter(max_backoff=16, **attrs):
    """A ``TreeDrafter`` with just the state ``take_step`` and ``_offer`` read (no vLLM config)."""
    from vllm_anisotropic.integration.vllm.engine.drafter import TreeDrafter

    d = object.__new__(TreeDrafter)
    d.acceptance, d.pending, d.zero_streak, d.skip, d.kept_mark = object(), {}, {}, {}, {}
    d.reorders, d.rested = {}, set()
    d.max_backoff = max_backoff
    for name, value in attrs.items():
        setattr(d, name, value)
    return d


def _take(d, tree, scheduled, req_id="r"):
    """``tree`` pending for ``req_id``, then taken by a step that scheduled ``scheduled``."""
    from vllm_anisotropic.integration.vllm.engine.drafter import _Proposal
    from vllm_anisotropic.tree import FlatTrees

    proposal = _Proposal(FlatTrees.from_trees([tree]), None, np.array([-1]), np.array([1], np.int8), False)
    d.pending = {req_id: (proposal, 0)}
    return d.take_step([req_id], {req_id: list(scheduled)})


def test_drafter_backoff_after_zero_cuts():
    """The drafter skips 1, 2, 4, ... proposals (capped by ``allocator_backoff``) after
    consecutive zero cuts, and resets; ``allocator_backoff`` 0 never skips."""
    from vllm_anisotropic.integration.vllm.frontdoor.config import EngineTreeConfig
    from vllm_anisotropic.tree import DraftTree

    tree = DraftTree(tokens=[1, 2, 3], parents=[-1, 0, 1])
    for cap, expected in [(EngineTreeConfig().allocator_backoff, [1, 2, 4, 8, 16, 16, 16]), (4, [1, 2, 4, 4, 4, 4, 4]),
                          (0, [0] * 7)]:
        d = _bare_drafter(max_backoff=cap)
        skips = []
        for _ in range(7):
            _take(d, tree, ())
            skips.append(d.skip["r"])
        assert skips == expected, cap
    d.max_backoff = 16
    _take(d, tree, [2])
    assert "r" not in d.zero_streak
    _take(d, tree, ())
    assert d.skip["r"] == 1


def test_drafter_tells_the_proposer_how_many_requests_draft_this_step():
    """``Proposer.begin_step`` (draft_tree's selector reads it as its batch size) counts the rows
    that propose: not a row without a sampled token, an ineligible one, or one in backoff; the
    backoff still counts down."""
    from vllm_anisotropic.integration.vllm.engine.metrics import TreeMetrics
    from vllm_anisotropic.tree import DraftTree

    seen = []

    class Chain:
        def propose(self, context, max_nodes=None):
            seen.append(("propose", int(context[-1])))
            return DraftTree.chain([7], root_token=int(context[-1]))

    proposer = SimpleNamespace(begin_step=lambda n, batch: seen.append(("begin", n, batch)),
                               new_request=lambda tenant=None: Chain())
    d = _bare_drafter(acceptance=None, unlabelled=LabelQueue(0), states={}, tenants={}, proposer=proposer, disabled=set(), _proposals=0,
                      metrics=TreeMetrics(), max_draft_tokens=4, max_model_len=64, offer_factor=0.0)
    d.skip = {"c": 2}
    tokens = np.arange(1, 5 * 64 + 1).reshape(5, 64)
    out = d.propose_trees(["a", "b", "c", "d", "e"], [True, True, True, False, True],
                          [[1], [], [1], [1], [1]], np.full(5, 10), tokens)
    assert seen[0] == ("begin", 2, 5) and [x[0] for x in seen].count("propose") == 2, seen  # rows a and e of 5
    assert out == [[7], [], [], [], [7]] and d.skip["c"] == 1
    d.disabled = {"e"}  # a contained fault turned e's trees off
    seen.clear()
    out = d.propose_trees(["a", "e"], [True, True], [[1], [1]], np.full(2, 10), tokens)
    assert seen[0] == ("begin", 1, 2) and out == [[7], []]


def test_drafter_offers_what_the_allocator_has_been_keeping():
    """The next tree's draft budget is max(8, factor x the decaying high-water mark of the
    scheduled drafts), the proposer's own budget when that reaches the room left."""
    from vllm_anisotropic.integration.vllm.engine.drafter import OFFER_MIN_DRAFTS
    from vllm_anisotropic.tree import DraftTree

    d = _bare_drafter(offer_factor=4.0)
    tree = DraftTree.chain(list(range(2, 42)), root_token=1)  # 40 drafts
    assert d._offer("r", room=59) is None  # no history: the proposer's budget
    offers = []
    for kept in (2, 5, 0, 0, 12):
        _take(d, tree, range(2, 2 + kept))
        offers.append(d._offer("r", room=59))
    # marks 2, 5, 4, 3.2, 12 -> drafts 8, 20, 16, 13 (ceil 12.8), 48 -> nodes + 1
    assert offers == [OFFER_MIN_DRAFTS + 1, 21, 17, 14, 49], offers
    assert d._offer("r", room=40) is None  # 48 drafts >= the room: no cap
    d.offer_factor = 0.0
    assert d._offer("r", room=59) is None  # allocator_offer_factor 0: whole budget


def test_chains_are_kept_when_tree_attention_costs_more_than_branches_bring(tmp_path):
    """A leading chain is verified by vLLM's causal attention: with a steep fixed cost of the
    masked tree recompute the cut stays inside the chain (and the step's tree rows count only
    the rows past it); with that cost gone the branches are kept too."""
    probs = {"a": [0.9, 0.8, 0.7, 0.6, 0.5], "b": [0.9, 0.6, 0.5]}
    offer = SimpleNamespace(req_ids=list(probs), tree_probs=list(probs.values()), tree_chains=[2, 1])
    tree_cost = CostModel.from_coefficients([0.0], base=0.01, tree_switch=0.05)
    b = _budget(tmp_path, tree_cost, cost_model_online=False)
    reqs = [_req("a", 5), _req("b", 3)]
    b.on_draft_ids(offer)
    b.cut(reqs)
    assert [len(r.spec_token_ids) for r in reqs] == [2, 1]
    spec = {r.request_id: r.spec_token_ids for r in reqs}
    b.on_scheduled(SimpleNamespace(num_scheduled_tokens={"a": 3, "b": 2}, total_num_scheduled_tokens=5,
                                   scheduled_spec_decode_tokens=spec, scheduled_new_reqs=[]))
    assert b._step[:4] == (2, 5, 0, 0)  # chain rows are no tree rows
    free = CostModel.from_coefficients([0.0], base=0.01)
    b = _budget(tmp_path, free, cost_model_online=False)
    reqs = [_req("a", 5), _req("b", 3)]
    b.on_draft_ids(offer)
    b.cut(reqs)
    assert [len(r.spec_token_ids) for r in reqs] == [5, 3]
    spec = {r.request_id: r.spec_token_ids for r in reqs}
    b.on_scheduled(SimpleNamespace(num_scheduled_tokens={"a": 6, "b": 4}, total_num_scheduled_tokens=10,
                                   scheduled_spec_decode_tokens=spec, scheduled_new_reqs=[]))
    assert b._step[2] == (5 - 2) + (3 - 1)


def test_drafter_learns_from_trees_the_allocator_cut():
    """The acceptance model learns every offered node from the tokens that followed its root,
    verified or not. A spine the proposer under-rates (values 0.1 ** depth) and the allocator
    cuts to nothing every step is still learned: its first two nodes always come true, so their
    predicted probabilities climb towards 1 and the third's stays low. Learning from verified
    nodes only (the old way) never moves them: nothing was verified."""
    from vllm_anisotropic.allocator import AcceptanceConfig, AcceptanceModel
    from vllm_anisotropic.integration.vllm.engine.drafter import TreeDrafter
    from vllm_anisotropic.tree import DraftTree, FlatTrees

    d = object.__new__(TreeDrafter)
    d.acceptance = AcceptanceModel(AcceptanceConfig(refit_every=1))
    d.unlabelled, d.label_depth, d.reorders = LabelQueue(8), 8, {}
    spine = DraftTree(tokens=[0, 7, 8, 9], parents=[-1, 0, 1, 2], sources=[0, 1, 1, 1], values=[1, 0.1, 0.01, 0.001])
    flat = FlatTrees.from_trees([DraftTree.chain([5], root_token=3), spine])  # the spine is tree 1
    before = d.acceptance.predict([1, 1, 1], [1, 2, 3], spine.values[1:])
    tokens = np.zeros((1, 4000), np.int64)
    n = 10
    for step in range(300):
        d.unlabelled.offer(flat, np.array([1]), ["r"], np.array([n]))  # offered at n tokens, then cut to 0
        tokens[0, n : n + 3] = [7, 8, 5]  # what the target emitted after the root
        n += 3
        d._label(["r"], np.array([n]), tokens)
    after = d.acceptance.predict([1, 1, 1], [1, 2, 3], spine.values[1:])
    assert np.allclose(before, spine.values[1:], rtol=1e-6)  # the prior: the values
    assert after[0] > 0.9 and after[1] > 0.9 and after[2] < 0.1, after
    # a tree waits until enough tokens follow its root, and leaves with the request
    d.unlabelled = LabelQueue(8)
    d.unlabelled.offer(flat, np.array([1]), ["r"], np.array([n]))
    d._label(["r"], np.array([n + 2]), tokens)
    assert d.unlabelled.waiting("r") == 1
    d._label(["r"], np.array([n + 3]), tokens)
    assert d.unlabelled.waiting("r") == 0


def test_plain_steps_pay_no_fit_and_the_error_is_what_each_step_predicted(tmp_path):
    """Steps without an allocation (the gate keeps them plain) only record the measured step:
    the cost model is refitted once, at the next cut that allocates, on every step measured
    since; the cost-model error counts each step against the model in use when it ran.

    Catches: a refit per step again (the floor's cost), steps dropped from the fit or the
    error, errors scored against the refitted model (it has seen those steps: ~0 error)."""
    prior = CostModel.from_coefficients([0.0], base=0.01, slopes=[1e-4])
    b = _budget(tmp_path, prior)
    fits = []
    refit = b.cost.refit
    b.cost.refit = lambda: (fits.append(len(b.cost._online)), refit())
    expected = 0.0
    rng = np.random.default_rng(3)
    for i in range(100):  # measured steps, no drafts offered: nothing is allocated
        reqs = [_req("a", 0), _req("b", 0)]
        b.cut(reqs)
        out = SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1}, total_num_scheduled_tokens=2,
                              scheduled_spec_decode_tokens={}, scheduled_new_reqs=[])
        b.on_scheduled(out)
        seconds = 0.02 + 0.01 * rng.random()
        b._step = b._step[:5] + (time_now() - seconds,) + b._step[6:]
        b.on_output(out, SimpleNamespace(sampled_token_ids=[[1], [2]], req_id_to_index={"a": 0, "b": 1}))
        measured = b.cost._online[-1][5]
        expected += abs(prior.predict(2, 2, 0, 0, 0) - measured) / measured
    assert fits == [] and len(b.cost._online) == 100
    reqs = [_req("a", 2), _req("b", 2)]
    _offer(b, {"a": [0.9, 0.5], "b": [0.9, 0.5]})
    b.cut(reqs)  # an allocation: one fit on all 100 steps, which now cost ~0.025 s, not ~0.0102
    assert fits == [100]
    b._score()
    assert b.metrics.cost_samples == 100
    assert b.metrics.cost_abs_rel_err == pytest.approx(expected, rel=1e-9)
    assert b.cost.predict(2, 2, 0, 0, 0) == pytest.approx(0.025, rel=0.1)


def time_now() -> float:
    import time

    return time.perf_counter()


def test_harvest_runs_later_with_the_bigram_key_of_its_own_step():
    """``observe_step`` counts a step's trees at once and harvests their rows later
    (``run_deferred``): the next proposal is built from the tables as they were (one step of
    lag), and the late harvest writes exactly what harvesting at once would have, bigram key
    included, though that proposal has moved the state's ``_prev_root`` on.

    Catches: a harvest that runs at once again (the reply would wait for it), one that reads
    ``_prev_root`` when it runs (the next root's key: wrong bigram rows), metrics that wait for
    the harvest (counters short by a step), rows taken at the wrong offsets. CPU logits are read
    in place when the harvest runs: vLLM's ``compute_logits`` returns a new tensor every step
    and nothing writes a step's logits after its sampler."""
    import torch

    from vllm_anisotropic.integration.vllm.engine.drafter import StepTrees, TreeDrafter
    from vllm_anisotropic.integration.vllm.engine.host_clock import HostClock
    from vllm_anisotropic.integration.vllm.engine.metrics import TreeMetrics
    from vllm_anisotropic.proposers import get_proposer
    from vllm_anisotropic.proposers.adjacency import TopKRows
    from vllm_anisotropic.tree import FlatTrees

    vocab = 64
    context = np.array([5, 6, 7, 5, 6, 7, 5, 6], np.int64)
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(0))

    def tables(state):
        t = state.table
        bigram = {int(k): t.bigram_ids[s].tolist() for s, k in enumerate(t.bigram_keys.tolist()) if k >= 0}
        return t.unigram_ids.copy(), bigram

    # at once: harvest, then propose the next tree
    eager = get_proposer("goose", vocab_size=vocab).new_request()
    tree = eager.propose(context)
    n = tree.num_nodes
    eager.observe(tree, [], TopKRows.of(logits[:n], eager.harvest_top_k))
    after_eager = tables(eager)

    d = object.__new__(TreeDrafter)
    d.proposer = get_proposer("goose", vocab_size=vocab)
    d.states, d._deferred, d.metrics, d.host_clock, d.reorders = {}, [], TreeMetrics(), HostClock(), {}
    d.sink = SimpleNamespace(trace=False, tick=lambda force=False: None)
    state = d.states["r"] = d.proposer.new_request()
    assert state.propose(context).tokens.tolist() == tree.tokens.tolist()
    before = tables(state)
    buffer = logits.clone()
    step = StepTrees(["r"], np.array([0]), FlatTrees.from_trees([tree]), np.array([context[-2]]),
                     np.array([1], np.int8), np.zeros(1, bool))
    d.observe_step(step, np.full((1, 1), -1), np.zeros(1, np.int64), np.array([0]), buffer)
    assert d.metrics.verified_trees + d.metrics.plain_steps == 1  # counted now
    assert np.array_equal(tables(state)[0], before[0]) and tables(state)[1] == before[1]  # not harvested yet
    nxt = state.propose(np.append(context, [7, 9]))  # moves _prev_root to 7
    assert state._prev_root == 7
    d.run_deferred()
    late = tables(state)
    assert np.array_equal(late[0], after_eager[0]) and late[1] == after_eager[1]
    assert d._deferred == [] and nxt.num_nodes >= 1


def test_a_chain_step_drafts_spine_chains_unranked_and_harvests_nothing():
    # the gate's chain steps (allocator.gate): each request's context-match spine alone, at most
    # allocator_chain_drafts tokens, no probabilities (nothing ranks or labels it), and its
    # verified rows never reach the adjacency table; a tree step after it is ranked and harvested
    from vllm_anisotropic.integration.vllm.frontdoor.config import TreeSpecConfig
    from vllm_anisotropic.integration.vllm.engine.drafter import TreeDrafter
    from vllm_anisotropic.proposers import GooseConfig

    vocab = 64
    spec = TreeSpecConfig.build("goose", {"allocator_chain_drafts": 3})
    assert spec.chain_steps and not TreeSpecConfig.build("goose", {"allocator_chains": False}).chain_steps
    assert not TreeSpecConfig.build("token_recycling", {}).chain_steps  # no chain to draft alone
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(method="goose", num_speculative_tokens=59),
                          additional_config={"vllm_anisotropic": spec.to_additional_config()},
                          model_config=SimpleNamespace(get_vocab_size=lambda: vocab, max_model_len=512))
    d = TreeDrafter(cfg)
    context = np.array([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], np.int64)
    tokens = np.zeros((2, 512), np.int64)
    tokens[0, : len(context)] = context
    tokens[1, : len(context)] = context[::-1]
    num = np.array([len(context), len(context)])
    drafts = d.propose_trees(["a", "b"], [True, True], [[7], [5]], num, tokens, chains=True)
    assert drafts[0] == [8, 9, 10]  # the spine, cut to 3 tokens
    assert d.pending["a"][0].probs is None and not d.unlabelled and d.pending["a"][0].chains
    assert d.pending_probs(["a", "b"]) == [None, None]
    assert d.metrics.table_bytes == d.proposer.table.memory_bytes()["total"] > 0  # one shared table, counted once
    step = d.take_step(["a", "b"], {"a": drafts[0], "b": drafts[1]})
    assert step.chains.all() and step.req_ids == ["a", "b"] and step.trees.tree(0).tokens.tolist() == [7, 8, 9, 10]
    state = d.states["a"]
    table = state.table.unigram_ids.copy()
    logits = torch.randn(step.trees.num_nodes, vocab, generator=torch.Generator().manual_seed(0))
    accepted = np.full((2, 3), -1)
    accepted[0, :2] = [1, 2]
    d.observe_step(step, accepted, np.array([2, 0]), step.trees.offsets[:-1], logits)
    d.run_deferred()
    assert np.array_equal(state.table.unigram_ids, table)  # nothing harvested
    assert state.spine_acceptance > GooseConfig().initial_spine_acceptance  # the spine EMA still learns
    # a tree step: ranked (probabilities for the allocator), and its rows harvested
    tokens[0, len(context) : len(context) + 3] = [8, 9, 10]  # accepted 8, 9 and the bonus 10
    drafts = d.propose_trees(["a"], [True], [[10]], num[:1] + 3, tokens[:1], chains=False)
    assert not d.pending["a"][0].chains and len(d.pending_probs(["a"])[0]) == len(drafts[0]) > 0


def test_a_failing_harvest_turns_trees_off_for_its_requests_only(caplog):
    """Deferred learning that raises (issue 43 item 5) is contained where it runs: logged with
    the request ids, counted (``faults``), those requests get no more trees, other requests and
    later calls are untouched, and the request's entry goes when it finishes."""
    import logging

    import torch

    from vllm_anisotropic.integration.vllm.engine.drafter import StepTrees, TreeDrafter
    from vllm_anisotropic.integration.vllm.engine.host_clock import HostClock
    from vllm_anisotropic.integration.vllm.engine.metrics import TreeMetrics
    from vllm_anisotropic.proposers import get_proposer
    from vllm_anisotropic.tree import DraftTree, FlatTrees

    d = object.__new__(TreeDrafter)
    d.proposer = get_proposer("goose", vocab_size=16)
    d.states = {r: d.proposer.new_request() for r in "ab"}
    d._deferred, d.metrics, d.host_clock, d.disabled, d.reorders, d.rested = [], TreeMetrics(), HostClock(), set(), {}, set()
    d.sink = SimpleNamespace(trace=False, tick=lambda force=False: None)
    trees = FlatTrees.from_trees([DraftTree.chain([3], root_token=2), DraftTree.chain([5], root_token=4)])

    def step(ids):
        return StepTrees(ids, np.arange(len(ids)), trees.select(np.arange(len(ids))), np.full(len(ids), -1),
                         np.ones(len(ids), np.int8), np.zeros(len(ids), bool))

    broken = d.proposer.learn_batch
    d.proposer.learn_batch = lambda *a, **k: (_ for _ in ()).throw(ValueError("corrupt row"))
    d.observe_step(step(["a"]), np.full((1, 1), -1), np.zeros(1, np.int64), np.array([0]), torch.randn(2, 16))
    with caplog.at_level(logging.ERROR):
        d.run_deferred()  # contained: no exception here, nor at any later call
    assert d.disabled == {"a"} and d.metrics.faults == {"harvest": 1} and d.metrics.disabled_requests == 1
    assert "['a']" in caplog.text and "corrupt row" in caplog.text
    d.proposer.learn_batch = broken
    d.observe_step(step(["a", "b"]), np.full((2, 1), -1), np.zeros(2, np.int64), np.array([0, 2]), torch.randn(4, 16))
    d.run_deferred()
    assert d.disabled == {"a"} and d.metrics.faults == {"harvest": 1}
    d.pending, d.tenants, d.zero_streak, d.skip, d.kept_mark, d.unlabelled = {}, {}, {}, {}, {}, LabelQueue(0)
    d.drop("a")
    assert d.disabled == set()


def _gated(decision, cost_dir, **engine):
    """A hook with the real gate whose decision for the coming step is ``decision``."""
    b = _budget(cost_dir, CostModel.from_coefficients([0.0], base=0.01), allocator_gate=True,
                cost_model_online=False, allocator_probe_every=0, **engine)
    b._allowed = decision  # the gate decides one step ahead (BatchBudget.cut)
    return b


def test_a_plain_step_of_the_gate_drops_every_draft_and_counts_what_was_offered(tmp_path):
    """Catches: drafts left in a step the gate made plain, the offered rows or the plain step not
    counted (or counted as a step with drafts), a probe fired, a step counted when no request
    decodes (prefill only)."""
    from vllm_anisotropic.allocator import PLAIN

    b = _gated(PLAIN, tmp_path)
    reqs = [_req("a", 4), _req("b", 2), _req("c", 0)]
    _offer(b, {"a": [0.9, 0.8, 0.7, 0.6], "b": [0.5, 0.4]})
    b.cut(reqs)
    assert [r.spec_token_ids for r in reqs] == [[], [], []]
    m = b.metrics
    assert (m.steps, m.steps_without_drafts, m.gate_plain_steps, m.tree_rows_offered, m.tree_rows) == (1, 1, 1, 6, 0)
    assert (m.last_budget, m.last_predicted_speedup, m.probe_steps, m.chain_steps) == (0, 1.0, 0, 0)
    # prefill only (no request past its prompt) and no drafts: not a step
    b = _gated(PLAIN, tmp_path)
    b.cut([_req("p", 0, num_tokens=50, computed=5)])
    assert b.metrics.steps == 0 and b.metrics.gate_plain_steps == 0


def test_a_chain_step_of_the_gate_keeps_each_chain_up_to_its_cap(tmp_path):
    """Each request keeps min(its drafts, its chain, allocator_chain_drafts); a tree that came
    instead keeps its leading chain. Catches: chains cut by the wrong bound (max for min), the
    chain counters off, a chain step counted as plain or as a step without drafts."""
    from vllm_anisotropic.allocator import CHAIN

    b = _gated(CHAIN, tmp_path, allocator_chain_drafts=3)
    reqs = [_req("a", 5), _req("b", 2), _req("c", 4)]
    b.on_draft_ids(SimpleNamespace(req_ids=["a", "b", "c"], tree_probs=[None, None, [0.9] * 4], tree_chains=[5, 2, 1]))
    b.cut(reqs)
    assert [len(r.spec_token_ids) for r in reqs] == [3, 2, 1]
    assert reqs[0].spec_token_ids == [1, 2, 3]  # a prefix
    m = b.metrics
    assert (m.steps, m.chain_steps, m.chain_drafts, m.last_budget) == (1, 1, 6, 6)
    assert (m.steps_without_drafts, m.gate_plain_steps) == (0, 0)
    # no chain anywhere: a chain step that kept nothing
    b = _gated(CHAIN, tmp_path)
    reqs = [_req("a", 3)]
    b.on_draft_ids(SimpleNamespace(req_ids=["a"], tree_probs=[None], tree_chains=[0]))
    b.cut(reqs)
    assert reqs[0].spec_token_ids == [] and (b.metrics.chain_steps, b.metrics.steps_without_drafts) == (1, 1)


def test_the_summary_line_reports_the_counters_per_step():
    from vllm_anisotropic.integration.vllm.engine.budget import BudgetMetrics

    m = BudgetMetrics(steps=4, tree_rows=10, tree_rows_offered=20, steps_without_drafts=1, gate_plain_steps=1,
                      chain_steps=2, predicted_accepted=7.4, realized_accepted=6, cost_samples=2, cost_abs_rel_err=0.3)
    assert m.summary_line() == (
        "vllm-anisotropic budget: steps 4, mean tree rows 2.5 of 5.0 offered, steps without drafts 0.25 "
        "(gate 0.25), chain steps 0.50, accepted predicted 7 realized 6, cost model error 0.150")
    assert "cost model error nan" in BudgetMetrics().summary_line()
    assert "mean tree rows 3.0 of 5.0 offered" in BudgetMetrics(steps=1, tree_rows=3, tree_rows_offered=5).summary_line()


def test_a_cut_counts_what_it_was_offered_kept_and_gave_up(tmp_path):
    """The allocator's counters of one step, against what the cut did: rows offered, rows within
    vLLM's caps (per-request cap 10, the step's token budget), the expected accepted drafts left
    out inside those caps, rows kept. Then the headroom bound exactly: a request 9 tokens from
    max_model_len keeps 8 drafts (its root takes the 9th place). Catches: counters summed with
    the wrong sign or bound, the given-up sum over the wrong slice, the headroom off by one."""
    cost = CostModel.from_coefficients([0.0], base=0.02, tree_row=0.002)  # as the test above: keeps p > ~0.1
    b = _budget(tmp_path, cost, cost_model_online=False, allocator_probe_every=0)
    pa, pb = [0.95, 0.9, 0.8, 0.3, 0.2, 0.05, 0.04, 0.03, 0.02, 0.02, 0.01, 0.01], [0.6, 0.04, 0.01]
    reqs = [_req("a", 12), _req("b", 3)]
    _offer(b, {"a": pa, "b": pb})
    b.cut(reqs)
    na, nb = (len(r.spec_token_ids) for r in reqs)
    assert 0 < na < 10 and 0 < nb < 3  # a real cut inside the caps
    m = b.metrics
    assert (m.steps, m.tree_rows_offered, m.tree_rows_within_caps) == (1, 15, 13)  # 10 + 3 of the 64 - 2 budget
    assert (m.tree_rows, m.last_budget) == (na + nb, na + nb)
    assert m.given_up_accepted == pytest.approx(sum(pa[na:10]) + sum(pb[nb:3]))
    flat = CostModel.from_coefficients([0.0], base=0.01)
    b = _budget(tmp_path, flat, cost_model_online=False)
    reqs = [_req("c", 12, num_tokens=991, computed=990)]
    _offer(b, {"c": [0.9] * 12})
    b.cut(reqs)
    assert len(reqs[0].spec_token_ids) == 1000 - 991 - 1


def test_a_steps_composition_and_what_the_gate_observes_of_it(tmp_path):
    """What ``on_scheduled`` records of a step (requests, tokens, tree rows past each leading
    chain, their context, requests speculating, the gate's arm) and what ``on_output`` reports:
    the gate observes the step's emitted tokens and its seconds less the next step's proposing
    time; acceptance predicted vs realized. Then the plain arm: a gate-plain decode step with
    nothing owed is PLAIN, with an accepted token still to re-run it is no arm (None).
    Catches: chain rows counted as tree rows, context not weighted by rows, an arm on a prefill
    step, tokens of unscheduled requests counted, the propose time added instead of subtracted."""
    from vllm_anisotropic.allocator import PLAIN

    b = _gated(TREE, tmp_path)
    reqs = [_req("a", 5, num_tokens=100, computed=99), _req("b", 3, num_tokens=80, computed=79)]
    b.on_draft_ids(SimpleNamespace(req_ids=["a", "b"], tree_probs=[[0.9, 0.8, 0.7, 0.6, 0.5], [0.5, 0.4, 0.3]],
                                   tree_chains=[2, 0]))
    b.cut(reqs)
    assert [len(r.spec_token_ids) for r in reqs] == [5, 3]  # flat cost: all kept
    out = SimpleNamespace(num_scheduled_tokens={"a": 6, "b": 4}, total_num_scheduled_tokens=10,
                          scheduled_spec_decode_tokens={"a": reqs[0].spec_token_ids, "b": reqs[1].spec_token_ids},
                          scheduled_new_reqs=[])
    b.on_scheduled(out)
    n, tokens, rows, ctx, speculating, _, arm = b._step
    assert (n, tokens, rows, ctx, speculating, arm) == (2, 10, 3 + 3, 3 * 99 + 3 * 79, 2, TREE)
    seen = []
    b.gate.observe = lambda *args: seen.append(args)
    t_cut = b._step[5]
    b.on_output(out, SimpleNamespace(sampled_token_ids=[[1, 2, 3], [4]], req_id_to_index={"a": 0, "b": 1, "z": 2},
                                     tree_propose_s=0.25))
    ((r, observed_arm, emitted, seconds),) = seen
    assert (r, observed_arm, emitted) == (2, TREE, 4)
    assert seconds < time_now() - t_cut - 0.2  # the proposing time is the next step's, not this one's
    assert b.metrics.predicted_accepted == pytest.approx(0.9 + 0.8 + 0.7 + 0.6 + 0.5 + 0.5 + 0.4 + 0.3)
    assert b.metrics.realized_accepted == 2
    # the plain arm
    for owed, expected in ((0, PLAIN), (1, None)):
        b = _gated(PLAIN, tmp_path)
        b.propose_next = PLAIN
        reqs = [_req("a", 0, num_tokens=100 + owed, computed=99)]
        b.cut(reqs)
        b.propose_next = PLAIN
        b.on_scheduled(SimpleNamespace(num_scheduled_tokens={"a": 1 + owed}, total_num_scheduled_tokens=1 + owed,
                                       scheduled_spec_decode_tokens={}, scheduled_new_reqs=[]))
        assert b._step[6] == expected, owed
    # a step with a new request (prompt tokens): no arm
    b = _gated(TREE, tmp_path)
    b.cut([_req("a", 0)])
    b.on_scheduled(SimpleNamespace(num_scheduled_tokens={"a": 1, "n": 30}, total_num_scheduled_tokens=31,
                                   scheduled_spec_decode_tokens={}, scheduled_new_reqs=[object()]))
    assert b._step[6] is None


# ---------------------------------------------------------------- written for the mutants that survived
# (scripts/mutate.py on budget.py against this file: docs/testing.md, "The engine glue")


def _scheduled(num, spec=None, new=()):
    """A ``SchedulerOutput`` stand-in: tokens per request, their drafts, new requests."""
    return SimpleNamespace(num_scheduled_tokens=num, total_num_scheduled_tokens=sum(num.values()),
                           scheduled_spec_decode_tokens=spec or {}, scheduled_new_reqs=list(new))


def _plain_step(b):
    """One decode step of request "a" without drafts (nothing allocated) through the hooks."""
    b.cut([_req("a", 0)])
    out = _scheduled({"a": 1})
    b.on_scheduled(out)
    b.on_output(out, SimpleNamespace(sampled_token_ids=[[1]], req_id_to_index={"a": 0}))


def test_chain_cost_is_the_model_without_its_tree_terms():
    """``_ChainCost``: a chain's rows are plain query tokens, so the wrapped model's four tree
    terms (tree switch, per request, per row, per context token) are zero and every other term is
    the model's own, in ``predict`` and in the compiled allocator's ``kernel_params`` (cached
    until the wrapped model's weights change). Catches: a tree term left in or a plain term
    zeroed (the slice off by one), the speculating requests defaulted with max for min, the
    cache never refreshed after a refit or refreshed on every call."""
    from vllm_anisotropic.integration.vllm.engine.budget import _ChainCost

    cost = CostModel.from_coefficients([0.0, 8.0], base=0.01, per_request=0.002, slopes=[1e-3, 2e-3],
                                       tree_switch=0.03, tree_switch_per_request=0.004, tree_row=0.005,
                                       tree_ctx=1e-4, spec_switch=0.006, spec_request=0.007, step_overhead=0.0009)
    chain = _ChainCost(cost)
    assert chain.spec_request_weight == cost.spec_request_weight == 0.007
    for r, q, t in ((4, 12, 2), (2, 9, 6)):
        want = cost.predict(r, q, 0, 0, min(r, t))
        assert chain.predict(r, q, t) == want and chain.predict(r, q, t, 500) == want  # context: a tree term
        assert chain.predict(r, q, t, spec_reqs=1) == cost.predict(r, q, 0, 0, 1)
    assert chain.predict(4, 12, 2) != cost.predict(4, 12, 0, 0, 4)
    knots, at_knots, tail = chain.kernel_params()
    k0, a0, t0 = cost.kernel_params()
    assert np.array_equal(knots, k0) and np.array_equal(at_knots, a0)
    plain_terms = [0, 1, 2, 7, 8, 9]  # w0, w_request, last Q slope, b_spec, b_d, b_step
    assert np.array_equal(tail[plain_terms], t0[plain_terms]) and t0[plain_terms].all()
    assert not tail[3:7].any() and t0[3:7].all()  # b_on, b_on_r, b_t, b_c
    assert chain.kernel_params()[2] is tail  # cached
    cost.weights = cost.weights * 2  # a refit
    assert np.array_equal(chain.kernel_params()[2][plain_terms], 2 * t0[plain_terms])


def test_a_given_cost_model_is_kept_and_deterministic_learns_nothing(tmp_path):
    """A ``cost_model`` file is not replaced by the worker's start-up sweep; with
    ``deterministic`` measured steps do not refine it (cost_model_online defaults on)."""
    given = CostModel.from_coefficients([0.0], base=0.01, tree_row=1e-3)
    sweep = [(q, q, 0, 0, 0, 0.002 + 1e-4 * q) for q in (1, 2, 4, 8, 16, 32)]
    for engine in ({}, {"deterministic": True}):
        b = _budget(tmp_path, given, **engine)
        b.on_output(SimpleNamespace(scheduled_spec_decode_tokens={}),
                    SimpleNamespace(cost_calibration=sweep, sampled_token_ids=[], req_id_to_index={}))
        assert b.cost.coefficients == given.coefficients and b.start_coefficients == {}
        _plain_step(b)
        assert len(b.cost._online) == (0 if engine else 1)
    # without a file, an output without a sweep leaves the prior in place
    b = _budget()
    prior = b.cost
    b.on_output(SimpleNamespace(scheduled_spec_decode_tokens={}),
                SimpleNamespace(sampled_token_ids=[], req_id_to_index={}))
    assert b.cost is prior and not b.calibrated


def test_stats_are_written_each_second_and_the_summary_logged_every_ten(tmp_path, caplog):
    """``_tick`` with the clock given: the first tick writes and logs at once, then a write only
    once 1 s has passed since the last (``flush`` at any time), a log line once 10 s have; the
    file carries the gate's rates (with a gate), the start-up fit (once there is one) and the
    refitted model (allocator on). Catches: the first write or log held back, the intervals'
    comparisons or their sign, the forced write not forced, a section written when its source
    is absent (or a crash on a budget without a gate)."""
    import json
    import logging

    stats = tmp_path / "budget.json"
    b = BatchBudget(SimpleNamespace(max_num_batched_tokens=64), SimpleNamespace(max_model_len=1000), 10,
                    EngineTreeConfig(allocator_gate=True), stats_path=str(stats))
    b.metrics.steps = 3
    lines = lambda: [r.getMessage() for r in caplog.records if "vllm-anisotropic budget:" in r.getMessage()]  # noqa: E731
    with caplog.at_level(logging.INFO, logger="vllm.anisotropic"):
        b._tick(0.5)
        written = json.loads(stats.read_text())
        assert written["steps"] == 3 and len(lines()) == 1
        assert "gate" in written and "cost_model_now" in written and "cost_model_start" not in written
        b.metrics.steps = 4
        b._tick(1.4)
        assert json.loads(stats.read_text())["steps"] == 3  # 0.9 s after the last write
        b._tick(1.5)
        assert json.loads(stats.read_text())["steps"] == 4
        b._tick(10.4)
        assert len(lines()) == 1  # 9.9 s after the last line
        b._tick(10.5)
        assert len(lines()) == 2
        b.metrics.steps = 5
        b.start_coefficients = {"base": 0.01}
        b._last_write = time_now()
        b.flush()
        written = json.loads(stats.read_text())
        assert written["steps"] == 5 and written["cost_model_start"] == {"base": 0.01}
    plain = BatchBudget(SimpleNamespace(max_num_batched_tokens=64), SimpleNamespace(max_model_len=1000), 10,
                        EngineTreeConfig(allocator="off", allocator_gate=False), stats_path=str(stats))
    plain.flush()
    written = json.loads(stats.read_text())
    assert "gate" not in written and "cost_model_now" not in written


def test_the_cut_reads_each_request_s_drafts_caps_and_probabilities(tmp_path):
    """Which requests a cut takes and under which caps. Catches: a request with drafts but no
    offered probabilities cut (or a KeyError), probabilities longer than the drafts vLLM kept
    (the scheduler trims lists) taken as a mismatch, probabilities above 1 not clipped, the
    kept prefix's expected acceptance summed one node too far, the owed tokens off by one in
    the token budget, a budget of one token when the owed tokens fill the step."""
    steep = CostModel.from_coefficients([0.0], base=0.01, tree_row=1.0)
    flat = CostModel.from_coefficients([0.0], base=0.01)
    moderate = CostModel.from_coefficients([0.0], base=0.02, tree_row=0.002)
    # no probabilities offered: left as drafted
    b = _budget(tmp_path, steep, cost_model_online=False, allocator_probe_every=0)
    reqs = [_req("a", 3)]
    b.cut(reqs)
    assert len(reqs[0].spec_token_ids) == 3
    # six probabilities for four drafts: cut on the first four
    reqs = [_req("a", 4)]
    _offer(b, {"a": [0.9] * 6})
    b.cut(reqs)
    assert reqs[0].spec_token_ids == []
    # probabilities clipped to [0, 1]; the kept prefix's expected acceptance
    b = _budget(tmp_path, moderate, cost_model_online=False, allocator_probe_every=0)
    reqs = [_req("a", 4)]
    _offer(b, {"a": [1.7, 0.9, 0.05, 0.01]})
    b.cut(reqs)
    assert len(reqs[0].spec_token_ids) == 2 and b._kept["a"] == pytest.approx(1.9)
    # the token budget: 64 less the tokens owed (a re-runs 49 tokens and its root: 50; b 1)
    b = _budget(tmp_path, flat, cost_model_online=False)
    reqs = [_req("a", 10, num_tokens=150, computed=100), _req("b", 10)]
    _offer(b, {"a": [0.9] * 10, "b": [0.8] * 10})
    b.cut(reqs)
    assert sum(len(r.spec_token_ids) for r in reqs) == 64 - 51
    # owed tokens fill the step: nothing kept
    b = _budget(tmp_path, flat, cost_model_online=False, allocator_probe_every=0)
    reqs = [_req("a", 4, num_tokens=170, computed=100), _req("b", 4)]
    _offer(b, {"a": [0.9] * 4, "b": [0.9] * 4})
    b.cut(reqs)
    assert [r.spec_token_ids for r in reqs] == [[], []]


def test_chains_are_weighed_when_any_request_has_one_with_the_model_in_use(tmp_path):
    """A step where one request's list starts with a chain and another's does not still weighs
    the chains-only cut; the chains' cost follows the model when it is replaced (the start-up
    fit assigns a new one). Catches: chains weighed only when every request has one, the chain
    model kept for the old cost."""
    offer = SimpleNamespace(req_ids=["a", "b"], tree_probs=[[0.9, 0.8, 0.7, 0.6, 0.5], [0.9, 0.6, 0.5]],
                            tree_chains=[2, 0])
    b = _budget(tmp_path, CostModel.from_coefficients([0.0], base=0.01, tree_switch=0.05), cost_model_online=False,
                allocator_probe_every=0)
    reqs = [_req("a", 5), _req("b", 3)]
    b.on_draft_ids(offer)
    b.cut(reqs)
    assert [len(r.spec_token_ids) for r in reqs] == [2, 0]
    b.cost = CostModel.from_coefficients([0.0], base=0.01, slopes=[1.0], tree_switch=0.05)  # every token costs 1 s
    reqs = [_req("a", 5), _req("b", 3)]
    b.on_draft_ids(offer)
    b.cut(reqs)
    assert [len(r.spec_token_ids) for r in reqs] == [0, 0]


def test_the_gate_decides_the_next_step_and_counts_steps_without_drafts(tmp_path):
    """The cut takes the decision made for this step and asks the gate for the next one; a
    gate-plain step where a request decodes without drafts is a step; a chain step keeps
    nothing of a request whose chain it never heard of. Catches: the next decision taken as
    this one's, decoding-only plain steps not counted, an unknown chain taken as one node."""
    from vllm_anisotropic.allocator import CHAIN, PLAIN

    b = _budget(tmp_path, CostModel.from_coefficients([0.0], base=0.01), allocator_gate=True,
                cost_model_online=False, allocator_probe_every=0)
    decisions = [TREE, PLAIN]
    b.gate.decide = lambda n: decisions.pop(0)
    reqs = [_req("a", 2)]
    _offer(b, {"a": [0.9, 0.8]})
    b.cut(reqs)
    assert len(reqs[0].spec_token_ids) == 2 and b.propose_next == PLAIN and b._drafting == TREE
    b = _gated(PLAIN, tmp_path)
    b.cut([_req("a", 0)])  # decoding, no drafts
    assert (b.metrics.steps, b.metrics.gate_plain_steps) == (1, 1)
    b = _gated(CHAIN, tmp_path)
    reqs = [_req("a", 3)]  # drafts without an offer (no chain length known)
    b.cut(reqs)
    assert reqs[0].spec_token_ids == []


def test_the_arm_of_a_step_from_its_requests(tmp_path):
    """``on_scheduled``'s arm: a request that has just finished its prompt decodes; one request
    speculating is the tree arm without a gate's say; a step that also schedules a new request
    or continues a chunked prefill is no arm; a gate-plain step where one of two requests
    re-runs accepted tokens is no arm; drafts that are all chain are no tree rows.
    Catches: the decoding test off by one, ``all`` for ``any`` and back, ``and`` for ``or``,
    one speculating request not enough, a chain-only list counted as one tree row."""
    from vllm_anisotropic.allocator import PLAIN

    b = _gated(TREE, tmp_path)
    reqs = [_req("a", 2, num_tokens=11, computed=10)]  # its prompt is 10 tokens: decoding from now
    _offer(b, {"a": [0.9, 0.8]})
    b.cut(reqs)
    b.on_scheduled(_scheduled({"a": 3}, {"a": reqs[0].spec_token_ids}))
    assert b._step[6] == TREE
    b = _budget(tmp_path, CostModel.from_coefficients([0.0], base=0.01), cost_model_online=False)  # no gate
    reqs = [_req("a", 2), _req("b", 0)]
    _offer(b, {"a": [0.9, 0.8]})
    b.cut(reqs)
    b.on_scheduled(_scheduled({"a": 3, "b": 1}, {"a": reqs[0].spec_token_ids}))
    assert b._step[4] == 1 and b._step[6] == TREE
    b = _gated(TREE, tmp_path)
    b.cut([_req("a", 0)])
    b.on_scheduled(_scheduled({"a": 1}, new=[object()]))
    assert b._step[6] is None
    b = _gated(TREE, tmp_path)
    prefill = _req("p", 0, num_tokens=50, computed=20)
    prefill.num_prompt_tokens = 50  # a chunked prefill goes on
    b.cut([_req("a", 0), prefill])
    b.on_scheduled(_scheduled({"a": 1, "p": 30}))
    assert b._step[6] is None
    b = _gated(PLAIN, tmp_path)
    b.propose_next = PLAIN
    b.cut([_req("a", 0), _req("b", 0, num_tokens=101, computed=99)])  # b re-runs an accepted token
    b.propose_next = PLAIN
    b.on_scheduled(_scheduled({"a": 1, "b": 2}))
    assert b._step[6] is None
    b = _gated(TREE, tmp_path)
    reqs = [_req("a", 3)]
    b.on_draft_ids(SimpleNamespace(req_ids=["a"], tree_probs=[[0.9, 0.8, 0.7]], tree_chains=[3]))
    b.cut(reqs)
    b.on_scheduled(_scheduled({"a": 4}, {"a": reqs[0].spec_token_ids}))
    assert b._step[2] == 0


def _decode_step(b, propose_s=0.0, resume_s=0.0):
    """One decode step of request "a" (two drafts offered) through cut, on_scheduled, on_output."""
    reqs = [_req("a", 2)]
    _offer(b, {"a": [0.9, 0.8]})
    b.cut(reqs)
    out = _scheduled({"a": 1 + len(reqs[0].spec_token_ids)}, {"a": reqs[0].spec_token_ids})
    b.on_scheduled(out)
    b.on_output(out, SimpleNamespace(sampled_token_ids=[[1, 2]], req_id_to_index={"a": 0}, tree_propose_s=propose_s,
                                     tree_resume_s=resume_s))


def test_proposing_time_is_charged_to_the_step_that_verifies_it(tmp_path):
    """The workers' seconds proposing step t + 1's drafts (reported with step t's output) are
    added to what the gate observes of step t + 1, also when step t scheduled nothing.
    Catches: the carried time subtracted, or dropped when it arrives on an empty step."""
    b = _gated(TREE, tmp_path)
    seen = []
    b.gate.observe = lambda *args: seen.append(args)
    _decode_step(b, propose_s=0.3)
    _decode_step(b)
    assert seen[1][3] >= 0.3
    b = _gated(TREE, tmp_path)
    b.gate.observe = lambda *args: seen.append(args)
    b.on_scheduled(SimpleNamespace(num_scheduled_tokens={}))  # an empty step
    b.on_output(SimpleNamespace(num_scheduled_tokens={}, scheduled_spec_decode_tokens={}),
                SimpleNamespace(sampled_token_ids=[], req_id_to_index={}, tree_propose_s=0.2))
    _decode_step(b)
    assert seen[-1][3] >= 0.2


def test_the_draft_models_resume_is_charged_to_neither_arm(tmp_path):
    """Of the proposing time carried to the next step, the draft model's catch-up of tokens decoded
    without it (``tree_resume_s``: a new prompt, a plain block) is prompt work: the gate sees the
    rest, after a decode step and after a step that scheduled nothing. Catches: the resume left
    in, subtracted from the wrong step, or dropped on the empty-step path."""
    b = _gated(TREE, tmp_path)
    seen = []
    b.gate.observe = lambda *args: seen.append(args)
    _decode_step(b, propose_s=0.3, resume_s=0.25)
    _decode_step(b)
    assert len(seen) == 2 and 0.05 <= seen[1][3] < 0.2 and b.metrics.draft_resume_seconds == 0.25  # a metric
    b = _gated(TREE, tmp_path)
    b.gate.observe = lambda *args: seen.append(args)
    b.on_scheduled(SimpleNamespace(num_scheduled_tokens={}))
    b.on_output(SimpleNamespace(num_scheduled_tokens={}, scheduled_spec_decode_tokens={}),
                SimpleNamespace(sampled_token_ids=[], req_id_to_index={}, tree_propose_s=0.3, tree_resume_s=0.25))
    _decode_step(b)
    assert len(seen) == 3 and 0.05 <= seen[-1][3] < 0.2


def test_measured_steps_are_scored_in_batches_of_64(tmp_path):
    """Cost-model errors are computed 64 steps at a time (one vectorised predict), over the five
    step columns. Catches: scoring every step, at 65, or never; the speculating-request column
    left out of the prediction."""
    from vllm_anisotropic.integration.vllm.engine.budget import SCORE_BATCH

    b = _budget(tmp_path, CostModel.from_coefficients([0.0], base=0.01))
    # plain steps: nothing allocated, so nothing refitted; no step counted, so no log line
    for _ in range(SCORE_BATCH - 1):
        _plain_step(b)
    assert b.metrics.cost_samples == 0
    _plain_step(b)
    assert b.metrics.cost_samples == SCORE_BATCH
    cost = CostModel.from_coefficients([0.0], base=0.01, spec_request=0.01)
    b = _budget(tmp_path, cost)
    b._unscored = [(1, 4, 0, 0, 1, 0.05)]  # one request speculating with chain rows only: D = 1, min(R, T) = 0
    b._score()
    assert b.metrics.cost_abs_rel_err == pytest.approx(abs(cost.predict(1, 4, 0, 0, 1) - 0.05) / 0.05)
    assert cost.predict(1, 4, 0, 0, 1) != cost.predict(1, 4, 0, 0)


def test_outputs_without_a_row_for_a_scheduled_request_are_read_safely(tmp_path):
    """A scheduled request missing from the output's index, or indexed past its sampled rows,
    counts no tokens and no acceptance (no exception). Catches: ``and`` for ``or`` in those
    guards, their bounds off by one."""
    b = _gated(TREE, tmp_path)
    seen = []
    b.gate.observe = lambda *args: seen.append(args)
    reqs = [_req("a", 2), _req("b", 2), _req("c", 2)]
    _offer(b, {"a": [0.9, 0.8], "b": [0.9, 0.8], "c": [0.9, 0.8]})
    b.cut(reqs)
    spec = {r.request_id: r.spec_token_ids for r in reqs}
    out = _scheduled({"a": 3, "b": 3, "c": 3}, spec)
    b.on_scheduled(out)
    b.on_output(out, SimpleNamespace(sampled_token_ids=[[1, 2]], req_id_to_index={"a": 0, "b": 1}))
    assert seen[0][2] == 2  # a's two tokens; b indexed past the rows, c not indexed
    assert b.metrics.realized_accepted == 1 and b.metrics.predicted_accepted == pytest.approx(1.7)


def test_tokens_owed_enter_the_step_s_fixed_cost(tmp_path):
    """The step's fixed query tokens are the tokens owed (here 31: a re-run of 29 accepted tokens
    and two roots), not the number of requests: at 1 ms a query token the step already costs
    ~41 ms, so nodes of probability 0.4-0.6 at 5 ms each raise its rate; priced as a 12 ms step
    of two roots they would not. Catches: ``min`` for ``max`` of owed and requests."""
    cost = CostModel.from_coefficients([0.0], base=0.01, slopes=[1e-3], tree_row=0.004)
    b = _budget(tmp_path, cost, cost_model_online=False, allocator_probe_every=0)
    reqs = [_req("a", 0, num_tokens=130, computed=100), _req("b", 3)]
    _offer(b, {"b": [0.6, 0.5, 0.4]})
    b.cut(reqs)
    assert len(reqs[1].spec_token_ids) >= 2
    b = _budget(tmp_path, cost, cost_model_online=False, allocator_probe_every=0)
    reqs = [_req("a", 0), _req("b", 3)]  # two roots owed: the same nodes do not pay
    _offer(b, {"b": [0.6, 0.5, 0.4]})
    b.cut(reqs)
    assert reqs[1].spec_token_ids == []


def test_the_repay_ratio_is_the_gates_saving_a_token_over_a_caught_up_tokens_seconds(tmp_path):
    """``repay_next`` (sent as ``tree_repay``): the gate's seconds saved an output token at the
    batch size over the draft model's seconds a caught-up token (``tree_catchup``, the later
    measures weighing most); none before any catch-up is measured, while the gate gives no
    saving, or when the next step is plain; at the batch ahead (``cut``'s ``ahead``: running and
    waiting requests) where the scheduler gives it. Catches: the ratio inverted, the catch-up
    seconds and tokens swapped, a ratio sent for a plain step or kept from an earlier step, the
    batch ahead ignored."""
    from vllm_anisotropic.allocator import PLAIN
    from vllm_anisotropic.integration.vllm.engine.budget import CATCHUP_DECAY

    b = _gated(TREE, tmp_path)
    b.gate.decide = lambda n: TREE
    b.gate.token_saving_s = lambda n: 0.1 if n == 1 else None
    _decode_step(b)
    assert b.repay_next is None  # no catch-up measured yet
    b.on_output(SimpleNamespace(num_scheduled_tokens={}, scheduled_spec_decode_tokens={}),
                SimpleNamespace(sampled_token_ids=[], req_id_to_index={}, tree_catchup=(0.4, 100, 0)))
    _decode_step(b)
    assert b.repay_next == pytest.approx(0.1 / 0.004)  # 25 caught-up tokens a remaining token
    b.on_output(SimpleNamespace(num_scheduled_tokens={}, scheduled_spec_decode_tokens={}),
                SimpleNamespace(sampled_token_ids=[], req_id_to_index={}, tree_catchup=(0.2, 100, 0)))
    _decode_step(b)
    s, t = CATCHUP_DECAY * 0.4 + 0.2, CATCHUP_DECAY * 100 + 100
    assert b.repay_next == pytest.approx(0.1 * t / s)
    b.cut([_req("a", 2), _req("b", 2)])  # two requests: no saving known there
    assert b.repay_next is None
    b.cut([])  # an empty batch: a prompt about to be admitted decodes alone
    assert b.repay_next == pytest.approx(0.1 * t / s)
    b.cut([], 2)  # ... unless another waits with it: priced at the batch ahead
    assert b.repay_next is None
    b.cut([_req("a", 2)], 1)
    assert b.repay_next == pytest.approx(0.1 * t / s)
    b.gate.decide = lambda n: PLAIN
    b.cut([_req("a", 2)])
    assert b.propose_next == PLAIN and b.repay_next is None


def test_a_step_whose_requests_the_repay_rule_left_without_drafts_is_no_arms(tmp_path):
    """A step the gate let draft in which no draft was verified and the workers reported requests
    left plain by the repay rule (``tree_catchup``'s third number, with the proposals for that
    step) measures no speculation: neither arm; the next such step without refusals is the
    speculative arm's as before; the refusals are counted. Catches: the refused step observed
    as speculative (its plain speed would pull the speculative rate down and close the gate), the
    refusal carried to later steps, the count dropped."""
    b = _gated(TREE, tmp_path)
    b.gate.decide = lambda n: TREE
    seen = []
    b.gate.observe = lambda *args: seen.append(args)

    def step(catchup=None):
        reqs = [_req("a", 0)]
        b.cut(reqs)
        out = _scheduled({"a": 1}, {})
        b.on_scheduled(out)
        b.on_output(out, SimpleNamespace(sampled_token_ids=[[1]], req_id_to_index={"a": 0},
                                         **({"tree_catchup": catchup} if catchup else {})))

    step((0.0, 0, 1))  # its output carries the next step's proposals: one request refused
    assert len(seen) == 1 and b.metrics.draft_unrepaid_catchups == 1
    step()
    assert len(seen) == 1  # the refused step: no arm
    step()
    assert len(seen) == 2 and seen[-1][1] == TREE
