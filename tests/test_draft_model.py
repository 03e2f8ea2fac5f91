"""Delayed-expansion draft-model trees (``proposers.draft_model``) against a from-scratch q.

Every check recomputes q without the session's KV cache (one full forward of context + path), so
a cache bug (a wrong crop, a branch reading its sibling's KV, a stale trunk) shows up as a
wrong token or a wrong ``draft_probs`` row. The draft model is the tiny structured model of
``models.tiny`` (seed 1, block_std 0.1: context-dependent tokens, so the KV matters); the
target of the verifier test is another tiny model (seed 2) with the same tokenizer.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from test_verifier_mc import chi2_z  # Pearson chi-square, pooled cells, Wilson-Hilferty z

from vllm_anisotropic.models.tiny import build_tiny_model
from vllm_anisotropic.proposers import get_proposer, proposer_config
from vllm_anisotropic.proposers.draft_model import (
    DelayedShape,
    DraftLM,
    check_same_vocabulary,
    delayed_tree,
    shape_parents,
)
from vllm_anisotropic.tree import NodeSource
from vllm_anisotropic.verifiers import TargetSampling, get_verifier
from vllm_anisotropic.verifiers.sampling import target_probs

CONTEXT = [1, 504, 3120, 28, 1711, 940, 77, 5012, 19, 640, 2201, 73]
SAMPLED = TargetSampling(temperature=0.7, top_k=-1, top_p=0.9)


@pytest.fixture(scope="module")
def draft_lm():
    return DraftLM(build_tiny_model(seed=1, block_std=0.1))


@pytest.fixture(scope="module")
def flat_lm():
    """A draft with a flat next-token law (small logits): sampling is really random."""
    return DraftLM(build_tiny_model(seed=1, block_std=0.1, lm_head_alpha=0.05))


@pytest.fixture(scope="module")
def q_lm():
    """A draft whose processed law at CONTEXT has ~250 tokens, the top one at ~0.56."""
    return DraftLM(build_tiny_model(seed=1, block_std=0.1, lm_head_alpha=0.2))


def law_z(tokens: np.ndarray, dist: torch.Tensor) -> float:
    """Wilson-Hilferty z of the chi-square of ``tokens`` against ``dist`` (cells with expected
    count < 5 pooled; ``test_verifier_mc.chi2_z``). z < 4: false-alarm rate ~3e-5 per check."""
    d = dist.double().numpy()
    support = np.flatnonzero(d > 0)
    law = {int(t): float(d[t]) for t in support}
    return chi2_z(Counter(tokens.tolist()), law, len(tokens))


def binomial_z(successes: int, n: int, p: float) -> float:
    return abs(successes - n * p) / np.sqrt(n * p * (1 - p))


def fresh_logits(lm: DraftLM, tokens) -> torch.Tensor:
    """q's logits after ``tokens`` from one forward without any cache."""
    from transformers import DynamicCache

    return lm.forward(torch.tensor([list(tokens)]), DynamicCache())[0, -1]


def law(logits: torch.Tensor, sampling: TargetSampling) -> torch.Tensor:
    return target_probs(logits[None].float(), torch.tensor([sampling.temperature]), torch.tensor([sampling.top_k]),
                        torch.tensor([sampling.top_p]))[0]


def paths(tree) -> list[list[int]]:
    """Root-excluded token path of every node."""
    out = []
    for i in range(tree.num_nodes):
        path, j = [], i
        while j > 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        out.append(path[::-1])
    return out


def test_shape_parents_trunk_then_branches_depth_major():
    assert shape_parents(DelayedShape(2, 1, 2)).tolist() == [-1, 0, 1, 1, 2, 3]
    assert shape_parents(DelayedShape(3, 0, 1)).tolist() == [-1, 0, 0, 0]
    assert shape_parents(DelayedShape(2, 3, 0)).tolist() == [-1, 0, 1, 2]
    assert shape_parents(DelayedShape(1, 2, 2)).tolist() == [-1, 0, 1, 2, 3]
    p = shape_parents(DelayedShape(4, 2, 3))
    assert p.size == 1 + DelayedShape(4, 2, 3).num_drafts == 15
    assert np.all(p[1:] < np.arange(1, p.size))  # parents first: every prefix is a subtree
    with pytest.raises(ValueError, match="branches >= 1"):
        DelayedShape(0, 1, 1)


