"""The measured gate (``allocator/gate.py``) and its scheduler hook (``integration/vllm/engine/budget.py``).

What each test would catch: a reversed comparison (exploiting the slower arm), rates computed
upside down (seconds per token), an exploration that never or always happens, a warm-up that
never measures the plain arm, a tie (arms within the margin) that speculates, plain steps that
are not measured in blocks, old data that never fades (a closed gate that cannot re-open),
arms mixed across batch sizes, and in the hook: prefill steps counted as decode steps,
re-run steps counted as plain, the wrong token count, a closed gate that still keeps drafts or
probes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_anisotropic.allocator import CHAIN, PLAIN, TREE, GateConfig, SpeculationGate
from vllm_anisotropic.allocator.gate import bucket
from vllm_anisotropic.integration.vllm.engine.budget import BatchBudget
from vllm_anisotropic.integration.vllm.frontdoor.config import EngineTreeConfig


def test_bucket_worked_example():
    assert [bucket(r, 8) for r in (0, 1, 5, 8, 9, 16, 17, 32, 33)] == [1, 1, 5, 8, 16, 16, 32, 32, 64]
    assert [bucket(r, 6) for r in (6, 7)] == [6, 8]  # the last exact bucket is exact


def test_rates_and_decisions_are_reported_and_empty_arms_read_zero():
    gate = SpeculationGate()
    gate.observe(3, False, 3, 0.03)
    gate.observe(3, True, 5, 0.0)  # no measurable time: ignored
    assert gate.rates() == {3: {"plain_rate": pytest.approx(100.0), "plain_steps": 1, "spec_rate": 0.0,
                                "spec_steps": 0, "decisions": 0}}
    gate.allows(3)
    gate.allows(3)
    assert gate.rates()[3]["decisions"] == 2


def test_allocator_decides_while_the_speculative_arm_warms_up():
    # the allocator keeps choosing no drafts (every step plain) after the plain warm-up: the gate
    # must leave it free (it has no evidence against speculation), not force plain
    gate = SpeculationGate(GateConfig(min_steps=4, block=2, explore_every=32))
    decisions = []
    for _ in range(40):
        decisions.append(gate.allows(2))
        gate.observe(2, False, 2, 0.02)  # plain whatever was allowed
    assert decisions[:3] == [True, False, False] and all(decisions[3:])



def _run(gate, num_reqs, plain_rate, spec_rate, decisions, tokens=8):
    """Drive ``decisions`` steps: the gate decides, the step is measured at the arm's rate."""
    out = []
    for _ in range(decisions):
        allowed = gate.allows(num_reqs)
        out.append(allowed)
        rate = spec_rate if allowed else plain_rate
        gate.observe(num_reqs, allowed, tokens, tokens / rate)
    return out


def test_docstring_example_warm_up_then_exploit_then_explore():
    gate = SpeculationGate(GateConfig(block=2, min_steps=2, explore_every=4))
    T, F = True, False
    assert _run(gate, 8, plain_rate=100.0, spec_rate=80.0, decisions=12) == [T, F, F, T, F, F, F, T, F, F, F, T]


@pytest.mark.parametrize("plain_rate, spec_rate", [(100.0, 80.0), (100.0, 125.0)])
def test_exploits_the_faster_arm_and_explores_the_other_every_nth_step(plain_rate, spec_rate):
    gate = SpeculationGate(GateConfig(min_steps=12, explore_every=32))  # plain blocks of 4, plain explored every 128
    decisions = _run(gate, 4, plain_rate, spec_rate, 24 + 320)
    warm, rest = decisions[:24], decisions[24:]
    assert warm == ([True] + [False] * 4) * 3 + [True] * 9  # plain blocks until 12 plain steps, then the allocator
    faster = spec_rate > plain_rate
    others = [i + 25 for i, d in enumerate(rest) if d != faster]
    if faster:  # open: a plain block at decisions 128 and 256
        assert others == [128, 129, 130, 131, 256, 257, 258, 259]
    else:  # closed (20 % short of opening: the longest period), decisions 56, 88, ..., 344 speculate
        assert others == list(range(56, 345, 32))
    rates = gate.rates()[4]
    assert rates["plain_rate"] == pytest.approx(plain_rate) and rates["spec_rate"] == pytest.approx(spec_rate)


