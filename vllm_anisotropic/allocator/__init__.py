"""Budget-aware batch allocator (issue 10): how many draft nodes each request verifies per step.

Scope: the core, which never imports vLLM: ``cost`` (step-latency model, fitted from a sweep
and refined online), ``acceptance`` (node value -> calibrated P(on the accepted path), with
ECHO's sparse gating), ``allocate`` (the per-step cut vector maximising expected tokens per
second), ``gate`` (speculate at a batch size only where it measured faster than plain, with
trees or with chains alone, whichever measured faster),
``tree_probs`` (DraftTree <-> flat arrays), ``config`` (the tunables). The engine hook
that calls them at the scheduler step lives in ``integration.vllm``.

Source: ECHO, arXiv 2604.09603 (Sec. 2 Eq. 2, Sec. 3.2, Alg. 1, Theorem 2).
"""

from .acceptance import AcceptanceModel
from .allocate import (
    Allocation,
    StepCost,
    allocate,
    allocate_flat,
    concave_slopes,
    pad_probs,
    request_caps,
)
from .config import AcceptanceConfig, CostModelConfig, GateConfig
from .cost import CostModel, CostSample
from .gate import CHAIN, PLAIN, TREE, SpeculationGate
from .tree_probs import (cap_by_tree, capped, continuation_labels, cut_trees, flat_continuation_labels,
                         order_by_probability, rank_flat, rank_trees, raw_probs, tree_probs)

__all__ = [
    "AcceptanceConfig",
    "AcceptanceModel",
    "Allocation",
    "CostModel",
    "CostModelConfig",
    "CostSample",
    "GateConfig",
    "SpeculationGate",
    "PLAIN",
    "TREE",
    "CHAIN",
    "StepCost",
    "allocate",
    "allocate_flat",
    "cap_by_tree",
    "capped",
    "concave_slopes",
    "continuation_labels",
    "cut_trees",
    "flat_continuation_labels",
    "order_by_probability",
    "pad_probs",
    "rank_flat",
    "rank_trees",
    "raw_probs",
    "request_caps",
    "tree_probs",
]
