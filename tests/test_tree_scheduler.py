"""The tree scheduler's own hooks on a real vLLM scheduler, without an engine or a worker.

``TreeScheduler`` (``integration/vllm/engine/scheduler.py``) is built here as the engine builds
it: vLLM's ``EngineArgs(..., speculative_config={"method": "goose"})`` through the plugin, a KV
cache of 64 blocks, vLLM's ``StructuredOutputManager``; requests are vLLM ``Request``s and each
step's output a vLLM ``ModelRunnerOutput`` carrying the drafts as the runner sends them. Only
what belongs to other modules is replaced where a test needs it: the allocator's hooks (to
inject a fault), the grammar's pruning and node rows (``tree_grammar.py``, tested on its own)
and vLLM's own grammar bitmask (to give the splice a known 0.32 or 0.33 layout).

What each test would catch: node caps not applied, applied one too many or left behind after
the request; a contained allocator or grammar fault that keeps drafts, caps at 1 instead of 0,
loses the workers' notice or repeats it; tenants sent for requests without a salt; pruned trees
validated by vLLM as chains or their metrics not counted; grammar rows spliced at the wrong
offsets, with the wrong stride, for the wrong requests or in the wrong layout; the next drafts
not applied with the output; the allocator not flushed when the batch drains. The engine tests
(test_engine_request_types.py, test_engine_faults.py) run the same paths end to end.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

MAX_DRAFTS = 6


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_anisotropic.integration.vllm.frontdoor.plugin import register

    register()
    spec = {"method": "goose", "budget": MAX_DRAFTS + 1, "allocator": "off"}
    cfg = EngineArgs(model=str(tiny_model_dir), speculative_config=spec, max_model_len=1024, max_num_seqs=8,
                     dtype="float32").create_engine_config()
    assert cfg.speculative_config.num_speculative_tokens == MAX_DRAFTS
    cfg.cache_config.num_gpu_blocks = 64
    return cfg


@pytest.fixture
def sched(vllm_config):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_anisotropic.integration.vllm.engine.scheduler import TreeScheduler

    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32))])
    return TreeScheduler(vllm_config, kv, StructuredOutputManager(vllm_config), block_size=16)


def _request(req_id: str, cap: int | None = None, salt: str | None = None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    extra = {"tree_max_nodes": cap} if cap is not None else None
    return Request(req_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=50, extra_args=extra), None, cache_salt=salt)


def _step(sched, drafts: dict[str, list[int]] | None = None, **tree_attrs):
    """schedule() -> every scheduled request samples one token -> update_from_output with the
    next ``drafts`` sent along (``runner.sample_tokens``'s ``tree_drafts``). Returns the
    scheduler output."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                               sampled_token_ids=[[7] for _ in ids])
    if drafts is not None:
        sent = DraftTokenIds(list(drafts), [list(d) for d in drafts.values()])
        for key, value in tree_attrs.items():
            setattr(sent, key, value)
        runner.tree_drafts = sent
    outputs = sched.update_from_output(out, runner)
    assert set(outputs) == ({0} if ids else set())  # vLLM's engine-core outputs, by client
    return out


def test_node_caps_cut_draft_lists_and_leave_with_the_request(sched):
    sched.add_request(_request("capped", cap=2))
    sched.add_request(_request("even", cap=3))
    sched.add_request(_request("free"))
    assert sched.node_caps == {"capped": 2, "even": 3}
    _step(sched, {"capped": [11, 12, 13, 14, 15], "even": [21, 22, 23], "free": [31, 32, 33, 34]})
    out = _step(sched)
    assert out.scheduled_spec_decode_tokens == {"capped": [11, 12], "even": [21, 22, 23], "free": [31, 32, 33, 34]}
    sched.finish_requests(["capped"], _finished())
    _step(sched)
    assert sched.node_caps == {"even": 3}


def test_the_budget_is_told_the_batch_ahead_running_and_waiting_at_most_max_num_seqs(sched, monkeypatch):
    """``cut(running, ahead)``: ``ahead`` = running + waiting requests, at most ``max_num_seqs``
    (8 here), the largest of the last ``AHEAD_STEPS`` steps: the batch size a draft model's
    catch-up is priced at (budget.BatchBudget.cut). Catches: the running requests alone (a batch
    about to refill priced as the small one), the cap dropped, no window (a dip priced as if it
    lasted), a window that never forgets, a window kept across an empty batch (a request after
    a drained batch priced at the batch before)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from vllm_anisotropic.integration.vllm.engine.scheduler import AHEAD_STEPS

    def _request(req_id):  # one prompt token: r0 runs 12 steps and stays inside one KV block
        return Request(req_id, [1], SamplingParams(max_tokens=50), None)

    seen = []
    cut = sched.budget.cut
    monkeypatch.setattr(sched.budget, "cut",
                        lambda running, ahead: seen.append((len(running), ahead)) or cut(running, ahead))
    for i in range(3):
        sched.add_request(_request(f"r{i}"))
    _step(sched)
    _step(sched)
    for i in range(3, 12):
        sched.add_request(_request(f"r{i}"))
    _step(sched)
    assert seen == [(0, 3), (3, 3), (3, 8)]
    sched.finish_requests([f"r{i}" for i in range(1, 12)], _finished())  # a dip to one request
    for _ in range(AHEAD_STEPS):
        _step(sched)
    assert seen[3:] == [(1, 8)] * (AHEAD_STEPS - 1) + [(1, 1)]  # until the 8 leaves the window
    for i in range(7):
        sched.add_request(_request(f"w{i}"))
    _step(sched)
    sched.finish_requests(["r0"] + [f"w{i}" for i in range(7)], _finished())  # drained; later one arrives
    sched.add_request(_request("late"))
    _step(sched)
    _step(sched)
    assert seen[3 + AHEAD_STEPS:] == [(1, 8), (0, 1), (1, 1)]


def _finished():
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


def test_tenants_and_the_next_step_kind_travel_with_the_output(sched):
    sched.add_request(_request("salted", salt="tenant-a"))
    sched.add_request(_request("unsalted"))
    sched.budget.propose_next = 3  # what the workers draft after this step (any value is passed on)
    out = sched.schedule()
    assert out.tree_tenants == {"salted": "tenant-a"}
    assert out.tree_propose == 3


def test_an_allocator_fault_drops_the_drafts_caps_at_zero_and_is_told_once(sched, monkeypatch):
    sched.add_request(_request("a"))
    sched.add_request(_request("b", cap=4))
    _step(sched, {"a": [1, 2, 3], "b": [4, 5]})

    def boom(running, ahead):
        raise RuntimeError("injected")

    monkeypatch.setattr(sched.budget, "cut", boom)
    out = _step(sched, {"a": [1, 2, 3], "b": [4, 5]})
    assert out.scheduled_spec_decode_tokens == {}
    assert sorted(out.tree_faults[0][1]) == ["a", "b"] and out.tree_faults[0][0] == "allocator"
    assert sched.node_caps == {"a": 0, "b": 0}
    monkeypatch.undo()
    out = _step(sched)  # the drafts that came with the faulted step: cut to nothing by the caps
    assert out.scheduled_spec_decode_tokens == {} and not hasattr(out, "tree_faults")


def test_pruned_trees_are_set_as_they_are_and_a_grammar_fault_is_contained(sched, monkeypatch):
    for r in ("tree", "chain", "broken"):
        sched.add_request(_request(r))
    _step(sched)
    pruned = []

    def prune(manager, request, draft_token_ids, i):
        if request.request_id == "broken":
            raise RuntimeError("injected")
        pruned.append(request.request_id)
        return 5

    monkeypatch.setattr(sched.grammars, "prune", prune)
    # "tree": its parents make it a tree (vLLM's chain validation would reject nothing here, but
    # must not be the one to set it); "chain": no parents, vLLM's own path
    _step(sched, {"tree": [1, 1, 2], "chain": [3, 4], "broken": [5, 6]}, tree_parents={"tree": [0, 0, 1], "broken": [0, 1]},
          tree_probs=[None, None, [0.5, 0.4]], tree_chains=[0, 2, 2])
    assert pruned == ["tree"] and sched.budget.metrics.grammar_pruned_nodes == 5
    assert sched.requests["tree"].spec_token_ids == [1, 1, 2] and sched.requests["chain"].spec_token_ids == [3, 4]
    assert sched.requests["broken"].spec_token_ids == [] and sched.node_caps == {"broken": 0}
    out = sched.schedule()
    assert out.tree_faults == [("grammar", ["broken"])]


def test_a_grammar_fault_clears_the_trees_probabilities_and_chain(sched, monkeypatch):
    from vllm.v1.outputs import DraftTokenIds

    sched.add_request(_request("broken"))
    _step(sched)
    monkeypatch.setattr(sched.grammars, "prune", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    sent = DraftTokenIds(["broken"], [[5, 6]])
    sent.tree_parents, sent.tree_probs, sent.tree_chains = {"broken": [0, 1]}, [[0.5, 0.4]], [2]
    sched.update_draft_token_ids(sent)
    assert sent.draft_token_ids == [[]] and sent.tree_probs == [None] and sent.tree_chains == [0]


def test_grammar_state_of_requests_that_left_is_forgotten_and_reorders_sent(sched):
    sched.add_request(_request("live"))
    sched.grammars.trees["gone"] = object()
    sched.grammars.trees["live"] = object()
    sched.grammars.reorders = {"live": [0, 2]}
    out = sched.schedule()
    assert set(sched.grammars.trees) == {"live"}
    assert out.tree_kept == {"live": [0, 2]} and sched.grammars.reorders == {}
    assert sched.budget.metrics.grammar_reordered_trees == 1


def test_drafts_sent_with_the_output_are_applied_and_the_drained_batch_flushes(sched, monkeypatch):
    flushed = []
    monkeypatch.setattr(sched.budget, "flush", lambda: flushed.append(1))
    sched.add_request(_request("a"))
    _step(sched, {"a": [9, 8]})
    assert sched.requests["a"].spec_token_ids == [9, 8] and not flushed
    sched.finish_requests(["a"], _finished())
    _step(sched)
    assert flushed


class _Grammar:
    """vLLM's own ``get_grammar_bitmask`` in a known layout: row values name (request, row)."""

    def __init__(self, layout: str):
        self.layout, self.seen = layout, []

    def __call__(self, scheduler, scheduler_output):
        spec = dict(scheduler_output.scheduled_spec_decode_tokens)
        self.seen.append(spec)
        ids = ["t1", "plain", "t2", "last"]
        rows = []
        for k, r in enumerate(ids):
            width = 1 + MAX_DRAFTS if self.layout == "0.33" else 1 + len(spec.get(r, ()))
            rows += [[100 * k + j] * 4 for j in range(width)]
        return SimpleNamespace(structured_output_request_ids=ids, grammar_bitmask=np.array(rows, np.int32),
                               num_acceptable_drafts=None)


@pytest.mark.parametrize("layout", ["0.32", "0.33"])
def test_grammar_rows_of_tree_nodes_spliced_into_vllms_layout(sched, monkeypatch, layout):
    from vllm.v1.core.sched.scheduler import Scheduler

    grammar = _Grammar(layout)
    monkeypatch.setattr(Scheduler, "get_grammar_bitmask", lambda self, out: grammar(self, out))
    allocated = []
    sched.structured_output_manager = SimpleNamespace(backend=SimpleNamespace(
        allocate_token_bitmask=lambda n: allocated.append(n) or np.zeros((n, 4), np.int32)))
    for r in ("t1", "plain", "t2", "last"):
        sched.add_request(_request(r))
    sched.grammars.trees.update({"t1": object(), "t2": object()})
    node_value = {"t1": 7, "t2": 9}
    monkeypatch.setattr(sched.grammars, "node_rows", lambda request, drafts, buf: np.full(
        (len(drafts), 4), node_value[request.request_id], np.int32))
    spec = {"t1": [1, 2, 3], "plain": [4, 5], "t2": [6], "last": [8]}  # a plain request last: a
    # too wide slice of plain's rows cannot hide in the tree rows that follow it
    out = SimpleNamespace(scheduled_spec_decode_tokens=spec)
    got = sched.get_grammar_bitmask(out)
    assert grammar.seen == [{"plain": [4, 5], "last": [8]}]  # vLLM fills the tree requests' root rows only
    assert out.scheduled_spec_decode_tokens is spec
    assert allocated == [MAX_DRAFTS]
    col = got.grammar_bitmask[:, 0].tolist()
    if layout == "0.32":  # root, its nodes; plain's root and drafts; root, its node
        assert col == [0, 7, 7, 7, 100, 101, 102, 200, 9, 300, 301]
    else:  # blocks of 1 + MAX_DRAFTS rows: each tree's nodes right after its root, the rest vLLM's
        assert col == [0, 7, 7, 7, 4, 5, 6, 100, 101, 102, 103, 104, 105, 106, 200, 9, 202, 203, 204, 205, 206,
                       300, 301, 302, 303, 304, 305, 306]
    assert got.num_acceptable_drafts == [3, 2, 1, 1]
    sched.get_grammar_bitmask(out)
    assert allocated == [MAX_DRAFTS]  # the node rows' buffer is allocated once


def test_grammar_bitmask_without_tree_requests_is_vllms(sched, monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    mine = object()
    monkeypatch.setattr(Scheduler, "get_grammar_bitmask", lambda self, out: mine)
    sched.grammars.trees["t1"] = object()
    out = SimpleNamespace(scheduled_spec_decode_tokens={"t1": [], "plain": [1]})
    assert sched.get_grammar_bitmask(out) is mine  # a tree request with no drafts this step: vLLM's rows
    monkeypatch.setattr(Scheduler, "get_grammar_bitmask", lambda self, out: None)
    out = SimpleNamespace(scheduled_spec_decode_tokens={"t1": [1], "plain": [1]})
    assert sched.get_grammar_bitmask(out) is None
    assert out.scheduled_spec_decode_tokens == {"t1": [1], "plain": [1]}
