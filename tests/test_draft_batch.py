"""``draft_tree``'s batched step (``proposers/draft_batch.py``) against one request at a time.

The reference is ``DraftTreeState.propose`` on a twin proposer (same q, same seeds), request by
request: every tree of a batched step must be the very tree it drafts (tokens, parents, q rows,
path values), step after step while the contexts grow by accepted tokens, and the sessions must
have run the same tokens through q. What this catches: a row reading another row's KV (the
rows of q's KV wrong, or a branch seeing another lane), positions off, a session left holding
the branches or missing the trunk, draws taken from another request's generator
or in another order, the wrong row's law recorded in ``draft_probs``, a selector's shape groups
mixed up. The batched step must also be one q forward per depth for all requests, whatever
shape each has (a stand-in selector gives requests different shapes; the shipped kind gives a
step one).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_selector_runtime import threshold_selector

from vllm_anisotropic.models.tiny import build_tiny_model
from vllm_anisotropic.proposers import get_proposer
from vllm_anisotropic.proposers.draft_kv import DraftKV
from vllm_anisotropic.selector.shape import DelayedShape
from vllm_anisotropic.verifiers import TargetSampling

SAMPLED = TargetSampling(temperature=0.8, top_k=-1, top_p=0.9)
WIDTH = 160


@pytest.fixture(scope="module")
def draft_dir():
    # a law with some hundreds of tokens: sampled draws vary, and a draw does not sit on a
    # boundary of the inverse CDF that float rounding of a batched matmul could move
    return str(build_tiny_model(seed=1, block_std=0.1, lm_head_alpha=0.2))


def _twins(draft_dir, n, **options):
    """Two proposers on the same q with ``n`` requests each, every other one sampled (seeded alike)."""
    out = []
    for _ in range(2):
        proposer = get_proposer("draft_tree", model=draft_dir, **options)
        states = [proposer.new_request() for _ in range(n)]
        for i, state in enumerate(states):
            if i % 2:
                state.set_sampling(SAMPLED, seed=11 + i)
        out.append((proposer, states))
    return out


def _contexts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(lengths), WIDTH), np.int64)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(100, 5000, n)
    return tokens, np.asarray(lengths, np.int64)


def _forwards(proposer) -> list:
    calls = []
    proposer.lm.model.get_decoder().register_forward_hook(lambda *args: calls.append(1))
    return calls


def _same(batched, reference) -> None:
    assert batched.tokens.tolist() == reference.tokens.tolist()
    assert batched.parents.tolist() == reference.parents.tolist()
    np.testing.assert_allclose(batched.values, reference.values, rtol=1e-4)
    if reference.draft_probs is None:
        assert batched.draft_probs is None
    else:
        torch.testing.assert_close(batched.draft_probs, reference.draft_probs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("shape", [(2, 1, 2), (1, 4, 0), (3, 0, 3)])
def test_a_batched_step_drafts_each_requests_own_tree(draft_dir, shape):
    (pa, sa), (pb, sb) = _twins(draft_dir, 4, branches=shape[0], trunk=shape[1], branch_length=shape[2], selector="off")
    tokens, lengths = _contexts([12, 40, 7, 25])
    rng = np.random.default_rng(1)
    calls = _forwards(pa)
    for step in range(3):
        calls.clear()
        out = pa.propose_batch(sa, tokens, np.arange(4), lengths)
        depth_forwards = 1 + shape[1] - (shape[2] == 0) + max(shape[2] - 1, 0)
        # one per depth, all requests at once: the new prompts run in the catch-up forward with
        # the others' accepted tokens
        assert len(calls) == depth_forwards, (step, len(calls))
        assert out.modes.tolist() == [1] * 4
        assert out.prev_roots.tolist() == tokens[np.arange(4), lengths - 2].tolist()
        for i, state in enumerate(sb):
            _same(out.trees.tree(i), state.propose(tokens[i, : lengths[i]]))
        # each request accepts its first two drafts and a bonus token (or, at step 1, request
        # 2 nothing: its session's trunk is cut back)
        for i in range(4):
            add = out.trees.tree(i).tokens[1:3].tolist() if (step, i) != (1, 2) else []
            add.append(int(rng.integers(100, 5000)))
            tokens[i, lengths[i] : lengths[i] + len(add)] = add
            lengths[i] += len(add)
    assert [s.session.forwarded for s in sa] == [s.session.forwarded for s in sb]
    assert [s.session.tokens for s in sa] == [s.session.tokens for s in sb]


class _Forced:
    """The twin's selector: the shape the batched step chose (``shape``), for every request."""

    def __init__(self, real) -> None:
        self.real, self.max_drafts, self.shape = real, real.max_drafts, None

    def may_draft(self, *args) -> bool:
        return self.real.may_draft(*args)

    def may_draft_rows(self, *args):
        return self.real.may_draft_rows(*args)

    def choose_shapes(self, features) -> list:
        return [self.shape] * len(features)


