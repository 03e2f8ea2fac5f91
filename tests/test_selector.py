"""The (K, L1, L2) selector (``vllm_anisotropic.selector``): labels, training, files.

What these would catch: a training objective that does not learn (a sign flip of Eq. 5, the
policy read as argmin, the times ignored: ``test_learns_...``), training that depends on
anything but the seed, choices outside the grid, a selector file accepted although corrupted,
of another version, trained on other features, or with actions outside the paper's grid, and
Eq. 11 or the T = 0 labels computed from the wrong fields.
"""

from __future__ import annotations

import dataclasses
import gzip
import json

import numpy as np
import pytest
import torch

from vllm_anisotropic.proposers.draft_model import DelayedShape
from vllm_anisotropic.selector.features import FEATURES
from vllm_anisotropic.selector.policy import JSON_NAME, WEIGHTS_NAME, SelectorFileError, ShapeSelector, action_grid
from vllm_anisotropic.selector.train import (Examples, batch_step_time, cross_validate, fit, format_report, load_examples,
                                             step_scores, step_time)

TIMING = {"kind": "timing", "t_q": {"1": 0.1, "2": 0.12, "3": 0.14, "4": 0.2},
          "t_p": {str(n): 0.3 + 0.01 * n for n in range(1, 42)}}


def test_action_grid_is_the_papers_without_duplicates():
    grid = action_grid()
    assert len(grid) == 4 * 9 * 9 - 3 * 9 == 297  # K > 1 with L2 = 0 repeats the K = 1 chain
    assert (1, 8, 0) in grid and (4, 8, 8) in grid and (2, 3, 0) not in grid
    assert all(l1 + k * l2 <= 8 for k, l1, l2 in action_grid(8)) and (1, 8, 0) in action_grid(8)


def test_step_time_is_eq_11():
    # (2, 3, 4): 3 trunk forwards of one token, 4 branch forwards of two, one target pass of 12 nodes
    assert step_time((2, 3, 4), TIMING) == pytest.approx(3 * 0.1 + 4 * 0.12 + 0.3 + 0.01 * 12)
    assert step_time((1, 0, 0), TIMING) == pytest.approx(0.31)
    # one of 4 requests: a quarter of q's trunk forwards of 4 rows, of its branch forwards of 8 rows
    # and of the target forward verifying the 4 trees (48 nodes)
    timing = {**TIMING, "t_p": {**TIMING["t_p"], "48": 0.9}, "t_q": {**TIMING["t_q"], "8": 0.3}}
    assert step_time((2, 3, 4), timing, 4) == pytest.approx((3 * 0.2 + 4 * 0.3 + 0.9) / 4)
    assert step_time((1, 0, 0), timing, 4) == pytest.approx((0.3 + 0.04) / 4)  # plain: no q forward needed
    with pytest.raises(ValueError, match="no target forward of 48 tokens"):
        step_time((2, 3, 4), {**TIMING, "t_q": timing["t_q"]}, 4)
    with pytest.raises(ValueError, match="no draft forward of 8 rows"):
        step_time((2, 3, 4), {**timing, "t_q": TIMING["t_q"]}, 4)