@pytest.mark.parametrize("spec_rate, exploits_spec", [(108.0, False), (109.9, False), (110.2, True), (120.0, True)])
def test_speculation_must_beat_plain_by_the_margin(spec_rate, exploits_spec):
    # arms within the 10 % margin of each other are a tie, and a tie goes to plain (the measured
    # case: 326.7 vs 322.6 tokens/s kept the gate open while the cell lost; GateConfig.margin
    # says why 10 %); a clear win still opens it
    gate = SpeculationGate(GateConfig(min_steps=12, explore_every=32))
    rest = _run(gate, 16, 100.0, spec_rate, 24 + 64)[24:]
    # closed on a near tie: explored at the shortest period, 32 // 8 = 4 decisions after the
    # warm-up's last (25), then after each plain block of 4 (29, 34, ..., 84)
    explored = [i + 25 for i, d in enumerate(rest) if d]
    assert explored == (list(range(25, 89)) if exploits_spec else list(range(29, 89, 5))), explored


@pytest.mark.parametrize("shortfall, period", [(0.40, 32), (0.20, 32), (0.10, 16), (0.05, 8), (0.02, 4), (0.0, 4)])
def test_a_closed_gate_explores_in_proportion_to_how_close_speculation_is(shortfall, period):
    # explore_every where speculation falls 20 % or more short of opening (the plain rate x 1.10),
    # proportionally more often closer: an arm that nearly pays is measured often, a clear loser
    # rarely (an exploring step costs at most ~0.2 / 32 of the tokens either way)
    gate = SpeculationGate(GateConfig(min_steps=12, explore_every=32, block=1))
    rest = _run(gate, 16, 100.0, 110.0 * (1 - shortfall) - 1e-9, 24 + 128)[24:]
    explored = [i + 25 for i, d in enumerate(rest) if d]
    assert explored == list(range(24 + period, 24 + 129, period)), explored


def test_a_closed_gate_reopens_when_speculation_starts_paying():
    gate = SpeculationGate(GateConfig(min_steps=12, explore_every=32))
    before = _run(gate, 8, 100.0, 80.0, 200)
    # closed (20 % short) but exploring every 32 decisions from the warm-up's last (24)
    assert [i + 1 for i, d in enumerate(before[24:], 24) if d] == [56, 88, 120, 152, 184]
    # the text changes: speculation now delivers 150 tokens/s; the exploration steps see it
    after = _run(gate, 8, 100.0, 150.0, 600)
    first_open = next(i for i, d in enumerate(after) if d and (i + 201) % 32)
    assert first_open < 400  # old slow steps fade with the plain steps too (decay 0.995)
    assert all(after[-60:][i] != (768 <= i + 741 <= 771) for i in range(60))  # open since, a plain block at 768


@pytest.mark.parametrize("above_rate, spec_first", [(130.0, True), (70.0, False)])
def test_a_new_smaller_bucket_speculates_first_below_an_open_one(above_rate, spec_first):
    # the tail of a batch: requests finish and the batch shrinks into buckets never seen. Below
    # a bucket whose warm-up measured speculation faster (16 at 130 vs 100), bucket 8 speculates
    # through its speculative warm-up first (4 steps here), then measures plain in a block; below
    # a closed one it warms up as any bucket (one speculative step, one plain block of 4, ...)
    gate = SpeculationGate(GateConfig(min_steps=4, explore_every=32))
    _run(gate, 16, 100.0, above_rate, 40)
    T, F = True, False
    warm = _run(gate, 8, 100.0, 120.0, 14)
    # then plain measured (a block of 4) and speculation, faster at 8 too, exploited
    assert warm == ([T] * 4 + [F] * 4 + [T] * 6 if spec_first else [T] + [F] * 4 + [T] * 9)
    gate.allows(4)
    assert gate._bucket(4).spec_first  # the nearest warmed-up bucket above decides: 8, open (16 may be closed)


