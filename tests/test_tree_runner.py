"""``TreeRunnerMixin`` (integration/vllm/engine/runner.py) without an engine: the mixin on a
recording stand-in for vLLM's model runner (what the mixin calls through ``super()``), with a
real ``TreeDrafter`` whose proposer's trees are given (``test_tree_drafter._stubbed``).

One batch for the step methods: row 0 request "a" with the tree ``r -> 11 -> 12`` plus the
branch ``r -> 13`` (3 drafts) after one re-run token (query rows 0-4, positions 20-24), row 1
"b" without drafts (row 5, position 30), row 2 "c" with the chain ``r -> 41 -> 42`` (rows 6-8,
positions 40-42). The engine tests (test_engine_*.py) run the same methods inside vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from random_trees import random_trees
from test_tree_drafter import V, _chain, _stubbed, _tokens
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

from vllm_anisotropic.allocator import CHAIN, PLAIN, TREE
from vllm_anisotropic.integration.vllm.engine import runner as runner_module
from vllm_anisotropic.integration.vllm.engine.runner import (
    TreeCPUModelRunner, TreePlan, TreeRunnerMixin, request_law)
from vllm_anisotropic.tree import DraftTree, FlatTrees


class _VllmRunner:
    """What the mixin reaches through ``super()``: records its calls, returns what a test set."""

    def _update_states(self, scheduler_output):
        self.calls.append(("update", sorted(self.drafter.states)))
        self.input_batch.num_reqs = self.after_update_reqs
        return "vllm-update"

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        self.calls.append(("prepare", self.speculative_config))
        # vLLM's positions: contiguous from each request's computed tokens
        qsl = self.query_start_loc.np
        for i in range(self.input_batch.num_reqs):
            start = int(self.input_batch.num_computed_tokens_cpu[i])
            self.positions[qsl[i]:qsl[i + 1]] = torch.arange(start, start + int(num_scheduled_tokens[i]))
        return "logits-indices", self.spec_metadata, 3

    def _build_attention_metadata(self, *args, **kwargs):
        return self.attn_metadata, "common"

    def _sample(self, logits, spec_decode_metadata):
        return "sampled"

    def take_draft_token_ids(self):
        return self.draft_ids

    def sample_tokens(self, grammar_output):
        return self.output


class _Runner(TreeRunnerMixin, _VllmRunner):
    pass


def _make(drafter, requests=None, **overrides) -> _Runner:
    r = object.__new__(_Runner)
    tokens, lengths = _tokens([21, 31, 41], shift=(0, 0, 0))
    r.drafter, r.calls = drafter, []
    r.input_batch = SimpleNamespace(
        req_ids=["a", "b", "c"], num_reqs=3, req_id_to_index={"a": 0, "b": 1, "c": 2}, token_ids_cpu=tokens,
        num_tokens_no_spec=lengths, num_computed_tokens_cpu=np.array([20, 30, 40], np.int32))
    r.after_update_reqs = 3
    r.query_start_loc = SimpleNamespace(np=np.array([0, 5, 6, 9], np.int32))
    r.positions = torch.zeros(9, dtype=torch.int64)
    r.speculative_config = "spec-config"
    r.spec_metadata = SimpleNamespace(num_draft_tokens=[3, 0, 2])
    r.requests = {k: SimpleNamespace(sampling_params=sp) for k, sp in (requests or {
        "a": SamplingParams(temperature=0.0), "b": SamplingParams(temperature=0.0),
        "c": SamplingParams(temperature=0.0)}).items()}
    r.model_config = SimpleNamespace(seed=5)
    r._sampling_trees, r._logprobs_trees, r._sampled_grammar_trees, r._draft_model = True, True, True, False
    r._tree_step, r._tree_plan, r._kv_mover = None, None, None
    r._eligible_cache, r._structured, r.row_edits, r._propose_s, r._resume_s = {}, set(), {}, 0.0, 0.0
    r._catchup, r.max_model_len = (0.0, 0, 0), 100
    for k, v in overrides.items():
        setattr(r, k, v)
    return r


def _trees_by_length(n):
    """The stub proposer's tree for a context of ``n`` tokens: a's (21) branchy, c's (41) a chain."""
    if n == 21:
        return DraftTree([21, 11, 12, 13], [-1, 0, 1, 0])
    return _chain(n % V, 2)


