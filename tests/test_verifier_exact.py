"""Exactness by enumeration: every verifier's emitted tokens follow the target's sequential law.

Method (no sampling noise): V = 4 tokens, a fixed target table and a draft table whose
divergence grows with depth (``verifiers.toy``). For every tree family we enumerate *every*
draft tree with its exact probability, take the verifier's exact output law for that tree
(``analytic.output_distribution``: the accepted-path tokens + bonus), complete each emitted
block with the target's own continuation law to a fixed horizon H, and require

    sum_T P(T) * completed_law(T)  ==  p^H (the target's law of H tokens)   to 1e-10.

Completion is exact and neutral: a verifier is lossless iff its emitted block is an
autoregressive target sample stopped at a (randomised) time, iff the completed law is p^H.
The implementation is tied to these laws by Monte Carlo (test_verifier_mc.py) and by
seed-for-seed agreement with the per-node reference (test_verifier_reference.py).
"""

import itertools

import pytest
import torch

from vllm_anisotropic.tree import DraftTree
from vllm_anisotropic.verifiers import TargetSampling, get_verifier, target_probs
from vllm_anisotropic.verifiers.analytic import output_distribution
from vllm_anisotropic.verifiers.toy import DraftTable, TableModel, enumerate_iid_paths, paths_to_tree, topk_tree, tree_rows

V = 4
TARGET = TableModel(V, seed=0)
DRAFT = DraftTable(TARGET, seed=1, lam0=0.35, slope=0.2)
PREFIX = (2,)
SAMPLINGS = [TargetSampling(1.0), TargetSampling(0.7, top_k=3, top_p=0.9)]
DRAFT_VERIFIERS = ["nss", "naive", "naive_tree", "spectr", "specinfer", "khisti", "traversal", "block"]
# (K, L1, L2): chain, i.i.d. multi-path tree, delayed trees
FAMILIES = {"chain": (1, 0, 3), "iid": (2, 0, 2), "delayed": (2, 1, 1), "iid3": (3, 0, 1)}


def p_of(prefix, s: TargetSampling):
    z = torch.tensor(TARGET.logits(prefix), dtype=torch.float64).unsqueeze(0)
    return target_probs(z, torch.tensor([s.temperature]), torch.tensor([s.top_k]), torch.tensor([s.top_p]), torch.float64)[0]


def target_law(h, s):
    out = {}
    for seq in itertools.product(range(V), repeat=h):
        pr, pre = 1.0, PREFIX
        for t in seq:
            pr *= float(p_of(pre, s)[t])
            pre = pre + (t,)
        out[seq] = pr
    return out


def completed(law, h, s):
    out = dict.fromkeys(itertools.product(range(V), repeat=h), 0.0)
    for seq in out:
        for m in range(1, h + 1):
            w = law.get(seq[:m], 0.0)
            if w:
                pr, pre = w, PREFIX + seq[:m]
                for t in seq[m:]:
                    pr *= float(p_of(pre, s)[t])
                    pre = pre + (t,)
                out[seq] += pr
    return out


def p_rows(tree, s):
    logits, q = tree_rows(tree, PREFIX, TARGET, DRAFT)
    n = tree.num_nodes
    p = target_probs(logits, torch.full((n,), s.temperature), torch.full((n,), s.top_k), torch.full((n,), s.top_p), torch.float64)
    return p, q


def assert_same(a, b, tol=1e-10):
    worst = max(abs(a[k] - b[k]) for k in b)
    assert worst < tol, worst


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("si", range(len(SAMPLINGS)))
def test_draft_model_trees_are_lossless(family, si):
    s = SAMPLINGS[si]
    k, l1, l2 = FAMILIES[family]
    h = l1 + l2 + 1
    trees = [(paths_to_tree(paths, PREFIX[-1], l1), pr) for paths, pr in enumerate_iid_paths(DRAFT, PREFIX, k, l1, l2)]
    assert abs(sum(pr for _, pr in trees) - 1) < 1e-12
    want = target_law(h, s)
    rows = [p_rows(t, s) for t, _ in trees]
    for name in DRAFT_VERIFIERS:
        mix = {}
        for (tree, pr), (p, q) in zip(trees, rows):
            for seq, w in output_distribution(name, tree, p, q).items():
                mix[seq] = mix.get(seq, 0.0) + pr * w
        assert abs(sum(mix.values()) - 1) < 1e-10, name
        got = completed(mix, h, s)
        worst = max(abs(got[x] - want[x]) for x in want)
        assert worst < 1e-10, (name, family, worst)