def test_batch_sizes_are_separate():
    gate = SpeculationGate(GateConfig(min_steps=4, explore_every=32))
    _run(gate, 1, 100.0, 130.0, 40)  # speculation pays alone
    _run(gate, 8, 100.0, 70.0, 40)  # and loses at eight requests
    assert gate.allows(1) and not gate.allows(8)
    assert set(gate.rates()) == {1, 8}


# ---------------------------------------------------------------- the scheduler hook


def _budget(**engine):
    engine = {"cost_model_online": False, "allocator_probe_every": 1, **engine}
    cfg = EngineTreeConfig(**engine)
    return BatchBudget(SimpleNamespace(max_num_batched_tokens=256), SimpleNamespace(max_model_len=1000), 10, cfg)


def _req(rid, drafts, rerun=0, prompt=10):
    return SimpleNamespace(request_id=rid, spec_token_ids=list(range(1, drafts + 1)), num_tokens=100,
                           num_computed_tokens=99 - rerun, num_prompt_tokens=prompt)


def _step(b, reqs, sampled, new_reqs=()):
    """One scheduler step after ``cut``: what vLLM scheduled and what the runner sampled."""
    spec = {r.request_id: r.spec_token_ids for r in reqs if r.spec_token_ids}
    num = {r.request_id: r.num_tokens - r.num_computed_tokens + len(r.spec_token_ids) for r in reqs}
    out = SimpleNamespace(num_scheduled_tokens=num, total_num_scheduled_tokens=sum(num.values()),
                          scheduled_spec_decode_tokens=spec, scheduled_new_reqs=list(new_reqs))
    b.on_scheduled(out)
    b.on_output(out, SimpleNamespace(sampled_token_ids=sampled, req_id_to_index={r.request_id: i for i, r in enumerate(reqs)}))


def _offer(b, probs):
    b.on_draft_ids(SimpleNamespace(req_ids=list(probs), tree_probs=list(probs.values())))


def test_hook_sorts_decode_steps_into_arms_and_counts_emitted_tokens():
    b = _budget()
    arms = b.gate._bucket(2).arms
    # a decode step with drafts kept: speculative arm, 3 + 1 tokens emitted
    reqs = [_req("a", 2), _req("b", 0)]
    _offer(b, {"a": [0.99, 0.99]})
    b.cut(reqs)
    assert reqs[0].spec_token_ids  # warm-up's first decision lets the allocator decide
    _step(b, reqs, [[1, 2, 3], [4]])
    assert (arms[1].count, arms[1].tokens, arms[0].count) == (1, 4, 0)
    # the warm-up's plain block (decisions 2-5). Its first step re-runs 2 tokens the step before
    # accepted: the switch's cost, neither arm's (sustained speculation re-runs them inside
    # steps that verify drafts)
    reqs = [_req("a", 0, rerun=2), _req("b", 0)]
    b.cut(reqs)
    assert not b._drafting and not b.propose_next
    _step(b, reqs, [[5], [6]])
    assert (arms[1].count, arms[0].count) == (1, 0)
    # then plain decode steps, no re-runs, nothing drafted after them: plain arm
    for count in (1, 2):
        reqs = [_req("a", 0), _req("b", 0)]
        b.cut(reqs)
        _step(b, reqs, [[7], [8]])
        assert (arms[0].count, arms[1].count) == (count, 1) and arms[0].tokens == pytest.approx(2 * count, rel=0.01)
    # the block's last step drafts for the next one (decision 6 speculates): neither arm's
    reqs = [_req("a", 0), _req("b", 0)]
    b.cut(reqs)
    assert not b._drafting and b.propose_next
    _step(b, reqs, [[7], [8]])
    assert (arms[0].count, arms[1].count) == (2, 1)
    # a step the gate let draft (decision 6), nothing kept: it paid for drafting, speculative
    reqs = [_req("a", 0), _req("b", 0)]
    b.cut(reqs)
    _step(b, reqs, [[7], [8]])
    assert (arms[0].count, arms[1].count) == (2, 2)
    # a request still in its prompt, or a new request scheduled: no arm
    reqs = [_req("a", 0), SimpleNamespace(request_id="c", spec_token_ids=[], num_tokens=100, num_computed_tokens=50,
                                          num_prompt_tokens=100)]
    b.cut(reqs)
    _step(b, reqs, [[9], []])
    reqs = [_req("a", 0)]
    b.cut(reqs)
    _step(b, reqs, [[9]], new_reqs=[SimpleNamespace(req_id="d")])
    assert (arms[0].count, arms[1].count, b.gate._bucket(1).arms[0].count) == (2, 2, 0)