def _proposed(**options):
    d = _stubbed(_trees_by_length, allocator="off", **options)
    tokens, lengths = _tokens([21, 31, 41], shift=(0, 0, 0))
    d.propose_trees(["a", "b", "c"], [True, False, True], [[1]] * 3, lengths, tokens)
    return d


def test_prepare_inputs_places_tree_rows_and_plans_the_trees_that_are_not_chains():
    r = _make(_proposed())
    so = SimpleNamespace(scheduled_spec_decode_tokens={"a": [11, 12, 13], "c": [42, 43]})
    out = r._prepare_inputs(so, np.array([5, 1, 3]))
    assert out == ("logits-indices", r.spec_metadata, 3) and r.calls == [("prepare", "spec-config")]
    # a: root at row 1 (position 21), nodes at rows 2-4 of depths 1, 2, 1; b, c unchanged
    assert r.positions.tolist() == [20, 21, 22, 23, 22, 30, 40, 41, 42]
    step = r.take_tree_step()
    assert step.req_ids == ["a", "c"] and step.node_rows.tolist() == [2, 7] and step.root_positions.tolist() == [21, 40]
    assert r.take_tree_step() is None  # taken once
    plan = r._tree_plan
    assert plan.req_index == [0] and plan.query_end == [5] and plan.seq_lens == [25]
    assert plan.chain_prefix.tolist() == [2] and plan.trees.tokens.tolist() == [21, 11, 12, 13]
    assert plan.clock is r.host_clock and 0 < r.host_clock.seconds["prepare"] < 5.0


def test_prepare_inputs_reads_only_the_batchs_rows():
    """vLLM's ``req_ids`` may run past ``num_reqs`` (a removed request's slot): its pending
    tree is not this step's."""
    r = _make(_proposed())
    r.input_batch.req_ids = ["a", "b", "c", "d"]
    d = r.drafter
    tokens, lengths = _tokens([21, 31, 41, 21], shift=(0, 0, 0, 0))
    d.propose_trees(["d"], [True], [[1]], lengths[3:], tokens[3:])
    r._prepare_inputs(SimpleNamespace(scheduled_spec_decode_tokens={"a": [11, 12, 13], "c": [42, 43]}),
                      np.array([5, 1, 3]))
    assert r.take_tree_step().req_ids == ["a", "c"] and "d" in d.pending


def test_prepare_inputs_without_drafts_takes_plain_decodings_path():
    r = _make(_proposed())
    r.spec_metadata, r.query_start_loc.np = None, np.array([0, 1, 2, 3], np.int32)
    out = r._prepare_inputs(SimpleNamespace(scheduled_spec_decode_tokens={}), np.array([1, 1, 1]))
    # vLLM's plain branch: no speculative config while it prepares, restored after
    assert r.calls == [("prepare", None)] and r.speculative_config == "spec-config"
    assert out[1] is None and r._tree_plan is None
    step = r.take_tree_step()  # root-only trees: their root rows are harvested
    assert step.trees.sizes().tolist() == [1, 1] and step.node_rows.tolist() == [1, 3]  # after each root row
    assert r.positions.tolist()[:3] == [20, 30, 40] and step.root_positions.tolist() == [20, 40]
    # drafts scheduled but all cut to none: vLLM's metadata dropped, plain decoding's sampler path
    r = _make(_proposed())
    r.spec_metadata, r.query_start_loc.np = SimpleNamespace(num_draft_tokens=[0, 0, 0]), np.array([0, 1, 2, 3], np.int32)
    assert r._prepare_inputs(SimpleNamespace(scheduled_spec_decode_tokens={"a": []}), np.array([1, 1, 1]))[1] is None
    # a chain alone: positions are vLLM's, no plan
    r = _make(_proposed())
    r._prepare_inputs(SimpleNamespace(scheduled_spec_decode_tokens={"a": [11, 12], "c": [42]}), np.array([5, 1, 3]))
    assert r._tree_plan is None and r.positions.tolist() == [20, 21, 22, 23, 24, 30, 40, 41, 42]
    assert r.take_tree_step().node_rows.tolist() == [3, 8]  # a: two re-run tokens before its root now


