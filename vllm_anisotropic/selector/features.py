"""The selector's features of one request-step, known before any token of the tree is drawn.

arXiv 2602.16994 App. E lists hidden states of p and q at the preceding token and of q at the
root, entropies and divergences of p and q at the preceding token, the entropy of q at the root,
the context length, the sampling parameters and latency estimates. Kept here: what the drafter
has at the root and the grid records carry (``bench.draft_tree_grid``):

* ``entropy_q``: the entropy (nats) of q's law at the root, processed as the request samples
  (temperature, top-k, top-p; the raw softmax for greedy requests), the law the first draft is
  drawn from. The drafter computes it anyway (the catch-up forward that ends at the root).
* ``log_context_len``: log(1 + tokens before and including the root).
* ``temperature``, ``top_p``: the request's (0 and 1 for greedy requests).

Left out: p's statistics (the root's p needs the target's forward that this step's tree is
for; p at the preceding token added no held-out gain at T = 0, ``bench.selector_prev`` and
docs/selector.md), hidden states, and latency estimates (constant on one machine: they enter
the labels instead, ``selector.train``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["FEATURES", "root_features", "record_features"]

FEATURES = ("entropy_q", "log_context_len", "temperature", "top_p")


def entropy(law: torch.Tensor) -> float:
    p = law.double()
    return float(-(p * p.clamp(min=1e-300).log()).sum())


def root_features(q_root_law: torch.Tensor, context_len: int, temperature: float, top_p: float) -> np.ndarray:
    """[len(FEATURES)] for one request-step; ``q_root_law`` is the [vocab] law of the first draft."""
    return np.array([entropy(q_root_law), math.log1p(context_len), float(temperature), float(top_p)])


def record_features(rec: dict) -> np.ndarray:
    """The same vector from a ``draft_tree_grid`` root record (its ``features`` and sampling)."""
    return np.array([float(rec["features"]["entropy_q"]), math.log1p(int(rec["context_len"])),
                     float(rec["temperature"]), float(rec.get("top_p", 1.0))])
