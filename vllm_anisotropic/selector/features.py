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
* ``log_batch_size``: log of the number of requests drafting a tree in this step (the engine's
  drafter passes it, ``Proposer.begin_step``; the same on every tensor-parallel rank). b
  requests' trees are verified in one target forward, so a draft token costs each request
  about t_p(b n) / b of it: the wider the batch, the cheaper the verification against the
  drafting, which each request pays alone (``selector.train.step_time``).

Left out: p's statistics (the root's p needs the target's forward that this step's tree is
for; p at the preceding token added no held-out gain at T = 0, ``bench.selector_prev`` and
docs/selector.md), hidden states, and a latency estimate besides the batch size (on one
machine the pass times are a function of the batch size: they enter the labels,
``selector.train``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["FEATURES", "features_of", "root_features", "record_features"]

FEATURES = ("entropy_q", "log_context_len", "temperature", "top_p", "log_batch_size")


def entropy(law: torch.Tensor) -> float:
    p = law.double()
    return float(-(p * p.clamp(min=1e-300).log()).sum())


def features_of(entropy_q: float, context_len: int, temperature: float, top_p: float,
                batch_size: int = 1) -> np.ndarray:
    """[len(FEATURES)] from the scalars (``entropy_q`` in nats)."""
    return np.array([float(entropy_q), math.log1p(context_len), float(temperature), float(top_p),
                     math.log(max(int(batch_size), 1))])


def root_features(q_root_law: torch.Tensor, context_len: int, temperature: float, top_p: float,
                  batch_size: int = 1) -> np.ndarray:
    """[len(FEATURES)] for one request-step; ``q_root_law`` is the [vocab] law of the first draft,
    ``batch_size`` the number of requests drafting in the step."""
    return features_of(entropy(q_root_law), context_len, temperature, top_p, batch_size)


def record_features(rec: dict, batch_size: int = 1) -> np.ndarray:
    """The same vector from a ``draft_tree_grid`` root record (its ``features`` and sampling),
    as if drafted in a step of ``batch_size`` requests."""
    return features_of(rec["features"]["entropy_q"], int(rec["context_len"]), rec["temperature"],
                       rec.get("top_p", 1.0), batch_size)