def test_the_selector_gives_a_step_one_shape_and_budgets_cut_after_drawing(draft_dir, tmp_path):
    """The threshold selector prefers (1, 3, 0) or (2, 1, 1) per root (its entropy). A batched
    step drafts every request in one shape, the highest summed log-policy over the drafting
    requests' features (in steps where their own choices differ, too), in 1 + its trunk forwards
    of q; each tree is the one drafted alone in that shape. Request 0's budget of 3 nodes cuts its
    tree after the draws, request 3's budget of 1 node drafts nothing (no q forward for it, and
    not one of the rows the shape is chosen from); new prompts of every length run in the
    catch-up forward. Fails if the step takes one request's choice, a vote or the summed
    probabilities, or per-request shapes."""
    path = str(threshold_selector(tmp_path, {0.0: 6.7, 0.8: 4.0}))
    (pa, sa), (pb, sb) = _twins(draft_dir, 5, selector=path)
    pb.selector = _Forced(pb.selector)
    seen = []
    choose = pa.selector.choose_shapes
    pa.selector.choose_shapes = lambda f: seen.append(f) or choose(f)
    tokens, lengths = _contexts([12, 40, 7, 25, 62], seed=3)
    budgets = np.array([3, 0, 0, 1, 0])
    rng = np.random.default_rng(2)
    calls = _forwards(pa)
    split = 0
    for step in range(5):
        pa.begin_step(5)
        pb.begin_step(5)
        calls.clear()
        seen.clear()
        before = dict(pa.shape_counts)
        out = pa.propose_batch(sa, tokens, np.arange(5), lengths, budgets)
        chosen = {key: count - before.get(key, 0) for key, count in pa.shape_counts.items()
                  if count > before.get(key, 0)}
        (features,) = seen
        assert len(features) == 4 and list(chosen.values()) == [4], chosen  # one shape, request 3 not drafting
        own = pa.selector.choose_index(features)
        split += len(set(own.tolist())) == 2
        step_action = pa.selector.actions[int(torch.log_softmax(pa.selector.logits(features), -1).sum(0).argmax())]
        assert list(chosen) == [",".join(map(str, step_action))], (chosen, step_action)
        pb.selector.shape = DelayedShape(*step_action)
        assert len(calls) == 1 + (2 if step_action == (1, 3, 0) else 1), (step, chosen, len(calls))
        for i, state in enumerate(sb):
            ref = state.propose(tokens[i, : lengths[i]], None if budgets[i] <= 0 else int(budgets[i]))
            _same(out.trees.tree(i), ref)
            assert MODES[out.modes[i]] == state.last_info.mode.value == sa[i].last_info.mode.value
        assert out.trees.tree(0).num_nodes <= 3 and out.trees.tree(3).num_nodes == 1
        for i in range(5):
            add = out.trees.tree(i).tokens[1:2].tolist() + [int(rng.integers(100, 5000))]
            tokens[i, lengths[i] : lengths[i] + len(add)] = add
            lengths[i] += len(add)
    assert {"1,3,0", "2,1,1"} <= set(pa.shape_counts), pa.shape_counts  # both shapes ran
    assert split >= 2, split  # the requests' own choices differed, and the step still took one
    assert sa[3].session.forwarded == 0  # never drafted: q never ran for it
    assert [s.session.tokens for s in sa] == [s.session.tokens for s in sb]


def test_a_released_session_is_rebuilt_from_the_context(draft_dir):
    """A preempted request's q cache is dropped (``release``); the next batched step rebuilds it
    from the whole context beside requests whose caches are current."""
    (pa, sa), (pb, sb) = _twins(draft_dir, 2, branches=2, trunk=1, branch_length=1, selector="off")
    tokens, lengths = _contexts([20, 9], seed=4)
    pa.propose_batch(sa, tokens, np.arange(2), lengths)
    for i, state in enumerate(sb):
        state.propose(tokens[i, : lengths[i]])
    sa[0].release()
    sb[0].release()
    tokens[:, lengths[0]] = 77
    lengths += 1
    out = pa.propose_batch(sa, tokens, np.arange(2), lengths)
    for i, state in enumerate(sb):
        _same(out.trees.tree(i), state.propose(tokens[i, : lengths[i]]))
    assert sa[0].session.tokens == sb[0].session.tokens and len(sa[0].session.tokens) == lengths[0] + 1


