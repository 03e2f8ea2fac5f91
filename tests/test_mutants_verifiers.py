"""The fast verifiers' per-node solvers and residual updates, one node at a time.

Written to kill the mutants ``scripts/mutate.py`` left alive (docs/testing.md): the exactness
tests (test_verifier_exact.py) prove the *analytic* laws, and test_verifier_reference.py
compares the fast code with a reference that shares some helpers (``_residual``,
``spectr_residual``, ``naive_solve`` via Khisti), so a mutant of a shared helper passed both.

Three layers:

* golden decisions: a hand-worked node, uniforms placed just below / above each threshold of
  the rule (accept with min(1, p/q), residual norm(max(0, p - q)), ...);
* Monte Carlo at one node: drafts i.i.d. q, the solver's output must have law p (losslessness,
  arXiv 2602.16994 Sec. 3.2) and its acceptance rate must be the closed form of arXiv
  2602.16994 Appendix C (Algorithms 6-9);
* Monte Carlo of whole trees for the two verifiers without a per-node solver (Block,
  Traversal) against ``analytic.output_distribution``.

Fixed seeds: deterministic. Node: V = 5, p = [.45, .30, .15, .10, 0], q = [.10, .20, .30, .25, .15].
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from vllm_anisotropic.tree import pack_trees
from vllm_anisotropic.verifiers import TargetSampling, get_verifier, target_probs
from vllm_anisotropic.verifiers.analytic import acceptance_rate, output_distribution
from vllm_anisotropic.verifiers.deterministic import _zero_tokens
from vllm_anisotropic.verifiers.naive import naive_solve
from vllm_anisotropic.verifiers.specinfer import _residual
from vllm_anisotropic.verifiers.spectr import spectr_residual
from vllm_anisotropic.verifiers.toy import DraftTable, TableModel, paths_to_tree, sample_iid_paths, tree_rows

P = torch.tensor([0.45, 0.30, 0.15, 0.10, 0.0], dtype=torch.float64)
Q = torch.tensor([0.10, 0.20, 0.30, 0.25, 0.15], dtype=torch.float64)


def _rows(n):
    return P.repeat(n, 1), Q.repeat(n, 1)


def _u(rows: list[dict[int, float]], s: int) -> torch.Tensor:
    """[rows, 3S + 2] uniforms, 0.5 except the given columns."""
    u = torch.full((len(rows), 3 * s + 2), 0.5, dtype=torch.float64)
    for i, cols in enumerate(rows):
        for c, v in cols.items():
            u[i, c] = v
    return u


# ------------------------------------------------------------------------ golden decisions
def test_naive_solve_golden():
    """x = 1: min(1, .30/.20) = 1, always accepted. x = 2: min(1, .15/.30) = .5, accepted iff
    u_acc < .5; on rejection y ~ norm(max(0, p - q)) = [.35, .10, 0, 0, 0] / .45 = [7/9, 2/9, ...]:
    u_res < 7/9 -> 0, else 1. x = 4: p(4) = 0, never accepted."""
    x = torch.tensor([1, 2, 2, 2, 4, 4])
    u_acc = torch.tensor([0.99, 0.49, 0.51, 0.51, 0.0, 0.0], dtype=torch.float64)
    u_res = torch.tensor([0.0, 0.99, 0.77, 0.78, 0.77, 0.78], dtype=torch.float64)
    p, q = _rows(6)
    assert naive_solve(p, q, x, u_acc, u_res).tolist() == [1, 2, 0, 1, 0, 1]
    # p == q at x = 4 (p(4) = q(4) = 0): rejected, the all-zero residual falls back to p
    # (cdf .45, .75, .90, 1): u_res 0 -> 0, .99 -> 3, .77 / .78 -> 2
    assert naive_solve(p, p.clone(), torch.tensor([4] * 6), torch.full((6,), 0.5, dtype=torch.float64), u_res).tolist() == [0, 3, 2, 2, 2, 2]


def test_specinfer_residual_and_rounds_golden():
    """_residual(p, q) = norm(max(0, p - q)) = [7/9, 2/9, 0, 0, 0]; p == q keeps p.
    solve with xs = [2, 3] (S = 2; round i reads column S + i, the final sample column 3S):
    round 0 accepts 2 iff u < .15/.30 = .5; else p_1 = [7/9, 2/9, 0, 0, 0], and round 1 accepts
    3 with p_1(3)/q(3) = 0 (never; without the residual update it would be .10/.25 = .4); then
    p_2 = norm(max(0, p_1 - q)) = [61/90, 2/90, 0, 0, 0] / (63/90) = [61/63, 2/63, ...]."""
    r = _residual(P.unsqueeze(0), Q.unsqueeze(0))[0]
    assert r.tolist() == pytest.approx([7 / 9, 2 / 9, 0, 0, 0], abs=1e-12)
    assert _residual(P.unsqueeze(0), P.unsqueeze(0))[0].tolist() == pytest.approx(P.tolist())
    v = get_verifier("specinfer", torch.float64)
    xs = torch.tensor([[2, 3]] * 4)
    u = _u([{2: 0.49}, {2: 0.51, 3: 0.0, 6: 0.96}, {2: 0.51, 3: 0.0, 6: 0.97}, {2: 0.51, 3: 0.3, 6: 0.5}], 2)
    p, q = _rows(4)
    assert v.solve(p, q, xs, u).tolist() == [2, 0, 1, 0]


def test_deterministic_solve_golden():
    """One-hot SpecInfer, xs = [1, 1, 3] (S = 3, round i reads column S + i, residual column 3S):
    round 0 accepts 1 w.p. p(1) = .3; round 1 is the repeat (p_cur(1) = 0, R stays .3); round 2
    accepts 3 w.p. .10 / (1 - .3) = 1/7; else y ~ p with 1 and 3 zeroed = [.45, 0, .15, 0, 0] /
    .6: u < .75 -> 0, else 2."""
    v = get_verifier("deterministic", torch.float64)
    cases = [
        ({3: 0.29}, 1),
        ({3: 0.31, 4: 0.0, 5: 0.14}, 3),  # the repeat never accepts, 0.14 < 1/7
        ({3: 0.31, 4: 0.0, 5: 0.2, 9: 0.74}, 0),  # 0.2 > 1/7 (R counted once: 1/(1-.6) would accept)
        ({3: 0.31, 4: 0.0, 5: 0.2, 9: 0.76}, 2),
    ]
    u = _u([c for c, _ in cases], 3)
    p, _ = _rows(len(cases))
    assert v.solve(p, None, torch.tensor([[1, 1, 3]] * len(cases)), u).tolist() == [y for _, y in cases]
    # padding (-1) is no token: only 2 is zeroed
    z = _zero_tokens(P.unsqueeze(0), torch.tensor([[2, -1]]))[0]
    assert z.tolist() == pytest.approx([0.45, 0.30, 0.0, 0.10, 0.0])


def test_spectr_residual_and_nss_golden():
    """spectr_residual = max(0, p - min(p / rho, q) * gamma), unnormalised; at rho = 1.5,
    gamma = 1.2: min(p/1.5, q) = [.10, .20, .10, .0667, 0] -> p - 1.2 * that = [.33, .06, .03, .02, 0].
    NSS ignores the drafts: y = inverse CDF of p at column 3S (cdf .45, .75, .90, 1.0)."""
    res = spectr_residual(P.unsqueeze(0), Q.unsqueeze(0), torch.tensor([1.5], dtype=torch.float64), torch.tensor([1.2], dtype=torch.float64))
    assert res[0].tolist() == pytest.approx([0.33, 0.06, 0.03, 0.02, 0.0], abs=1e-12)
    nss = get_verifier("nss", torch.float64)
    u = _u([{6: 0.44}, {6: 0.46}, {6: 0.89}, {6: 0.91}], 2)
    p, _ = _rows(4)
    assert nss.solve(p, None, torch.tensor([[3, 3]] * 4), u).tolist() == [0, 1, 2, 3]


# ------------------------------------------------------------------------ one node, Monte Carlo
N = 30_000


@pytest.mark.parametrize("name,k", [("naive", 1), ("naive_tree", 2), ("specinfer", 2), ("specinfer", 3), ("spectr", 2), ("khisti", 2), ("khisti", 3)])
def test_solver_is_lossless_and_accepts_at_the_closed_form_rate(name, k):
    g = torch.Generator().manual_seed(7)
    xs = torch.multinomial(Q.float(), N * k, replacement=True, generator=g).reshape(N, k)  # i.i.d. q
    u = torch.rand((N, 3 * k + 2), generator=g, dtype=torch.float64)
    p, q = _rows(N)
    y = get_verifier(name, torch.float64).solve(p, q, xs, u)
    law = torch.bincount(y, minlength=5).double() / N
    assert (law - P).abs().max() < 0.015, law  # std <= 0.0029
    accepted = (y.unsqueeze(1) == (xs[:, :1] if name == "naive" else xs)).any(dim=1).double().mean()
    if name == "khisti":  # Alg. 10 gives a lower bound (hits on non-selected drafts not counted)
        assert accepted >= acceptance_rate(name, P, Q, k) - 0.015
    else:
        assert float(accepted) == pytest.approx(acceptance_rate(name, P, Q, k), abs=0.015)


@pytest.mark.parametrize("xs", [[2, 0], [1, 1, 3], [4]])
def test_deterministic_and_nss_are_lossless_for_any_children(xs):
    g = torch.Generator().manual_seed(3)
    s = len(xs)
    u = torch.rand((N, 3 * s + 2), generator=g, dtype=torch.float64)
    p, _ = _rows(N)
    for name in ("deterministic", "nss"):
        y = get_verifier(name, torch.float64).solve(p, None, torch.tensor([xs] * N), u)
        law = torch.bincount(y, minlength=5).double() / N
        assert (law - P).abs().max() < 0.015, (name, law)


# ------------------------------------------------------------------------ whole trees (Block, Traversal)
V = 4
TARGET = TableModel(V, seed=3)
DRAFT = DraftTable(TARGET, seed=4, lam0=0.4, slope=0.2)
SAMPLING = TargetSampling(0.9)


@pytest.mark.parametrize("name,k", [("block", 1), ("traversal", 1), ("traversal", 2)])
def test_block_and_traversal_sample_the_exact_law(name, k):
    rng = np.random.default_rng(11)
    tree = paths_to_tree(sample_iid_paths(DRAFT, (1,), k, 0, 2, rng), 1, 0)
    logits, q = tree_rows(tree, (1,), TARGET, DRAFT)
    n = tree.num_nodes
    p = target_probs(logits, torch.full((n,), 0.9), torch.full((n,), 0), torch.full((n,), 1.0), torch.float64)
    law = output_distribution(name, tree, p, q)
    m = 20_000
    res = get_verifier(name, torch.float64).verify_batch(
        pack_trees([tree]).repeat(m), logits.repeat(m, 1), SAMPLING, torch.Generator().manual_seed(5), q.repeat(m, 1))
    acc, num = res.accepted.numpy(), res.num_accepted.numpy()
    seqs = Counter(tuple(tree.tokens[acc[i, : num[i]]].tolist()) + (int(res.bonus_tokens[i]),) for i in range(m))
    worst = max(abs(seqs.get(key, 0) / m - law.get(key, 0.0)) for key in set(law) | set(seqs))
    assert worst < 0.015, worst  # std <= 0.0036


# ------------------------------------------------------------------------ greedy walk
def test_greedy_walk_output_layout_and_root_only_tree():
    """accepted is [batch_size, max_depth], -1 padded; a root-only tree (the only node of the
    batch) emits the argmax as its bonus token."""
    from vllm_anisotropic.tree import DraftTree

    greedy = get_verifier("greedy", torch.float64)
    one = DraftTree(tokens=[3], parents=[-1])
    r = greedy.verify_batch(pack_trees([one]), torch.tensor([[0.0, 2.0, 1.0]], dtype=torch.float64))
    assert r.bonus_tokens.tolist() == [1] and r.num_accepted.tolist() == [0] and r.accepted.tolist() == [[-1]]
    # root 0 -> 1 (argmax after the root is 1: accepted), 0 -> 2; second tree: root only
    t = DraftTree(tokens=[0, 1, 2], parents=[-1, 0, 0])
    logits = torch.tensor([[0, 5, 1.0], [4, 0, 0], [0, 0, 3], [0, 1, 0]], dtype=torch.float64)
    r = greedy.verify_batch(pack_trees([t, one]), logits)
    assert r.accepted.shape == (2, 1) and r.accepted.tolist() == [[1], [-1]]
    assert r.num_accepted.tolist() == [1, 0] and r.bonus_tokens.tolist() == [0, 1]


def test_spectr_round_i_reads_column_s_plus_i():
    """SpecTr round i tests rho* U < p(x) / q(x) with U = u[:, S + i] (uniform layout of
    topdown.py). xs = [3, 2], S = 2, rho* in [1, 2]: round 0 (3: p/q = .4) rejects at U = .999;
    round 1 (2: p/q = .5, so accept iff U < .5 / rho* >= .25) accepts at U = .1. The shuffle-key
    column 1 is set to .999, so reading it instead would reject and sample the residual at 0."""
    u = _u([{1: 0.999, 2: 0.999, 3: 0.1, 6: 0.0}], 2)
    p, q = _rows(1)
    assert get_verifier("spectr", torch.float64).solve(p, q, torch.tensor([[3, 2]]), u).tolist() == [2]


def test_khisti_fast_solve_equals_reference_row_by_row():
    """The Khisti tournament reads column 2S + i for stage i (challenger X_{i+1}); the fast
    solve, on one row at a time and on all rows at once, makes the reference's decisions.
    p = [.3, .3, .4], q = [.34, .33, .33]: the truncated LP's pairwise weights are fractional
    here (e.g. theta = .33 and .85 in the first stage), so the stage uniforms matter."""
    p1 = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)
    q1 = torch.tensor([0.34, 0.33, 0.33], dtype=torch.float64)
    g = torch.Generator().manual_seed(11)
    v = get_verifier("khisti", torch.float64)
    for k in (2, 3):
        n = 40
        xs = torch.multinomial(q1.float(), n * k, replacement=True, generator=g).reshape(n, k)
        u = torch.rand((n, 3 * k + 2), generator=g, dtype=torch.float64)
        ref = [v.solve_reference(p1, q1, xs[i].tolist(), u[i], k) for i in range(n)]
        p, q = p1.repeat(n, 1), q1.repeat(n, 1)
        assert v.solve(p, q, xs, u).tolist() == ref
        assert [int(v.solve(p[i : i + 1], q[i : i + 1], xs[i : i + 1], u[i : i + 1])[0]) for i in range(n)] == ref


def test_block_weights_golden():
    """Block Verification weights on the chain root -> 1 -> 1 -> 0 (V = 3; rows p_i, q_i):
    w_1 = min(1, p_0(1)/q_0(1)) = min(1, .6/.3) = 1 (clamped), w_2 = min(1, 1 * .25/.5) = .5,
    w_3 = min(1, .5 * .8/.1) = 1. h_0 = 1; D_1 = sum (w_1 p_1 - q_1)_+ = .3, h_1 = .3/(.3 + 1 - 1)
    = 1; D_2 = sum (.5 p_2 - q_2)_+ = .4 - .1 = .3, h_2 = .3/(.3 + 1 - .5) = .375; h_3 = w_3 = 1."""
    from vllm_anisotropic.tree import DraftTree
    from vllm_anisotropic.verifiers.block import first_child_chain
    from vllm_anisotropic.verifiers.sampling import SamplingTensors

    p = torch.tensor([[0.2, 0.6, 0.2], [0.5, 0.25, 0.25], [0.8, 0.1, 0.1], [0.3, 0.3, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.3, 0.3, 0.4], [0.2, 0.5, 0.3], [0.1, 0.45, 0.45], [1 / 3] * 3], dtype=torch.float64)
    batch = pack_trees([DraftTree(tokens=[2, 1, 1, 0], parents=[-1, 0, 1, 2])])
    chain, length = first_child_chain(batch)
    v = get_verifier("block", torch.float64)
    _, _, w, h, m = v._weights(chain, length, batch, p.log(), SamplingTensors.from_params(TargetSampling(1.0), 1), q)
    assert w[0].tolist() == pytest.approx([1.0, 1.0, 0.5, 1.0], abs=1e-12)
    assert h[0].tolist() == pytest.approx([1.0, 1.0, 0.375, 1.0], abs=1e-12)
    assert m[0, 2].tolist() == pytest.approx([0.3, 0.0, 0.0], abs=1e-12)  # (w_2 p_2 - q_2)_+


@pytest.mark.parametrize("name", ["traversal", "block"])
def test_chain_with_ratio_above_one_samples_the_exact_law(name):
    """The rows of test_block_weights_golden on the chain root -> 1 -> 1 -> 1: p_0(1)/q_0(1) = 2,
    so the sequence weight is clamped at 1 (alpha = min(1, alpha p/q)): alpha = 1, .5, then
    .5 * .1/.45 = 1/9 at the leaf; unclamped it would be 2, 1, 2/9 (accepting too often)."""
    from vllm_anisotropic.tree import DraftTree

    p = torch.tensor([[0.2, 0.6, 0.2], [0.5, 0.25, 0.25], [0.8, 0.1, 0.1], [0.3, 0.3, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.3, 0.3, 0.4], [0.2, 0.5, 0.3], [0.1, 0.45, 0.45], [1 / 3] * 3], dtype=torch.float64)
    tree = DraftTree(tokens=[2, 1, 1, 1], parents=[-1, 0, 1, 2])
    law = output_distribution(name, tree, p, q)
    m = 20_000
    res = get_verifier(name, torch.float64).verify_batch(
        pack_trees([tree]).repeat(m), p.log().repeat(m, 1), TargetSampling(1.0), torch.Generator().manual_seed(9), q.repeat(m, 1))
    acc, num = res.accepted.numpy(), res.num_accepted.numpy()
    assert res.accepted.shape == (m, 3) and all((acc[i, num[i] :] == -1).all() for i in range(m))  # -1 padded
    seqs = Counter(tuple(tree.tokens[acc[i, : num[i]]].tolist()) + (int(res.bonus_tokens[i]),) for i in range(m))
    worst = max(abs(seqs.get(key, 0) / m - law.get(key, 0.0)) for key in set(law) | set(seqs))
    assert worst < 0.015, worst
    root_only = get_verifier(name, torch.float64).verify_batch(
        pack_trees([DraftTree(tokens=[2], parents=[-1])] * 2), p[:1].log().repeat(2, 1), TargetSampling(1.0), None, q[:1].repeat(2, 1))
    assert root_only.accepted.tolist() == [[-1], [-1]] and root_only.num_accepted.tolist() == [0, 0]


def test_traversal_second_child_sees_the_normalised_residual():
    """Root with leaves 1 and 0 (in that order), p_0 = [.6, .1, .3], q_0 = [.2, .5, .3]: child 1
    (alpha .2) rejected leaves m = (p_0 - q_0)_+ = [.4, 0, 0], D = .4, root state p = m / D =
    [1, 0, 0], alpha 1; child 0 then enters with alpha min(1, 1 / .2) = 1 (unnormalised m * D
    would give .8)."""
    from vllm_anisotropic.tree import DraftTree

    p = torch.tensor([[0.6, 0.1, 0.3], [0.2, 0.3, 0.5], [0.5, 0.4, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.5, 0.3], [1 / 3] * 3, [1 / 3] * 3], dtype=torch.float64)
    tree = DraftTree(tokens=[2, 1, 0], parents=[-1, 0, 0])
    law = output_distribution("traversal", tree, p, q)
    m = 20_000
    res = get_verifier("traversal", torch.float64).verify_batch(
        pack_trees([tree]).repeat(m), p.log().repeat(m, 1), TargetSampling(1.0), torch.Generator().manual_seed(2), q.repeat(m, 1))
    acc, num = res.accepted.numpy(), res.num_accepted.numpy()
    seqs = Counter(tuple(tree.tokens[acc[i, : num[i]]].tolist()) + (int(res.bonus_tokens[i]),) for i in range(m))
    worst = max(abs(seqs.get(key, 0) / m - law.get(key, 0.0)) for key in set(law) | set(seqs))
    assert worst < 0.015, worst


def test_specinfer_round_columns_and_padded_rows():
    """p = [.5, .35, .15], q = [.2, .3, .5], xs = [2, 1] (S = 2): round 0 rejects 2 (p/q = .3) at
    u[:, 2] = .9; p_1 = norm(max(0, p - q)) = [.3, .05, 0] / .35 = [6/7, 1/7, 0]; round 1 accepts 1
    (p_1/q = (1/7)/.3 = .476) at u[:, 3] = .2 (column 1, set to .9, is a shuffle key). A row
    with one child (xs = [2, -1]) rejected at round 0 samples p_1 at u[:, 6]: .86 -> 1 (cdf 6/7 =
    .857); the padding slot must not apply a second residual update."""
    p1 = torch.tensor([0.5, 0.35, 0.15], dtype=torch.float64)
    q1 = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    u = _u([{1: 0.9, 2: 0.9, 3: 0.2}, {2: 0.9, 3: 0.0, 6: 0.86}], 2)
    y = get_verifier("specinfer", torch.float64).solve(p1.repeat(2, 1), q1.repeat(2, 1), torch.tensor([[2, 1], [2, -1]]), u)
    assert y.tolist() == [1, 1]
