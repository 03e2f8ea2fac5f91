"""SpecInfer multi-draft verification (Miao et al. 2024, arXiv 2305.09781; arXiv 2602.16994 Algorithm 4).

Scope: the OTLP solver with a residual update after every rejected draft. At a node with
i.i.d. drafts X_1..X_k ~ q, taken in uniformly random order (the shuffled multiset of
``topdown.py`` *is* "sample x ~ U(S) without replacement"):

    round i:  accept X_i with prob  min(1, p_i(X_i) / q(X_i))
              on rejection          p_{i+1} = norm(max(0, p_i - q))      (residual update)
    finally   y ~ p_k

Reduces to Naive for k = 1. Uniforms per depth step: column S + i (round i), column 3S
(final residual sample).
"""

from __future__ import annotations

import torch

from vllm_anisotropic.verifiers.sampling import sample_inverse_cdf
from vllm_anisotropic.verifiers.topdown import TopDownVerifier

__all__ = ["SpecInferVerifier"]


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row; rows with no mass left keep p (a probability-0 event)."""
    r = (p - q).clamp(min=0)
    z = r.sum(dim=-1, keepdim=True)
    return torch.where(z > 0, r / torch.where(z > 0, z, torch.ones_like(z)), p)


class SpecInferVerifier(TopDownVerifier):
    name = "specinfer"
    requires_draft_probs = True

    def solve(self, target, q, xs, u):
        rows, s = xs.shape
        p = target.clone()  # [rows, vocab_size] current residual target p_i
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
            acc = valid & (u[:, s + i] * qx < px)  # U <= p_i(x) / q(x)
            y = torch.where(acc, x, y)
            done |= acc
            rej = (valid & ~acc).nonzero().squeeze(1)
            if rej.numel():
                p[rej] = _residual(p[rej], q[rej])  # p_{i+1} = norm(max(0, p_i - q))
        rest = (~done).nonzero().squeeze(1)
        if rest.numel():
            y[rest] = sample_inverse_cdf(p[rest], u[rest, 3 * s])
        return y

    def solve_reference(self, p, q, xs, u, s) -> int:
        p = p.clone()
        for i, x in enumerate(xs):
            if float(u[s + i]) * float(q[x]) < float(p[x]):
                return x
            p = _residual(p.unsqueeze(0), q.unsqueeze(0))[0]
        return int(sample_inverse_cdf(p.unsqueeze(0), u[3 * s].reshape(1))[0])