def test_merged_trie_is_lossless_for_ot_solvers():
    """A trie that merges the K paths (multiplicity counts) is as exact as unmerged paths."""
    s = SAMPLINGS[0]
    want = target_law(3, s)
    trees = []
    for paths, pr in enumerate_iid_paths(DRAFT, PREFIX, 2, 0, 2):
        tree = DraftTree.from_paths(paths, root_token=PREFIX[-1], merge=True)
        trees.append((tree, pr, *p_rows(tree, s)))
    for name in ["naive", "specinfer", "khisti"]:
        mix = {}
        for tree, pr, p, q in trees:
            for seq, w in output_distribution(name, tree, p, q).items():
                mix[seq] = mix.get(seq, 0.0) + pr * w
        assert_same(completed(mix, 3, s), want)


DET_TREES = {
    "spine_tree": lambda: topk_tree(TARGET, PREFIX, width=2, depth=2, spine=[1, 3, 0]),
    "topk_tree": lambda: topk_tree(TARGET, PREFIX, width=3, depth=2),
    "duplicate_siblings": lambda: DraftTree(tokens=[2, 1, 1, 3, 0], parents=[-1, 0, 0, 1, 2]),
}


@pytest.mark.parametrize("tree_name", list(DET_TREES))
@pytest.mark.parametrize("si", range(len(SAMPLINGS)))
def test_deterministic_trees_are_lossless(tree_name, si):
    s = SAMPLINGS[si]
    tree = DET_TREES[tree_name]()
    h = tree.max_depth + 1
    p, _ = p_rows(tree, s)
    want = target_law(h, s)
    for name in ["deterministic", "nss"]:
        law = output_distribution(name, tree, p)
        assert_same(completed(law, h, s), want)


@pytest.mark.parametrize("tree_name", list(DET_TREES))
def test_greedy_is_exact_greedy_decoding(tree_name):
    """Temperature 0: the greedy walk and every sampler emit exactly the target's argmax chain."""
    tree = DET_TREES[tree_name]()
    logits, q = tree_rows(tree, PREFIX, TARGET, DRAFT)
    greedy = TargetSampling(0.0)
    emitted = get_verifier("greedy", torch.float64).verify(tree, logits, greedy).emitted_tokens(tree)
    pre = PREFIX
    for t in emitted:  # every emitted token is the argmax after its prefix
        assert t == int(torch.tensor(TARGET.logits(pre)).argmax())
        pre = pre + (t,)
    # the walk stops only when no child carries the argmax
    node = 0
    for t in emitted[:-1]:
        node = next(c for c in tree.children_lists()[node] if tree.tokens[c] == t)
    assert all(tree.tokens[c] != emitted[-1] for c in tree.children_lists()[node])
    tree_q = tree.with_draft_probs(q)
    for name in ["deterministic", "nss", "specinfer", "spectr", "naive_tree", "khisti", "traversal", "block"]:
        for seed in range(3):
            r = get_verifier(name, torch.float64).verify(tree_q, logits, greedy, torch.Generator().manual_seed(seed))
            out = r.emitted_tokens(tree)
            assert out[: len(emitted)] == emitted[: len(out)], name
            if name in ("deterministic", "nss"):
                assert out == emitted, name


def test_greedy_source_priority_spine_over_branch():
    """Duplicate child tokens: the walk takes the SPINE child (GOOSE Algorithm 3)."""
    from vllm_anisotropic.tree import NodeSource as S

    a = int(torch.tensor(TARGET.logits(PREFIX)).argmax())
    b = int(torch.tensor(TARGET.logits(PREFIX + (a,))).argmax())
    tree = DraftTree(tokens=[PREFIX[-1], a, a, b], parents=[-1, 0, 0, 2], sources=[S.ROOT, S.BRANCH, S.SPINE, S.SPINE])
    logits, _ = tree_rows(tree, PREFIX, TARGET)
    r = get_verifier("greedy").verify(tree, logits.float(), TargetSampling(0.0))
    assert r.accepted == [2, 3]


def test_enumeration_has_power():
    """Sanity of the method: a lossy variant (drafts verified against the wrong q) is caught."""
    s = SAMPLINGS[0]
    want = target_law(3, s)
    mix = {}
    for paths, pr in enumerate_iid_paths(DRAFT, PREFIX, 2, 0, 2):
        tree = paths_to_tree(paths, PREFIX[-1], 0)
        p, q = p_rows(tree, s)
        wrong_q = torch.full_like(q, 1.0 / V)
        for seq, w in output_distribution("specinfer", tree, p, wrong_q).items():
            mix[seq] = mix.get(seq, 0.0) + pr * w
    got = completed(mix, 3, s)
    assert max(abs(got[x] - want[x]) for x in want) > 1e-3