def test_every_layer_of_every_group_gets_the_steps_plan_once():
    r = _make(_proposed())
    plan = TreePlan([0], FlatTrees.from_trees([DraftTree([1, 2, 3], [-1, 0, 0])]))
    groups = [{"l0": SimpleNamespace(), "l1": SimpleNamespace()}, {"l2": SimpleNamespace()}]
    r.attn_metadata, r._tree_plan = groups, plan
    converted = []
    r._attention_plan = lambda p: converted.append(p) or ("device", p)
    assert r._build_attention_metadata() == (groups, "common")
    assert all(md.tree_plan == ("device", plan) for g in groups for md in g.values()) and converted == [plan]
    assert r._tree_plan is None
    assert TreeRunnerMixin._attention_plan(r, plan) is plan  # the CPU attention reads the plan itself
    one = {"l0": SimpleNamespace()}
    r.attn_metadata = one  # one group: a dict
    r._build_attention_metadata()
    assert one["l0"].tree_plan is None and converted == [plan]  # no plan this step


def test_eligibility_is_computed_once_counted_by_reason_and_registers_edits():
    requests = {
        "a": SamplingParams(temperature=0.0, logit_bias={3: 1.5}),
        "b": SamplingParams(temperature=0.8, seed=1),
        "c": SamplingParams(temperature=0.0, logprobs=2),
        "d": SamplingParams(temperature=0.0, extra_args={"trees": False}),
    }
    from vllm.sampling_params import StructuredOutputsParams

    requests["e"] = SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    r = _make(_proposed(), requests, _sampling_trees=False, _logprobs_trees=False)
    assert [r._eligible(k) for k in "abcde"] == [True, False, False, False, True]
    assert [r._eligible(k) for k in "abcde"] == [True, False, False, False, True]
    assert r.drafter.metrics.without_trees == {"sampled": 1, "logprobs": 1, "request_opt_out": 1}
    assert set(r.row_edits) == {"a"} and r.row_edits["a"].bias_tokens.tolist() == [3]
    assert r._structured == {"e"} and r._eligible_cache == dict(zip("abcde", [True, False, False, False, True]))


def test_propose_rests_chains_or_trees_as_the_gate_says_and_contains_a_failure():
    r = _make(_stubbed(_trees_by_length, allocator="off"))
    r.requests["d"] = SimpleNamespace(sampling_params=SamplingParams(temperature=0.8))
    sampled = [[1], [1], [1]]
    drafts = r.propose_draft_token_ids(SimpleNamespace(tree_propose=TREE), sampled)
    assert drafts == [[11, 12, 13], [31 % V + 1, 31 % V + 2], [41 % V + 1, 41 % V + 2]]
    assert 0 < r._propose_s < 5.0 and "propose" in r.host_clock.seconds
    r.drafter.proposer.take_resume_seconds = lambda: 0.125  # the draft model's catch-up, carried
    r.drafter.proposer.take_catchup = lambda: (0.5, 128, 1)  # and its catch-up account, summed
    r.propose_draft_token_ids(SimpleNamespace(tree_propose=TREE), sampled)
    r.propose_draft_token_ids(SimpleNamespace(tree_propose=TREE), sampled)
    assert r._resume_s == 0.25 and r._catchup == (1.0, 256, 2)
    assert r.propose_draft_token_ids(SimpleNamespace(tree_propose=PLAIN), sampled) == [[], [], []]
    assert r.drafter.pending == {}  # rested: no pending tree
    chains = r.propose_draft_token_ids(SimpleNamespace(tree_propose=CHAIN), sampled)
    assert all(r.drafter.pending[k][0].chains for k in "abc") and len(chains[0]) == r.drafter.chain_drafts
    assert r.propose_draft_token_ids(SimpleNamespace(), sampled)[0] == [11, 12, 13]  # no decision: trees
    r.drafter.disabled.add("b")
    r.drafter.proposer.make = lambda n: 1 / 0
    before = r._propose_s
    r.input_batch.req_ids = ["a", "b", "c", "d"]  # d samples without trees (no sampling verifier here)
    r._sampling_trees = False
    assert r.propose_draft_token_ids(SimpleNamespace(tree_propose=TREE), sampled + [[1]]) == [[], [], [], []]
    assert r.drafter.disabled == {"a", "b", "c"} and r.drafter.metrics.faults == {"propose": 1}
    assert r.drafter.metrics.disabled_requests == 2 and before < r._propose_s < 5.0


