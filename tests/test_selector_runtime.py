"""The selector inside ``draft_tree`` (no vLLM): config, "auto" resolution, per-step shapes.

What these would catch: the proposer drafting its fixed shape although a selector is set, the
selector fed other features than q's law at the root under the request's sampling (e.g. the
unprocessed law, or the context length off by one), the root's forward run twice, a selector
path or a shape key combination accepted that should be refused, ``auto`` picking a selector
for another pair (or none for its own), and the budget (vLLM's num_speculative_tokens) not
covering the selector's largest shape.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from vllm_anisotropic.models.tiny import build_tiny_model
from vllm_anisotropic.proposers import get_proposer, proposer_config
from vllm_anisotropic.proposers.draft_model import DelayedShape, delayed_tree, root_law_of
from vllm_anisotropic.selector.features import FEATURES, features_of, root_features
from vllm_anisotropic.selector.policy import ENTROPY_PROBES, JSON_NAME, ShapeSelector
from vllm_anisotropic.selector.shipped import model_fingerprint, resolve_selector, shipped_selector
from vllm_anisotropic.selector.train import Examples, fit, step_time
from vllm_anisotropic.verifiers import TargetSampling

CONTEXT = [1, 504, 3120, 28, 1711, 940, 77, 5012, 19, 640, 2201, 73]
SAMPLED = TargetSampling(temperature=0.7, top_k=-1, top_p=0.9)
TIMING = {"t_q": {"1": 0.1, "2": 0.12, "3": 0.14, "4": 0.2}, "t_p": {str(n): 0.3 for n in range(1, 42)}}


@pytest.fixture(scope="module")
def draft_dir():
    return str(build_tiny_model(seed=1, block_std=0.1))


def constant_selector(tmp_path, best: tuple[int, int, int], pair: dict | None = None):
    """A selector trained on roots where ``best`` always pays most (so it always chooses it)."""
    actions = [(1, 1, 0), (1, 3, 0), (2, 1, 1), (3, 0, 2)]
    n = 64
    e = np.ones((n, len(actions)))
    e[:, actions.index(best)] = 4.0
    feats = np.random.default_rng(0).normal(1.0, 0.5, (n, 5))
    ex = Examples(feats, {"traversal": e}, np.tile([step_time(a, TIMING) for a in actions], (n, 1)),
                  np.array([str(i) for i in range(n)]), actions)
    sel = fit(ex, np.arange(n), "traversal", epochs=200, lr=1e-2)
    sel.meta["pair"] = pair or {}
    return sel.save(tmp_path / f"sel-{'-'.join(map(str, best))}")


def threshold_selector(tmp_path, thresholds: dict[float, float], low=(1, 3, 0), high=(2, 1, 1)):
    """A selector that drafts ``low`` when q's root entropy is below ``thresholds[temperature]``
    (temperatures 0 and 0.8, top-p 1 and 0.9), else ``high``: its choice changes from step to
    step (the engine's TP test needs every rank to make the same changing choices)."""
    rng = np.random.default_rng(0)
    n = 800
    temps = rng.choice(sorted(thresholds), n)
    h = rng.uniform(0, 9, n)
    low_pays = h < np.array([thresholds[t] for t in temps])
    actions = [low, high]
    e = np.stack([np.where(low_pays, 3.0, 1.0), np.where(low_pays, 1.0, 3.0)], 1)
    # the batch size varies and decides nothing: the choice must not move with it in the engine
    feats = np.stack([h, np.full(n, np.log1p(100)), temps, np.where(temps > 0, 0.9, 1.0), rng.uniform(0, np.log(8), n)], 1)
    ex = Examples(feats, {"traversal": e}, np.ones((n, 2)), np.array([str(i) for i in range(n)]), actions)
    sel = fit(ex, np.arange(n), "traversal", epochs=400, lr=1e-2)
    assert (sel.choose_index(feats) == np.where(low_pays, 0, 1)).mean() > 0.97
    return sel.save(tmp_path / "sel-threshold")


def test_threshold_selector_switches_with_the_entropy(tmp_path):
    sel = ShapeSelector.load(threshold_selector(tmp_path, {0.0: 6.7, 0.8: 4.0}))
    for log_b in (0.0, np.log(2), np.log(8)):
        assert sel.choose(np.array([6.0, 5.0, 0.0, 1.0, log_b])) == DelayedShape(1, 3, 0)
        assert sel.choose(np.array([7.5, 5.0, 0.0, 1.0, log_b])) == DelayedShape(2, 1, 1)
        assert sel.choose(np.array([3.0, 5.0, 0.8, 0.9, log_b])) == DelayedShape(1, 3, 0)
        assert sel.choose(np.array([5.0, 5.0, 0.8, 0.9, log_b])) == DelayedShape(2, 1, 1)


@pytest.mark.parametrize("best", [(1, 3, 0), (3, 0, 2)])
def test_proposer_drafts_the_selectors_shape_from_the_roots_features(draft_dir, tmp_path, best):
    path = constant_selector(tmp_path, best)
    proposer = get_proposer("draft_tree", model=draft_dir, selector=str(path))
    assert proposer.selector is not None and proposer.selector.max_drafts == 6
    seen = []
    choose = proposer.selector.choose_shapes
    proposer.selector.choose_shapes = lambda f: seen.append(f[0]) or choose(f)
    state = proposer.new_request()
    state.set_sampling(SAMPLED, seed=5)
    tree = state.propose(np.array(CONTEXT))
    shape = DelayedShape(best[0], best[1], best[2])
    assert tree.num_nodes == 1 + shape.num_drafts and proposer.shape_counts == {",".join(map(str, best)): 1}
    # the engine's stats file carries the counts as they are (a Counter came out of asdict with
    # (key, count) tuples as keys and broke the worker's JSON dump)
    from dataclasses import asdict

    from vllm_anisotropic.integration.vllm.engine.metrics import TreeMetrics

    dumped = json.loads(json.dumps(asdict(TreeMetrics(selector_shapes=proposer.shape_counts))))
    assert dumped["selector_shapes"] == {",".join(map(str, best)): 1}
    # the same tree as drafting that shape directly, with the same uniforms
    ref = delayed_tree(proposer.lm.new_session(), CONTEXT, shape, SAMPLED, torch.Generator().manual_seed(5))
    assert tree.tokens.tolist() == ref.tokens.tolist() and tree.parents.tolist() == ref.parents.tolist()
    torch.testing.assert_close(tree.draft_probs, ref.draft_probs)
    # features: q's processed law at the root, the context's length, the request's sampling
    law = root_law_of(proposer.lm.new_session(), CONTEXT, SAMPLED)
    np.testing.assert_allclose(seen[0], root_features(law, len(CONTEXT), 0.7, 0.9), rtol=1e-6)
    # the root ran once: context (12) + the trunk's and branches' forwards, no second root forward
    k, l1, l2 = best
    trunk_forwards = l1 if l2 else max(l1 - 1, 0)  # q after the last trunk node only if branches follow
    forwards = len(CONTEXT) + trunk_forwards + (k * (l2 - 1) if l2 else 0)
    assert state.session.forwarded == forwards, (state.session.forwarded, forwards)


def test_greedy_requests_take_temperature_zero_features(draft_dir, tmp_path):
    proposer = get_proposer("draft_tree", model=draft_dir, selector=str(constant_selector(tmp_path, (1, 3, 0))))
    seen = []
    choose = proposer.selector.choose_shapes
    proposer.selector.choose_shapes = lambda f: seen.append(f[0]) or choose(f)
    proposer.new_request().propose(np.array(CONTEXT))
    assert seen[0][2:].tolist() == [0.0, 1.0, 0.0]
    proposer.begin_step(4)  # the engine's drafter: four requests draft in this step
    proposer.new_request().propose(np.array(CONTEXT))
    assert seen[1][4] == pytest.approx(np.log(4))
    law = root_law_of(proposer.lm.new_session(), CONTEXT, TargetSampling(temperature=0.0))
    assert seen[0][0] == pytest.approx(root_features(law, len(CONTEXT), 0.0, 1.0)[0])


def test_a_batch_where_no_root_would_draft_skips_q(draft_dir, tmp_path):
    """A selector that drafts a chain of 3 alone and nothing from 4 requests on, whatever q's
    entropy: in a step of 4 the proposer decodes plainly without q's root forward (fails if
    the batch size is not passed, or q runs first), alone it drafts, q catching up."""
    rng = np.random.default_rng(0)
    n = 400
    b = rng.choice([1, 4, 8], n)
    feats = np.stack([rng.uniform(0, 9, n), np.full(n, np.log1p(100)), np.zeros(n), np.ones(n), np.log(b)], 1)
    actions = [(1, 0, 0), (1, 3, 0)]
    e = np.stack([np.where(b == 1, 1.0, 3.0), np.where(b == 1, 3.0, 1.0)], 1)
    ex = Examples(feats, {"traversal": e}, np.ones((n, 2)), np.array([str(i) for i in range(n)]), actions)
    path = fit(ex, np.arange(n), "traversal", epochs=300, lr=1e-2).save(tmp_path / "sel-batch")
    proposer = get_proposer("draft_tree", model=draft_dir, selector=str(path))
    state = proposer.new_request()
    proposer.begin_step(4)
    assert proposer.selector.may_draft(len(CONTEXT), 0.0, 1.0, 4) is False
    tree = state.propose(np.array(CONTEXT))
    assert tree.num_nodes == 1 and state.session.forwarded == 0 and proposer.shape_counts == {"1,0,0": 1}
    proposer.begin_step(1)
    tree = state.propose(np.array(CONTEXT))
    assert tree.num_nodes == 4 and state.session.forwarded >= len(CONTEXT)
    assert proposer.shape_counts == {"1,0,0": 1, "1,3,0": 1}


def test_a_steps_may_draft_answers_each_request_in_one_pass(tmp_path):
    """``may_draft_rows`` asks the network once for a whole step: each request's answer is the one
    ``may_draft`` gives it alone, with requests whose answers differ in one call (fails if the
    entropy probes and the requests' rows are paired wrongly, or one request's answer is read for
    another's). The selector drafts a chain of 3 below 100 context tokens at root entropies above 6,
nothing otherwise: each request's answer needs the high probes of its own rows."""
    rng = np.random.default_rng(0)
    n = 400
    length = rng.integers(10, 1000, n)
    feats = np.stack([rng.uniform(0, 9, n), np.log1p(length), np.zeros(n), np.ones(n), np.zeros(n)], 1)
    pays = (length < 100) & (feats[:, 0] > 6)
    e = np.stack([np.where(pays, 1.0, 3.0), np.where(pays, 3.0, 1.0)], 1)
    ex = Examples(feats, {"traversal": e}, np.ones((n, 2)), np.array([str(i) for i in range(n)]), [(1, 0, 0), (1, 3, 0)])
    selector = ShapeSelector.load(fit(ex, np.arange(n), "traversal", epochs=300, lr=1e-2).save(tmp_path / "sel"))
    lengths, temps, top_ps = [20, 900, 40, 700, 30], [0.0, 0.0, 0.7, 0.0, 0.0], [1.0, 1.0, 0.9, 1.0, 1.0]
    alone = [selector.may_draft(c, t, p, 1) for c, t, p in zip(lengths, temps, top_ps)]
    assert alone == [True, False, True, False, True]
    assert selector.may_draft_rows(lengths, temps, top_ps, 1).tolist() == alone


def test_may_draft_probes_the_entropy_grid_and_counts_one_draft_as_drafting(tmp_path, monkeypatch):
    """The rows the network sees: each request's own features with ``ENTROPY_PROBES`` root
    entropies evenly over [max(0, mean - 4 std), mean + 4 std] of the training entropies (fails
    if a bound moves: a grid starting at the lower clamp, or one std short); and a shape with a
    single draft, (1, 1, 0), counts as drafting."""
    selector = ShapeSelector.load(constant_selector(tmp_path, (1, 1, 0)))
    assert selector.may_draft_rows([50, 70], [0.0, 0.7], [1.0, 0.9], 2).tolist() == [True, True]
    col = FEATURES.index("entropy_q")
    seen = []
    monkeypatch.setattr(selector, "choose_index", lambda rows: seen.append(rows.copy()) or np.zeros(len(rows), int))
    for mean, std in ((12.0, 2.0), (2.0, 1.0)):  # the lower bound above 0, and clamped at 0
        selector.mean[col], selector.std[col] = mean, std
        seen.clear()
        selector.may_draft_rows([50, 70], [0.0, 0.7], [1.0, 0.9], 2)
        grid = np.linspace(max(0.0, mean - 4 * std), mean + 4 * std, ENTROPY_PROBES)
        np.testing.assert_allclose(seen[0][:, col], np.tile(grid, 2))
        others = [i for i in range(len(FEATURES)) if i != col]
        for r, (c, t, p) in enumerate([(50, 0.0, 1.0), (70, 0.7, 0.9)]):
            block = seen[0][r * ENTROPY_PROBES : (r + 1) * ENTROPY_PROBES]
            np.testing.assert_allclose(block[:, others], np.tile(features_of(0.0, c, t, p, 2)[others], (ENTROPY_PROBES, 1)))


def test_config_budget_and_refusals(draft_dir, tmp_path):
    path = str(constant_selector(tmp_path, (3, 0, 2)))
    assert proposer_config("draft_tree", model=draft_dir, selector=path).budget == 1 + 6
    assert proposer_config("draft_tree", model=draft_dir, selector="off", trunk=1, branch_length=0).budget == 2
    assert proposer_config("draft_tree", model=draft_dir).selector == "auto"
    with pytest.raises(ValueError, match="valid: 'auto', 'off'"):
        proposer_config("draft_tree", model=draft_dir, selector="/no/such/dir")
    with pytest.raises(ValueError, match=r"drop \['trunk'\]"):
        proposer_config("draft_tree", model=draft_dir, selector=path, trunk=2)
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    doc = json.loads((broken / JSON_NAME).read_text())
    doc["version"] = 99
    (broken / JSON_NAME).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="version 99"):
        proposer_config("draft_tree", model=draft_dir, selector=str(broken))