def test_closed_gate_keeps_no_drafts_and_no_probe():
    b = _budget()
    for _ in range(200):  # measured: plain 400 tokens/s, speculative 100 at two requests
        b.gate.observe(2, False, 2, 0.005)
        b.gate.observe(2, True, 3, 0.03)
    closed = 0
    for _ in range(32):
        reqs = [_req("a", 3), _req("b", 3)]
        _offer(b, {"a": [0.99] * 3, "b": [0.99] * 3})
        b.cut(reqs)
        closed += not any(r.spec_token_ids for r in reqs)
    assert closed == 31  # decision 32 explores: the allocator decides (and keeps the drafts)
    assert b.metrics.gate_plain_steps == 31 and b.metrics.probe_steps == 0
    # gate off: the allocator (flat prior cost, confident nodes) keeps drafts every step
    b = _budget(allocator_gate=False)
    reqs = [_req("a", 3), _req("b", 3)]
    _offer(b, {"a": [0.99] * 3, "b": [0.99] * 3})
    b.cut(reqs)
    assert all(r.spec_token_ids for r in reqs) and b.gate is None


def test_one_stall_from_outside_does_not_decide_an_arm():
    # speculation pays (140 vs 100 tokens/s), but one speculative step of the warm-up stalls
    # for 50x its time (another process took the cores): clipped at 3x the recent median
    gate = SpeculationGate()
    _run(gate, 1, 100.0, 140.0, 20)
    gate.observe(1, True, 8, 50 * 8 / 140.0)
    assert _run(gate, 1, 100.0, 140.0, 40)[-30:].count(True) >= 29
    rates = gate.rates()[1]
    assert rates["spec_rate"] > rates["plain_rate"], rates
    # unclipped, the same stall outweighs the arm's dozen steps
    gate = SpeculationGate(GateConfig(clip=1e9))
    _run(gate, 1, 100.0, 140.0, 20)
    gate.observe(1, True, 8, 50 * 8 / 140.0)
    assert _run(gate, 1, 100.0, 140.0, 40)[-30:].count(True) <= 1


