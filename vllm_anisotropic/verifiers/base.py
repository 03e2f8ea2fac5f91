"""The verifier interface shared by every algorithm in ``vllm_anisotropic.verifiers``.

Scope: inputs, outputs and the random-number layout; no algorithm lives here.

A verifier takes

* a draft tree (``DraftTree``, or a packed ``TreeBatch``),
* the target logits of every node, ``[num_nodes, vocab_size]``, row i = the target's
  next-token logits after node i's path (row 0 = after the root),
* the sampling parameters vLLM applies (temperature / top-k / top-p; ``sampling.py``),
* a ``torch.Generator``,

and returns the **accepted path** (node indices from the root, root excluded) and one
**bonus token**: the target's token after the last accepted node (a "correction" token when
it is drawn from a residual, a "bonus" when drawn from p at a node whose children were all
passed over; both are emitted the same way). Emitted tokens = tokens of the path + bonus.

Randomness: each call consumes one float64 uniform tensor ``u`` of shape
``[batch_size, num_steps, num_columns]`` (``uniform_shape``) in a documented layout, so that the
vectorised implementation and the slow per-node reference (``reference.py``) make identical
decisions on identical uniforms. It is drawn from the generator, or given (``uniforms=``): the
engine passes counter-based uniforms (``uniforms.counter_uniforms``) keyed by each uniform's role
(``uniform_keys``), so a tree's verification does not depend on the rest of the batch.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from vllm_anisotropic.tree import DraftTree, TreeBatch, pack_trees
from vllm_anisotropic.verifiers.sampling import SamplingTensors, TargetSampling

__all__ = ["VerifyResult", "BatchVerifyResult", "Verifier", "draw_uniforms"]


@dataclass(frozen=True)
class VerifyResult:
    """Outcome for one tree."""

    accepted: list[int]  # accepted node indices (local), root excluded, root->leaf order
    bonus_token: int  # the target-distributed token emitted after the accepted path

    def emitted_tokens(self, tree: DraftTree) -> list[int]:
        return [int(tree.tokens[i]) for i in self.accepted] + [int(self.bonus_token)]


@dataclass(frozen=True)
class BatchVerifyResult:
    """Outcome for a batch. Accepted paths are padded with -1."""

    # [batch_size, max_depth] local node indices along each accepted path, -1 padded
    accepted: torch.Tensor
    # [batch_size] int64 number of accepted draft nodes (root excluded)
    num_accepted: torch.Tensor
    # [batch_size] int64
    bonus_tokens: torch.Tensor

    def to_list(self) -> list[VerifyResult]:
        acc = self.accepted.cpu().tolist()
        n = self.num_accepted.cpu().tolist()
        bonus = self.bonus_tokens.cpu().tolist()
        return [VerifyResult(a[:k], int(y)) for a, k, y in zip(acc, n, bonus)]


def draw_uniforms(generator: torch.Generator | None, shape, device) -> torch.Tensor:
    """float64 uniforms in [0, 1) of ``shape`` (the one RNG call of a verification)."""
    return torch.rand(shape, generator=generator, dtype=torch.float64, device=device)


class Verifier(abc.ABC):
    """Base class. Subclasses implement ``verify_batch`` (fast, vectorised over the batch and
    the vocabulary) and ``reference_batch`` (slow per-node loop, same uniforms)."""

    name: ClassVar[str]
    # needs a draft distribution q per node (trees sampled from a draft model)
    requires_draft_probs: ClassVar[bool] = False
    # needs independent sibling subtrees (no merged i.i.d. paths, multiplicity == 1)
    requires_unmerged: ClassVar[bool] = False

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        # dtype of the probability arithmetic (float32 in serving, float64 in exactness tests)
        self.dtype = dtype

    # ------------------------------------------------------------------ public API
    def verify(
        self,
        tree: DraftTree,
        target_logits: torch.Tensor,  # [num_nodes, vocab_size]
        sampling: TargetSampling = TargetSampling(),
        generator: torch.Generator | None = None,
    ) -> VerifyResult:
        """Verify one tree (packs it into a batch of one)."""
        assert target_logits.shape[0] == tree.num_nodes, (target_logits.shape, tree.num_nodes)
        batch = pack_trees([tree], device=target_logits.device)
        return self.verify_batch(batch, target_logits, sampling, generator, tree.draft_probs).to_list()[0]

    def verify_batch(
        self,
        batch: TreeBatch,
        target_logits: torch.Tensor,  # [num_nodes (flat), vocab_size]
        sampling: TargetSampling | SamplingTensors | list = TargetSampling(),
        generator: torch.Generator | None = None,
        draft_probs: torch.Tensor | None = None,  # [num_nodes (flat), vocab_size] or None
        uniforms: torch.Tensor | None = None,  # [batch_size, *uniform_shape(batch)] float64 or None
    ) -> BatchVerifyResult:
        """Verify every tree of a packed batch; vectorised over trees and vocabulary. The
        uniforms are ``uniforms`` when given, else drawn from ``generator``."""
        sampling, draft_probs = self._check(batch, target_logits, sampling, draft_probs)
        shape = (batch.batch_size, *self.uniform_shape(batch))
        if uniforms is None:
            u = draw_uniforms(generator, shape, target_logits.device)
        else:
            if tuple(uniforms.shape) != shape:
                raise ValueError(f"uniforms must be {list(shape)} for this batch, got {list(uniforms.shape)}")
            u = uniforms.to(device=target_logits.device, dtype=torch.float64)
        return self._verify_batch(batch, target_logits, sampling, draft_probs, u)

    def reference_batch(
        self,
        batch: TreeBatch,
        target_logits: torch.Tensor,
        sampling: TargetSampling | SamplingTensors | list = TargetSampling(),
        generator: torch.Generator | None = None,
        draft_probs: torch.Tensor | None = None,
    ) -> list[VerifyResult]:
        """Slow reference: a plain Python loop per tree and per node (``reference_tree``) that
        consumes the same uniforms as ``verify_batch``; both agree on a fixed seed."""
        sampling, draft_probs = self._check(batch, target_logits, sampling, draft_probs)
        u = draw_uniforms(generator, (batch.batch_size, *self.uniform_shape(batch)), target_logits.device)
        offsets = batch.node_offsets.tolist()
        return [
            self.reference_tree(
                list(range(offsets[b], offsets[b + 1])),
                batch,
                target_logits,
                sampling.index(slice(b, b + 1)),
                draft_probs,
                u[b],
            )
            for b in range(batch.batch_size)
        ]

    # ------------------------------------------------------------------ subclass hooks
    @abc.abstractmethod
    def uniform_shape(self, batch: TreeBatch) -> tuple[int, int]:
        """(num_steps, num_columns) of the per-tree uniform block."""

    def uniform_keys(self, batch: TreeBatch) -> np.ndarray:
        """``[num_steps, num_columns]`` int64: the role of each uniform inside one tree, the same
        whatever else the batch holds (``uniforms.counter_uniforms``). Default: the position in
        the block, right for layouts whose shape does not depend on the batch (one column per
        depth or per event); layouts sized by the batch's widest node override it."""
        steps, cols = self.uniform_shape(batch)
        return np.arange(steps * cols, dtype=np.int64).reshape(steps, cols)

    @abc.abstractmethod
    def _verify_batch(self, batch, target_logits, sampling, draft_probs, u) -> BatchVerifyResult: ...

    def reference_tree(self, tree_nodes, batch, logits, sampling_b, q, u_b) -> VerifyResult:
        """Slow reference for one tree: ``tree_nodes`` its global node ids, ``sampling_b`` its
        one-row ``SamplingTensors``, ``u_b`` its uniform block (top-down verifiers:
        ``reference.topdown_tree``)."""
        raise NotImplementedError(f"verifier {self.name!r} has no slow reference")

    # ------------------------------------------------------------------ helpers
    def _check(self, batch, target_logits, sampling, draft_probs):
        assert target_logits.ndim == 2 and target_logits.shape[0] == batch.num_nodes, (
            f"target_logits must be [num_nodes={batch.num_nodes}, vocab_size], got {tuple(target_logits.shape)}"
        )
        if self.requires_draft_probs:
            if draft_probs is None:
                raise ValueError(f"verifier {self.name!r} needs draft_probs (a tree sampled from a draft model)")
            assert draft_probs.shape == target_logits.shape, (draft_probs.shape, target_logits.shape)
        if self.requires_unmerged and not batch.unmerged:
            raise ValueError(f"verifier {self.name!r} needs unmerged trees (multiplicity == 1 everywhere)")
        st = SamplingTensors.from_params(sampling, batch.batch_size, target_logits.device)
        return st, draft_probs