def test_no_drafting_above_the_selectors_batch_bound(draft_dir, tmp_path):
    """A selector with ``max_batch_size`` 2 drafts (its chain of 3, at every entropy) in steps of
    1 or 2 drafting requests and in none above: ``may_draft_rows`` answers no for every request
    there, so the drafter runs no q at all; without the bound, it drafts at every batch size."""
    sel = ShapeSelector.load(constant_selector(tmp_path, (1, 3, 0)))
    assert sel.max_batch_size is None
    assert all(sel.may_draft(100, 0.0, 1.0, b) for b in (1, 2, 3, 8, 64))
    sel.meta["max_batch_size"] = 2
    assert sel.may_draft(100, 0.0, 1.0, 1) and sel.may_draft(100, 0.7, 0.9, 2)
    assert not any(sel.may_draft(100, t, 1.0, b) for b in (3, 8, 64) for t in (0.0, 0.7))
    assert sel.may_draft_rows([50, 900], [0.0, 0.7], [1.0, 1.0], 2).tolist() == [True, True]
    assert sel.may_draft_rows([50, 900], [0.0, 0.7], [1.0, 1.0], 3).tolist() == [False, False]
    proposer = get_proposer("draft_tree", model=draft_dir, selector=str(sel.save(tmp_path / "capped")))
    assert proposer.selector.max_batch_size == 2