def test_closed_gate_stops_drafting_one_step_ahead():
    # the gate decides step t + 1 in step t's cut and tells the workers (propose_next): while it
    # stays closed they draft nothing, and the step before an exploring decision they draft
    b = _budget()
    for _ in range(200):  # measured: plain 400 tokens/s, speculative 100 at two requests
        b.gate.observe(2, False, 2, 0.005)
        b.gate.observe(2, True, 3, 0.03)
    flags = []
    for _ in range(64):  # dormant: the workers sent no drafts
        b.cut([_req("a", 0), _req("b", 0)])
        flags.append(b.propose_next)
    assert flags.count(True) == 2 and flags[-1] == PLAIN, flags  # one exploring decision in 32
    assert b.metrics.gate_plain_steps == 64 - flags[:-1].count(True)  # decode steps the gate kept plain
    while not b.propose_next:  # up to the step before the next exploring decision
        b.cut([_req("a", 0), _req("b", 0)])
    reqs = [_req("a", 3), _req("b", 3)]
    _offer(b, {"a": [0.99] * 3, "b": [0.99] * 3})
    b.cut(reqs)  # the exploring step: the allocator decides, and keeps the confident drafts
    assert all(r.spec_token_ids for r in reqs) and b.propose_next == PLAIN
    reqs = [_req("a", 3), _req("b", 3)]
    _offer(b, {"a": [0.99] * 3, "b": [0.99] * 3})
    b.cut(reqs)  # drafts that arrive although the gate said plain (the batch changed) are cut
    assert not any(r.spec_token_ids for r in reqs)
    # gate off: the workers always draft
    b = _budget(allocator_gate=False)
    b.cut([_req("a", 0)])
    assert b.propose_next == TREE


def test_steps_the_gate_let_draft_are_speculative_even_when_every_draft_is_cut():
    # the allocator cut every draft (a steep cost), yet the step paid for drafting: it belongs to
    # the speculative arm, so a gate whose drafting steps are slower closes after its warm-up
    # (counted as plain, the speculative arm never warmed up and the gate drafted forever)
    b = _budget(allocator_probe_every=0)
    b.cost = type(b.cost).linear(1.0, 1.0)  # every query token costs 1 s: no draft ever pays
    plain_s, drafting_s = 0.010, 0.012
    arms = b.gate._bucket(2).arms
    allowed = []
    for _ in range(200):
        reqs = [_req("a", 3), _req("b", 3)]
        if b.propose_next:
            _offer(b, {"a": [0.5] * 3, "b": [0.5] * 3})
        else:
            reqs = [_req("a", 0), _req("b", 0)]
        b.cut(reqs)
        assert not any(r.spec_token_ids for r in reqs)  # never a draft kept
        allowed.append(b._drafting)
        b._t_cut -= drafting_s if b._drafting else plain_s  # the step's measured time
        _step(b, reqs, [[1], [2]])
    assert arms[1].count >= b.gate.config.min_steps and arms[0].count >= b.gate.config.min_steps
    late = allowed[-64:]
    assert late.count(True) <= 3, late  # only the exploring decisions draft


def test_proposal_time_is_charged_to_the_step_that_verifies_the_drafts():
    # the runner reports the seconds it spent drafting for the next step (tree_propose_s): the
    # cost model never sees them, the gate charges them to the next step
    b = _budget()
    seen = []
    b.cost.update = lambda sample, refit=True: seen.append(sample.seconds)
    b.online = True
    observed = []
    b.gate.observe = lambda r, arm, tokens, seconds: observed.append(round(seconds, 3))
    for propose_s in (0.004, 0.0):
        reqs = [_req("a", 0), _req("b", 0)]
        b.cut(reqs)
        b._t_cut -= 0.010
        spec = {}
        num = {r.request_id: 1 for r in reqs}
        out = SimpleNamespace(num_scheduled_tokens=num, total_num_scheduled_tokens=2,
                              scheduled_spec_decode_tokens=spec, scheduled_new_reqs=[])
        b.on_scheduled(out)
        b.on_output(out, SimpleNamespace(sampled_token_ids=[[1], [2]], req_id_to_index={"a": 0, "b": 1},
                                         tree_propose_s=propose_s))
    assert [round(s, 3) for s in seen] == [0.006, 0.010]
    assert observed == [0.006, 0.014]


# ---------------------------------------------------------------- chain steps (a third arm)