def test_a_draft_models_proposal_gets_the_repay_ratio_and_each_requests_remaining_tokens():
    """With the scheduler's ``tree_repay`` a draft model's drafter gets the ratio and, per batch
    row, the tokens the request may still emit: its ``max_tokens`` less its outputs, at most the
    model length less its tokens; without a ratio, or for GOOSE, neither. Catches: the outputs
    not subtracted, the model length's bound dropped or taken from the prompt, the ratio not
    passed on."""
    requests = {"a": SamplingParams(temperature=0.0, max_tokens=30), "b": SamplingParams(temperature=0.0, max_tokens=95),
                "c": SamplingParams(temperature=0.0, max_tokens=16)}
    r = _make(_stubbed(_trees_by_length, allocator="off"), requests, _draft_model=True)
    for k, n in zip("abc", (4, 10, 16)):
        r.requests[k].output_token_ids = [7] * n
    seen = []
    r.drafter.propose_trees = lambda *a, **k: seen.append(k) or [[], [], []]
    r.propose_draft_token_ids(SimpleNamespace(tree_propose=TREE, tree_repay=12.5), [[1], [1], [1]])
    assert seen[-1]["repay"] == 12.5 and seen[-1]["remaining"] == [26, 69, 0]  # b: 100 - 31 tokens
    r.propose_draft_token_ids(SimpleNamespace(tree_propose=TREE), [[1], [1], [1]])
    assert seen[-1]["repay"] is None and seen[-1]["remaining"] is None
    r._draft_model = False
    r.propose_draft_token_ids(SimpleNamespace(tree_propose=TREE, tree_repay=12.5), [[1], [1], [1]])
    assert seen[-1]["remaining"] is None


def test_draft_model_requests_get_their_law_when_their_state_is_made():
    requests = {"a": SamplingParams(temperature=0.7, top_k=5, seed=9), "b": SamplingParams(temperature=0.0),
                "c": SamplingParams(temperature=0.9, top_p=0.5)}
    r = _make(_stubbed(_trees_by_length, allocator="off"), requests, _draft_model=True)
    r.drafter.states["b"] = r.drafter.proposer.new_request()  # b has its state already
    r.propose_draft_token_ids(SimpleNamespace(tree_propose=TREE), [[1], [1], [1]])
    assert r.drafter.states["a"].law == request_law("a", requests["a"], 5)
    assert r.drafter.states["c"].law == request_law("c", requests["c"], 5)
    assert r.drafter.states["b"].law is None
    law, _ = r.drafter.states["a"].law
    assert (law.temperature, law.top_k) == (pytest.approx(0.7), 5)
    seen = []
    r.drafter.propose_trees = lambda *a, **k: seen.append(a[5]) or [[], [], []]
    r.propose_draft_token_ids(SimpleNamespace(tree_propose=TREE), [[1], [1], [1]])
    assert seen == [None]  # every request has its state: no laws computed


def test_update_states_runs_the_deferred_work_first_then_the_requests_news():
    d = _proposed()
    r = _make(d)
    order = []
    d._deferred.append(("harvest", [], lambda: order.append(("deferred", sorted(d.states)))))
    dropped, trees_dropped, ticks = [], [], []
    real_drop = d.drop
    d.drop = lambda req_id, context=None: dropped.append((req_id, None if context is None else context.tolist())) \
        or real_drop(req_id, context)
    d.drop_tree = lambda req_id: trees_dropped.append(req_id)
    d.sink.tick = lambda force=False: ticks.append(force)
    r._eligible_cache = {"a": True, "c": True}
    r.row_edits = {"a": "edits"}
    r._structured = {"a", "c"}
    r.requests = {"a": None, "c": None}
    so = SimpleNamespace(finished_req_ids={"c", "a", "zz"}, preempted_req_ids={"b"}, tree_kept={"c": [2]},
                         tree_faults=[("allocator", ["a", "gone"])], tree_tenants={"b": "tenant-1"})
    assert r._update_states(so) == "vllm-update"
    assert order == [("deferred", ["a", "c"])]  # before any drop
    tokens = r.input_batch.token_ids_cpu
    assert dropped == [("a", tokens[0, :21].tolist()), ("c", tokens[2, :41].tolist()), ("zz", None)]
    assert trees_dropped == ["b"] and d.reorders == {"c": [2]} and d.tenants == {"b": "tenant-1"}
    assert r._eligible_cache == {} and r.row_edits == {} and r._structured == set()
    assert d.disabled == {"a"} and d.metrics.faults == {"allocator": 1}  # "gone" is no request of the runner
    assert r.calls == [("update", [])] and 0 < r.host_clock.seconds["states"] < 5.0
    assert ticks[-1] is not True  # requests left in the batch: no forced stats write
    r.after_update_reqs = 0
    r._update_states(SimpleNamespace(finished_req_ids={"b"}))
    assert ticks[-1] is True  # the batch drained: the stats file is written now
    n = len(ticks)
    r._update_states(SimpleNamespace(finished_req_ids=set()))
    assert len(ticks) == n  # nothing finished: no write


