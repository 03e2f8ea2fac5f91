"""Khisti et al. canonical decomposition (ICLR 2025, arXiv 2410.18234; papers/002 Algorithm 5).

Scope: multi-draft verification in two steps: (1) an importance-weighted *selection* of one
draft x out of X_1..X_k ~ q i.i.d., whose marginal law r is known in closed form; (2) single-
draft speculative sampling (Naive) of p against r with the one draft x. Any selection with
exactly computed r keeps the output exact, because step 2 is lossless whenever x ~ r.

Selection used here (a simplification of Khisti's truncated-LP weights, stated honestly): a
deterministic pairwise tournament on the importance ratio w = p / q -- the draft with the
highest w wins (ties: higher token id). With tokens ranked by w ascending and
F(x) = sum_{rank(y) <= rank(x)} q(y), the winner's law is the max-order statistic

    r(x) = F(x)^k - F_prev(x)^k                   (O(V log V): one sort + one cumsum)

then  accept x with prob min(1, p(x) / r(x)),  else  y ~ norm(max(0, p - r)).
r moves mass toward tokens the target favours relative to the draft. This is not Khisti's
optimal (LP) r, so its acceptance can fall below theirs; ``analytic.py`` computes the exact
acceptance of this scheme.
Uniforms per depth step: column S (accept), column 3S (residual).
"""

from __future__ import annotations

import torch

from vllm_anisotropic.verifiers.naive import naive_reference, naive_solve
from vllm_anisotropic.verifiers.topdown import TopDownVerifier

__all__ = ["KhistiVerifier", "khisti_selection_law", "khisti_rank"]


def khisti_rank(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[rows, vocab_size] int64 rank of each token in the tournament (higher wins)."""
    w = torch.where(q > 0, p / torch.where(q > 0, q, torch.ones_like(q)), torch.zeros_like(p))
    order = w.argsort(dim=1, stable=True)  # ascending ratio, ties by token id
    return torch.empty_like(order).scatter_(1, order, torch.arange(p.shape[1], device=p.device).expand_as(order))


def khisti_selection_law(
    p: torch.Tensor,  # [rows, vocab_size]
    q: torch.Tensor,  # [rows, vocab_size]
    k: torch.Tensor,  # [rows] number of drafts
) -> torch.Tensor:
    """r, the law of the tournament winner among k i.i.d. q-draws: [rows, vocab_size]."""
    w = torch.where(q > 0, p / torch.where(q > 0, q, torch.ones_like(q)), torch.zeros_like(p))
    order = w.argsort(dim=1, stable=True)
    qs = q.gather(1, order)
    f = qs.cumsum(dim=1)  # F(x) in rank order
    f_prev = torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1)
    kf = k.to(p.dtype).unsqueeze(1)
    # P(max-rank draw == x) = F(x)^k - F_prev(x)^k
    rs = f.clamp(max=1) ** kf - f_prev.clamp(max=1) ** kf
    return torch.empty_like(rs).scatter_(1, order, rs)


class KhistiVerifier(TopDownVerifier):
    name = "khisti"
    requires_draft_probs = True

    def solve(self, target, q, xs, u):
        s = xs.shape[1]
        k = (xs >= 0).sum(dim=1)
        r = khisti_selection_law(target, q, k)
        rank = khisti_rank(target, q)
        draft_rank = torch.where(xs >= 0, rank.gather(1, xs.clamp(min=0)), torch.full_like(xs, -1))
        x = xs.gather(1, draft_rank.argmax(dim=1, keepdim=True)).squeeze(1)  # tournament winner
        return naive_solve(target, r, x, u[:, s], u[:, 3 * s])

    def solve_reference(self, p, q, xs, u, s) -> int:
        p1, q1 = p.unsqueeze(0), q.unsqueeze(0)
        r = khisti_selection_law(p1, q1, torch.tensor([len(xs)]))[0]
        rank = khisti_rank(p1, q1)[0]
        winner = xs[0]
        for x in xs[1:]:  # pairwise tournament: higher importance-ratio rank wins
            if int(rank[x]) > int(rank[winner]):
                winner = x
        return naive_reference(p, r, winner, u[s], u[3 * s])