def _run_kinds(gate, num_reqs, rates, decisions, tokens=8):
    """Drive ``decisions`` steps with ``gate.decide``; each kind measured at ``rates[kind]``."""
    out = []
    for _ in range(decisions):
        kind = gate.decide(num_reqs)
        out.append(kind)
        gate.observe(num_reqs, kind, tokens, tokens / rates[kind])
    return out


@pytest.mark.parametrize("tree_rate, chain_rate, best", [(90.0, 120.0, CHAIN), (140.0, 120.0, TREE),
                                                         (131.0, 120.0, CHAIN), (80.0, 90.0, PLAIN)])
def test_the_gate_speculates_with_the_faster_kind(tree_rate, chain_rate, best):
    # the two speculative kinds are measured apart; trees must beat chains by the margin (131 vs
    # 120, 9 %, is a tie, and a tie goes to the cheaper chains); plain decoding is compared with the
    # kind the gate would pick, so chains at 90 do not open it against plain at 100
    gate = SpeculationGate(GateConfig(min_steps=8, explore_every=32, chains=True))
    kinds = _run_kinds(gate, 16, {PLAIN: 100.0, TREE: tree_rate, CHAIN: chain_rate}, 400)
    late = kinds[-200:]  # the rest: an open gate's plain blocks (every 128th) and the other kind (1 in 32)
    assert late.count(best) >= 180, (best, late)
    rates = gate.rates()[16]
    assert rates["chain_steps"] >= 8 and rates["spec_steps"] >= 8 and rates["plain_steps"] >= 8, rates
    assert rates["chain_rate"] == pytest.approx(chain_rate) and rates["spec_rate"] == pytest.approx(tree_rate)


def test_the_kinds_warm_up_in_turn_and_the_slower_one_is_explored():
    gate = SpeculationGate(GateConfig(min_steps=4, block=2, explore_every=8, chains=True))
    kinds = _run_kinds(gate, 4, {PLAIN: 50.0, TREE: 60.0, CHAIN: 100.0}, 200)
    spec = [k for k in kinds if k != PLAIN]
    assert spec[:8] == [CHAIN, TREE] * 4  # the less measured kind first, a tie to chains
    # then chains, trees every 8th speculative decision (and never two in a row)
    assert spec[8:].count(TREE) == len(spec[8:]) // 8, spec
    # without chains the gate never picks them, and decide() is allows()
    gate = SpeculationGate(GateConfig(min_steps=4, block=2, explore_every=8))
    assert set(_run_kinds(gate, 4, {PLAIN: 50.0, TREE: 60.0, CHAIN: 1e9}, 200)) == {PLAIN, TREE}


def test_a_chain_step_keeps_the_chains_as_drafted_and_is_the_chain_arm():
    b = _budget()
    b.gate = SpeculationGate(GateConfig(chains=True))
    b._allowed = CHAIN  # the gate chose a chain step for this step one step ahead
    arms = b.gate._bucket(3).arms
    # chains arrive without probabilities (nothing ranked them); "b" is a tree whose leading chain
    # is 2 nodes (the first step, before the workers heard of the gate); "c" has 7 chain drafts
    b.on_draft_ids(SimpleNamespace(req_ids=["a", "b", "c"], tree_probs=[None, [0.9, 0.8, 0.7], None],
                                   tree_chains=[3, 2, 7]))
    reqs = [_req("a", 3), _req("b", 3), _req("c", 7)]
    b.cut(reqs)
    assert [len(r.spec_token_ids) for r in reqs] == [3, 2, 5]  # chains whole, a tree to its chain, at most 5
    assert b.metrics.chain_steps == 1 and b.metrics.chain_drafts == 10
    _step(b, reqs, [[1, 2], [3], [4, 5, 6]])
    assert (arms[CHAIN].count, arms[CHAIN].tokens, arms[TREE].count, arms[PLAIN].count) == (1, 6, 0, 0)
    # a plain step clears drafts that carry no probabilities too
    b._allowed = PLAIN
    b.on_draft_ids(SimpleNamespace(req_ids=["a"], tree_probs=[None], tree_chains=[3]))
    reqs = [_req("a", 3)]
    b.cut(reqs)
    assert reqs[0].spec_token_ids == []


