"""Analytic acceptance rates, branching probabilities, exact output laws and expected block
efficiency of the verifiers (arXiv 2602.16994 Sec. 5, Appendix C and D, Eq. 1-3).

Scope: closed-form / exact computations on small vocabularies, in float64, with plain Python
control flow. Used by tests (exactness proofs, Monte Carlo checks of the samplers) and by the
delayed-tree selector (expected block efficiency from per-node branching probabilities).

Terms (arXiv 2602.16994):

acceptance rate (Def. 5.1)
    alpha(f_{p,q,k}) = P(f(X_1..X_k) in {X_1..X_k}) for X_i ~ q i.i.d.
branching probability (Def. 5.3)
    B(f_{p,q,k}, x, t) = P(f(x) = t); ``solver_output_law`` returns the whole law over the
    vocabulary (children and non-children), ``branching_probabilities`` its values on x.
expected block efficiency (Eq. 1-3)
    E[tau + 1 | T] = sum over nodes c of P(the traversal reaches c), the root included.

The solvers see the child multiset in uniformly random order (``topdown.py``), so the laws of
the order-dependent ones (Naive, SpecTr, the Khisti tournament) average over the orderings of the multiset.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import torch

from vllm_anisotropic.tree import DraftTree
from vllm_anisotropic.verifiers.khisti import khisti_importance_law, khisti_keep_probability
from vllm_anisotropic.verifiers.spectr import spectr_constants, spectr_rho

__all__ = [
    "OT_SOLVERS",
    "solver_output_law",
    "branching_probabilities",
    "acceptance_rate",
    "output_distribution",
    "expected_block_efficiency",
    "reach_probabilities",
    "expected_tokens",
]

OT_SOLVERS = ("nss", "naive", "naive_tree", "spectr", "specinfer", "khisti", "deterministic", "greedy")


def _norm_pos(v: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    v = v.clamp(min=0)
    s = float(v.sum())
    return v / s if s > 0 else fallback


def _delta(vocab: int, t: int) -> torch.Tensor:
    d = torch.zeros(vocab, dtype=torch.float64)
    d[t] = 1.0
    return d


def _naive_law(p, q, x1: int) -> torch.Tensor:
    # accept X_1 with min(1, p/q), else y ~ norm((p - q)_+)
    a = min(1.0, float(p[x1]) / float(q[x1])) if float(q[x1]) > 0 else 1.0
    return a * _delta(p.shape[0], x1) + (1.0 - a) * _norm_pos(p - q, p)


def _spectr_rho_gamma(p, q, k: int) -> tuple[float, float]:
    kt = torch.tensor([k])
    rho = spectr_rho(p.unsqueeze(0), q.unsqueeze(0), kt)
    _, _, gamma = spectr_constants(p.unsqueeze(0), q.unsqueeze(0), kt, rho)
    return float(rho[0]), float(gamma[0])


def _spectr_order_law(p, q, order, rho_f: float, gam: float) -> torch.Tensor:
    # rho and gamma depend on (p, q, k) only, not on the order of the drafts
    out = torch.zeros_like(p)
    stay = 1.0
    for x in order:  # accept X_i with min(1, p / (rho q)) in sequence
        a = min(1.0, float(p[x]) / (rho_f * float(q[x]))) if float(q[x]) > 0 else 1.0
        out[x] += stay * a
        stay *= 1.0 - a
    res = (p - torch.minimum(p / rho_f, q) * gam).clamp(min=0)
    return out + stay * _norm_pos(res, p)


def _specinfer_law(p, q, xs: list[int]) -> torch.Tensor:
    # B(S, p) = 1/|S| sum_{t in S} [a(t) delta_t + (1 - a(t)) B(S \ t, norm((p - q)_+))]
    if not xs:
        return p.clone()
    out = torch.zeros_like(p)
    res = _norm_pos(p - q, p)
    for i, t in enumerate(xs):
        a = min(1.0, float(p[t]) / float(q[t])) if float(q[t]) > 0 else 1.0
        out += (a * _delta(p.shape[0], t) + (1.0 - a) * _specinfer_law(res, q, xs[:i] + xs[i + 1 :])) / len(xs)
    return out


def _khisti_law(p, q, xs: list[int]) -> torch.Tensor:
    # arXiv 2602.16994 Algorithm 15: sum_x pi_x NAIVE_BRANCHING(p, r, [x]), pi_x = P(tournament
    # winner = x). The tournament is sequential, so pi averages over the uniformly random
    # order of the multiset the driver presents; the stages (and r) depend on p, q, k only.
    stages = khisti_importance_law(p.unsqueeze(0), q.unsqueeze(0), len(xs))
    r = stages[-1].r[0] if stages else q
    perms = list(itertools.permutations(xs))
    pi: dict[int, float] = defaultdict(float)
    for order in perms:
        dist = {order[0]: 1.0}  # law of the current winner
        for stage, challenger in zip(stages, order[1:]):
            nxt: dict[int, float] = defaultdict(float)
            for w, m in dist.items():
                keep = khisti_keep_probability(stage, 0, w, challenger)
                nxt[w] += m * keep
                nxt[challenger] += m * (1.0 - keep)
            dist = nxt
        for w, m in dist.items():
            pi[w] += m / len(perms)
    return sum(m * _naive_law(p, r, w) for w, m in pi.items())


def _deterministic_law(p, xs: list[int]) -> torch.Tensor:
    # one-hot SpecInfer in priority order: accept x with p_cur(x), else zero x and renormalise
    out = torch.zeros_like(p)
    cur = p.clone()
    stay = 1.0
    for x in xs:
        a = float(cur[x])
        out[x] += stay * a
        stay *= 1.0 - a
        cur[x] = 0.0
        cur = _norm_pos(cur, cur)
    return out + stay * cur


def solver_output_law(name: str, p: torch.Tensor, q: torch.Tensor | None, xs: list[int]) -> torch.Tensor:
    """Law of the token output by the OTLP solver ``name`` at a node, [vocab_size] float64.

    ``xs``: the child multiset (tokens, repeated by multiplicity), in priority order. For
    "naive" (single path) the law includes residual tokens equal to other drafts, which the
    single-path walk does not descend into (``output_distribution`` handles that).
    """
    p = p.to(torch.float64)
    q = None if q is None else q.to(torch.float64)
    if name in ("nss", "greedy"):
        return p.clone()
    if name == "deterministic":
        return _deterministic_law(p, xs)
    if name in ("naive", "naive_tree"):  # X_1 is uniform over the shuffled multiset
        return sum(_naive_law(p, q, x) for x in xs) / len(xs)
    if name == "spectr":
        perms = list(itertools.permutations(xs))
        rho_gamma = _spectr_rho_gamma(p, q, len(xs))
        return sum(_spectr_order_law(p, q, list(o), *rho_gamma) for o in perms) / len(perms)
    if name == "specinfer":
        return _specinfer_law(p, q, list(xs))
    if name == "khisti":
        return _khisti_law(p, q, list(xs))
    raise ValueError(f"no OTLP solver law for {name!r}; valid: {OT_SOLVERS}")


def branching_probabilities(name: str, p, q, xs: list[int]) -> dict[int, float]:
    """B(f_{p,q,k}, xs, t) for every distinct draft token t (arXiv 2602.16994 Def. 5.3, Appendix D)."""
    law = solver_output_law(name, p, q, xs)
    if name == "naive":  # single path: only the (uniformly chosen) first draft is descended into
        return {t: float(_single_path_accept(p, q, xs, t)) for t in set(xs)}
    return {t: float(law[t]) for t in set(xs)}


def _single_path_accept(p, q, xs, t) -> float:
    p = p.to(torch.float64)
    q = q.to(torch.float64)
    return sum(min(1.0, float(p[x]) / float(q[x])) for x in xs if x == t) / len(xs)


def acceptance_rate(name: str, p: torch.Tensor, q: torch.Tensor, k: int) -> float:
    """alpha(f_{p,q,k}) by the closed forms of arXiv 2602.16994 Appendix C (Algorithms 6-10).

    For "khisti" this returns the arXiv 2602.16994 Algorithm 10 *lower bound* sum_x min(p, r)
    (residual hits on the non-selected drafts are not counted).
    """
    p = p.to(torch.float64)
    q = q.to(torch.float64)
    if name == "nss":  # Alg. 6: sum_t p(t) (1 - (1 - q(t))^k)
        return float((p * (1 - (1 - q) ** k)).sum())
    if name == "naive":  # single path: only X_1 can be accepted
        return float(torch.minimum(p, q).sum())
    if name == "naive_tree":  # Alg. 7
        return float(torch.minimum(p, q).sum() + ((p - q).clamp(min=0) * (1 - (1 - q) ** (k - 1))).sum())
    if name == "spectr":  # Alg. 8
        kt = torch.tensor([k])
        rho = spectr_rho(p.unsqueeze(0), q.unsqueeze(0), kt)
        beta, p_acc, gamma = (float(v[0]) for v in spectr_constants(p.unsqueeze(0), q.unsqueeze(0), kt, rho))
        res = _norm_pos(p - torch.minimum(p / float(rho[0]), q) * gamma, p)
        r = (q - p / float(rho[0])).clamp(min=0) / (1 - beta) if beta < 1 else torch.zeros_like(q)
        return p_acc + (1 - p_acc) * float((res * (1 - (1 - r) ** k)).sum())
    if name == "specinfer":  # Alg. 9
        p_rej, m, pc = 1.0, torch.ones_like(p), p.clone()
        for _ in range(k):
            r = float(torch.minimum(pc, q).sum())
            p_rej *= 1 - r
            if r < 1:
                m = m * (1 - (q - pc).clamp(min=0) / (1 - r))  # P(t not among rejected drafts)
            pc = _norm_pos(pc - q, pc)
        return (1 - p_rej) + p_rej * float((pc * (1 - m)).sum())
    if name == "khisti":  # Alg. 10 lower bound: sum_t min(p(t), r(t)), r the importance-weighted law
        stages = khisti_importance_law(p.unsqueeze(0), q.unsqueeze(0), k)
        r = stages[-1].r[0] if stages else q
        return float(torch.minimum(p, r).sum())
    raise ValueError(f"no acceptance formula for {name!r}")


# ---------------------------------------------------------------------------- whole trees
def output_distribution(
    name: str,
    tree: DraftTree,
    p_rows: torch.Tensor,  # [num_nodes, vocab_size] processed target p per node
    q_rows: torch.Tensor | None = None,  # [num_nodes, vocab_size] draft law of each node's children
) -> dict[tuple[int, ...], float]:
    """Exact law of the emitted tokens (accepted path tokens + bonus) for a fixed tree."""
    p_rows = p_rows.to(torch.float64)
    q_rows = None if q_rows is None else q_rows.to(torch.float64)
    out: dict[tuple[int, ...], float] = defaultdict(float)
    if name == "traversal":
        _traversal_law(tree, p_rows, q_rows, out)
    elif name == "block":
        _block_law(tree, p_rows, q_rows, out)
    else:
        _topdown_law(name, tree, p_rows, q_rows, 0, 1.0, (), out)
    return dict(out)


def _topdown_law(name, tree, p_rows, q_rows, node, reach, prefix, out) -> None:
    kids = tree.children_lists()[node]
    p = p_rows[node]
    if not kids:
        for y in torch.nonzero(p > 0).flatten().tolist():
            out[prefix + (y,)] += reach * float(p[y])
        return
    slots = [j for j in kids for _ in range(int(tree.multiplicity[j]))]
    xs = [int(tree.tokens[j]) for j in slots]
    q = None if q_rows is None else q_rows[node]
    law = solver_output_law(name, p, q, xs)
    if name == "naive":
        # single path: X_1 uniform over the slots; accepted -> descend into that slot's node
        for j, x in zip(slots, xs):
            a = min(1.0, float(p[x]) / float(q[x])) if float(q[x]) > 0 else 1.0
            if a > 0:
                _topdown_law(name, tree, p_rows, q_rows, j, reach * a / len(xs), prefix + (x,), out)
            res = _norm_pos(p - q, p)
            for y in torch.nonzero(res > 0).flatten().tolist():
                out[prefix + (y,)] += reach * (1 - a) / len(xs) * float(res[y])
        return
    first = {}
    for j in kids:  # the driver descends into the first child (priority order) with the token
        first.setdefault(int(tree.tokens[j]), j)
    for y in torch.nonzero(law > 0).flatten().tolist():
        mass = reach * float(law[y])
        if y in first:
            _topdown_law(name, tree, p_rows, q_rows, first[y], mass, prefix + (y,), out)
        else:
            out[prefix + (y,)] += mass


def _traversal_law(tree, p_rows, q_rows, out) -> None:
    kids = tree.children_lists()
    state = {0: [1.0, p_rows[0].clone()]}
    reach = [1.0]  # probability that no node was accepted so far

    def tokens_to(c):
        return tuple(int(tree.tokens[n]) for n in tree.path_to(c))

    def visit(c) -> None:
        for x in kids[c]:
            a_c, p_c = state[c]
            qc = q_rows[c]
            tok = int(tree.tokens[x])
            state[x] = [min(1.0, a_c * float(p_c[tok]) / float(qc[tok])), p_rows[x].clone()]
            visit(x)
            m = (a_c * p_c - qc).clamp(min=0)  # child rejected: missing mass to the parent
            dm = float(m.sum())
            state[c] = [dm / (1 - a_c + dm), m / dm] if dm > 0 else [0.0, p_c]
        a_c, p_c = state[c]
        acc = 1.0 if c == 0 else a_c
        for y in torch.nonzero(p_c > 0).flatten().tolist():
            out[tokens_to(c) + (y,)] += reach[0] * acc * float(p_c[y])
        reach[0] *= 1 - acc

    visit(0)


def _block_weights(tree, p_rows, q_rows) -> tuple[list[int], list[float]]:
    """Block verification's chain (first children from the root) and its weights
    w_i = min(1, w_{i-1} p(x_i) / q(x_i)), w_0 = 1 (Sun et al. 2024, arXiv 2403.10444)."""
    chain = [0]
    while tree.first_child[chain[-1]] >= 0:
        chain.append(int(tree.first_child[chain[-1]]))
    w = [1.0]
    for i in range(1, len(chain)):
        x = int(tree.tokens[chain[i]])
        qx = float(q_rows[chain[i - 1]][x])
        w.append(min(1.0, w[-1] * float(p_rows[chain[i - 1]][x]) / qx) if qx > 0 else 1.0)
    return chain, w


def _block_law(tree, p_rows, q_rows, out) -> None:
    chain, w = _block_weights(tree, p_rows, q_rows)
    big_l = len(chain) - 1
    reach = 1.0
    for i in range(big_l, -1, -1):
        if i == big_l:
            h, dist = w[i], p_rows[chain[i]]
        else:
            dist = (w[i] * p_rows[chain[i]] - q_rows[chain[i]]).clamp(min=0)
            dsum = float(dist.sum())
            h = 1.0 if i == 0 else (dsum / (dsum + (1 - w[i])) if dsum > 0 else 0.0)
            dist = dist / dsum if dsum > 0 else p_rows[chain[i]]
        prefix = tuple(int(tree.tokens[n]) for n in chain[1 : i + 1])
        for y in torch.nonzero(dist > 0).flatten().tolist():
            out[prefix + (y,)] += reach * h * float(dist[y])
        reach *= 1 - h


def expected_block_efficiency(name: str, tree: DraftTree, p_rows, q_rows=None) -> float:
    """E[tau + 1 | T] (arXiv 2602.16994 Eq. 2-3): expected number of emitted tokens for this tree."""
    law = output_distribution(name, tree, p_rows, q_rows)
    return sum(len(s) * w for s, w in law.items())


# ------------------------------------------------------------------- real vocabularies
# The same expectations without enumerating the output law token by token: vector operations
# over the vocabulary only, so a 151,936-token law costs a few milliseconds per node.

TOPDOWN = ("nss", "naive", "naive_tree", "spectr", "specinfer", "khisti")


def reach_probabilities(name: str, tree: DraftTree, p_rows, q_rows=None) -> np.ndarray:
    """P(the top-down solver ``name`` reaches node c | T) for every node (arXiv 2602.16994 Eq. 2-3:
    the product of branching probabilities along c's path); node 0 is 1.

    The reach of a node depends on its ancestors' child multisets only, so for a tree cut
    below depth d the nodes above d keep their values: ``reach[depths <= d].sum()`` is the
    cut tree's E[tau + 1]."""
    if name not in TOPDOWN:
        raise ValueError(f"no top-down branching law for {name!r}; valid: {TOPDOWN}")
    kids = tree.children_lists()
    reach = np.zeros(tree.num_nodes)
    reach[0] = 1.0
    for node in range(tree.num_nodes):  # parents before children
        if not kids[node] or reach[node] == 0.0:
            continue
        slots = [j for j in kids[node] for _ in range(int(tree.multiplicity[j]))]
        xs = [int(tree.tokens[j]) for j in slots]
        p = p_rows[node].to(torch.float64)
        q = None if q_rows is None else q_rows[node].to(torch.float64)
        if name == "naive" or (len(xs) == 1 and name != "nss"):
            # Naive tries one uniformly chosen slot and descends only into it; with one draft
            # every OT solver here is Naive: accept with min(1, p / q)
            for j, x in zip(slots, xs):
                a = min(1.0, float(p[x]) / float(q[x])) if float(q[x]) > 0 else 1.0
                reach[j] += reach[node] * a / len(xs)
            continue
        law = solver_output_law(name, p, q, xs)
        first: dict[int, int] = {}
        for j in kids[node]:  # the driver descends into the first child holding the token
            first.setdefault(int(tree.tokens[j]), j)
        for t, j in first.items():
            reach[j] = reach[node] * float(law[t])
    return reach


def expected_tokens(name: str, tree: DraftTree, p_rows, q_rows=None) -> float:
    """E[tau + 1 | T] like ``expected_block_efficiency``, by vector operations over the
    vocabulary (no per-token enumeration): the same value, usable at real vocabulary sizes."""
    if name in TOPDOWN:
        return float(reach_probabilities(name, tree, p_rows, q_rows).sum())
    p_rows = p_rows.to(torch.float64)
    q_rows = q_rows.to(torch.float64)
    depths = tree.depths
    if name == "traversal":
        return _traversal_expected(tree, p_rows, q_rows, depths)
    if name == "block":
        return _block_expected(tree, p_rows, q_rows)
    raise ValueError(f"no expected block efficiency for {name!r}; valid: {TOPDOWN + ('traversal', 'block')}")


def _traversal_expected(tree, p_rows, q_rows, depths) -> float:
    # _traversal_law's walk, keeping only P(node c is the accepted one) * (depth(c) + 1)
    kids = tree.children_lists()
    state = {0: (1.0, p_rows[0])}
    total, stay = 0.0, 1.0  # stay: probability that no node was accepted so far

    def visit(c) -> None:
        nonlocal total, stay
        for x in kids[c]:
            a_c, p_c = state[c]
            tok = int(tree.tokens[x])
            qx = float(q_rows[c][tok])
            state[x] = (min(1.0, a_c * float(p_c[tok]) / qx) if qx > 0 else 1.0, p_rows[x])
            visit(x)
            m = (a_c * p_c - q_rows[c]).clamp(min=0)  # child rejected: missing mass to the parent
            dm = float(m.sum())
            state[c] = (dm / (1 - a_c + dm), m / dm) if dm > 0 else (0.0, p_c)
        acc = 1.0 if c == 0 else state[c][0]
        total += stay * acc * (int(depths[c]) + 1)
        stay *= 1 - acc

    visit(0)
    return total


def _block_expected(tree, p_rows, q_rows) -> float:
    chain, w = _block_weights(tree, p_rows, q_rows)
    big_l = len(chain) - 1
    total, stay = 0.0, 1.0
    for i in range(big_l, -1, -1):
        if i == big_l:
            h = w[i]
        else:
            dsum = float((w[i] * p_rows[chain[i]] - q_rows[chain[i]]).clamp(min=0).sum())
            h = 1.0 if i == 0 else (dsum / (dsum + (1 - w[i])) if dsum > 0 else 0.0)
        total += stay * h * (i + 1)
        stay *= 1 - h
    return total
