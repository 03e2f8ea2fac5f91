"""SpecTr's K-SEQ OTLP solver (Sun et al. 2023, arXiv 2310.15141; arXiv 2602.16994 Algorithm 3).

Scope: multi-draft verification by rho-weighted sequential acceptance and one final residual.
For drafts X_1..X_k ~ q i.i.d. (shuffled multiset, ``topdown.py``):

    beta(rho)  = sum_x min(p(x) / rho, q(x))                       (arXiv 2602.16994 Eq. 6)
    p_acc(rho) = 1 - (1 - beta(rho))^k                              (Eq. 7)
    rho*       = root of p_acc(rho) - rho * beta(rho) on [1, k]     (decreasing: bisection)
    accept X_i (first i) with prob  min(1, p(X_i) / (rho* q(X_i)))
    else       y ~ norm(max(0, p - min(p / rho*, q) * gamma)),  gamma = p_acc / beta

Bisection returns the *upper* end of the final bracket: every rho in [rho*, k] keeps the
solver exact (arXiv 2602.16994 B.3), since then gamma <= rho and min(p/rho, q) * gamma <= p, so the
residual is p minus an exact sub-measure. Uniforms per depth step: column S + i (round i),
column 3S (residual).
"""

from __future__ import annotations

import torch

from vllm_anisotropic.verifiers.sampling import sample_inverse_cdf
from vllm_anisotropic.verifiers.topdown import TopDownVerifier

__all__ = ["SpecTrVerifier", "spectr_rho", "BISECTION_STEPS"]

BISECTION_STEPS = 40


def spectr_rho(
    p: torch.Tensor,  # [rows, vocab_size]
    q: torch.Tensor,  # [rows, vocab_size]
    k: torch.Tensor,  # [rows] number of drafts (>= 1)
    steps: int = BISECTION_STEPS,
) -> torch.Tensor:
    """rho* per row by bisection on [1, k] (upper bracket end). [rows]"""
    kf = k.to(p.dtype)
    lo = torch.ones_like(kf)
    hi = kf.clone()
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        beta = torch.minimum(p / mid.unsqueeze(1), q).sum(dim=1)
        # f(rho) = p_acc(rho) - rho * beta(rho), decreasing in rho
        f = 1.0 - (1.0 - beta).clamp(min=0) ** kf - mid * beta
        lo = torch.where(f > 0, mid, lo)
        hi = torch.where(f > 0, hi, mid)
    return hi


def spectr_constants(p, q, k, rho):
    """(beta, p_acc, gamma) at rho, each [rows]."""
    kf = k.to(p.dtype)
    beta = torch.minimum(p / rho.unsqueeze(1), q).sum(dim=1)
    p_acc = 1.0 - (1.0 - beta).clamp(min=0) ** kf
    gamma = torch.where(beta > 0, p_acc / torch.where(beta > 0, beta, torch.ones_like(beta)), torch.zeros_like(beta))
    return beta, p_acc, gamma


def spectr_residual(p, q, rho, gamma):
    """norm(max(0, p - min(p / rho, q) * gamma)) per row (rows with no mass keep p)."""
    r = (p - torch.minimum(p / rho.unsqueeze(1), q) * gamma.unsqueeze(1)).clamp(min=0)
    z = r.sum(dim=1, keepdim=True)
    return torch.where(z > 0, r, p)


class SpecTrVerifier(TopDownVerifier):
    name = "spectr"
    requires_draft_probs = True

    def solve(self, target, q, xs, u):
        rows, s = xs.shape
        p = target
        k = (xs >= 0).sum(dim=1)
        rho = spectr_rho(p, q, k)
        _, _, gamma = spectr_constants(p, q, k, rho)
        done = torch.zeros(rows, dtype=torch.bool, device=p.device)
        y = torch.full((rows,), -1, dtype=torch.int64, device=p.device)
        for i in range(s):
            x = xs[:, i]
            valid = (x >= 0) & ~done
            if not bool(valid.any()):
                break
            xc = x.clamp(min=0).unsqueeze(1)
            px = p.gather(1, xc).squeeze(1)
            qx = q.gather(1, xc).squeeze(1)
            acc = valid & (rho * u[:, s + i] * qx < px)  # rho* U <= p(x)/q(x)
            y = torch.where(acc, x, y)
            done |= acc
        rest = (~done).nonzero().squeeze(1)
        if rest.numel():
            res = spectr_residual(p[rest], q[rest], rho[rest], gamma[rest])
            y[rest] = sample_inverse_cdf(res, u[rest, 3 * s])
        return y

    def solve_reference(self, p, q, xs, u, s) -> int:
        p1, q1 = p.unsqueeze(0), q.unsqueeze(0)
        k = torch.tensor([len(xs)])
        rho = spectr_rho(p1, q1, k)
        _, _, gamma = spectr_constants(p1, q1, k, rho)
        for i, x in enumerate(xs):
            if float(rho[0]) * float(u[s + i]) * float(q[x]) < float(p[x]):
                return x
        res = spectr_residual(p1, q1, rho, gamma)
        return int(sample_inverse_cdf(res, u[3 * s].reshape(1))[0])
