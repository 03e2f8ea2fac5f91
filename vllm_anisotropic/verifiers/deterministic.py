"""Lossless sampling on deterministic trees (GOOSE spine trees, top-k trees): one-hot SpecInfer.

Scope: temperature > 0 verification of trees whose children are *chosen*, not sampled
(no draft distribution). Each child token x is a point-mass draft q = delta_x. Running
SpecInfer's residual rule (Miao et al. 2024, arXiv 2305.09781; arXiv 2602.16994 Algorithm 4) with
one-hot drafts, children tried in priority order (SPINE first, ``tree.SOURCE_PRIORITY``):

    accept child x with prob  min(1, p_cur(x) / q(x)) = p_cur(x)
    on rejection              p_cur <- norm(max(0, p_cur - delta_x)) = p_cur with x zeroed
    after the last child      emit y ~ p_cur = p with every child token zeroed, renormalised

With R = mass of the distinct tokens rejected so far, p_cur(x) = p(x) / (1 - R) for a new
token and 0 for a repeated one. Proof of exactness: child x_j (first occurrence) is emitted
with prob prod_{i<j}(1 - p(x_i)/(1 - R_{i-1})) * p(x_j)/(1 - R_{j-1}) = (1 - R_{j-1}) *
p(x_j)/(1 - R_{j-1}) = p(x_j) (the product telescopes to 1 - R_{j-1}), and a non-child y with
prob (1 - R_all) * p(y)/(1 - R_all) = p(y). So every output token has law p: the same law as
NSS (sample y ~ p and descend if y is a child) but with one decision per child, which lets the
integration stop early. Temperature 0 (one-hot p) reduces it to the greedy walk.
Tested by exact enumeration (tests/test_verifier_exact.py).
"""

from __future__ import annotations

import torch

from vllm_anisotropic.verifiers.sampling import sample_inverse_cdf
from vllm_anisotropic.verifiers.topdown import TopDownVerifier

__all__ = ["DeterministicVerifier"]


def _zero_tokens(p: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """p with every token of xs (-1 padded) set to 0. p: [rows, vocab_size], xs: [rows, C]."""
    hits = torch.zeros_like(p).scatter_add_(1, xs.clamp(min=0), (xs >= 0).to(p.dtype))
    return torch.where(hits > 0, torch.zeros_like(p), p)


class DeterministicVerifier(TopDownVerifier):
    name = "deterministic"
    shuffle = False
    use_children = True

    def solve(self, target, q, xs, u):
        rows, c = xs.shape
        p = target
        removed = torch.zeros(rows, dtype=p.dtype, device=p.device)  # R: rejected distinct mass
        done = torch.zeros(rows, dtype=torch.bool, device=p.device)
        y = torch.full((rows,), -1, dtype=torch.int64, device=p.device)
        tiny = torch.finfo(p.dtype).tiny
        for i in range(c):
            x = xs[:, i]
            valid = (x >= 0) & ~done
            if not bool(valid.any()):
                break
            dup = (xs[:, :i] == x.unsqueeze(1)).any(dim=1) if i else torch.zeros_like(valid)
            px = p.gather(1, x.clamp(min=0).unsqueeze(1)).squeeze(1)
            # one-hot SpecInfer round: accept with p_cur(x) = p(x) / (1 - R); repeats have p_cur = 0
            a = torch.where(dup, torch.zeros_like(px), px / (1.0 - removed).clamp(min=tiny)).clamp(max=1.0)
            acc = valid & (u[:, c + i] < a)
            y = torch.where(acc, x, y)
            done |= acc
            removed = torch.where(valid & ~acc & ~dup, removed + px, removed)
        rest = (~done).nonzero().squeeze(1)
        if rest.numel():
            # residual after rejecting every child: p with the child tokens zeroed
            res = _zero_tokens(p[rest], xs[rest])
            y[rest] = sample_inverse_cdf(res, u[rest, 3 * c])
        return y

    def solve_reference(self, p, q, xs, u, s) -> int:
        removed = 0.0
        seen: list[int] = []
        for i, x in enumerate(xs):
            if x in seen:
                continue  # p_cur(x) == 0 after x was rejected once
            px = float(p[x])
            a = min(1.0, px / max(1.0 - removed, torch.finfo(p.dtype).tiny))
            if float(u[s + i]) < a:
                return x
            removed += px
            seen.append(x)
        res = p.clone()
        for x in seen:
            res[x] = 0.0
        return int(sample_inverse_cdf(res.unsqueeze(0), u[3 * s].reshape(1))[0])
