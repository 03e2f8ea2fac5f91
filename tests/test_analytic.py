"""Analytic acceptance rates (arXiv 2602.16994 App. C), branching laws (App. D) and expected block
efficiency (Eq. 1-3): checked against exact enumeration and Monte Carlo of the fast samplers."""

import itertools
import math

import numpy as np
import pytest
import torch

from vllm_anisotropic.tree import DraftTree, pack_trees
from vllm_anisotropic.verifiers import TargetSampling, get_verifier
from vllm_anisotropic.verifiers.analytic import (
    TOPDOWN,
    acceptance_rate,
    expected_block_efficiency,
    expected_tokens,
    reach_probabilities,
    solver_output_law,
)
from vllm_anisotropic.verifiers.khisti import khisti_keep_probability, khisti_stage
from vllm_anisotropic.verifiers.toy import DraftTable, TableModel, paths_to_tree, sample_iid_paths, tree_rows

V = 4
g = torch.Generator().manual_seed(7)
P = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, 0)
Q = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, 0)


def exact_acceptance(name, k):
    """P(output in drafts) by enumerating every ordered draw X_1..X_k ~ q."""
    total = 0.0
    for xs in itertools.product(range(V), repeat=k):
        w = math.prod(float(Q[x]) for x in xs)
        law = solver_output_law(name, P, Q, list(xs))
        if name == "naive":  # single path: only X_1 (uniform over the slots) counts
            acc = sum(min(1.0, float(P[x] / Q[x])) for x in xs) / k
        else:
            acc = sum(float(law[t]) for t in set(xs))
        total += w * acc
    return total


@pytest.mark.parametrize("name", ["nss", "naive", "naive_tree", "spectr", "specinfer"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_acceptance_formula_equals_enumeration(name, k):
    assert abs(acceptance_rate(name, P, Q, k) - exact_acceptance(name, k)) < 1e-9


@pytest.mark.parametrize("k", [1, 2, 3])
def test_khisti_lower_bound(k):
    assert acceptance_rate("khisti", P, Q, k) <= exact_acceptance("khisti", k) + 1e-12


@pytest.mark.parametrize("name", ["nss", "naive", "naive_tree", "spectr", "specinfer", "khisti"])
def test_solver_laws_are_target(name):
    """Branching laws mixed over i.i.d. drafts give back p (the OTLP property, Def. 3.2)."""
    for k in (1, 2, 3):
        mix = torch.zeros(V, dtype=torch.float64)
        for xs in itertools.product(range(V), repeat=k):
            mix += math.prod(float(Q[x]) for x in xs) * solver_output_law(name, P, Q, list(xs))
        torch.testing.assert_close(mix, P, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["naive_tree", "spectr", "specinfer", "khisti"])
def test_acceptance_matches_monte_carlo(name):
    """Fast sampler on depth-1 trees with k = 3 i.i.d. drafts: accept rate vs formula, 1e5 runs."""
    n, k = 100_000, 3
    rng = np.random.default_rng(3)
    draws = rng.choice(V, size=(n, k), p=Q.numpy())
    tree_tokens = np.concatenate([np.zeros((n, 1), np.int64), draws], 1)
    trees = {}
    for row in map(tuple, tree_tokens):
        trees.setdefault(row, DraftTree(tokens=list(row), parents=[-1, 0, 0, 0]))
    uniq = list(trees)
    idx = {r: i for i, r in enumerate(uniq)}
    order = np.array([idx[tuple(r)] for r in tree_tokens])
    hits = 0
    logits = torch.log(P).unsqueeze(0).repeat(4, 1)
    q = Q.unsqueeze(0).repeat(4, 1)
    v = get_verifier(name, torch.float64)
    for i, r in enumerate(uniq):  # one batch per distinct draw, sized by its count
        m = int((order == i).sum())
        b = pack_trees([trees[r]]).repeat(m)
        res = v.verify_batch(b, logits.repeat(m, 1), TargetSampling(1.0), torch.Generator().manual_seed(i), q.repeat(m, 1))
        hits += int((res.num_accepted > 0).sum())
    est = hits / n
    want = acceptance_rate(name, P, Q, k) if name != "khisti" else exact_acceptance(name, k)
    assert abs(est - want) < 5 * math.sqrt(want * (1 - want) / n) + 1e-9


@pytest.mark.parametrize("name", ["specinfer", "traversal", "deterministic"])
def test_expected_block_efficiency_matches_monte_carlo(name):
    target = TableModel(V, seed=1)
    draft = DraftTable(target, seed=2)
    tree = paths_to_tree(sample_iid_paths(draft, (0,), 3, 1, 2, np.random.default_rng(4)), 0, 1)
    logits, q = tree_rows(tree, (0,), target, draft)
    p = torch.softmax(logits, -1)
    want = expected_block_efficiency(name, tree, p, q)
    n = 100_000
    res = get_verifier(name, torch.float64).verify_batch(
        pack_trees([tree]).repeat(n), logits.repeat(n, 1), TargetSampling(1.0), torch.Generator().manual_seed(0), q.repeat(n, 1))
    x = (res.num_accepted + 1).double()
    assert abs(float(x.mean()) - want) <= 5 * float(x.std()) / math.sqrt(n) + 1e-9


def test_khisti_stage_law_and_truncated_lp_optimality():
    """One Khisti stage (arXiv 2410.18234 Sec. 4, truncated LP): (a) r is exactly the law of the
    pairwise selection, by enumeration of the ordered pair (Y ~ q1, X ~ q2); (b) the max-flow
    solution attains the LP optimum, the min-cut value
        min_A sum_{i in A} p_i + sum_{i not in A} b_i + sum_{pairs not inside A} M_ij
    over subsets A of Omega_1 (the LP value sum_{i in Omega_1} min(p_i, r_i))."""
    v, s = 7, 5
    for trial in range(25):
        g = torch.Generator().manual_seed(trial)
        p = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 2, 0)
        if trial % 3 == 0:  # target with zeros (top-k / top-p)
            p[torch.randperm(v, generator=g)[:3]] = 0
            p = p / p.sum()
        q1 = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 2, 0)
        q2 = q1 if trial % 2 else torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 2, 0)
        st = khisti_stage(p[None], q1[None], q2[None], s)
        law = torch.zeros(v, dtype=torch.float64)
        for a, b in itertools.product(range(v), repeat=2):
            keep = khisti_keep_probability(st, 0, a, b)
            law[a] += q1[a] * q2[b] * keep
            law[b] += q1[a] * q2[b] * (1 - keep)
        torch.testing.assert_close(law, st.r[0], rtol=0, atol=1e-14)
        top = st.top[0].tolist()
        rest = [t for t in range(v) if t not in top]
        t1, t2 = float(q1[rest].sum()), float(q2[rest].sum())
        b = [float(q1[t] * q2[t] + q1[t] * t2 + t1 * q2[t]) for t in top]
        m = {(i, j): float(q1[top[i]] * q2[top[j]] + q1[top[j]] * q2[top[i]]) for i in range(s) for j in range(i + 1, s)}
        cut = min(
            sum(float(p[top[i]]) if i in a else b[i] for i in range(s))
            + sum(w for (i, j), w in m.items() if not (i in a and j in a))
            for n in range(s + 1)
            for a in map(set, itertools.combinations(range(s), n))
        )
        assert abs(float(torch.minimum(p[top], st.r[0][top]).sum()) - cut) < 1e-12