def test_a_batched_step_pays_the_deepest_shape_of_its_requests():
    """``batch_step_time`` counts q's forwards as the engine runs them (``draft_batch``): the
    catch-up of the drafting rows, a trunk depth's rows, the branch lanes past each depth, one
    target pass of all trees. Fails if a shallow request is charged the deep one's rows, the
    step is priced as the sum or the mean of its requests, or a missing count is not interpolated."""
    # (2, 1, 2) twice: catch-up of 2 rows, trunk depth 0 of 2 rows, branch depth 0 of 4 lanes, 12 nodes
    assert batch_step_time([(2, 1, 2)] * 2, TIMING) == pytest.approx(0.12 + 0.12 + 0.2 + 0.3 + 0.12)
    # a chain of 3 (forwards after its nodes 1 and 2), branches of 1 from the root (none) and a plain row
    assert batch_step_time([(1, 3, 0), (2, 0, 1), (1, 0, 0)], TIMING) == pytest.approx(0.12 + 0.1 + 0.1 + 0.3 + 0.08)
    assert batch_step_time([(1, 0, 0)] * 3, TIMING) == pytest.approx(0.33)  # plain: the target alone
    assert batch_step_time([(1, 1, 0)], TIMING) == pytest.approx(0.1 + 0.32)  # one draft: the catch-up alone
    # a chain of 2 beside branches of 3 from the root: q runs the branches' two depths for the step
    assert batch_step_time([(1, 2, 0), (2, 0, 3)], TIMING) == pytest.approx(0.12 + 0.1 + 0.12 + 0.12 + 0.4)
    # 3 rows where only 2 and 4 were timed: halfway
    gap = {**TIMING, "t_q": {"1": 0.1, "2": 0.12, "4": 0.2}}
    assert batch_step_time([(1, 2, 0)] * 3, gap) == pytest.approx(0.16 + 0.16 + 0.3 + 0.09)


def test_step_scores_price_whole_steps():
    """Two steps of two requests (a fifth row makes no step of its own), (1, 0, 0) against a chain
    (1, 3, 0). Each request's own choice mixes plain and chain rows in a step, which pays the
    chain's forwards for one request; the summed log-policy gives each step one shape; the static
    shape is the step's first request's for all; the step oracle takes the best single shape."""
    actions = [(1, 0, 0), (1, 3, 0)]
    e = np.array([[1.0, 3.5], [1.0, 1.1], [1.0, 3.0], [1.0, 3.0], [1.0, 3.0]])
    pi = np.log(np.array([[0.1, 0.9], [0.6, 0.4], [0.2, 0.8], [0.3, 0.7], [0.3, 0.7]]))
    ex = Examples(np.zeros((5, len(FEATURES))), {"traversal": e}, np.ones((5, 2)), np.array(list("abcde")), actions,
                  np.full(5, 2), [TIMING], np.zeros(5, np.int64))
    static = np.array([1, 1, 0, 0, 0])  # the shuffle makes steps (2, 0) and (1, 3): first requests 0 and 1
    got = step_scores(ex, np.arange(4), 2, "traversal", pi.argmax(1), pi, static, seed=0)
    chain, plain, mixed = (batch_step_time(a, TIMING) for a in ([(1, 3, 0)] * 2, [(1, 0, 0)] * 2,
                                                                [(1, 3, 0), (1, 0, 0)]))
    assert got["steps"] == 2 and step_scores(ex, np.arange(5), 2, "traversal", pi.argmax(1), pi, static)["steps"] == 2
    # every step's rows are {0, 1} or {2, 3} or a mix; summed log-policy picks the chain in each
    assert got["selector_step"]["tokens_per_s"] == pytest.approx(e[:4, 1].sum() / (2 * chain))
    assert got["selector_step"]["block_efficiency"] == pytest.approx(e[:4, 1].mean())
    assert got["selector_step"]["step_s"] == pytest.approx(chain)
    steps = np.random.default_rng(0).permutation(4).reshape(2, 2)  # step_scores' shuffle
    value = sum(e[step, static[step[0]]].sum() for step in steps)
    time = sum(batch_step_time([actions[static[step[0]]]] * 2, TIMING) for step in steps)
    assert got["static_per_batch"]["tokens_per_s"] == pytest.approx(value / time)
    assert got["oracle_step"]["tokens_per_s"] >= max(got[k]["tokens_per_s"] for k in ("selector", "selector_step"))
    # request 1 alone chooses plain: whichever step holds it is mixed
    assert got["selector"]["step_s"] == pytest.approx((mixed + chain) / 2)