def test_may_draft_reads_a_shapes_drafts_from_its_trunk_and_branches(tmp_path):
    """``may_draft`` says yes for a selector that always picks branches without a trunk (K 3, L1 0,
    L2 2: six drafts, none on a trunk) and no for one that always picks plain decoding (1, 0, 0):
    fails if a shape's drafts are counted as L1 - K L2 or L1 alone, or plain counted as drafting."""
    assert ShapeSelector.load(constant_selector(tmp_path, (3, 0, 2))).may_draft(100, 0.0, 1.0, 1)
    actions = [(1, 0, 0), (1, 3, 0)]
    n = 64
    e = np.ones((n, 2))
    e[:, 0] = 4.0  # plain decoding pays most at every root
    ex = Examples(np.random.default_rng(0).normal(1.0, 0.5, (n, 5)), {"traversal": e},
                  np.tile([step_time(a, TIMING) for a in actions], (n, 1)), np.array([str(i) for i in range(n)]), actions)
    plain = fit(ex, np.arange(n), "traversal", epochs=200, lr=1e-2)
    assert not any(plain.may_draft(100, t, 1.0, b) for b in (1, 4) for t in (0.0, 0.7))


def test_auto_finds_the_selector_of_its_pair_only(draft_dir, tmp_path):
    target_dir = str(build_tiny_model(seed=2, block_std=0.1))
    other_dir = str(build_tiny_model(seed=3, block_std=0.1))
    assert len({model_fingerprint(d) for d in (draft_dir, target_dir, other_dir)}) == 3
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    constant_selector(shipped, (1, 3, 0), pair={"target_fingerprint": model_fingerprint(target_dir),
                                                "draft_fingerprint": model_fingerprint(draft_dir)})
    found = shipped_selector(target_dir, draft_dir, shipped)
    assert found is not None and found.parent == shipped
    assert shipped_selector(other_dir, draft_dir, shipped) is None  # another target
    assert shipped_selector(target_dir, other_dir, shipped) is None  # another draft
    assert resolve_selector("auto", target_dir, draft_dir, shape_given=False, shipped=shipped) == str(found)
    assert resolve_selector("auto", target_dir, draft_dir, shape_given=True, shipped=shipped) == "off"
    assert resolve_selector("auto", "org/hub-name", draft_dir, shape_given=False, shipped=shipped) == "off"
    assert resolve_selector("off", target_dir, draft_dir, shape_given=False, shipped=shipped) == "off"
    # a second selector of the pair, timed with q in int8: taken when q runs in int8, not otherwise
    int8 = constant_selector(shipped, (1, 1, 0), pair={"target_fingerprint": model_fingerprint(target_dir),
                                                       "draft_fingerprint": model_fingerprint(draft_dir)})
    doc = json.loads((int8 / JSON_NAME).read_text())
    (int8 / JSON_NAME).write_text(json.dumps({**doc, "draft_quantization": "int8"}))
    # the int8 one sorts first: the one without the key is taken for "none" by reading its absence
    # as "none", not by its place
    assert int8.name < found.name
    assert shipped_selector(target_dir, draft_dir, shipped, quantization="int8") == int8
    assert shipped_selector(target_dir, draft_dir, shipped, quantization="none") == found
    assert shipped_selector(target_dir, draft_dir, shipped) == found
    assert resolve_selector("auto", target_dir, draft_dir, shape_given=False, shipped=shipped,
                            quantization="int8") == str(int8)
    # only the int8 one left: q in bf16 still gets the pair's selector rather than none
    shutil.rmtree(found)
    assert shipped_selector(target_dir, draft_dir, shipped, quantization="none") == int8


