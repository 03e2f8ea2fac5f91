"""Tree verifiers: one interface (``base.Verifier``), one registry.

Scope: lossless verification of a ``DraftTree`` against target logits, returning the
accepted node path and a bonus token. Algorithms (one module each):

==============  ===========================================  =========================
name            algorithm                                    trees
==============  ===========================================  =========================
greedy          GOOSE unified greedy walk (arXiv 2604.02047 Alg 3)   any, temperature 0
deterministic   one-hot SpecInfer (point-mass drafts)           any (GOOSE / top-k)
nss             NSS (arXiv 2602.16994 Alg 1)                          any
naive           speculative sampling, single path (Alg 2)       draft-model (q)
naive_tree      NaiveTree (Alg 2 on the multiset)               draft-model (q)
spectr          SpecTr K-SEQ, rho* by bisection (Alg 3)         draft-model (q)
specinfer       SpecInfer, residual per rejection (Alg 4)       draft-model (q)
khisti          IS selection + naive on r (Alg 5)               draft-model (q)
traversal       Traversal Verification (bottom-up)              draft-model, unmerged
block           Block Verification (first-child chain)          draft-model (q)
==============  ===========================================  =========================

``get_verifier(name, dtype=torch.float32)`` builds one; ``VERIFIERS`` maps names to classes.
Analytic acceptance / branching / block efficiency: ``verifiers.analytic``.
"""

from __future__ import annotations

import torch

from vllm_anisotropic.verifiers.base import BatchVerifyResult, Verifier, VerifyResult
from vllm_anisotropic.verifiers.block import BlockVerifier
from vllm_anisotropic.verifiers.deterministic import DeterministicVerifier
from vllm_anisotropic.verifiers.greedy import GreedyVerifier
from vllm_anisotropic.verifiers.khisti import KhistiVerifier
from vllm_anisotropic.verifiers.naive import NaiveTreeVerifier, NaiveVerifier
from vllm_anisotropic.verifiers.nss import NSSVerifier
from vllm_anisotropic.verifiers.sampling import SamplingTensors, TargetSampling, target_probs
from vllm_anisotropic.verifiers.specinfer import SpecInferVerifier
from vllm_anisotropic.verifiers.spectr import SpecTrVerifier
from vllm_anisotropic.verifiers.traversal import TraversalVerifier

__all__ = [
    "VERIFIERS",
    "get_verifier",
    "Verifier",
    "VerifyResult",
    "BatchVerifyResult",
    "TargetSampling",
    "SamplingTensors",
    "target_probs",
]

VERIFIERS: dict[str, type[Verifier]] = {
    cls.name: cls
    for cls in (
        GreedyVerifier,
        DeterministicVerifier,
        NSSVerifier,
        NaiveVerifier,
        NaiveTreeVerifier,
        SpecTrVerifier,
        SpecInferVerifier,
        KhistiVerifier,
        TraversalVerifier,
        BlockVerifier,
    )
}


def get_verifier(name: str, dtype: torch.dtype = torch.float32) -> Verifier:
    """The verifier registered under ``name``; ValueError naming the valid ones otherwise."""
    try:
        cls = VERIFIERS[name]
    except KeyError:
        raise ValueError(f"unknown verifier {name!r}; valid names: {sorted(VERIFIERS)}") from None
    return cls(dtype=dtype)
