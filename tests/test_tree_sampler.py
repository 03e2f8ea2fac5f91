"""``TreeRejectionSampler`` (integration/vllm/engine/sampler.py) on vLLM's real ``Sampler``,
``RejectionSampler``, ``SpecDecodeMetadata`` and ``SamplingMetadata``, without an engine: the
runner it reads (``take_tree_step``, ``drafter``, ``move_kv``, ...) is a small recording stand-in.

One batch throughout: row 0 request "a" with the tree ``5 -> 7 -> 8`` plus the branch ``5 -> 9``
(3 drafts, logits rows 0-3), row 1 request "b" without drafts (its bonus row 4), row 2 request
"c" with the chain ``3 -> 4 -> 6`` (2 drafts, rows 5-7). The target's argmax: row 0 (a's root)
9 = the branch, row 3 (after 9) 2 = no child; row 4 (b) 11; rows 5, 6 take c's chain, row 7 13.
So greedy emits ``[9, 2]`` for a (its node 3 accepted off the leading chain: one K/V move),
``[11]`` for b and ``[4, 6, 13]`` for c. Rows 1 and 2 (a's spine, not visited) prefer 14 and 15:
a walk reading the wrong rows emits them."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_anisotropic.integration.vllm.engine import sampler as sampler_module
from vllm_anisotropic.integration.vllm.engine.drafter import StepTrees
from vllm_anisotropic.integration.vllm.engine.host_clock import HostClock
from vllm_anisotropic.integration.vllm.engine.sampler import (
    PLACEHOLDER_TOKEN_ID, TreeRejectionSampler, _row_pasts, _sampling_tensors, harvest_plain)
from vllm_anisotropic.tree import DraftTree, FlatTrees, NodeSource

V = 16
S, B = NodeSource.SPINE, NodeSource.BRANCH
TREE_A = DraftTree([5, 7, 8, 9], [-1, 0, 1, 0], [NodeSource.ROOT, S, S, B])
TREE_C = DraftTree([3, 4, 6], [-1, 0, 1], [NodeSource.ROOT, S, S])
DRAFTS = [[7, 8, 9], [], [4, 6]]
ARGMAX = {0: 9, 1: 14, 2: 15, 3: 2, 4: 11, 5: 4, 6: 6, 7: 13}  # logits row -> the target's argmax
GREEDY_OUT = [[9, 2, -1, -1], [11, -1, -1, -1], [4, 6, 13, -1]]


def _logits(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, V, generator=g)
    for row, token in ARGMAX.items():
        x[row, token] = x[row].max() + 2.0 + row * 0.1
    return x


def _metadata(drafts=DRAFTS):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    md = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    cu = md.cu_num_sampled_tokens.long()
    md.bonus_logits_indices = (cu - 1).to(torch.int32)  # each request's last row (make_dummy leaves zeros)
    return md


def _sampling(temperature=None, top_k=None, top_p=None, generators=None, logprobs=None, batch=3):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    temps = None if temperature is None else torch.tensor(temperature, dtype=torch.float32)
    return SamplingMetadata(
        temperature=temps, all_greedy=temps is None, all_random=temps is not None and bool((temps > 0).all()),
        top_p=top_p, top_k=top_k, generators=generators or {}, max_num_logprobs=logprobs, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def _step(trees=(TREE_A, TREE_C), rows=(0, 2), ids=("a", "c")) -> StepTrees:
    n = len(trees)
    step = StepTrees(list(ids), np.asarray(rows, np.int64), FlatTrees.from_trees(list(trees)),
                     np.full(n, -1, np.int64), np.ones(n, np.int8), np.zeros(n, bool))
    step.node_rows = np.array([1, 6], np.int64)[:n]  # the query row of each tree's node 1
    step.root_positions = np.array([10, 20], np.int64)[:n]
    return step


class _Drafter:
    def __init__(self) -> None:
        self.observed, self.contained, self.on_paths = [], [], []
        self.forgotten = 0  # forget_writes calls (the ranks' refresh windows started over)

    def forget_writes(self) -> None:
        self.forgotten += 1

    def observe_step(self, step, accepted, num_accepted, starts, logits, on_path=None) -> None:
        self.observed.append((step, accepted.copy(), num_accepted.copy(), np.asarray(starts).copy(), logits))
        self.on_paths.append(on_path)

    def contain(self, stage, req_ids, live=True) -> None:
        self.contained.append((stage, list(req_ids)))


class _Runner:
    """What the sampler reads of the tree runner."""

    def __init__(self, step, seeds=None, outputs=None) -> None:
        self._step = step
        self.drafter = _Drafter()
        self.host_clock = HostClock()
        self.row_edits = {}
        self.moves = []
        self.model_config = SimpleNamespace(seed=0)
        self.requests = {r: SimpleNamespace(sampling_params=SimpleNamespace(seed=s))
                         for r, s in (seeds or {"a": 1, "b": 2, "c": 3}).items()}
        self.input_batch = SimpleNamespace(req_output_token_ids=outputs or [[1, 5], [11], [2, 3]])

    def take_tree_step(self):
        step, self._step = self._step, None
        return step

    def move_kv(self, src, dst) -> None:
        self.moves.append((src.tolist(), dst.tolist()))


def _sampler(runner, sampling_verifier="nss") -> TreeRejectionSampler:
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    return TreeRejectionSampler(RejectionSampler(Sampler()), runner, sampling_verifier=sampling_verifier)


def test_greedy_trees_emit_the_walked_paths_and_move_the_off_chain_node():
    runner = _Runner(_step())
    logits = _logits()
    out = _sampler(runner)(_metadata(), None, logits, _sampling())
    assert out.sampled_token_ids.dtype == torch.int32
    assert out.sampled_token_ids.tolist() == GREEDY_OUT
    assert out.logprobs_tensors is None
    # a's node 3 (depth 1) sits in node 3's query row (node_rows 1 + 3 - 1) and goes to depth 1's (1)
    assert runner.moves == [([3], [1])]
    ((step, accepted, num_accepted, starts, seen),) = runner.drafter.observed
    assert accepted.tolist() == [[3, -1], [1, 2]] and num_accepted.tolist() == [1, 2]
    assert starts.tolist() == [0, 5] and seen is logits
    assert np.flatnonzero(runner.drafter.on_paths[0]).tolist() == [3, 5, 6]  # a's node 3, c's nodes 1, 2
    assert runner.drafter.contained == []
    assert {"walk", "kv"} <= set(runner.host_clock.seconds)


def test_the_workers_emit_warm_up_compiles_what_a_step_emits():
    """After ``warm_up_emit`` (the worker's start) a tree step's logits starts, emitted rows,
    moves, metrics counts and harvested rows compile nothing more: the same signatures before
    and after the step above (a fresh process: numba's signatures are its own)."""
    import subprocess
    import sys

    code = """
import sys; sys.path.insert(0, ".")
from tests.test_tree_sampler import _Runner, _logits, _metadata, _sampler, _sampling, _step
from vllm_anisotropic.integration.vllm.engine.metrics import TreeMetrics
from vllm_anisotropic.integration.vllm.engine.sampler import warm_up_emit
from vllm_anisotropic.kernels import load
warm_up_emit()
emit = load("emit")
import numpy as np
kernels = (emit.logits_starts, emit.emit_rows, emit.count_step, emit.harvest_rows)
before = [len(k.signatures) for k in kernels]
runner = _Runner(_step())
_sampler(runner)(_metadata(), None, _logits(), _sampling())
step, accepted, num_accepted, starts, *_ = runner.drafter.observed[0]
TreeMetrics().record_step(step.trees, runner.drafter.on_paths[0], num_accepted, step.modes, step.req_ids, False)
# the arrays TreeDrafter.observe_step passes (this runner's drafter records instead)
emit.harvest_rows(np.asarray(starts, np.int64), step.trees.offsets, ~step.chains, np.empty(step.trees.num_nodes, np.int64))
print(*before, *(len(k.signatures) for k in kernels))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1"] * 8


def test_logprobs_come_from_the_row_that_predicted_each_token():
    runner = _Runner(_step())
    logits = _logits(1)
    out = _sampler(runner)(_metadata(), None, logits, _sampling(logprobs=1))
    lp = out.logprobs_tensors
    want_rows = {(0, 0): 0, (0, 1): 3, (1, 0): 4, (2, 0): 5, (2, 1): 6, (2, 2): 7}
    ref = torch.log_softmax(logits.float(), dim=-1)
    width = 4
    for (b, col), row in want_rows.items():
        k = b * width + col
        token = GREEDY_OUT[b][col]
        assert lp.logprob_token_ids[k, 0].item() == token
        assert lp.logprobs[k, 0].item() == pytest.approx(ref[row, token].item(), abs=1e-5), (b, col)
        assert lp.selected_token_ranks[k].item() == 1  # every token was its row's argmax
    # no token emitted: zeros (vLLM drops them with its valid-token mask)
    assert lp.logprobs[3].abs().sum().item() == 0 and lp.logprob_token_ids[1 * width + 1].abs().sum().item() == 0
    assert lp.logprobs.shape[0] == 3 * width


def test_drafts_that_do_not_match_the_tree_are_refused_with_the_batch_row():
    runner = _Runner(_step())
    with pytest.raises(RuntimeError, match="batch row 2 has 1 drafts but its draft tree 2"):
        _sampler(runner)(_metadata([[7, 8, 9], [], [4]]), None, _logits()[:7], _sampling())


def test_no_tree_step_is_vllms_rejection_sampler_and_root_only_trees_are_harvested():
    """No step, or root-only trees (vLLM's warm-up call with dummy drafts): vLLM's own rejection
    sampler with the same arguments (its Triton kernels do not run on this CPU: a recording
    stand-in takes its place), the root-only trees' rows harvested."""
    logits = _logits(2)[:5]
    md, smd = _metadata([[7], [], [4]]), _sampling()
    calls = []

    class Original(torch.nn.Module):
        def forward(self, *args):
            calls.append(args)
            return "vllm's output"

    original = Original()
    runner = _Runner(None)
    ts = _sampler(runner)
    ts.original = original
    assert ts(md, None, logits, smd) == "vllm's output"
    assert len(calls) == 1 and calls[0][0] is md and calls[0][2] is logits and calls[0][3] is smd
    assert runner.drafter.observed == []
    roots = _step((DraftTree([5], [-1]), DraftTree([3], [-1])))
    runner = _Runner(roots)
    ts = _sampler(runner)
    ts.original = original
    assert ts(md, None, logits, smd) == "vllm's output" and len(calls) == 2
    ((_, accepted, num_accepted, starts, _),) = runner.drafter.observed
    assert starts.tolist() == [1, 4]  # each tree row's last logits row (cu_num_sampled - 1)
    assert accepted.tolist() == [[-1], [-1]] and num_accepted.tolist() == [0, 0]


def test_a_verify_fault_gives_each_tree_its_root_rows_token(monkeypatch):
    def failing(stage):
        if stage == "verify":
            raise ValueError("broken walk")

    monkeypatch.setattr(sampler_module, "inject", failing)
    runner = _Runner(_step())
    out = _sampler(runner)(_metadata(), None, _logits(), _sampling())
    assert out.sampled_token_ids.tolist() == [[9, -1, -1, -1], [11, -1, -1, -1], [4, -1, -1, -1]]
    assert runner.drafter.contained == [("verify", ["a", "c"])]
    assert runner.moves == []
    ((_, accepted, num_accepted, starts, _),) = runner.drafter.observed
    assert accepted.tolist() == [[-1], [-1]] and num_accepted.tolist() == [0, 0] and starts.tolist() == [0, 5]


@pytest.mark.parametrize("verifier", ["nss", "deterministic"])
def test_sampled_rows_with_top_k_1_walk_the_greedy_paths(verifier):
    """Top-k 1 makes every draw the row's argmax whatever the temperature: the sampled paths
    (vLLM's sampler per visited row, or the one-hot verifier on the processed law) equal the
    greedy ones; request b (greedy, temperature 0) keeps its bonus row's argmax."""
    gens = {0: torch.Generator().manual_seed(4), 2: torch.Generator().manual_seed(5)}
    md = _sampling([0.7, 0.0, 1.3], top_k=torch.tensor([1, V, 1]), top_p=torch.tensor([0.9, 1.0, 0.8]), generators=gens)
    runner = _Runner(_step())
    out = _sampler(runner, verifier)(_metadata(), None, _logits(), md)
    assert out.sampled_token_ids.tolist() == GREEDY_OUT
    assert runner.moves == [([3], [1])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_seeded_nss_walk_emits_its_generators_draws_row_by_row(dtype):
    """NSS with vLLM's sampler: each emitted token is the request's generator's next draw from
    the row of the node before it (temperature applied, in float32), so a seeded request emits
    what plain decoding would draw at those positions. Reference: the same draws made one row
    at a time with a fresh generator of the seed, descending while a child holds the draw. The
    walk reads the rows where they are (no edits): bf16 logits too."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    temps = [1.0, 0.0, 0.8]
    logits = (torch.randn(8, V, generator=torch.Generator().manual_seed(9)) * 0.5).to(dtype)  # flat: the draws vary
    for seed in range(6):
        gens = {0: torch.Generator().manual_seed(seed), 2: torch.Generator().manual_seed(100 + seed)}
        runner = _Runner(_step())
        out = _sampler(runner)(_metadata(), None, logits, _sampling(temps, generators=gens)).sampled_token_ids
        draw = TopKTopPSampler("raw_logprobs")
        for b, tree, start, s in ((0, TREE_A, 0, seed), (2, TREE_C, 5, 100 + seed)):
            g = torch.Generator().manual_seed(s)
            node, want = 0, []
            while True:
                x = (logits[start + node].float() / temps[b]).unsqueeze(0)
                y = int(draw(x, {0: g}, None, None)[0][0])
                want.append(y)
                child = [j for j in range(1, tree.num_nodes) if tree.parents[j] == node and tree.tokens[j] == y]
                if not child:
                    break
                node = child[0]
            got = [t for t in out[b].tolist() if t != PLACEHOLDER_TOKEN_ID]
            assert got == want, (seed, b)


class _LawSpy(torch.nn.Module):
    """vLLM's ``Sampler`` recording the top-p / top-k of each call's metadata."""

    def __init__(self, sampler) -> None:
        super().__init__()
        self.inner, self.topk_topp_sampler, self.laws = sampler, sampler.topk_topp_sampler, []

    def forward(self, logits, sampling_metadata, **kwargs):
        md = sampling_metadata
        self.laws.append((None if md.top_p is None else md.top_p.tolist(), None if md.top_k is None else md.top_k.tolist()))
        return self.inner(logits=logits, sampling_metadata=md, **kwargs)


@pytest.mark.parametrize("verifier", ["nss", "deterministic"])
def test_the_bonus_call_drops_a_top_p_or_top_k_only_walked_rows_use(verifier, monkeypatch):
    """The step's bonus sampler call (vLLM's, every batch row) gets no top-p (top-k) when only
    rows of walked trees (a, c) use one: their bonus samples are replaced by the walks' tokens,
    and b's top-p of 1.0 (top-k of the vocabulary) masks nothing. When b uses one, the call
    keeps it, and b's token obeys it: a top-k of 1 (a top-p of 0.0625) leaves b its argmax 11,
    where b's row at temperature 2 would draw other tokens. b's token is the same either way
    as with the metadata untouched, seed by seed."""
    logits = _logits()
    logits[4] = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 0.3
    logits[4, 11] += 1.0  # b's argmax, with some mass left elsewhere
    cases = [  # (top_p, top_k, what the bonus call should see)
        ([0.5, 1.0, 0.875], [V, V, 2], (None, None)),
        ([0.5, 0.0625, 0.875], [V, V, V], ([0.5, 0.0625, 0.875], None)),
        ([1.0, 1.0, 1.0], [3, 1, V], (None, [3, 1, V])),
    ]
    for top_p, top_k, seen in cases:
        bs = []
        for seed in range(12):
            gens = {i: torch.Generator().manual_seed(10 * seed + i) for i in range(3)}
            runner = _Runner(_step())
            ts = _sampler(runner, verifier)
            ts.sampler = spy = _LawSpy(ts.sampler)
            md = _sampling([0.8, 2.0, 1.2], top_k=torch.tensor(top_k), top_p=torch.tensor(top_p), generators=gens)
            out = ts(_metadata(), None, logits.clone(), md).sampled_token_ids.tolist()
            assert spy.laws[0] == seen, (top_p, top_k)
            assert out[1][1:] == [PLACEHOLDER_TOKEN_ID] * 3
            bs.append(out[1][0])
            # the same step with the metadata as vLLM gave it: b draws the same token
            gens = {i: torch.Generator().manual_seed(10 * seed + i) for i in range(3)}
            ts = _sampler(_Runner(_step()), verifier)
            md = _sampling([0.8, 2.0, 1.2], top_k=torch.tensor(top_k), top_p=torch.tensor(top_p), generators=gens)
            with monkeypatch.context() as m:
                m.setattr(sampler_module, "_unwalked_laws", lambda md, rows, vocab: md)
                assert ts(_metadata(), None, logits.clone(), md).sampled_token_ids.tolist()[1][0] == bs[-1]
        if seen[0] is not None and top_p[1] < 1 or seen[1] is not None and top_k[1] < V:
            assert set(bs) == {11}, bs  # b's own top-p / top-k applied
        else:
            assert len(set(bs)) > 1, bs  # b samples: its row at temperature 2 is flat enough


@pytest.mark.parametrize("sampled", [False, True])
def test_edited_rows_are_walked_with_each_rows_own_past(sampled):
    """A request with row edits (``runner.RowEdits``): its tree rows are copied in float32 and
    edited, each with the output before it (``_row_pasts``), before the walk reads them. The
    edit here bans token 9, so a's root row falls to its runner-up 7 and a walks its spine.
    Sampled: every request at a temperature with a top-k of 1 (each draw its row's argmax), so
    the NSS walk (``_walk_sampled``) emits the greedy tokens of the edited rows; a tree of the
    same step without edits is walked on vLLM's rows as they are."""
    law = {"temperature": [0.9, 1.1, 0.7], "top_k": torch.tensor([1, 1, 1])} if sampled else {}
    logits = _logits(3)
    logits[0, 7] = logits[0, 9] - 0.5  # the root row's runner-up
    logits[1, 8] = logits[1].max() + 1.0  # after 7: 8; after 8 (row 2): 15, no child -> bonus
    calls = []

    class Ban:
        path = True

        def apply(self, rows, past, md, row):
            calls.append((rows.dtype, rows.shape[0], past, row))
            rows[:, 9] = -float("inf")

    class KeepC:  # c's edit, a no-op on the scores: its rows and pasts are what is checked
        path = True

        def apply(self, rows, past, md, row):
            calls.append((rows.dtype, rows.shape[0], past, row))

    runner = _Runner(_step())
    runner.row_edits = {"a": Ban(), "c": KeepC()}
    out = _sampler(runner)(_metadata(), None, logits, _sampling(**law))
    assert out.sampled_token_ids.tolist() == [[7, 8, 15, -1], GREEDY_OUT[1], GREEDY_OUT[2]]
    # each tree's own rows (4 and 3, not one row of the next tree), each row with its own past
    assert calls == [(torch.float32, 4, [[1, 5], [1, 5, 7], [1, 5, 7, 8], [1, 5, 9]], 0),
                     (torch.float32, 3, [[2, 3], [2, 3, 4], [2, 3, 4, 6]], 2)]
    assert runner.moves == []  # the leading chain: in place
    assert logits[0, 9] > logits[0, 7]  # vLLM's logits untouched
    # an edit of the second tree alone changes its walk: c's root row loses 4, its runner-up wins
    calls.clear()

    class BanC(KeepC):
        def apply(self, rows, past, md, row):
            super().apply(rows, past, md, row)
            rows[:, 4] = -float("inf")

    runner = _Runner(_step())
    runner.row_edits = {"c": BanC()}
    out = _sampler(runner)(_metadata(), None, logits, _sampling(**law))
    c_root = logits[5].clone()
    c_root[4] = -float("inf")
    assert out.sampled_token_ids.tolist() == [[9, 2, -1, -1], GREEDY_OUT[1], [int(c_root.argmax()), -1, -1, -1]]
    assert [c[1] for c in calls] == [3]


def test_row_pasts_and_sampling_tensors():
    assert _row_pasts(np.array([5, 7, 8, 9]), np.array([-1, 0, 1, 0]), [1, 5]) == [
        [1, 5], [1, 5, 7], [1, 5, 7, 8], [1, 5, 9]]
    md = _sampling([0.5, 0.0, 2.0])
    t = _sampling_tensors(md, [2, 0])
    assert t.temperature.tolist() == [2.0, 0.5] and t.top_k.tolist() == [-1, -1] and t.top_p.tolist() == [1.0, 1.0]
    md = replace(md, top_k=torch.tensor([3, 4, 5]), top_p=torch.tensor([0.5, 0.6, 0.7]))
    t = _sampling_tensors(md, [2, 0])
    assert t.top_k.tolist() == [5, 3] and t.top_p.tolist() == pytest.approx([0.7, 0.5])
    assert t.top_k.dtype == torch.long and t.top_p.dtype == torch.float32


def test_harvest_plain_hands_the_root_rows_to_the_drafter():
    runner = _Runner(None)
    harvest_plain(runner, torch.zeros(3, V))
    assert runner.drafter.observed == []
    roots = _step((DraftTree([5], [-1]), DraftTree([3], [-1])))
    runner = _Runner(roots)
    logits = torch.zeros(3, V)
    harvest_plain(runner, logits)
    ((step, accepted, num_accepted, starts, seen),) = runner.drafter.observed
    assert step is roots and starts.tolist() == [0, 2] and seen is logits
    assert accepted.tolist() == [[-1], [-1]] and num_accepted.tolist() == [0, 0]


def _draws(logits, tree, start, temperature, generator):
    """The reference NSS walk of one tree: the generator's draws one row at a time (vLLM's
    ``TopKTopPSampler`` on the row at ``temperature``), descending while a child holds the draw."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    draw = TopKTopPSampler("raw_logprobs")
    node, out = 0, []
    while True:
        x = (logits[start + node].float() / temperature).unsqueeze(0)
        y = int(draw(x, {0: generator}, None, None)[0][0])
        out.append(y)
        child = [j for j in range(1, tree.num_nodes) if tree.parents[j] == node and tree.tokens[j] == y]
        if not child:
            return out
        node = child[0]


class _NoVllmSampler(torch.nn.Module):
    def forward(self, *args):
        raise AssertionError("a step with a multi-node tree went to vLLM's rejection sampler")


PAIR = DraftTree([5, 9], [-1, 0], [NodeSource.ROOT, B])  # one draft
ROOT_ONLY = DraftTree([3], [-1])


def test_a_two_node_tree_beside_a_root_only_tree_and_a_plain_row():
    """Drafts [1, 0, 0]: a's tree of two nodes is walked (rows 0-1), b's bonus row 2 and c's
    root-only tree (row 3) keep vLLM's bonus sample. The walk's ``accepted`` is ``[T,
    max_depth]``, -1 padded, the root-only tree's row all -1. The host clocks are seconds of
    this call (none negative, none longer than the call)."""
    import time

    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(7))
    for row, token in {0: 9, 1: 12, 2: 10, 3: 1}.items():
        logits[row, token] = logits[row].max() + 3.0
    runner = _Runner(_step((PAIR, ROOT_ONLY)))
    ts = _sampler(runner)
    ts.original = _NoVllmSampler()
    t0 = time.perf_counter()
    out = ts(_metadata([[9], [], []]), None, logits, _sampling())
    elapsed = time.perf_counter() - t0
    assert out.sampled_token_ids.tolist() == [[9, 12], [10, -1], [1, -1]]
    ((_, accepted, num_accepted, starts, _),) = runner.drafter.observed
    assert accepted.tolist() == [[1], [-1]] and num_accepted.tolist() == [1, 0] and starts.tolist() == [0, 3]
    assert runner.moves == []
    for phase in ("walk", "kv"):
        assert 0.0 <= runner.host_clock.seconds[phase] <= elapsed, phase


def test_seeded_sampled_rows_draw_as_fresh_generators_whatever_their_tree():
    """Seeded sampled requests with a two-node tree (a), no tree (b) and a root-only tree (c),
    NSS: a's tokens are its generator's draws along its walk, b's and c's the first draw from
    their one row, each generator used by one sampler only (a generator drawn for a's bonus row
    before the walk, or c's row walked as a tree, would shift the draws)."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(8)) * 0.5
    logits[0, 9] += 1.0  # the walk descends into a's node sometimes
    temps = [0.9, 1.1, 0.7]
    descended = 0
    for seed in range(8):
        seeds = [seed, 50 + seed, 90 + seed]
        gens = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)}
        runner = _Runner(_step((PAIR, ROOT_ONLY)))
        ts = _sampler(runner)
        ts.original = _NoVllmSampler()
        out = ts(_metadata([[9], [], []]), None, logits, _sampling(temps, generators=gens)).sampled_token_ids
        got = [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in out.tolist()]
        want = [_draws(logits, PAIR, 0, temps[0], torch.Generator().manual_seed(seeds[0])),
                _draws(logits, ROOT_ONLY, 2, temps[1], torch.Generator().manual_seed(seeds[1])),
                _draws(logits, ROOT_ONLY, 3, temps[2], torch.Generator().manual_seed(seeds[2]))]
        assert got == want, seed
        descended += len(got[0]) == 2
    assert 0 < descended < 8  # both outcomes of a's walk were exercised


def test_a_fault_inside_a_sampled_walk_restores_the_generators_first():
    """The NSS walk fails after its first depth drew: the fallback restores each walked
    request's generator to the step's start and draws once from its root row, so the token is
    the one a fresh generator of its seed draws there (not the generator's second draw)."""
    temps = [1.0, 0.0, 1.0]
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(10)) * 0.3
    for seed in range(4):
        gens = {0: torch.Generator().manual_seed(seed), 2: torch.Generator().manual_seed(20 + seed)}
        runner = _Runner(_step())
        ts = _sampler(runner)
        real = ts.draw  # the walk's draws (vLLM's sampler's, cpu_draw.py)

        def flaky(*args, **kwargs):
            real(*args, **kwargs)  # the generators draw
            raise ValueError("the walk fails after drawing")  # at its first depth

        ts.draw = flaky
        out = ts(_metadata(), None, logits, _sampling(temps, generators=gens)).sampled_token_ids.tolist()
        assert runner.drafter.contained == [("verify", ["a", "c"])]
        for b, start, s in ((0, 0, seed), (2, 5, 20 + seed)):
            want = _draws(logits, ROOT_ONLY, start, temps[b], torch.Generator().manual_seed(s))
            assert out[b] == want + [-1, -1, -1], (seed, b)
        assert out[1] == [int(logits[4].argmax()), -1, -1, -1]


def test_the_walks_clock_leaves_out_vllms_sampler_the_harvest_and_the_moves():
    """``walk`` is the sampler's own host work: vLLM's sampler for the bonus rows, the drafter's
    ``observe_step`` (its own ``harvest`` phase) and the K/V moves (``kv``) are timed apart.
    Each of those three is made to take 0.1 s here; the walk itself takes milliseconds."""
    import time

    runner = _Runner(_step())
    slow = 0.1
    observe, move = runner.drafter.observe_step, runner.move_kv
    runner.drafter.observe_step = lambda *a: (time.sleep(slow), observe(*a))[1]
    runner.move_kv = lambda *a: (time.sleep(slow), move(*a))[1]
    ts = _sampler(runner)
    bonus = ts.sampler.forward
    ts.sampler.forward = lambda *a, **k: (time.sleep(slow), bonus(*a, **k))[1]
    out = ts(_metadata(), None, _logits(), _sampling())
    assert out.sampled_token_ids.tolist() == GREEDY_OUT
    clock = runner.host_clock.seconds
    assert 0.0 <= clock["walk"] < slow, clock
    assert slow <= clock["kv"] < 2 * slow, clock


def test_after_a_verify_fault_penalties_see_the_output_not_the_drafts(monkeypatch):
    """The fallback samples each tree's root row as plain decoding does: penalties count the
    request's output only, not its tree's drafts (vLLM's ``predict_bonus_token`` would add the
    scheduled drafts to the output). a's root row prefers its draft 9 by 2.0 over 13; a presence
    penalty of 5 on 9 would flip it."""
    monkeypatch.setattr(sampler_module, "inject", lambda stage: (_ for _ in ()).throw(ValueError("x"))
                        if stage == "verify" else None)
    logits = torch.zeros(8, V)
    logits[0, 9], logits[0, 13] = 4.0, 2.0
    logits[5, 4] = 3.0
    md = replace(_sampling(), no_penalties=False, presence_penalties=torch.tensor([5.0, 0.0, 0.0]),
                 prompt_token_ids=torch.full((3, 1), V, dtype=torch.int64), output_token_ids=[[1], [2], [3]],
                 spec_token_ids=[list(d) for d in DRAFTS])
    runner = _Runner(_step())
    out = _sampler(runner)(_metadata(), None, logits, md).sampled_token_ids.tolist()
    assert [row[0] for row in out] == [9, int(logits[4].argmax()), 4]


def test_a_temperature_of_exactly_the_sampling_epsilon_samples_as_vllm_does():
    """vLLM samples a row whose temperature is >= its epsilon (1e-5) and takes the argmax below:
    at exactly 1e-5 a's root row, with 7 and 9 tied for the maximum, is a draw of its generator
    (either child, as the seed falls), not the greedy argmax (always 7, the lower id)."""
    from vllm_anisotropic.verifiers.sampling import SAMPLING_EPS

    logits = _logits(4)
    logits[0, 7] = logits[0, 9]
    temps = [SAMPLING_EPS, 0.0, 0.0]
    firsts = set()
    for seed in range(8):
        runner = _Runner(_step())
        md = _sampling(temps, generators={0: torch.Generator().manual_seed(seed)})
        out = _sampler(runner)(_metadata(), None, logits, md).sampled_token_ids.tolist()
        want = _draws(logits, TREE_A, 0, SAMPLING_EPS, torch.Generator().manual_seed(seed))
        assert [t for t in out[0] if t != PLACEHOLDER_TOKEN_ID] == want, seed
        firsts.add(want[0])
    assert firsts == {7, 9}


def _other_rank(monkeypatch, other):
    """Tensor parallelism: ``faults.agree`` with one more rank whose flags are ``other`` (a flag
    per batch row, then its verify fault); records the flags this rank sends."""
    sent = []

    def agree(flags, group):
        assert group == "tp-group"
        sent.append(flags.tolist())
        return flags | np.asarray(other, bool)

    monkeypatch.setattr(sampler_module, "agree", agree)
    return sent


def _tp_runner(step):
    runner = _Runner(step)
    runner.tree_ranks = "tp-group"
    return runner


def test_a_tree_another_rank_lacks_is_verified_by_no_rank(monkeypatch):
    """Rank 1 had no tree for c (a fault there): here c's token is its root row's, c loses
    trees ("ranks"), a is walked as usual, and only a is observed."""
    sent = _other_rank(monkeypatch, [0, 0, 1, 0])
    runner = _tp_runner(_step())
    out = _sampler(runner)(_metadata(), None, _logits(), _sampling())
    assert sent == [[False, False, False, False]]
    assert out.sampled_token_ids.tolist() == [[9, 2, -1, -1], [11, -1, -1, -1], [4, -1, -1, -1]]
    assert runner.drafter.contained == [("ranks", ["c"])] and runner.drafter.forgotten == 1
    assert runner.moves == [([3], [1])]
    ((step, accepted, num_accepted, starts, _),) = runner.drafter.observed
    assert step.req_ids == ["a"] and step.rows.tolist() == [0] and step.node_rows.tolist() == [1]
    assert accepted.tolist() == [[3, -1]] and num_accepted.tolist() == [1] and starts.tolist() == [0]


def test_this_ranks_void_tree_is_sent_and_verified_by_no_rank(monkeypatch):
    """Here c's drafts came without a tree of this rank's (``take_step``'s void chain, whose
    root token is a placeholder): c's row is flagged to the other ranks and c's token is its
    root row's, never a walk of the chain."""
    sent = _other_rank(monkeypatch, [0, 0, 0, 0])
    step = _step((TREE_A, DraftTree([0, 4, 6], [-1, 0, 1])))
    step.void = np.array([False, True])
    runner = _tp_runner(step)
    out = _sampler(runner)(_metadata(), None, _logits(), _sampling())
    assert sent == [[False, False, True, False]]
    assert out.sampled_token_ids.tolist() == [[9, 2, -1, -1], [11, -1, -1, -1], [4, -1, -1, -1]]
    assert runner.drafter.contained == [("ranks", ["c"])]
    ((step, *_),) = runner.drafter.observed
    assert step.req_ids == ["a"]


def test_ranks_that_agree_keep_their_tables_refresh_windows(monkeypatch):
    """Nothing flagged by any rank: the trees are walked as on one rank, and the tables' refresh
    windows are not started over (``forget_writes`` only when the ranks' trees differ)."""
    sent = _other_rank(monkeypatch, [0, 0, 0, 0])
    runner = _tp_runner(_step())
    _sampler(runner)(_metadata(), None, _logits(), _sampling())
    assert sent == [[False, False, False, False]]
    assert runner.drafter.contained == [] and runner.drafter.forgotten == 0
    assert [s.req_ids for s, *_ in runner.drafter.observed] == [["a", "c"]]


def test_another_ranks_verify_fault_gives_every_tree_its_root_rows_token(monkeypatch):
    sent = _other_rank(monkeypatch, [0, 0, 0, 1])
    runner = _tp_runner(_step())
    out = _sampler(runner)(_metadata(), None, _logits(), _sampling())
    assert sent == [[False, False, False, False]]
    assert out.sampled_token_ids.tolist() == [[9, -1, -1, -1], [11, -1, -1, -1], [4, -1, -1, -1]]
    assert runner.drafter.contained == [("ranks", ["a", "c"])] and runner.drafter.forgotten == 1
    assert runner.moves == []
    ((step, accepted, num_accepted, _, _),) = runner.drafter.observed
    assert step.req_ids == ["a", "c"] and num_accepted.tolist() == [0, 0]


def test_this_ranks_verify_fault_is_sent_to_the_other_ranks(monkeypatch):
    def failing(stage):
        if stage == "verify":
            raise ValueError("broken walk")

    monkeypatch.setattr(sampler_module, "inject", failing)
    sent = _other_rank(monkeypatch, [0, 0, 1, 0])
    runner = _tp_runner(_step())
    out = _sampler(runner)(_metadata(), None, _logits(), _sampling())
    assert sent == [[False, False, False, True]]
    assert out.sampled_token_ids.tolist() == [[9, -1, -1, -1], [11, -1, -1, -1], [4, -1, -1, -1]]
    assert runner.drafter.contained == [("verify", ["a", "c"])] and runner.drafter.forgotten == 1
    ((step, *_),) = runner.drafter.observed
    assert step.req_ids == ["a"]  # c: void on the other rank, not observed


def test_a_tree_another_rank_lacks_draws_once_from_its_restored_generator(monkeypatch):
    """Seeded sampled rows (NSS): a is walked with its generator; c, which the other rank lacks,
    gets the first draw of a fresh generator of its seed from its root row (its generator
    restored after this rank's walk drew from it), as plain decoding draws it."""
    temps = [1.0, 0.0, 1.0]
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(11)) * 0.3
    _other_rank(monkeypatch, [0, 0, 1, 0])
    for seed in range(4):
        gens = {0: torch.Generator().manual_seed(seed), 2: torch.Generator().manual_seed(30 + seed)}
        runner = _tp_runner(_step())
        out = _sampler(runner)(_metadata(), None, logits, _sampling(temps, generators=gens)).sampled_token_ids.tolist()
        want_a = _draws(logits, TREE_A, 0, 1.0, torch.Generator().manual_seed(seed))
        want_c = _draws(logits, ROOT_ONLY, 5, 1.0, torch.Generator().manual_seed(30 + seed))
        assert out[0] == want_a + [-1] * (4 - len(want_a)), seed
        assert out[2] == want_c + [-1, -1, -1], seed
        assert runner.drafter.contained == [("ranks", ["c"])]


def test_logits_starts_against_vllms_running_sum_on_random_batches():
    """``kernels.emit.logits_starts`` against its definitions: tree t's root row is the first of
    its batch row's ``num_draft + 1`` rows (vLLM's ``cu_num_sampled_tokens`` minus them), the walked
    trees are those with a draft node, and ``bad`` is the first batch row whose draft count is not
    its tree's (0 without a tree); a count off by one anywhere, a row without a tree holding
    drafts, or a tree at another row is caught."""
    from random_trees import random_trees
    from vllm_anisotropic.kernels import load

    emit = load("emit")
    rng = np.random.default_rng(11)
    for _ in range(300):
        trees = FlatTrees.from_trees(random_trees(rng))
        num = trees.num_trees
        batch = num + int(rng.integers(0, 4))
        rows = np.sort(rng.choice(batch, num, replace=False)).astype(np.int64)
        num_draft = np.zeros(batch, np.int64)
        num_draft[rows] = trees.sizes() - 1
        if rng.random() < 0.5:  # a wrong count somewhere
            num_draft[int(rng.integers(0, batch))] += int(rng.choice([-1, 1, 2]))
            num_draft = np.maximum(num_draft, 0)
        starts, walked = np.full(num, -7, np.int64), np.full(num, -7, np.int64)
        m, bad = emit.logits_starts(num_draft, rows, trees.offsets, starts, walked)
        cu = np.cumsum(num_draft + 1)
        assert starts.tolist() == (cu - num_draft - 1)[rows].tolist()
        assert walked[:m].tolist() == np.flatnonzero(trees.sizes() > 1).tolist()
        expected = np.zeros(batch, np.int64)
        expected[rows] = trees.sizes() - 1
        differ = np.flatnonzero(num_draft != expected)
        assert bad == (int(differ[0]) if differ.size else -1)


def test_harvest_rows_against_their_definition():
    """``kernels.emit.harvest_rows``: the kept trees' logits rows, tree by tree (tree t's
    ``num_nodes`` rows from its start), none of the others'."""
    from random_trees import random_trees
    from vllm_anisotropic.kernels import load

    emit = load("emit")
    rng = np.random.default_rng(12)
    for _ in range(300):
        trees = FlatTrees.from_trees(random_trees(rng))
        sizes = trees.sizes()
        row_starts = np.cumsum(sizes + rng.integers(0, 3, trees.num_trees)) - sizes
        keep = rng.random(trees.num_trees) < 0.7
        out = np.full(trees.num_nodes, -7, np.int64)
        m = emit.harvest_rows(row_starts, trees.offsets, keep, out)
        want = [int(row_starts[t]) + j for t in range(trees.num_trees) if keep[t] for j in range(int(sizes[t]))]
        assert out[:m].tolist() == want


def test_a_wrong_draft_count_is_refused_at_any_batch_row():
    """The draft-count check names the first disagreeing batch row wherever it is: the first
    row (a tree with fewer drafts scheduled than it has), or a row without a tree that has
    drafts (expected 0)."""
    runner = _Runner(_step())
    with pytest.raises(RuntimeError, match="batch row 0 has 2 drafts but its draft tree 3"):
        _sampler(runner)(_metadata([[7, 8], [], [4, 5]]), None, _logits()[:7], _sampling())
    runner = _Runner(_step())
    with pytest.raises(RuntimeError, match="batch row 1 has 1 drafts but its draft tree 0"):
        _sampler(runner)(_metadata([[7, 8, 9], [5], [4, 5]]), None, _logits(), _sampling())


def test_an_all_greedy_cpu_step_walks_every_tree_in_one_call(monkeypatch):
    """All greedy, no logits edits, every tree this rank's, CPU logits: the walk alone, once,
    over every tree of the step (a root-only tree walks to no path; its row keeps vLLM's bonus
    sample); the same tokens as the general path."""
    walks = []
    real = sampler_module.walk_flat
    monkeypatch.setattr(sampler_module, "walk_flat", lambda trees, *a: walks.append(trees.num_trees) or real(trees, *a))
    step = _step((TREE_A, DraftTree([11], [-1]), TREE_C), rows=(0, 1, 2), ids=("a", "b", "c"))
    step.node_rows = np.array([1, 5, 6], np.int64)
    step.root_positions = np.array([10, 15, 20], np.int64)
    runner = _Runner(step)
    out = _sampler(runner)(_metadata(), None, _logits(), _sampling())
    assert walks == [3]
    assert out.sampled_token_ids.tolist() == GREEDY_OUT