def test_fingerprint_survives_resaving_and_the_shipped_selector_loads(tmp_path):
    from safetensors.torch import load_file, save_file

    src = build_tiny_model(seed=2, block_std=0.1)
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    for f in copy.glob("*.safetensors"):  # another header and tensor order, same values
        tensors = load_file(str(f))
        save_file(dict(reversed(list(tensors.items()))), str(f), metadata={"note": "resaved"})
    assert model_fingerprint(copy) == model_fingerprint(src)
    from vllm_anisotropic.selector.shipped import SHIPPED_DIR

    shipped = sorted(SHIPPED_DIR.glob("*/"))
    assert shipped, "the package ships the Qwen2.5-Coder 1.5B / 0.5B selector"
    for d in shipped:
        sel = ShapeSelector.load(d)
        assert sel.max_drafts <= 8 and {"target_fingerprint", "draft_fingerprint"} <= set(sel.meta["pair"])
    # the pair's two: q not quantized (no bound) and q in int8 (bounded at two requests, docs/selector.md)
    by_q = {sel.draft_quantization: sel for sel in map(ShapeSelector.load, shipped)}
    assert set(by_q) == {"none", "int8"} and by_q["none"].meta["pair"] == by_q["int8"].meta["pair"]
    assert by_q["int8"].max_batch_size == 2 and by_q["none"].max_batch_size is None
