"""NSS: sample from the target, descend if the sample is a child (Miao et al. 2024,
arXiv 2305.09781 "naive sampling"; arXiv 2602.16994 Algorithm 1, footnote 3).

Scope: the OTLP solver that ignores the drafts: y ~ p. Valid for every tree (draft-model or
deterministic) since it never reads q. Lossless trivially (the output is a p-sample).
Uniforms: column 3S of each depth step.
"""

from __future__ import annotations

from vllm_anisotropic.verifiers.sampling import sample_inverse_cdf
from vllm_anisotropic.verifiers.topdown import TopDownVerifier

__all__ = ["NSSVerifier"]


class NSSVerifier(TopDownVerifier):
    name = "nss"
    shuffle = False
    use_children = True

    def solve(self, target, q, xs, u):
        return sample_inverse_cdf(target, u[:, 3 * xs.shape[1]])

    def solve_reference(self, p, q, xs, u, s) -> int:
        return int(sample_inverse_cdf(p.unsqueeze(0), u[3 * s].reshape(1))[0])