def test_q_catching_up_a_request_the_gate_rested_or_a_new_prompt_is_in_neither_arm(draft_dir, monkeypatch):
    """The catch-up forward of a step with a request marked ``resuming`` (the gate rested it: the
    engine's drafter marks it) is timed as a resume (``take_resume_seconds``; the gate counts it in
    neither arm) and clears the mark; new prompts (q's first run for a request) put their share of
    the forward, by tokens, there too; a long catch-up of a request q ran before, without the
    mark, is the speculative step's own; a marked request q does not run for keeps its mark.
    Catches: the time left uncounted or counted twice (not reset when taken), counted without a
    mark, a prompt's share wrong or the whole forward's, the mark never cleared or cleared when q
    did not run."""
    from vllm_anisotropic.proposers import draft_batch

    clock = iter(range(10_000))  # each reading one second later: a catch-up forward takes 1 s
    monkeypatch.setattr(draft_batch, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    (pa, sa), _ = _twins(draft_dir, 3, branches=2, trunk=1, branch_length=2, selector="off")
    tokens, lengths = _contexts([20, 9, 14], seed=6)
    pa.propose_batch(sa[:2], tokens, np.arange(2), lengths[:2])  # two new prompts, not rested
    assert pa.take_resume_seconds() == 1.0

    def extend(lag):
        nonlocal lengths
        for i in range(2):  # tokens q has not run: the first differs from q's trunk token
            trunk = sa[i].session.tokens[lengths[i]]
            tokens[i, lengths[i]:lengths[i] + lag] = trunk + 1 + np.arange(lag)
        lengths[:2] = lengths[:2] + lag

    extend(12)  # more than any speculative step leaves, but not rested
    pa.propose_batch(sa[:2], tokens, np.arange(2), lengths[:2])
    assert pa.take_resume_seconds() == 0.0
    extend(2)  # two tokens each, and request 2's prompt of 14: 14 of the forward's 18 tokens
    pa.propose_batch(sa, tokens, np.arange(3), lengths)
    assert pa.take_resume_seconds() == 14 / 18
    extend(3)
    sa[0].resuming = sa[1].resuming = True
    pa.propose_batch(sa[:2], tokens, np.arange(2), lengths[:2], np.array([0, 1]))  # q runs for request 0 alone
    assert pa.take_resume_seconds() == 1.0 and pa.take_resume_seconds() == 0.0
    assert [s.resuming for s in sa[:2]] == [False, True]


def test_a_long_catch_up_the_requests_remaining_tokens_cannot_repay_is_left_out(draft_dir):
    """With a repay ratio (``proposer.repay``), a request whose catch-up is longer than a drafting
    step leaves drafts only where its ``remaining`` tokens x the ratio cover the catch-up; else
    its tree is the root alone, q does not run for it (its resume mark kept), and ``take_catchup``
    counts it. A request drafting every step, a ratio of None or an unknown remainder never
    stop q. Long catch-ups (>= CATCHUP_MIN_TOKENS tokens a forward) are measured
    (``take_catchup``), short ones not. Catches: the comparison reversed or against the context
    length instead of the lag, a short per-step catch-up held back, the rule applied without a
    ratio, the refusal leaving q's session or the mark changed, the measure taken of every
    forward or of none."""
    from vllm_anisotropic.proposers.draft_batch import CATCHUP_MIN_TOKENS

    (pa, sa), _ = _twins(draft_dir, 2, branches=2, trunk=1, branch_length=2, selector="off")
    tokens, lengths = _contexts([CATCHUP_MIN_TOKENS, 9], seed=7)
    pa.repay = 2.0  # catch-up tokens an output token repays
    sa[0].remaining, sa[1].remaining = 100, 2  # a new prompt of 64 tokens, one of 9 (lag 9 > 6)
    out = pa.propose_batch(sa, tokens, np.arange(2), lengths)
    assert out.trees.sizes().tolist()[1] == 1 and sa[1].session.forwarded == 0
    seconds, caught_up, refused = pa.take_catchup()
    assert out.trees.sizes().tolist()[0] > 1 and seconds > 0 and (caught_up, refused) == (CATCHUP_MIN_TOKENS, 1)
    assert pa.take_catchup() == (0.0, 0, 0)
    sa[1].remaining = 5  # 5 x 2 covers the lag of 9
    pa.propose_batch(sa, tokens, np.arange(2), lengths)
    assert sa[1].session.forwarded >= 9 and pa.take_catchup() == (0.0, 0, 0)  # short: not measured

    def extend(i, lag):
        nonlocal lengths
        trunk = sa[i].session.tokens[lengths[i]]  # the first token differs from q's trunk token
        tokens[i, lengths[i]:lengths[i] + lag] = trunk + 1 + np.arange(lag)
        lengths = lengths.copy()
        lengths[i] += lag

    extend(0, 3)  # a drafting step's catch-up: never held back
    sa[0].remaining = 0
    before = sa[0].session.forwarded
    pa.propose_batch(sa, tokens, np.arange(2), lengths)
    assert sa[0].session.forwarded > before and pa.take_catchup()[2] == 0
    extend(0, 6)  # a lag of 6 = max_drafts + 1, a drafting step's: never held back
    pa.propose_batch(sa, tokens, np.arange(2), lengths)
    assert pa.take_catchup()[2] == 0
    extend(0, 7)  # a lag of 7 (its last draft differs too): 3 tokens left (6) do not cover it, 4 (8) do
    sa[0].remaining = 3
    before = sa[0].session.forwarded
    pa.propose_batch(sa, tokens, np.arange(2), lengths)
    assert pa.take_catchup()[2] == 1 and sa[0].session.forwarded == before
    sa[0].remaining = 4
    pa.propose_batch(sa, tokens, np.arange(2), lengths)
    assert pa.take_catchup()[2] == 0 and sa[0].session.forwarded >= before + 7
    extend(0, 12)  # rested: a lag of 12, 5 tokens left (10)
    sa[0].resuming, sa[0].remaining = True, 5
    before = sa[0].session.forwarded
    out = pa.propose_batch(sa, tokens, np.arange(2), lengths)
    assert out.trees.sizes().tolist()[0] == 1 and sa[0].session.forwarded == before and sa[0].resuming
    assert pa.take_catchup()[2] == 1 and out.modes.tolist()[0] == 0
    sa[0].remaining = 6  # 6 x 2 covers the lag of 12 (the context: 79 tokens)
    pa.propose_batch(sa, tokens, np.arange(2), lengths)
    assert sa[0].session.forwarded >= before + 12 and not sa[0].resuming and pa.take_catchup()[2] == 0
    extend(0, 12)
    sa[0].remaining = None  # an unknown remainder
    before = sa[0].session.forwarded
    pa.propose_batch(sa, tokens, np.arange(2), lengths)
    assert sa[0].session.forwarded >= before + 12 and pa.take_catchup()[2] == 0
    extend(0, 12)
    sa[0].remaining, pa.repay = 0, None  # no ratio
    before = sa[0].session.forwarded
    pa.propose_batch(sa, tokens, np.arange(2), lengths)
    assert sa[0].session.forwarded >= before + 12 and pa.take_catchup()[2] == 0


MODES = {0: "plain", 1: "tree", 2: "bypass", 3: "chain"}


def test_a_step_with_one_drafting_request_runs_the_forwards_of_one_request(draft_dir):
    """One request drafting (the others plain by their budgets): q runs exactly the forwards of
    ``DraftTreeState.propose``, and only that request takes a slot of q's KV."""
    (pa, sa), (pb, sb) = _twins(draft_dir, 3, branches=2, trunk=1, branch_length=2, selector="off")
    tokens, lengths = _contexts([14, 9, 11], seed=5)
    budgets = np.array([1, 0, 1])
    calls_a, calls_b = _forwards(pa), _forwards(pb)
    out = pa.propose_batch(sa, tokens, np.arange(3), lengths, budgets)
    ref = sb[1].propose(tokens[1, : lengths[1]])
    _same(out.trees.tree(1), ref)
    assert out.trees.sizes().tolist() == [1, ref.num_nodes, 1] and out.modes.tolist() == [0, 1, 0]
    assert len(calls_a) == len(calls_b) == 1 + 1 + 1  # the context, the trunk's end, one branch depth
    assert sa[1].session.forwarded == sb[1].session.forwarded and sa[0].session.forwarded == 0
    assert pa.kv.slots == [sa[1].session] and sa[0].session.slot is None


class _ByContextLength:
    """A stand-in selector: request r's shape follows its context length (so the batched step and
    the one-at-a-time reference give each request the same shape, in whatever order they ask)."""

    SHAPES = [DelayedShape(1, 3, 0), DelayedShape(2, 0, 3), DelayedShape(3, 1, 2), DelayedShape(1, 0, 1)]
    max_drafts = 9

    def may_draft(self, *args, **kwargs) -> bool:
        return True

    def may_draft_rows(self, context_lens, *args, **kwargs):
        return np.ones(len(context_lens), bool)

    def choose_shapes(self, features) -> list:
        return [self.SHAPES[int(round(np.expm1(f[1]))) % len(self.SHAPES)] for f in features]


def test_branches_of_different_widths_and_lengths_share_each_depths_forward(draft_dir):
    """Four requests, four shapes in every step: a chain, K = 2 branches of 3 from the root,
    K = 3 of 2 after one trunk token, K = 1 of 1. The branch rows are 0 / 2 / 3 / 1 per request,
    and the branches end at different depths. Fails if a request's branches read another's rows,
    if rows whose branches ended are run or stop the others, or if one width is assumed."""
    (pa, sa), (pb, sb) = _twins(draft_dir, 4, selector="off")
    for p in (pa, pb):
        p.selector = _ByContextLength()
    tokens, lengths = _contexts([12, 13, 14, 15], seed=5)
    calls = _forwards(pa)
    for step in range(3):
        calls.clear()
        out = pa.propose_batch(sa, tokens, np.arange(4), lengths)
        for i, state in enumerate(sb):
            _same(out.trees.tree(i), state.propose(tokens[i, : lengths[i]]))
        shapes = [_ByContextLength.SHAPES[n % 4] for n in lengths]
        assert len(set(shapes)) >= 3, shapes
        trunk = max(s.trunk - (s.branch_length == 0) for s in shapes)  # a chain's last node runs no forward
        assert len(calls) == 1 + trunk + max(s.branch_length - 1 for s in shapes), (step, shapes, len(calls))
        for i in range(4):
            add = [int(out.trees.tree(i).tokens[1])] if out.trees.tree(i).num_nodes > 1 else []
            add.append(int(np.random.default_rng(step * 10 + i).integers(100, 5000)))
            tokens[i, lengths[i] : lengths[i] + len(add)] = add
            lengths[i] += len(add)
    assert [s.session.tokens for s in sa] == [s.session.tokens for s in sb]


class _EvenLengths(_ByContextLength):
    """Would draft only for contexts of even length, whatever q's entropy."""

    def may_draft(self, context_len, *args, **kwargs) -> bool:
        return context_len % 2 == 0

    def may_draft_rows(self, context_lens, *args, **kwargs):
        return np.array([n % 2 == 0 for n in context_lens])


def test_a_batched_step_skips_q_for_each_request_the_selector_would_not_draft_for(draft_dir):
    """The step asks the selector once for all its requests (``may_draft_rows``): the requests it
    answers no for decode plainly, q not run for them, and the others draft as they would alone
    (fails if one request's answer is read for all, or for another request)."""
    (pa, sa), (pb, sb) = _twins(draft_dir, 4, selector="off")
    for p in (pa, pb):
        p.selector = _EvenLengths()
    tokens, lengths = _contexts([12, 13, 14, 15], seed=5)
    out = pa.propose_batch(sa, tokens, np.arange(4), lengths)
    for i, state in enumerate(sb):
        _same(out.trees.tree(i), state.propose(tokens[i, : lengths[i]]))
    assert [out.trees.tree(i).num_nodes > 1 for i in range(4)] == [True, False, True, False]
    assert [s.session.forwarded > 0 for s in sa] == [True, False, True, False]


def test_no_request_drafts_in_a_step_wider_than_the_selectors_bound(draft_dir, tmp_path):
    """A selector bounded at two requests (``max_batch_size``): in a step of three requests, or of
    one drafting request among three, no request drafts and q runs no forward at all (fails if
    the bound is read from the drafting requests alone, or not at all); in a step of two, both
    draft the selector's chain of 3."""
    from test_selector_runtime import constant_selector

    path = constant_selector(tmp_path, (1, 3, 0))
    doc = json.loads((path / "selector.json").read_text())
    (path / "selector.json").write_text(json.dumps({**doc, "max_batch_size": 2}))
    proposer = get_proposer("draft_tree", model=draft_dir, selector=str(path))
    calls = _forwards(proposer)
    tokens, lengths = _contexts([12, 13, 14], seed=8)
    for drafting, batch in ((3, 3), (1, 3)):
        states = [proposer.new_request() for _ in range(drafting)]
        proposer.begin_step(drafting, batch)
        out = proposer.propose_batch(states, tokens, np.arange(drafting), lengths[:drafting])
        assert all(out.trees.tree(i).num_nodes == 1 for i in range(drafting)), (drafting, batch)
        assert not calls and all(s.session is None or s.session.forwarded == 0 for s in states)
    states = [proposer.new_request() for _ in range(2)]
    proposer.begin_step(2, 2)
    out = proposer.propose_batch(states, tokens, np.arange(2), lengths[:2])
    assert [out.trees.tree(i).num_nodes for i in range(2)] == [4, 4] and calls


def test_kv_bytes_per_token_is_what_the_cache_holds(draft_dir):
    """``DraftLM.kv_bytes_per_token`` (the draft KV reserve's unit) against the bytes of the K/V
    tensors a session's cache holds after a context: off by a factor (K only, one layer, the
    query heads instead of the KV heads) and the reserve would be wrong by it."""
    proposer = get_proposer("draft_tree", model=draft_dir, selector="off")
    session = proposer.lm.new_session()
    session.root_logits(list(range(100, 137)))
    held = sum(t.numel() * t.element_size() for layer in session.cache.layers for t in (layer.keys, layer.values))
    assert session.kv_bytes() == held == 37 * proposer.lm.kv_bytes_per_token


def _pool_bytes(kv: DraftKV) -> int:
    return sum(t.numel() * t.element_size() for t in kv.keys + kv.values)


def test_q_kv_rows_stay_in_place_while_the_steps_requests_do(draft_dir):
    """Steps with the same requests reuse q's KV tensors as they are (no copy: the same storage),
    in whatever order the engine lists the requests; a new request takes a free row below the
    step's count without a copy; a step that needs more columns copies once, by doubling; the
    bytes counted are the bytes held; a finished request's row is free, and the tensors go
    when no request holds one. Trees equal the one-at-a-time twin's throughout."""
    (pa, sa), (pb, sb) = _twins(draft_dir, 4, branches=2, trunk=1, branch_length=2, selector="off")
    tokens, lengths = _contexts([20, 30, 25, 10], seed=8)
    tokens = np.pad(tokens, ((0, 0), (0, 400)))
    rng = np.random.default_rng(9)

    def step(active):
        rows = np.asarray(active)
        out = pa.propose_batch([sa[i] for i in active], tokens, rows, lengths[rows])
        for k, i in enumerate(active):
            _same(out.trees.tree(k), sb[i].propose(tokens[i, : lengths[i]]))
            add = out.trees.tree(k).tokens[1:2].tolist() + [int(rng.integers(100, 5000))]
            tokens[i, lengths[i] : lengths[i] + len(add)] = add
            lengths[i] += len(add)

    step([0, 1, 2])
    kv = pa.kv
    storage = kv.keys[0].data_ptr()
    assert sorted(s.session.slot for s in sa[:3]) == [0, 1, 2] and kv.columns == 256
    assert kv.bytes() == _pool_bytes(kv) == 3 * 256 * pa.lm.kv_bytes_per_token
    step([2, 0, 1])  # another order: the rows stay
    assert kv.keys[0].data_ptr() == storage
    sa[1].finish()
    sb[1].finish()
    step([3, 0, 2])  # request 3 takes request 1's free row
    assert kv.keys[0].data_ptr() == storage and sa[3].session.slot == 1, sa[3].session.slot
    tokens[0, lengths[0] : lengths[0] + 300] = rng.integers(100, 5000, 300)  # past 256 columns
    lengths[0] += 300
    step([0, 2, 3])
    assert kv.columns == 512 and kv.keys[0].data_ptr() != storage and kv.bytes() == _pool_bytes(kv)
    for state in sa:
        state.finish()
    assert kv.keys == [] and kv.bytes() == 0 and kv.peak == 3 * 512 * pa.lm.kv_bytes_per_token


def test_the_kv_bound_drops_the_least_recently_drafted_sessions_and_the_trees_stay_the_same(draft_dir):
    """Six requests, of which steps draft one to four at a time, under a bound of four rows of
    256 columns: q's KV never takes more than the bound; the requests not drafting in a step are
    dropped when the step needs their rows, the ones that drafted longest ago first; every tree
    is the tree of a twin with no bound (a dropped session is rebuilt from the context; greedy
    and seeded sampled alike, float32). Fails on an unbounded pool, a most-recent-first order,
    or a rebuilt session that drafts differently."""
    (pa, sa), (pb, sb) = _twins(draft_dir, 6, branches=2, trunk=1, branch_length=2, selector="off")
    per_token = pa.lm.kv_bytes_per_token
    pa.kv_bound = 4 * 256 * per_token
    tokens, lengths = _contexts([30, 36, 33, 40, 28, 35], seed=6)
    rng = np.random.default_rng(7)
    evicted = 0
    for step, active in enumerate([[0, 1], [2], [3], [4, 5], [0, 2, 4, 5], [1, 3], [0, 1, 2, 3], [5, 4]]):
        rows = np.asarray(active)
        for p in (pa, pb):
            p.begin_step(len(rows))
        before = {i: (sa[i].session.slot, sa[i].session.last_step) for i in range(6)}
        out = pa.propose_batch([sa[i] for i in active], tokens, rows, lengths[rows])
        for k, i in enumerate(active):
            _same(out.trees.tree(k), sb[i].propose(tokens[i, : lengths[i]]))
        held, _, drops = pa.kv_stats()
        assert held == _pool_bytes(pa.kv) <= pa.kv_bound, (step, held)
        dropped = [i for i in range(6) if before[i][0] is not None and sa[i].session.slot is None]
        kept = [i for i in range(6) if i not in active and sa[i].session.slot is not None]
        if dropped and kept:  # never a more recent session dropped while an older one is kept
            assert max(before[i][1] for i in dropped) <= min(before[i][1] for i in kept), step
        evicted += len(dropped)
        assert drops == evicted, (step, drops, evicted)
        for i in active:
            add = out.trees.tree(active.index(i)).tokens[1:2].tolist() + [int(rng.integers(100, 5000))]
            tokens[i, lengths[i] : lengths[i] + len(add)] = add
            lengths[i] += len(add)
    assert evicted >= 6, evicted
    assert pb.kv_stats() == (0, 0, 0)  # the twin drafted one at a time: no pool


def test_requests_past_the_kv_bound_decode_plainly_that_step(draft_dir):
    """A bound of two rows of 256 columns and three drafting requests: the two shortest draft
    (their trees are the twin's), the longest gets the root alone and a plain mode, its session
    dropped; with the bound lifted it drafts again from a rebuilt cache."""
    (pa, sa), (pb, sb) = _twins(draft_dir, 3, branches=2, trunk=1, branch_length=1, selector="off")
    pa.kv_bound = 2 * 256 * pa.lm.kv_bytes_per_token
    tokens, lengths = _contexts([30, 60, 20], seed=10)
    out = pa.propose_batch(sa, tokens, np.arange(3), lengths)
    assert out.trees.sizes().tolist() == [4, 1, 4] and out.modes.tolist() == [1, 0, 1]
    for i in (0, 2):
        _same(out.trees.tree(i), sb[i].propose(tokens[i, : lengths[i]]))
    assert sa[1].session.slot is None and pa.kv_stats()[0] <= pa.kv_bound
    pa.kv_bound = None
    out = pa.propose_batch(sa, tokens, np.arange(3), lengths)
    _same(out.trees.tree(1), sb[1].propose(tokens[1, : lengths[1]]))


def test_the_draft_device_and_dtype_follow_the_engine_unless_named(draft_dir):
    """``draft_device`` / ``draft_dtype`` "auto" take what the engine passes (its worker's device,
    the target's dtype), CPU / float32 without an engine; a named dtype wins; an unknown device
    is refused by name."""
    assert get_proposer("draft_tree", model=draft_dir).lm.dtype == torch.float32
    from vllm_anisotropic.proposers import DraftTreeProposer, proposer_config

    auto = DraftTreeProposer(proposer_config("draft_tree", model=draft_dir), device="cpu", dtype=torch.bfloat16)
    assert auto.lm.dtype == torch.bfloat16 and next(auto.lm.model.parameters()).dtype == torch.bfloat16
    assert auto.lm.kv_bytes_per_token * 2 == get_proposer("draft_tree", model=draft_dir).lm.kv_bytes_per_token
    named = DraftTreeProposer(proposer_config("draft_tree", model=draft_dir, draft_dtype="float32"), dtype=torch.bfloat16)
    assert named.lm.dtype == torch.float32 and named.lm.device.type == "cpu"
    with pytest.raises(ValueError, match=r"draft_device[\s\S]*'auto' or 'cpu'"):
        proposer_config("draft_tree", model=draft_dir, draft_device="cuda:1")


def test_short_rows_on_cuda_attend_with_the_math_backend_and_prompts_with_torchs_choice():
    """``draft_kv._backends``: on CUDA, an attention call of at most ``LONG_ROW`` queries per row
    runs with only SDPA's math backend enabled (cuDNN's per-mask-shape planning measured 4x
    slower on an H200), a longer one (a prompt) and any CPU call with torch's backends as they
    were; the flags are restored after the call."""
    from types import SimpleNamespace

    from vllm_anisotropic.proposers.draft_kv import LONG_ROW, _backends

    flags = (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.flash_sdp_enabled,
             torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.mem_efficient_sdp_enabled)
    before = [f() for f in flags]
    assert all(before)
    for is_cuda, n, want in ((True, 1, [True, False, False, False]), (True, LONG_ROW, [True, False, False, False]),
                             (True, LONG_ROW + 1, before), (False, 1, before)):
        with _backends(SimpleNamespace(is_cuda=is_cuda), n):
            assert [f() for f in flags] == want, (is_cuda, n)
        assert [f() for f in flags] == before


@pytest.mark.parametrize("scale", [None, 0.3])
def test_short_rows_attention_is_masked_grouped_attention(scale):
    """``draft_kv.short_rows_attention`` (the CPU's short rows) against float64 SDPA on random
    masks, 14 query heads over 2 kv heads (Qwen2.5-0.5B's grouping): query head h reads kv head
    h // 7, the scale defaults to 1 / sqrt(dim), a masked column gets no weight. Catches heads
    mapped h % kv_heads, a dropped or doubled scale, the mask taken inverted, the softmax over
    the wrong axis; a padding row (mask all False) is NaN, which callers drop."""
    from vllm_anisotropic.proposers.draft_kv import short_rows_attention

    g = torch.Generator().manual_seed(3)
    rows, heads, kv_heads, n, dim, width = 3, 14, 2, 4, 64, 50
    q = torch.randn(rows, heads, n, dim, generator=g)
    k = torch.randn(rows, kv_heads, 64, dim, generator=g)[:, :, :width]  # views of wider slots, as in DraftKV
    v = torch.randn(rows, kv_heads, 64, dim, generator=g)[:, :, :width]
    mask = torch.rand(rows, 1, n, width, generator=g) < 0.5
    mask[..., 0] = True
    mask[2, :, 3] = False  # a padding query
    got = short_rows_attention(q, k, v, mask, scale)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                            scale=scale, enable_gqa=True)
    real = torch.ones(rows, heads, n, dtype=torch.bool)
    real[2, :, 3] = False
    assert got.dtype == torch.float32
    assert (got.double() - want)[real].abs().max() < 1e-5
    assert got[2, :, 3].isnan().all()
    got16 = short_rows_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, scale)
    assert got16.dtype == torch.bfloat16 and (got16.double() - want)[real].abs().max() < 0.05