def test_batch_labels_price_q_batched():
    """q's forward of b rows serves b requests: when it costs little more than one row, a chain pays
    in a wide batch; when it costs b rows' worth, it does not (the target's forward is the same in
    both). Fails if a request of a batch is charged t_q(1) or t_q(K) (q drafted alone)."""
    t_p = {str(n): 0.5 + 0.002 * n for n in range(1, 60)}
    flat = {"t_q": {str(m): 0.08 for m in range(1, 33)}, "t_p": t_p}
    per_row = {"t_q": {str(m): 0.08 * m for m in range(1, 33)}, "t_p": t_p}
    value = 1 + sum(0.8 ** d for d in range(1, 7))  # chain of 6, E[tau + 1]
    for timing, chain_pays in ((flat, True), (per_row, False)):
        plain, chain = step_time((1, 0, 0), timing, 8), step_time((1, 6, 0), timing, 8) / value
        assert (chain < plain) == chain_pays, (timing["t_q"]["8"], chain, plain)
    assert step_time((2, 2, 2), flat, 8) == pytest.approx((2 * 0.08 + 2 * 0.08 + 0.5 + 0.002 * 56) / 8)


def test_learns_which_shape_pays_from_the_batch_size(tmp_path):
    """The same roots at batch sizes 1 and 8, with a target forward that costs little more for
    more tokens and q's forward that costs each row the same however many share it: a long chain pays alone, plain
    decoding in the wide batch. Fails if the batch size is not a feature, the times are not
    divided by the batch size, or the rows of one root get one batch size."""
    actions = [(1, 0, 0), (1, 2, 0), (1, 6, 0)]
    timing = {"kind": "timing", "t_q": {str(m): 0.08 * m for m in range(1, 33)},  # q: no gain from batching
              "t_p": {str(n): 0.5 + 0.002 * n for n in range(1, 60)}}
    vals = {f"{k},{l1},{l2}": {"greedy": 1 + sum(0.8 ** d for d in range(1, l1 + 1))} for k, l1, l2 in actions}
    roots = [{"kind": "root", "temperature": 0.0, "dataset": "d", "prompt": i, "context_len": 50 + i,
              "features": {"entropy_q": 0.5}, "values": vals} for i in range(40)]
    path = tmp_path / "grid.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [timing, *roots]))
    ex = load_examples([str(path)], max_drafts=6, batch_sizes=(1, 8))
    assert len(ex) == 80 and ex.features[:, 4].tolist() == [0.0, np.log(8)] * 40
    keep = [ex.actions.index(a) for a in actions]  # the three actions the roots have values for
    ex = dataclasses.replace(ex, values={v: x[:, keep] for v, x in ex.values.items()}, time=ex.time[:, keep],
                             actions=actions)
    best = (ex.values["traversal"] / ex.time).argmax(1)
    assert set(best[ex.batch == 1]) == {2} and set(best[ex.batch == 8]) == {0}  # chain of 6 alone, plain in 8
    sel = fit(ex, np.arange(len(ex)), "traversal", seed=0, epochs=300, lr=1e-2)
    assert (sel.choose_index(ex.features) == best).all()
    cv = cross_validate(ex, "traversal", folds=4, seed=0, epochs=300, lr=1e-2)
    one, eight = cv["by_batch_size"]["1"], cv["by_batch_size"]["8"]
    assert eight["static_per_batch_actions"] == {"1,0,0": 40} and one["static_per_batch_actions"] == {"1,6,0": 40}
    for part in (one, eight):  # each batch size is its own workload
        assert part["selector"]["tokens_per_s"] == pytest.approx(part["static_per_batch"]["tokens_per_s"])
    assert eight["selector"]["tokens_per_s"] > 1.2 * eight["selector_without_batch"]["tokens_per_s"], eight
    assert "geometric mean over batch sizes 1, 8" in format_report("traversal", cv)