def test_context_is_the_requests_tokens_while_it_has_a_row():
    r = _make(_proposed())
    assert r._context("c").tolist() == r.input_batch.token_ids_cpu[2, :41].tolist()
    assert r._context("zz") is None


def test_after_reply_runs_the_deferred_work():
    r = _make(_proposed())
    ran = []
    r.drafter._deferred.append(("label", [], lambda: ran.append(1)))
    r.after_reply()
    assert ran == [1] and r.drafter._deferred == []


def test_a_step_without_drafts_harvests_its_root_rows(monkeypatch):
    r = _make(_proposed())
    seen = []
    monkeypatch.setattr(runner_module, "harvest_plain", lambda runner, logits: seen.append((runner, logits)))
    logits = torch.zeros(3, V)
    assert r._sample(logits, None) == "sampled" and seen == [(r, logits)]
    r._sample(logits, "spec-metadata")
    r._sample(None, None)
    assert len(seen) == 1


def test_the_reply_carries_the_allocators_inputs_and_the_grammar_trees_parents():
    d = _stubbed(_trees_by_length)  # allocator on
    tokens, lengths = _tokens([21, 31, 41], shift=(0, 0, 0))
    d.propose_trees(["a", "b", "c"], [True, False, True], [[1]] * 3, lengths, tokens)
    r = _make(d, draft_ids=SimpleNamespace(req_ids=["a", "b", "c"]))
    r._structured = {"c", "zz"}
    out = r.take_draft_token_ids()
    assert [None if p is None else len(p) for p in out.tree_probs] == [3, None, 2]
    assert out.tree_chains == [2, 0, 2] and out.tree_parents == {"c": [0, 1]}
    assert 0 < r.host_clock.seconds["reply"] < 5.0
    off = _make(_proposed(), draft_ids=SimpleNamespace(req_ids=["a"]))
    out = off.take_draft_token_ids()
    assert not hasattr(out, "tree_probs") and not hasattr(out, "tree_parents")
    r.draft_ids = None
    assert r.take_draft_token_ids() is None


def test_sample_tokens_sends_calibration_once_the_drafting_time_and_the_next_drafts():
    out = SimpleNamespace(sampled_token_ids=[[1]])
    r = _make(_proposed(), output=out, draft_ids=SimpleNamespace(req_ids=["a"]))
    r._cost_calibration = [(1, 1, 0, 0, 0, 0.01)]
    r._propose_s, r._resume_s, r._catchup = 0.25, 0.125, (0.5, 128, 3)
    assert r.sample_tokens(None) is out
    assert out.cost_calibration == [(1, 1, 0, 0, 0, 0.01)] and out.tree_propose_s == 0.25
    assert out.tree_resume_s == 0.125 and r._resume_s == 0.0
    assert out.tree_catchup == (0.5, 128, 3) and r._catchup == (0.0, 0, 0)
    assert out.tree_drafts is r.draft_ids and r._cost_calibration is None and r._propose_s == 0.0
    again = SimpleNamespace(sampled_token_ids=[[2]])
    r.output = again
    r.sample_tokens(None)
    assert not any(hasattr(again, k) for k in ("cost_calibration", "tree_propose_s", "tree_resume_s", "tree_catchup"))
    # vLLM's shared empty output is never written to (its drafts stay for vLLM's own RPC)
    r.output, r._propose_s, r._cost_calibration = EMPTY_MODEL_RUNNER_OUTPUT, 0.5, [(1,)]
    assert r.sample_tokens(None) is EMPTY_MODEL_RUNNER_OUTPUT
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, "tree_drafts") and r._cost_calibration == [(1,)]
    assert r._propose_s == 0.0  # spent: charged to no step