def test_cpu_decode_rows_take_short_rows_attention_and_prompts_sdpa(draft_dir, monkeypatch):
    """On the CPU a forward's rows of at most ``LONG_ROW`` new tokens attend through
    ``short_rows_attention``, a prompt's row through SDPA; the logits are the same as with SDPA
    for every row (float32)."""
    import vllm_anisotropic.proposers.draft_kv as draft_kv

    calls = []
    real = draft_kv.short_rows_attention

    def spy(query, *args):
        calls.append(query.shape[2])
        return real(query, *args)

    lm = get_proposer("draft_tree", model=draft_dir).lm
    rng = np.random.default_rng(0)
    prompt = list(rng.integers(0, 200, draft_kv.LONG_ROW + 8))
    short = [list(rng.integers(0, 200, 3)), list(rng.integers(0, 200, 1))]

    def run():
        kv = DraftKV(lm)
        sessions = [lm.new_session() for _ in range(3)]
        kv.place(sessions, [len(prompt) + 8] * 3)
        kv.forward(3, [prompt, short[0], short[1]], [0, 0, 0], [None] * 3, [0] * 3)
        return kv.forward(3, [[5], [6, 7], [8]], [len(prompt), 3, 1], [None] * 3, [0] * 3)

    monkeypatch.setattr(draft_kv, "short_rows_attention", spy)
    got = run()
    assert calls == [3] * lm.model.config.num_hidden_layers + [2] * lm.model.config.num_hidden_layers
    monkeypatch.setattr(draft_kv, "LONG_ROW", 0)  # every row through SDPA: the reference
    calls.clear()
    want = run()
    assert calls == []
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