def _synthetic(n: int = 240, seed: int = 0) -> Examples:
    """Roots where q's entropy decides: a confident q (low entropy) makes long chains pay, an
    unsure one makes them lose (each draft accepted with probability 0.95 or 0.2)."""
    rng = np.random.default_rng(seed)
    actions = [(1, 0, 0), (1, 2, 0), (1, 6, 0), (2, 0, 2)]
    t = np.array([step_time(a, TIMING) for a in actions])
    h = rng.uniform(0, 3, n)
    accept = np.where(h < 1.5, 0.95, 0.2)
    e = np.stack([(accept[:, None] ** np.arange(1, l1 + l2 + 1)).sum(1) + 1 if l1 + l2 else np.ones(n)
                  for k, l1, l2 in actions], 1)
    feats = np.stack([h, np.full(n, np.log1p(200)), np.full(n, 0.7), np.ones(n), np.zeros(n)], 1)
    return Examples(feats, {"traversal": e, "specinfer": e}, np.tile(t, (n, 1)),
                    np.array([f"d/{i // 2}" for i in range(n)]), actions)


def test_learns_which_shape_pays_from_the_entropy():
    ex = _synthetic()
    sel = fit(ex, np.arange(0, len(ex), 2), "traversal", seed=0, epochs=300, lr=1e-2)
    test = np.arange(1, len(ex), 2)
    best = (ex.values["traversal"] / ex.time).argmax(1)[test]
    assert set(best) == {0, 2}  # both regimes present: a constant choice cannot pass
    assert (sel.choose_index(ex.features[test]) == best).mean() > 0.95
    cv = cross_validate(ex, "traversal", folds=4, seed=0, epochs=300, lr=1e-2)
    assert cv["selector"]["tokens_per_s"] > 1.2 * cv["static"]["tokens_per_s"], cv