@pytest.mark.parametrize("spec_rate, saving", [(200.0, 0.005), (105.0, 0.01 - 0.01 / 1.1), (80.0, 0.01 - 0.01 / 1.1)])
def test_a_token_saves_the_difference_of_the_arms_seconds_a_token_or_what_would_open_the_gate(spec_rate, saving):
    """``token_saving_s``: where the gate is open, 1 / plain - 1 / speculative rate; where it is
    closed (a tie inside the margin, or speculation slower) or warming up, what a token saves at
    the opening rate, plain x 1.10, or at the speculative rate if higher; None before any plain
    arm's first step (a bucket never seen borrows: the next test). Catches: the difference reversed or of rates
    (not seconds a token), the measured slower rate used while closed (a saving <= 0: every
    resume refused, the gate could never reopen), a saving before any plain step, a decision
    counted by asking."""
    gate = SpeculationGate(GateConfig(min_steps=4, block=2, explore_every=32))
    assert gate.token_saving_s(2) is None
    _run(gate, 2, 100.0, spec_rate, 1)  # the warm-up's first speculative step: no plain rate yet
    assert gate.token_saving_s(2) is None
    _run(gate, 2, 100.0, spec_rate, 2)  # then a plain block: warming up, the better of the two rates
    assert gate.token_saving_s(2) == pytest.approx(0.01 - 1 / max(spec_rate, 110.0), rel=0.02)
    _run(gate, 2, 100.0, spec_rate, 40)
    decisions = gate.rates()[2]["decisions"]
    assert gate.token_saving_s(2) == pytest.approx(saving, rel=0.02)
    assert gate.rates()[2]["decisions"] == decisions and 3 not in gate.rates()
    slow = SpeculationGate(GateConfig(min_steps=4, explore_every=32))  # a large model on a CPU: < 1 token/s
    _run(slow, 1, 0.5, 2.0, 40)
    assert slow.token_saving_s(1) == pytest.approx(2.0 - 0.5, rel=0.02)


def test_a_batch_size_without_a_plain_step_borrows_the_nearest_measured_saving_scaled_by_size():
    """A cold batch size (the tail of a batch at a size not run before) takes the saving of the
    measured bucket nearest by ratio of sizes (ties: the smaller), times that bucket's size over
    its own: a step's saving spread over its tokens. Catches: the scale inverted or dropped, the
    nearest by difference (5 would tie 2 and 8 and take 2, not 8), ties to the larger, a cold
    size answered None (every catch-up let through: the bench's 1.26-s resume at a batch's
    tail), a bucket made or a decision counted by being asked."""
    gate = SpeculationGate(GateConfig(min_steps=4, block=2, explore_every=32, exact_buckets=8))
    _run(gate, 2, 100.0, 80.0, 40)  # closed at 2: plain x 1.1 would open it
    _run(gate, 8, 400.0, 1000.0, 40)  # open at 8
    at2, at8 = 0.01 - 0.01 / 1.1, 1 / 400 - 1 / 1000
    rates = gate.rates()
    assert gate.token_saving_s(2) == pytest.approx(at2, rel=0.02)
    assert gate.token_saving_s(1) == pytest.approx(at2 * 2, rel=0.02)
    assert gate.token_saving_s(4) == pytest.approx(at2 / 2, rel=0.02)  # 4 / 2 = 8 / 4: ties to 2
    assert gate.token_saving_s(5) == pytest.approx(at8 * 8 / 5, rel=0.02)  # 8 / 5 < 5 / 2
    assert gate.token_saving_s(40) == pytest.approx(at8 * 8 / 64, rel=0.02)  # 33..64: bucket 64
    assert gate.rates() == rates
