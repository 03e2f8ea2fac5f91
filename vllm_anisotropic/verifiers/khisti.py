"""Khisti et al. importance-weighted multi-draft verification (ICLR 2025, arXiv 2410.18234,
Sec. 3 canonical decomposition, Sec. 4 / Appendix I truncated LP; arXiv 2602.16994 Algorithm 5).

Scope: the OTLP solver at one node with drafts X_1..X_k ~ q i.i.d. (shuffled multiset,
``topdown.py``), in three steps:

1. **importance-weighted sampling** (KHISTI_IMPORTANCE_SAMPLE): the law r of the selected
   draft, built by k - 1 pairwise *stages*. Stage i selects between the current winner
   Y ~ r_{i-1} (r_0 = q) and the challenger X_{i+1} ~ q, which are independent, so its
   output has the two-draft importance-sampled law of Khisti Sec. 4 with (q1, q2) =
   (r_{i-1}, q); r = r_{k-1}.
2. **pairwise tournament selection** (KHISTI_TOURNAMENT_SELECT): the winner of stage i is
   drawn with exactly the stage's selection probabilities, so the final winner x ~ r.
3. **naive speculative sampling** of p with r as the draft law and [x] as the only draft:
   accept x with min(1, p(x) / r(x)), else y ~ norm(max(0, p - r)). Lossless because x ~ r.

One stage (Khisti Sec. 4, "truncated LP", Appendix I), for independent Y ~ q1, X ~ q2:

* rank the vocabulary by p - q1 q2, descending (ties: lower token id first); Omega_1 = the
  top s tokens (``LP_TRUNCATION``, s = 5 as in Khisti's experiments), Omega_2 the rest;
* equal drafts select themselves; a pair with a token outside Omega_1 selects the token of
  lower rank (weights fixed to 0 / 1), so for x in Omega_2

      r(x) = q1(x) q2(x) + q1(x) T2(x) + T1(x) q2(x),   T(x) = mass ranked after x;

* a pair {i, j} inside Omega_1 (i ranked first) selects i with probability theta_ij, chosen
  by the truncated LP   max sum_{i in Omega_1} min(p(i), r(i))   over theta in [0, 1]^(s, s),
  where r(i) = b_i + sum_j M_ij * P(i wins {i, j}), b_i = q1(i) q2(i) + q1(i) q2(Omega_2) +
  q1(Omega_2) q2(i), M_ij = q1(i) q2(j) + q1(j) q2(i).

The LP is solved exactly, without an LP package: it is a max-flow problem (each pair's mass
M_ij flows to i or to j; token i absorbs at most p(i) - b_i usefully), solved by augmenting
paths on the s-node graph, vectorised over rows (``_truncated_lp``). Any theta keeps the
verifier exact (r is computed from the theta actually used); the LP only maximises
acceptance. Ordered draws (i, j) and (j, i) share one weight theta_ij: the LP objective only
depends on their sum, so this loses nothing.

Source note: the ranking key p - q1 q2, the 0/1 weights outside Omega_1 and the sequential
stages for k > 2 follow the arXiv 2602.16994 authors' Khisti baseline (their reading of Khisti
Appendix I and of arXiv 2602.16994 Algorithms 5, 10, 15); the LP itself is Khisti's.

Terms: *winner* the current tournament survivor, *challenger* the next draft, *stage* one
pairwise selection with its law. Uniforms per depth step (S = max child-multiset size):
column 2S + i (stage i, challenger X_{i+1}), column S (accept), column 3S (residual).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_anisotropic.verifiers.naive import naive_reference, naive_solve
from vllm_anisotropic.verifiers.topdown import TopDownVerifier

__all__ = [
    "KhistiVerifier",
    "KhistiStage",
    "LP_TRUNCATION",
    "khisti_stage",
    "khisti_importance_law",
    "khisti_keep_probability",
    "khisti_select",
]

# s, the LP-truncation threshold (Khisti et al. Sec. 5 ablation over s in {5, 10, 15}: s = 5 gave
# the best token rate; also the arXiv 2602.16994 authors' default)
LP_TRUNCATION = 5


@dataclass(frozen=True)
class KhistiStage:
    """One pairwise stage (winner Y ~ q1 against challenger X ~ q2) for a batch of rows."""

    # [rows, vocab_size] law of the stage's output (the importance-weighted distribution)
    r: torch.Tensor
    # [rows, vocab_size] ranking key p - q1 q2 (higher ranks first; ties: lower token id)
    key: torch.Tensor
    # [rows, s] token ids of Omega_1 in rank order
    top: torch.Tensor
    # [rows, s, s] theta[i, j] (i < j): P(rank-i token wins against rank-j token); upper part
    theta: torch.Tensor


def _truncated_lp(
    p: torch.Tensor,  # [rows, s] target mass of Omega_1 (rank order)
    base: torch.Tensor,  # [rows, s] b_i, mass selected as i by fixed weights
    pair: torch.Tensor,  # [rows, s, s] symmetric M_ij, zero diagonal
) -> torch.Tensor:
    """theta [rows, s, s] maximising sum_i min(p_i, b_i + sum_j M_ij P(i wins {i, j})).

    Max-flow form: ``alloc[i, j]`` = the part of M_ij selected as i (alloc[i, j] + alloc[j, i]
    = M_ij). Start with every pair given to its first-ranked token, then move mass along
    augmenting paths u -> ... -> v (edge u -> x carries up to alloc[u, x]) from tokens with
    surplus (intake > p) to tokens with deficit (intake < p) until none is left; with no
    augmenting path the flow, hence the LP, is optimal (max-flow min-cut). Breadth-first
    paths (Edmonds-Karp), at most O(s^3) augmentations, all rows at once; rows without an
    augmenting path retire from the loop.
    """
    rows, s = p.shape
    # identical rows (e.g. a batch of repeated trees) are solved once
    uniq, inv = torch.unique(torch.cat([p, base, pair.flatten(1)], dim=1), dim=0, return_inverse=True)
    if uniq.shape[0] < rows:
        return _truncated_lp(uniq[:, :s], uniq[:, s : 2 * s], uniq[:, 2 * s :].reshape(-1, s, s))[inv]
    dtype = p.dtype
    tol = 64 * torch.finfo(dtype).eps
    ar = torch.arange(s, device=p.device)
    upper = ar.unsqueeze(1) < ar.unsqueeze(0)  # [s, s] i < j
    alloc = torch.where(upper, pair, torch.zeros_like(pair))  # [rows, s, s]
    excess = base + alloc.sum(dim=2) - p  # [rows, s] intake - p
    # live rows (compacted): those that may still have an augmenting path
    live = ((excess > tol).any(dim=1) & (excess < -tol).any(dim=1)).nonzero().squeeze(1)
    a, e = alloc[live], excess[live]
    for _ in range(4 * s**3):
        if live.numel() == 0:
            break
        n = live.shape[0]
        # breadth-first search from every surplus node over edges with alloc > tol
        reach = e > tol  # [n, s]
        pred = torch.full((n, s), -1, dtype=torch.int64, device=p.device)
        for _ in range(s - 1):
            cand = reach.unsqueeze(2) & (a > tol) & ~reach.unsqueeze(1)  # [n, u, v]
            new = cand.any(dim=1)
            if not bool(new.any()):
                break
            pred = torch.where(new, cand.to(torch.int8).argmax(dim=1), pred)
            reach |= new
        sink = reach & (e < -tol)
        found = sink.any(dim=1)
        if not bool(found.all()):  # no augmenting path: optimal, retire the row
            alloc[live[~found]] = a[~found]
            live, a, e, pred, sink = live[found], a[found], e[found], pred[found], sink[found]
            if live.numel() == 0:
                break
        r = torch.arange(live.shape[0], device=p.device)
        t = sink.to(torch.int8).argmax(dim=1)  # deficit node reached
        # bottleneck: deficit, capacities along the path, surplus of its start
        delta = -e[r, t]
        v = t
        for _ in range(s - 1):
            u = pred[r, v]
            edge = u >= 0
            delta = torch.where(edge, torch.minimum(delta, a[r, u.clamp(min=0), v]), delta)
            v = torch.where(edge, u, v)
        delta = torch.minimum(delta, e[r, v])
        # push delta along the path: pair {u, x} mass moves from u to x
        v = t
        for _ in range(s - 1):
            u = pred[r, v]
            edge = u >= 0
            uc = u.clamp(min=0)
            d = torch.where(edge, delta, torch.zeros_like(delta))
            a[r, uc, v] -= d
            a[r, v, uc] += d
            v = torch.where(edge, u, v)
        e[r, t] += delta
        e[r, v] -= delta
    alloc[live] = a
    safe = torch.where(pair > 0, pair, torch.ones_like(pair))
    return torch.where(upper & (pair > 0), (alloc / safe).clamp(0, 1), upper.to(dtype).expand_as(pair))


def khisti_stage(
    p: torch.Tensor,  # [rows, vocab_size] target
    q1: torch.Tensor,  # [rows, vocab_size] law of the current winner Y
    q2: torch.Tensor,  # [rows, vocab_size] law of the challenger X (independent of Y)
    s: int = LP_TRUNCATION,
) -> KhistiStage:
    """One two-draft importance-weighted selection (Khisti Sec. 4 truncated LP) and its law."""
    rows, vocab = p.shape
    s = min(s, vocab)
    key = p - q1 * q2
    order = key.argsort(dim=1, descending=True, stable=True)  # rank order
    q1s, q2s = q1.gather(1, order), q2.gather(1, order)
    # T(x): mass ranked strictly after x (exclusive suffix sums)
    t1 = (q1s.sum(dim=1, keepdim=True) - q1s.cumsum(dim=1)).clamp(min=0)
    t2 = (q2s.sum(dim=1, keepdim=True) - q2s.cumsum(dim=1)).clamp(min=0)
    # Omega_2 and fixed weights: equal drafts select themselves, else the lower rank wins
    rs = q1s * q2s + q1s * t2 + t1 * q2s
    a1, a2 = q1s[:, :s], q2s[:, :s]  # [rows, s]
    tail1, tail2 = t1[:, s - 1 : s], t2[:, s - 1 : s]  # q(Omega_2), [rows, 1]
    base = a1 * a2 + a1 * tail2 + tail1 * a2
    pair = a1.unsqueeze(2) * a2.unsqueeze(1)
    pair = pair + pair.transpose(1, 2)
    pair = pair.masked_fill(torch.eye(s, dtype=torch.bool, device=p.device), 0.0)  # M_ij, zero diagonal
    theta = _truncated_lp(p.gather(1, order[:, :s]), base, pair)
    # r on Omega_1 from the theta actually used: P(i wins {i, j}) = theta_ij (i first), else 1 - theta_ji
    ar = torch.arange(s, device=p.device)
    win = theta + (1 - theta).transpose(1, 2) * (ar.unsqueeze(1) > ar.unsqueeze(0))
    rs[:, :s] = base + (pair * win).sum(dim=2)
    r = torch.empty_like(rs).scatter_(1, order, rs)
    return KhistiStage(r=r, key=key, top=order[:, :s].contiguous(), theta=theta)


def khisti_importance_law(p: torch.Tensor, q: torch.Tensor, k: int, s: int = LP_TRUNCATION) -> list[KhistiStage]:
    """The k - 1 stages of the tournament for k i.i.d. drafts; ``[-1].r`` is r (q when k = 1)."""
    stages, r = [], q
    for _ in range(k - 1):
        stages.append(khisti_stage(p, r, q, s))
        r = stages[-1].r
    return stages


def khisti_select(
    stage: KhistiStage,
    winner: torch.Tensor,  # [rows] current winner token
    challenger: torch.Tensor,  # [rows] challenger token
    u: torch.Tensor,  # [rows] uniforms
) -> torch.Tensor:
    """Pairwise selection with the stage's probabilities: keep the winner w.p.
    ``khisti_keep_probability``; [rows] int64 new winner."""
    kw = stage.key.gather(1, winner.unsqueeze(1)).squeeze(1)
    kc = stage.key.gather(1, challenger.unsqueeze(1)).squeeze(1)
    winner_first = (kw > kc) | ((kw == kc) & (winner < challenger))  # winner ranked first
    mw, mc = stage.top == winner.unsqueeze(1), stage.top == challenger.unsqueeze(1)
    pw, pc = mw.to(torch.int8).argmax(dim=1), mc.to(torch.int8).argmax(dim=1)  # position in Omega_1
    rows = torch.arange(winner.shape[0], device=winner.device)
    theta = stage.theta[rows, torch.minimum(pw, pc), torch.maximum(pw, pc)]
    # both in Omega_1: first-ranked wins w.p. theta; otherwise the first-ranked wins
    in_lp = mw.any(dim=1) & mc.any(dim=1)
    first_wins = torch.where(in_lp, theta, torch.ones_like(theta))
    keep = torch.where(winner_first, first_wins, 1 - first_wins)
    keep = torch.where(winner == challenger, torch.ones_like(keep), keep)
    return torch.where(u < keep.to(u.dtype), winner, challenger)


def khisti_keep_probability(stage: KhistiStage, row: int, winner: int, challenger: int) -> float:
    """P(the stage keeps ``winner`` against ``challenger``) for one row, plain Python."""
    if winner == challenger:
        return 1.0
    top = [int(t) for t in stage.top[row].tolist()]
    key = stage.key[row]
    kw, kc = float(key[winner]), float(key[challenger])
    winner_first = kw > kc or (kw == kc and winner < challenger)
    if winner in top and challenger in top:
        i, j = sorted((top.index(winner), top.index(challenger)))
        first = float(stage.theta[row, i, j])
    else:
        first = 1.0
    return first if winner_first else 1.0 - first


class KhistiVerifier(TopDownVerifier):
    name = "khisti"
    requires_draft_probs = True
    # s, the number of top-ranked tokens whose pairwise weights the LP optimises
    lp_truncation: ClassVar[int] = LP_TRUNCATION

    def solve(self, target, q, xs, u):
        s = xs.shape[1]
        r = q.clone()  # [rows, vocab_size] law of the current winner
        winner = xs[:, 0].clone()
        for i in range(1, s):
            act = (xs[:, i] >= 0).nonzero().squeeze(1)  # rows with a challenger X_{i+1}
            if act.numel() == 0:
                break
            stage = khisti_stage(target[act], r[act], q[act], self.lp_truncation)
            winner[act] = khisti_select(stage, winner[act], xs[act, i], u[act, 2 * s + i])
            r[act] = stage.r
        return naive_solve(target, r, winner, u[:, s], u[:, 3 * s])

    def solve_reference(self, p, q, xs, u, s) -> int:
        stages = khisti_importance_law(p.unsqueeze(0), q.unsqueeze(0), len(xs), self.lp_truncation)
        winner = xs[0]
        for i, x in enumerate(xs[1:], start=1):  # pairwise tournament, one uniform per stage
            if not float(u[2 * s + i]) < khisti_keep_probability(stages[i - 1], 0, winner, x):
                winner = x
        r = stages[-1].r[0] if stages else q
        return naive_reference(p, r, winner, u[s], u[3 * s])