def test_greedy_tree_is_the_trunk_then_the_top_k_each_continued_greedily(draft_lm):
    shape = DelayedShape(branches=3, trunk=2, branch_length=3)
    tree = delayed_tree(draft_lm.new_session(), CONTEXT, shape)
    assert tree.tokens[0] == CONTEXT[-1] and tree.draft_probs is None
    assert tree.parents.tolist() == shape_parents(shape).tolist()
    assert (tree.sources[1:] == NodeSource.DRAFT).all()
    p = paths(tree)
    trunk = p[2]
    assert p[1] == trunk[:1] and len(trunk) == 2
    for t in range(2):  # trunk: q's greedy path
        assert trunk[t] == int(fresh_logits(draft_lm, CONTEXT + trunk[:t]).argmax())
    q_end = fresh_logits(draft_lm, CONTEXT + trunk).softmax(-1)
    firsts = [p[3 + k][-1] for k in range(3)]
    assert firsts == torch.topk(q_end, 3).indices.tolist()  # distinct, most likely first
    for k in range(3):
        leaf = p[3 + 2 * 3 + k]
        assert leaf[:3] == trunk + [firsts[k]]
        for depth in (1, 2):
            assert leaf[2 + depth] == int(fresh_logits(draft_lm, CONTEXT + leaf[: 2 + depth]).argmax())
    # values: q path probabilities, products along the path
    q0 = fresh_logits(draft_lm, CONTEXT).softmax(-1)
    assert tree.values[1] == pytest.approx(float(q0[trunk[0]]), rel=1e-4)
    assert tree.values[3] == pytest.approx(tree.values[2] * float(q_end[firsts[0]]), rel=1e-4)


def test_sampled_rows_are_the_processed_q_of_each_path_recomputed_without_cache(flat_lm):
    """draft_probs row i = processed q after node i's path (the law its children were drawn
    from), over three steps of one session (cache kept, cropped and forked in between)."""
    shape = DelayedShape(branches=2, trunk=2, branch_length=3)
    session = flat_lm.new_session()
    gen = torch.Generator().manual_seed(3)
    context = list(CONTEXT)
    for _ in range(3):
        tree = delayed_tree(session, context, shape, SAMPLED, gen)
        rows = tree.draft_probs
        leaves = set(range(tree.num_nodes)) - set(tree.parents[1:].tolist())
        for i, path in enumerate(paths(tree)):
            if i in leaves:
                assert rows[i].abs().sum() == 0
                continue
            expected = law(fresh_logits(flat_lm, context + path), SAMPLED)
            torch.testing.assert_close(rows[i], expected, atol=2e-5, rtol=1e-4)
            for child in np.flatnonzero(tree.parents == i):
                assert expected[int(tree.tokens[child])] > 0  # drawn inside the top-p set
        # next step: the first trunk token accepted plus a bonus token
        context = context + [int(tree.tokens[1]), int(tree.tokens[-1])]


def test_the_session_runs_only_new_tokens(draft_lm):
    shape = DelayedShape(branches=2, trunk=2, branch_length=2)
    s = draft_lm.new_session()
    tree = delayed_tree(s, CONTEXT, shape)
    # the context, two trunk tokens, then one batched step of the two branches
    assert s.forwarded == len(CONTEXT) + 2 + 2
    assert s.tokens == CONTEXT + paths(tree)[2]
    before = s.forwarded
    accepted = paths(tree)[2]  # the whole trunk accepted, then a bonus token
    delayed_tree(s, CONTEXT + accepted + [42], shape)
    assert s.forwarded - before == 1 + 2 + 2  # only the bonus token is new context
    before = s.forwarded
    other = CONTEXT[:5] + [9, 9, 9]  # a different context: recomputed from the common prefix
    root = s.root_logits(other)
    assert s.forwarded - before == 3
    torch.testing.assert_close(root, fresh_logits(draft_lm, other), atol=1e-4, rtol=1e-4)


def test_trunk_tokens_follow_q_and_branches_are_independent(q_lm):
    """Over 3000 drafts at one context: the first trunk token follows processed q (chi-square
    z < 4, false-alarm rate ~3e-5), and two i.i.d. branches start with the same token as often
    as sum q^2 (binomial |z| < 4, ~6e-5). A sampler that drew argmax, or both branches from one
    draw, fails both by far (z > 20)."""
    session = q_lm.new_session()
    gen = torch.Generator().manual_seed(11)
    q = law(fresh_logits(q_lm, CONTEXT), SAMPLED)
    n = 3000
    firsts = np.empty((n, 2), np.int64)
    for i in range(n):
        firsts[i] = delayed_tree(session, CONTEXT, DelayedShape(2, 0, 1), SAMPLED, gen).tokens[1:]
    assert law_z(firsts[:, 0], q) < 4
    collide = float((q.double() ** 2).sum())
    same = int((firsts[:, 0] == firsts[:, 1]).sum())
    assert binomial_z(same, n, collide) < 4
    # power, at the same n: argmax draws, and one draw copied to both branches
    assert law_z(np.full(n, int(q.argmax())), q) > 20
    assert binomial_z(n, n, collide) > 20


