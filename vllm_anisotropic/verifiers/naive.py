"""Naive speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023) as an
OTLP solver (arXiv 2602.16994 Algorithm 2), single-path (``naive``) and multi-path (``naive_tree``).

Scope: at a node with i.i.d. drafts X_1..X_k ~ q (shuffled multiset, ``topdown.py``):

    accept X_1 with prob  min(1, p(X_1) / q(X_1))
    else  y ~ p_res = norm(max(0, p - q))            (the residual)

``naive`` descends only into X_1 (the single path); ``naive_tree`` (arXiv 2602.16994 Sec. 3.2,
"NaiveTree") also descends when the residual sample equals another draft X_2..X_k.
Lossless: P(y) = min(p, q)(y) + (1 - sum min(p, q)) * p_res(y) = p(y).
Uniforms per depth step: column S (accept), column 3S (residual).
"""

from __future__ import annotations

import torch

from vllm_anisotropic.verifiers.sampling import sample_inverse_cdf
from vllm_anisotropic.verifiers.topdown import TopDownVerifier

__all__ = ["NaiveVerifier", "NaiveTreeVerifier"]


def naive_solve(
    p: torch.Tensor,  # [rows, vocab_size]
    q: torch.Tensor,  # [rows, vocab_size]
    x1: torch.Tensor,  # [rows] the single draft token
    u_acc: torch.Tensor,  # [rows]
    u_res: torch.Tensor,  # [rows]
) -> torch.Tensor:
    """Speculative sampling with one draft: returns y [rows] with law p when x1 ~ q."""
    px = p.gather(1, x1.unsqueeze(1)).squeeze(1)
    qx = q.gather(1, x1.unsqueeze(1)).squeeze(1)
    # accept X_1 with min(1, p/q)  (Leviathan et al. 2023, Algorithm 1)
    acc = u_acc * qx < px
    y = x1.clone()
    rej = (~acc).nonzero().squeeze(1)
    if rej.numel():
        # residual norm(max(0, p - q)); all-zero only when p == q (then rejection has prob 0)
        res = (p[rej] - q[rej]).clamp(min=0)
        res = torch.where(res.sum(1, keepdim=True) > 0, res, p[rej])
        y[rej] = sample_inverse_cdf(res, u_res[rej])
    return y


def naive_reference(p, q, x1: int, u_acc: float, u_res) -> int:
    if float(u_acc) * float(q[x1]) < float(p[x1]):
        return x1
    res = (p - q).clamp(min=0)
    if float(res.sum()) <= 0:
        res = p
    return int(sample_inverse_cdf(res.unsqueeze(0), u_res.reshape(1))[0])


class NaiveVerifier(TopDownVerifier):
    name = "naive"
    requires_draft_probs = True
    single_path = True

    def solve(self, target, q, xs, u):
        s = xs.shape[1]
        return naive_solve(target, q, xs[:, 0], u[:, s], u[:, 3 * s])

    def solve_reference(self, p, q, xs, u, s) -> int:
        return naive_reference(p, q, xs[0], u[s], u[3 * s])


class NaiveTreeVerifier(NaiveVerifier):
    name = "naive_tree"
    single_path = False
