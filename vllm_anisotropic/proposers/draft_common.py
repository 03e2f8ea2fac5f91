"""What one draft-model tree is made of, shared by ``draft_model.py`` (one request) and
``draft_batch.py`` (a step's requests batched): the node order of a (K, L1, L2) shape, the law a
draw comes from, a draw, the tree of drawn nodes (``draft_model``'s module docstring), and q's attention
dimensions (``attention_dims``)."""

from __future__ import annotations

import numpy as np
import torch

from vllm_anisotropic.selector.shape import DelayedShape
from vllm_anisotropic.tree import DraftTree, NodeSource
from vllm_anisotropic.verifiers.sampling import TargetSampling, sample_inverse_cdf, target_probs

__all__ = ["NO_DRAFTS", "attention_dims", "shape_parents"]

NO_DRAFTS = DelayedShape(1, 0, 0)  # the root alone: a plain step


def shape_parents(shape: DelayedShape) -> np.ndarray:
    """[1 + num_drafts] parents of the tree ``shape`` drafts, in node order (module docstring).

    ``shape_parents(DelayedShape(2, 1, 2)) -> [-1, 0, 1, 1, 2, 3]``."""
    parents = [-1] + list(range(shape.trunk))
    end = shape.trunk  # the trunk's last node (the root when there is no trunk)
    for depth in range(shape.branch_length):
        for k in range(shape.branches):
            parents.append(end if depth == 0 else 1 + shape.trunk + (depth - 1) * shape.branches + k)
    return np.asarray(parents, np.int64)


def _law(logits: torch.Tensor, sampling: TargetSampling) -> torch.Tensor:
    """[rows, vocab] law of the draws: q processed like the target's (raw softmax when greedy)."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    if sampling.greedy:
        return logits.softmax(dim=-1)
    n = logits.shape[0]
    return target_probs(logits, torch.full((n,), float(sampling.temperature)), torch.full((n,), int(sampling.top_k)),
                        torch.full((n,), float(sampling.top_p)))


def _draw(law: torch.Tensor, sampling: TargetSampling, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``law`` [rows, vocab]: argmax (greedy) or an inverse-CDF sample."""
    if sampling.greedy:
        return law.argmax(dim=-1)
    return sample_inverse_cdf(law, torch.rand(law.shape[0], generator=generator, dtype=torch.float64).float())


def _tree(tokens, parents, values, rows) -> DraftTree:
    sources = np.full(tokens.size, NodeSource.DRAFT, np.int8)
    sources[0] = NodeSource.ROOT
    return DraftTree(tokens=tokens, parents=parents, sources=sources, values=values, draft_probs=rows)


def attention_dims(config) -> tuple[int, int, int]:
    """(heads, KV heads, head dim) of a causal LM of transformers ``config``."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return heads, kv_heads, head_dim