def test_sampled_trees_verified_by_traversal_and_specinfer_emit_the_target_law(q_lm):
    """Delayed trees of q verified against another model p (the same tiny network with
    sharper logits: the two laws overlap ~60 % at the root) by Traversal (arXiv 2505.12398)
    and SpecInfer: the first emitted token has p's processed law (chi-square z < 4 each,
    false-alarm rate ~3e-5). Power: the same counts tested against q's law give z > 8."""
    p_lm = DraftLM(build_tiny_model(seed=1, block_std=0.1, lm_head_alpha=0.3))
    shape = DelayedShape(branches=2, trunk=1, branch_length=1)
    p_root = law(fresh_logits(p_lm, CONTEXT), SAMPLED)
    q_root = law(fresh_logits(q_lm, CONTEXT), SAMPLED)
    session = q_lm.new_session()
    gen, vgen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(7)
    from vllm_anisotropic.tree import pack_trees

    p_cache: dict[tuple, torch.Tensor] = {}

    def p_logits(path: tuple) -> torch.Tensor:
        if path not in p_cache:
            p_cache[path] = fresh_logits(p_lm, CONTEXT + list(path))
        return p_cache[path]

    names = ("traversal", "specinfer")
    first = {name: [] for name in names}
    accepted = {name: [] for name in names}
    for _ in range(15):  # 15 x 100 trees, verified in chunks (a tree's rows span the vocabulary: 49152)
        trees = [delayed_tree(session, CONTEXT, shape, SAMPLED, gen) for _ in range(100)]
        logits = torch.cat([torch.stack([p_logits(tuple(path)) for path in paths(t)]) for t in trees])
        q_rows = torch.cat([t.draft_probs for t in trees])
        for name in names:
            res = get_verifier(name).verify_batch(pack_trees(trees), logits, SAMPLED, vgen, q_rows).to_list()
            first[name] += [r.emitted_tokens(t)[0] for r, t in zip(res, trees)]
            accepted[name] += [len(r.accepted) for r in res]
    for name in names:
        tokens = np.array(first[name])
        assert law_z(tokens, p_root) < 4, name
        assert law_z(tokens, q_root) > 8, name  # the check has power
        assert np.mean(accepted[name]) > 0.3, (name, np.mean(accepted[name]))  # drafts do get accepted


def test_proposer_state_uses_the_request_law_and_cuts_before_drawing(flat_lm):
    model = build_tiny_model(seed=1, block_std=0.1, lm_head_alpha=0.05)
    proposer = get_proposer("draft_tree", vocab_size=flat_lm.vocab_size, model=str(model), trunk=1, branches=3,
                            branch_length=2)
    assert proposer_config("draft_tree", model=str(model)).budget == 1 + 2 + 2 * 2
    state = proposer.new_request()
    greedy = state.propose(np.array(CONTEXT))
    assert greedy.draft_probs is None and greedy.num_nodes == 8
    state.set_sampling(SAMPLED, seed=1)
    a = state.propose(np.array(CONTEXT))
    state.set_sampling(SAMPLED, seed=1)
    b = state.propose(np.array(CONTEXT), max_nodes=5)  # same seed: the same draws, cut to 5 nodes
    assert a.draft_probs is not None and b.num_nodes == 5
    assert b.tokens.tolist() == a.tokens[:5].tolist() and b.parents.tolist() == a.parents[:5].tolist()
    assert state.propose(np.array(CONTEXT), max_nodes=1).num_nodes == 1
    assert len(state.session.tokens) > 0
    state.release()  # preempted: q's cache is freed, the next proposal rebuilds it
    assert state.session.tokens == [] and state.propose(np.array(CONTEXT)).num_nodes == 8
    with pytest.raises(ValueError, match="vocab_size"):
        get_proposer("draft_tree", vocab_size=1000, model=str(model))


def test_config_names_the_bad_value():
    with pytest.raises(ValueError, match="trunk"):
        proposer_config("draft_tree", model="/x", trunk=9)
    with pytest.raises(ValueError, match="branches"):
        proposer_config("draft_tree", model="/x", branches=0)
    with pytest.raises(ValueError, match="model"):
        proposer_config("draft_tree")
    with pytest.raises(ValueError, match="brnches"):
        proposer_config("draft_tree", model="/nonexistent", brnches=2)


def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    import json
    import shutil

    target = build_tiny_model(seed=2)
    check_same_vocabulary(build_tiny_model(seed=1, block_std=0.1), target)  # same tokenizer: fine
    other = tmp_path / "other"
    shutil.copytree(target, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        check_same_vocabulary(other, target)
