"""Unified greedy walk with source priority (GOOSE, papers/000 Algorithm 3; papers/001 B.3).

Scope: temperature-0 verification of any tree (spine trees, top-k trees, draft-model trees).
At each node the walk follows the child whose token equals the target's argmax, checking
SPINE children before BRANCH/DRAFT children (``tree.SOURCE_PRIORITY``; equal priority: lower
node index first). It stops when no child matches and emits the argmax at the last accepted
node as the bonus token. The walk ignores the sampling parameters: it *is* the greedy
(temperature 0) target, argmax of the raw logits, exactly as vLLM's greedy sampler.
Uses no randomness (the uniform block is drawn for a uniform interface but unused).
"""

from __future__ import annotations

import torch

from vllm_anisotropic.verifiers.topdown import TopDownVerifier

__all__ = ["GreedyVerifier"]


class GreedyVerifier(TopDownVerifier):
    name = "greedy"
    shuffle = False
    use_children = True

    def node_target(self, logits_rows, sampling) -> torch.Tensor:
        # [rows] argmax token of the raw target logits (the temperature-0 target)
        return logits_rows.argmax(dim=-1)

    def bonus(self, target, u):
        return target

    def solve(self, target, q, xs, u):
        # the solver's output is the argmax; the driver descends to the first child
        # (SPINE first) carrying it, or emits it as the bonus token
        return target

    def solve_reference(self, target, q, xs, u, s) -> int:
        return int(target)

    def bonus_reference(self, target, u) -> int:
        return int(target)