def test_move_kv_moves_through_the_slot_mapping_and_follows_a_new_cache():
    r = _make(_proposed())
    block_size, hs = 4, 8
    cache = torch.randn(3, 2, block_size, 2 * hs)
    layers = {"l0": SimpleNamespace(kv_cache=cache), "skip": SimpleNamespace(kv_cache=None)}
    r.compilation_config = SimpleNamespace(static_forward_context=layers)
    # query row q sits in slot slots[q]
    slots = torch.tensor([0, 1, 2, 5, 6, 9, 10, 11], dtype=torch.int32)
    r.input_batch.block_table = [SimpleNamespace(slot_mapping=SimpleNamespace(gpu=slots))]
    before = cache.clone()
    r.move_kv(np.array([4, 6]), np.array([3, 5]))  # rows 4, 6 (slots 6, 10) -> rows 3, 5 (slots 5, 9)

    def at(x, s):
        return x[s // block_size, :, s % block_size]

    assert torch.equal(at(cache, 5), at(before, 6)) and torch.equal(at(cache, 9), at(before, 10))
    changed = [s for s in range(12) if not torch.equal(at(cache, s), at(before, s))]
    assert changed == [5, 9]
    mover = r._kv_mover
    r.move_kv(np.array([1]), np.array([0]))
    assert r._kv_mover is mover and torch.equal(at(cache, 0), at(before, 1))
    layers["l0"] = SimpleNamespace(kv_cache=torch.zeros_like(cache))  # vLLM reallocated the cache
    layers["l0"].kv_cache[1, :, 2] = 7.0  # slot 6
    r.move_kv(np.array([4]), np.array([0]))
    assert r._kv_mover is not mover and bool((layers["l0"].kv_cache[0, :, 0] == 7.0).all())
    r.compilation_config = SimpleNamespace(static_forward_context={"x": SimpleNamespace(kv_cache=torch.zeros(2, 2))})
    assert r._first_cache_ptr() == -1


def test_warm_up_kv_moves_builds_the_mover_and_changes_no_cache():
    """At the worker's start: the mover of the model's caches is built and its compiled kernel
    run once (slot 0 onto itself), so the first step that moves loads nothing; no cache changes."""
    r = _make(_proposed())
    caches = [torch.randn(3, 2, 4, 16), torch.randn(3, 2, 4, 16).to(torch.bfloat16)]
    r.compilation_config = SimpleNamespace(static_forward_context={
        f"l{i}": SimpleNamespace(kv_cache=c) for i, c in enumerate(caches)})
    before = [c.clone() for c in caches]
    r.warm_up_kv_moves()
    assert r._kv_mover is not None and len(r._kv_mover._host_groups) == 2
    assert all(torch.equal(a, b) for a, b in zip(caches, before))


def test_the_tree_drafter_always_fits():
    r = _make(_proposed())
    assert r._input_fits_in_drafter(SimpleNamespace()) and not r._input_fits_in_drafter(None)


class _Clock:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


def test_calibration_times_each_query_size_after_a_warm_up_run(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(runner_module, "time", clock)
    runs = []

    def dummy_run(q):
        runs.append(q)
        k = sum(1 for x in runs if x == q)  # 1: the warm-up run of this shape
        clock.now += 1.0 if k == 1 else q * (1e-3, 3e-3, 2e-3)[k - 2]

    r = _make(_proposed(), _dummy_run=dummy_run, device=SimpleNamespace(type="cpu"),
              scheduler_config=SimpleNamespace(max_num_batched_tokens=16, max_num_seqs=4))
    tree = (9, 9, 9, 9, 9, 9.0)
    r._tree_cost_samples = lambda forwards, repeats: [tree] if len(forwards) == 5 and repeats == 3 else []
    samples = r.calibrate_step_cost(sizes=(1, 4, 2, 8, 64, 16, 32), repeats=3)
    assert runs == [q for q in (1, 2, 4, 8, 16) for _ in range(4)]
    want = [(min(q, 4), q, 0, 0, 0, q * 2e-3) for q in (1, 2, 4, 8, 16)] + [tree]  # the median of 1, 3, 2
    assert len(samples) == 6 and samples[-1] == tree
    for got, w in zip(samples[:-1], want):
        assert got[:5] == w[:5] and got[5] == pytest.approx(w[5])
    assert r._cost_calibration is samples and TreeRunnerMixin._tree_cost_samples(r, [], 3) == []


def test_cpu_tree_cost_samples_time_star_trees_on_every_tree_attention_layer(monkeypatch):
    """Each shape that fits the cache: ``(Rt, Rt + Rt n, Rt n, Rt n ctx, Rt, forward + tree
    rows)``, the tree rows timed over every tree-attention layer after a warm-up repeat, on
    metadata of Rt requests of ``ctx + n`` tokens over their own blocks; shapes needing more
    blocks than the cache has are left out."""
    from test_cpu_attention import _impl

    clock = _Clock()
    monkeypatch.setattr(runner_module, "time", clock)
    block_size, blocks = 32, 36
    calls = []

    def layer():
        impl = _impl(4, 2, 8)

        def tree_rows(lay, query, key, value, cache, md, plan, output):
            rt = md.seq_lens.numel()
            n = plan.trees.sizes()[0] - 1
            calls.append((rt, n, int(md.seq_lens[0]), query.shape, md.query_start_loc.tolist(), md.block_table.shape,
                          plan.chain_prefix.tolist(), cache is lay.kv_cache, plan.trees.parents[1:].max()))
            k = (sum(1 for c in calls if c[:3] == calls[-1][:3]) - 1) // 2  # the repeat (2 layers each)
            clock.now += (0.5, 0.004, 0.016)[k]  # the warm-up, then 0.008 and 0.032 over both layers

        impl.tree_rows = tree_rows
        return SimpleNamespace(impl=impl, isa="vec", kv_cache=torch.zeros(blocks, 2, block_size, 16))

    r = object.__new__(TreeCPUModelRunner)
    r.model_config = SimpleNamespace(dtype=torch.float32)
    r.compilation_config = SimpleNamespace(static_forward_context={
        "l0": layer(), "l1": layer(), "other": SimpleNamespace(impl=object(), isa="vec", kv_cache=torch.zeros(1, 1, 1, 2)),
        "no-cache": SimpleNamespace(impl=_impl(4, 2, 8), isa="vec", kv_cache=None)})
    forwards = [(1, 1, 0, 0, 0, 0.001), (4, 64, 0, 0, 0, 0.009)]
    samples = r._tree_cost_samples(forwards, repeats=2)
    # (4, 16, 512) and (8, 8, 512) need 68 and 136 blocks of 36; (4, 4, 256) exactly 36
    shapes = [(1, 4, 256), (1, 16, 256), (1, 16, 1024), (2, 8, 512), (4, 4, 256)]
    assert len(samples) == len(shapes) and len(calls) == len(shapes) * 3 * 2
    for (rt, n, ctx), got in zip(shapes, samples):
        q = rt + rt * n
        assert got[:5] == (rt, q, rt * n, rt * n * ctx, rt)
        assert got[5] == pytest.approx(float(np.interp(q, [1, 64], [0.001, 0.009])) + 0.02)
    rt, n, seq, qshape, qsl, table, chain, same, parent = calls[-1]
    per = -(-(256 + 4) // block_size)
    assert (rt, n, seq) == (4, 4, 260) and tuple(qshape) == (4 * 5, 4, 8) and qsl == [0, 5, 10, 15, 20]
    assert tuple(table) == (4, per) and chain == [0] * 4 and same and parent == 0
    r.compilation_config = SimpleNamespace(static_forward_context={})
    assert r._tree_cost_samples(forwards, 2) == []


def test_request_law_seeds_from_the_request_or_from_its_id_and_the_engine_seed():
    """The drafting seed: the request's own seed, else its id's CRC32 with the engine seed (every
    tensor-parallel rank the same), mixed with the drafting stream's tag so that it never equals
    the seed vLLM gives the same request's verification uniforms. A change here changes every
    seeded draft_tree output: the derivation is pinned."""
    import zlib

    def derive(base):
        return int(np.random.SeedSequence([base & 0xFFFFFFFFFFFF, 0xD8AF7]).generate_state(1, np.uint64)[0] >> 1)

    sp = SamplingParams(temperature=0.6, top_k=0, top_p=0.9, seed=42)
    law, seed = request_law("a", sp, 7)
    assert (law.temperature, law.top_k, law.top_p) == (pytest.approx(0.6), -1, pytest.approx(0.9))
    assert seed == derive(42) == request_law("b", sp, 3)[1] and seed != 42
    assert request_law("a", SamplingParams(temperature=0.6, top_k=5), 7)[0].top_k == 5
    assert request_law("a", SamplingParams(temperature=0.6, top_k=1), 7)[0].top_k == 1
    unseeded = SamplingParams(temperature=0.6)
    s = request_law("a", unseeded, 7)[1]
    assert s == derive(zlib.crc32(b"a") ^ 7) and s != request_law("b", unseeded, 7)[1]
    assert request_law("a", unseeded, None)[1] == derive(zlib.crc32(b"a")) != s


def test_scatter_places_a_single_node_row():
    from vllm_anisotropic.integration.vllm.engine.runner import scatter_tree_positions

    positions = torch.tensor([9, 10, 11, 12])
    scatter_tree_positions(positions, np.array([[3], [1], [1]]))
    assert positions.tolist() == [9, 10, 11, 11]
    scatter_tree_positions(positions, np.zeros((3, 0), np.int64))
    assert positions.tolist() == [9, 10, 11, 11]


def test_the_workers_step_rows_warm_up_compiles_what_a_step_passes():
    """After ``warm_up_step_rows`` (the worker's start) the arrays ``_prepare_inputs`` passes
    (a step's flat trees, vLLM's int32 query ends made int64; take_step's scheduled counts and
    drafts) compile nothing more (a fresh process: numba's signatures are its own)."""
    import subprocess
    import sys

    code = """
import numpy as np
from vllm_anisotropic.integration.vllm.engine.runner import warm_up_step_rows
from vllm_anisotropic.kernels import load
from vllm_anisotropic.tree import DraftTree, FlatTrees
from vllm_anisotropic.integration.vllm.engine.drafter import _scheduled_prefixes
warm_up_step_rows()
plan = load("plan")
before = (len(plan.step_rows.signatures), len(plan.scheduled_prefixes.signatures))
trees = FlatTrees.from_trees([DraftTree([1, 2, 3], [-1, 0, 0]), DraftTree([4], [-1])])
n = trees.sizes() - 1
ends = np.array([3, 4], np.int32)[np.array([0, 1])].astype(np.int64)
plan.step_rows(trees.offsets, trees.parents, trees.depths, ends, np.empty_like(n),
               np.empty((3, int(n.sum())), np.int64), np.empty_like(n))
_scheduled_prefixes(trees, np.fromiter((len(d) for d in ([2], [])), np.int64, 2), [[2], []])
print(*before, len(plan.step_rows.signatures), len(plan.scheduled_prefixes.signatures))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1"] * 4


def test_step_rows_place_every_draft_node_and_find_each_leading_chain():
    """``kernels.plan.step_rows`` against its definitions on random trees: node 1's query row is
    the query's end minus the draft nodes, each node's row / root row / depth, and the leading
    chain as ``FlatTrees.chain_prefix`` computes it."""
    from vllm_anisotropic import kernels

    rng = np.random.default_rng(0)
    for _ in range(200):
        trees = random_trees(rng, chain=0.6)
        flat = FlatTrees.from_trees(trees)
        n = flat.sizes() - 1
        ends = np.cumsum(n + rng.integers(1, 4, len(trees)))
        node_rows, chain = np.empty_like(n), np.empty_like(n)
        positions = np.empty((3, int(n.sum())), np.int64)
        kernels.load("plan").step_rows(flat.offsets, flat.parents, flat.depths, ends, node_rows, positions, chain)
        assert node_rows.tolist() == (ends - n).tolist()
        assert chain.tolist() == flat.chain_prefix().tolist()
        want = [(e - m + j - 1, e - m - 1, int(t.depths[j])) for t, e, m in zip(trees, ends, n) for j in range(1, m + 1)]
        assert [tuple(c) for c in positions.T.tolist()] == want