def test_training_is_reproducible_and_seeded():
    ex = _synthetic()
    rows = np.arange(len(ex))
    a, b, c = (fit(ex, rows, "traversal", seed=s, epochs=20).net.state_dict() for s in (3, 3, 4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_choices_are_shapes_of_the_grid(tmp_path):
    ex = _synthetic()
    sel = fit(ex, np.arange(len(ex)), "traversal", epochs=5)
    feats = np.random.default_rng(1).normal(0, 100, (500, len(FEATURES)))  # far outside the training range
    assert set(sel.choose_index(feats)) <= set(range(len(ex.actions)))
    shape = sel.choose(feats[0])
    assert isinstance(shape, DelayedShape) and (shape.branches, shape.trunk, shape.branch_length) in ex.actions
    assert sel.max_drafts == 6


def test_a_steps_shape_is_the_highest_summed_log_policy():
    """Three requests of one step: two prefer (1, 2, 0) mildly (pi 0.9 / 0.1), one (2, 1, 1)
    strongly (0.001 / 0.999). The product of their policies picks (2, 1, 1) for all three; the
    first request's choice, a vote of the choices and the summed probabilities would pick
    (1, 2, 0). One request alone gets its own argmax."""
    sel = ShapeSelector(net=torch.nn.Identity(), mean=np.zeros(len(FEATURES)), std=np.ones(len(FEATURES)),
                        actions=[(1, 2, 0), (2, 1, 1)], verifier="traversal")
    pi = {0: [0.9, 0.1], 1: [0.9, 0.1], 2: [0.001, 0.999]}
    sel.logits = lambda f: torch.tensor([pi[int(row[0])] for row in np.atleast_2d(f)]).log() + 3.0 * torch.arange(
        len(np.atleast_2d(f)))[:, None]  # a constant per row: the logits are not normalized
    step = np.array([[r, 0, 0, 1, 0] for r in range(3)], np.float64)
    assert sel.choose_shapes(step) == [DelayedShape(2, 1, 1)] * 3
    assert sel.choose_shapes(step[:2]) == [DelayedShape(1, 2, 0)] * 2
    assert sel.choose(step[0]) == DelayedShape(1, 2, 0) and sel.choose(step[2]) == DelayedShape(2, 1, 1)


def test_file_round_trip_and_refusals(tmp_path):
    ex = _synthetic()
    sel = fit(ex, np.arange(len(ex)), "specinfer", epochs=30)
    sel.meta["pair"] = {"target": "t", "draft": "d"}
    good = sel.save(tmp_path / "good")
    back = ShapeSelector.load(good)
    feats = ex.features[:50]
    assert np.array_equal(back.choose_index(feats), sel.choose_index(feats))
    assert back.verifier == "specinfer" and back.actions == ex.actions and back.meta["pair"]["draft"] == "d"

    def broken(name: str, edit) -> str:
        d = tmp_path / name
        d.mkdir()
        for f in (JSON_NAME, WEIGHTS_NAME):
            (d / f).write_bytes((good / f).read_bytes())
        edit(d)
        with pytest.raises(SelectorFileError) as err:
            ShapeSelector.load(d)
        return str(err.value)

    def edit_json(**changes):
        def edit(d):
            doc = json.loads((d / JSON_NAME).read_text())
            doc.update(changes)
            (d / JSON_NAME).write_text(json.dumps(doc))
        return edit

    def flip_byte(d):
        raw = bytearray((d / WEIGHTS_NAME).read_bytes())
        raw[-3] ^= 0x55
        (d / WEIGHTS_NAME).write_bytes(bytes(raw))

    assert "checksum" in broken("corrupt", flip_byte)
    assert "version 2" in broken("version", edit_json(version=2))
    assert "features" in broken("features", edit_json(features=["entropy_p", *FEATURES[1:]]))
    assert "outside" in broken("grid", edit_json(actions=[[5, 0, 0]] + [list(a) for a in ex.actions[1:]]))
    assert "missing" in broken("missing", lambda d: (d / WEIGHTS_NAME).unlink())
    assert "not valid JSON" in broken("json", lambda d: (d / JSON_NAME).write_text("{"))
    for cap in (0, 2.5, "2", True):
        assert f"max_batch_size {cap!r}" in broken(f"cap-{cap}", edit_json(max_batch_size=cap))
    # weights that fit another grid: the checksum matches (recomputed) but the shapes do not
    def fewer_actions(d):
        doc = json.loads((d / JSON_NAME).read_text())
        doc["actions"] = doc["actions"][:2]
        (d / JSON_NAME).write_text(json.dumps(doc))
    assert "does not fit" in broken("shapes", fewer_actions)


def test_examples_from_grid_records(tmp_path):
    actions = action_grid(2)
    def root(temp, prompt, e):
        vals = {f"{k},{l1},{l2}": ({"greedy": e} if temp == 0 else {"traversal": e, "specinfer": e - 0.5})
                for k, l1, l2 in actions}
        return {"kind": "root", "temperature": temp, "dataset": "humaneval", "prompt": prompt, "context_len": 99,
                "features": {"entropy_q": 0.25, "context_len": 99}, "values": vals}
    path = tmp_path / "grid.jsonl.gz"
    path.write_bytes(gzip.compress("\n".join(json.dumps(r) for r in (TIMING, root(0.0, 0, 2.0), root(0.7, 1, 3.0))).encode()))
    ex = load_examples([str(path)], max_drafts=2)
    assert ex.actions == actions and len(ex) == 2
    assert ex.features[0].tolist() == pytest.approx([0.25, np.log(100), 0.0, 1.0, 0.0])
    assert np.all(ex.values["specinfer"][0] == 2.0)  # T = 0: every verifier is the greedy walk
    assert np.all(ex.values["specinfer"][1] == 2.5) and np.all(ex.values["traversal"][1] == 3.0)
    assert ex.time[0, actions.index((2, 0, 1))] == pytest.approx(0.12 + 0.3 + 0.03)
    assert list(ex.groups) == ["humaneval/0", "humaneval/1"]
    (tmp_path / "no_timing.jsonl").write_text(json.dumps(root(0.0, 0, 2.0)) + "\n")
    with pytest.raises(ValueError, match="no timing record"):
        load_examples([str(tmp_path / "no_timing.jsonl")])


def test_train_command_stores_what_q_ran_in_when_timed(tmp_path):
    """``selector train`` writes the timing record's ``draft_quantization`` into the file (the
    shipped selector of a pair is chosen by it, test_selector_runtime.py): that of ``--timing``
    when given, else the records' own, ``none`` for a timing record from before the key."""
    import argparse

    from vllm_anisotropic.selector.train import add_parser, run_train

    actions = action_grid(2)
    roots = [{"kind": "root", "temperature": 0.0, "dataset": "humaneval", "prompt": i, "context_len": 99,
              "features": {"entropy_q": 0.1 * i, "context_len": 99},
              "values": {f"{k},{l1},{l2}": {"greedy": 1.0 + l1 + k * l2} for k, l1, l2 in actions}} for i in range(6)]
    grid = tmp_path / "grid.jsonl"
    grid.write_text("\n".join(json.dumps(r) for r in [TIMING, *roots]))
    int8 = tmp_path / "time_int8.jsonl"
    int8.write_text(json.dumps({**TIMING, "draft_quantization": "int8"}))
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    for timing, expect in ((None, "none"), (str(int8), "int8")):
        out = tmp_path / f"sel-{expect}"
        argv = ["selector", "train", "--records", str(grid), "--out", str(out), "--folds", "0", "--epochs", "5", "--max-drafts", "2"]
        assert run_train(parser.parse_args(argv + (["--timing", timing] if timing else []))) == 0
        doc = json.loads((out / JSON_NAME).read_text())
        assert doc["draft_quantization"] == expect
        assert doc["timing"] == (None if timing is None else "time_int8.jsonl")
        assert "max_batch_size" not in doc and ShapeSelector.load(out).max_batch_size is None
    # --max-batch-size: stored, and read back as the selector's bound
    assert run_train(parser.parse_args(argv + ["--max-batch-size", "2"])) == 0
    assert ShapeSelector.load(out).max_batch_size == 2
    with pytest.raises(SystemExit, match="--max-batch-size must be an integer >= 1, got 0"):
        run_train(parser.parse_args(argv + ["--max-batch-size", "0"]))


def test_a_signal_in_an_extra_feature_column_is_learned():
    # bench.selector_prev trains on the shipped features plus extra columns: the network is
    # sized from the data, and the decisive signal may sit in a column past the shipped four
    ex = _synthetic()
    h = ex.features[:, 0].copy()
    ex.features[:, 0] = 1.0
    ex = Examples(np.column_stack([ex.features, h]), ex.values, ex.time, ex.groups, ex.actions)
    sel = fit(ex, np.arange(0, len(ex), 2), "traversal", seed=0, epochs=300, lr=1e-2)
    test = np.arange(1, len(ex), 2)
    best = (ex.values["traversal"] / ex.time).argmax(1)[test]
    assert (sel.choose_index(ex.features[test]) == best).mean() > 0.95


def test_preceding_token_statistics():
    from vllm_anisotropic.bench.selector_prev import law_stats

    u = torch.full((4,), 0.25)
    s = law_stats(u, u)
    assert s["entropy_p_prev"] == pytest.approx(np.log(4)) and s["kl_pq_prev"] == pytest.approx(0.0)
    p, q = torch.tensor([0.5, 0.5, 0.0, 0.0]), torch.tensor([0.5, 0.25, 0.25, 0.0])
    s = law_stats(p, q)
    assert s["kl_pq_prev"] == pytest.approx(0.5 * np.log(2))  # 0.5 log(0.5/0.5) + 0.5 log(0.5/0.25)
    assert s["l1_prev"] == pytest.approx(0.5) and s["entropy_q_prev"] == pytest.approx(1.5 * np.log(2))
    assert s["kl_qp_prev"] > 100  # q puts mass where p has none (p clamped at 1e-300)