def test_khisti_four_drafts_law_is_target():
    """k = 4 (three tournament stages): the branching law mixed over i.i.d. drafts is p."""
    mix = torch.zeros(V, dtype=torch.float64)
    for xs in itertools.product(range(V), repeat=4):
        mix += math.prod(float(Q[x]) for x in xs) * solver_output_law("khisti", P, Q, list(xs))
    torch.testing.assert_close(mix, P, rtol=0, atol=1e-10)
    assert acceptance_rate("khisti", P, Q, 4) >= acceptance_rate("khisti", P, Q, 1) - 1e-12


@pytest.mark.parametrize("name", ["nss", "naive", "naive_tree", "spectr", "specinfer", "khisti", "traversal", "block"])
def test_expected_tokens_equals_enumerated_law(name):
    """The vector-only E[tau + 1 | T] (used at 151,936 tokens by the draft_tree grid) equals the
    expectation of the enumerated output law, on delayed trees with duplicate siblings, top-p
    zeros in p and every (K, L1, L2) shape of a small grid; and the reach of a tree cut below
    depth d is the cut tree's value (the grid's prefix shortcut)."""
    target = TableModel(V, seed=11)
    draft = DraftTable(target, seed=12)
    rng = np.random.default_rng(5)
    checked = 0
    for k, l1, l2 in itertools.product((1, 2, 3) if name != "block" else (1,), (0, 1, 2), (1, 2)):
        for _ in range(3):
            tree = paths_to_tree(sample_iid_paths(draft, (0,), k, l1, l1 + l2, rng), 0, l1)
            logits, q = tree_rows(tree, (0,), target, draft)
            p = torch.softmax(logits, -1)
            p[:, 0] = 0.0  # a token the target's top-p removed
            p = p / p.sum(-1, keepdim=True)
            want = expected_block_efficiency(name, tree, p, q)
            assert abs(expected_tokens(name, tree, p, q) - want) < 1e-10
            if name in TOPDOWN:
                reach = reach_probabilities(name, tree, p, q)
                for d in range(int(tree.depths.max()) + 1):
                    keep = np.flatnonzero(tree.depths <= d)
                    new = np.full(tree.num_nodes, -1)
                    new[keep] = np.arange(keep.size)
                    parents = np.where(tree.parents[keep] >= 0, new[np.maximum(tree.parents[keep], 0)], -1)
                    cut = DraftTree(tokens=tree.tokens[keep], parents=parents)
                    assert abs(reach[keep].sum() - expected_block_efficiency(name, cut, p[keep], q[keep])) < 1e-10
            checked += 1
    assert checked >= 9
