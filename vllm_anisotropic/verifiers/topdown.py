"""Top-down tree traversal driven by a per-node OTLP solver (arXiv 2602.16994 Sec. 3.2, Appendix B).

Scope: the shared driver of every top-down verifier (greedy walk, deterministic sampler, NSS,
Naive, NaiveTree, SpecTr, SpecInfer, Khisti). Each algorithm module supplies one ``solve``:
given p (and q) at the current node and its child multiset, output one token y. The driver
descends to the first child (priority order) whose token is y, or stops and emits y as the
bonus/correction token. A node without children emits y ~ p (the bonus).

Losslessness (arXiv 2602.16994 Sec. 3.2): if, conditioned on the current node, the solver's output
follows p(. | node), the emitted sequence follows the target model. For draft-model trees the
solver must see the child multiset as i.i.d. draws in random order; a merged trie stores a
multiset, so the driver *shuffles* it with uniform keys (a uniformly random order of an
i.i.d. multiset has the law of i.i.d. draws, since i.i.d. sequences are exchangeable).

Uniform layout per tree and depth step t (S = max child-multiset size of the batch)::

    u[:, t, 0:S]      shuffle keys of the child multiset
    u[:, t, S:2S]     acceptance uniforms, round i uses column S + i
    u[:, t, 2S:3S]    spare per-round uniforms (solver-specific)
    u[:, t, 3S]       residual / correction sample
    u[:, t, 3S + 1]   bonus sample at a node without children
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from vllm_anisotropic.tree import TreeBatch
from vllm_anisotropic.verifiers import reference
from vllm_anisotropic.verifiers.base import BatchVerifyResult, Verifier, VerifyResult
from vllm_anisotropic.verifiers.sampling import sample_inverse_cdf, target_probs

__all__ = ["TopDownVerifier", "shuffle_slots"]


def shuffle_slots(
    slot_tokens: torch.Tensor,  # [num_rows, max_slots] token per slot, -1 padded
    slot_nodes: torch.Tensor,  # [num_rows, max_slots] global node per slot, -1 padded
    keys: torch.Tensor,  # [num_rows, max_slots] uniforms
):
    """Uniformly random order of the valid slots (padding stays last): argsort of uniform keys."""
    k = torch.where(slot_tokens >= 0, keys, torch.full_like(keys, 2.0))
    order = k.argsort(dim=1, stable=True)
    return slot_tokens.gather(1, order), slot_nodes.gather(1, order)



def descend(
    batch: TreeBatch,
    rows: torch.Tensor,  # [rows] request indices still walking
    cand: torch.Tensor,  # [rows, max_children] candidate child nodes, priority order, -1 padded
    y: torch.Tensor,  # [rows] the token each row emits at this depth
    cur: torch.Tensor,  # [batch_size] current node per request (updated in place)
    accepted: torch.Tensor,  # [batch_size, max_depth] accepted local node ids (updated in place)
    num_acc: torch.Tensor,  # [batch_size] (updated in place)
    bonus: torch.Tensor,  # [batch_size] (updated in place)
    active: torch.Tensor,  # [batch_size] bool (updated in place)
) -> None:
    """One step of a top-down walk: each row moves to its first candidate child whose token is
    ``y`` (accepting it); a row with no such child stops and emits ``y`` as its bonus token."""
    cand_tok = torch.where(cand >= 0, batch.tokens[cand.clamp(min=0)], -1)
    match = cand_tok == y.unsqueeze(1)
    hit = match.any(dim=1)
    child = cand.gather(1, match.to(torch.int8).argmax(dim=1, keepdim=True)).squeeze(1)
    go = rows[hit]
    accepted[go, num_acc[go]] = child[hit] - batch.root_index[go]
    num_acc[go] += 1
    cur[go] = child[hit]
    stop = rows[~hit]
    bonus[stop] = y[~hit]
    active[stop] = False

def descend_all(
    batch: TreeBatch,
    cand: torch.Tensor,  # [batch_size, max_children] candidate child nodes of every tree's current node
    y: torch.Tensor,  # [batch_size] the token each tree emits at this depth
    cur: torch.Tensor,  # [batch_size] (updated in place)
    accepted: torch.Tensor,  # [batch_size, max_depth] (updated in place)
    num_acc: torch.Tensor,  # [batch_size] (updated in place)
    bonus: torch.Tensor,  # [batch_size] (updated in place)
    active: torch.Tensor,  # [batch_size] bool (updated in place)
) -> None:
    """``descend`` over every tree with fixed shapes (inactive trees are left as they are): no
    boolean indexing, so no host synchronization on a GPU. Same result as ``descend`` on
    ``rows = active.nonzero()``."""
    cand_tok = torch.where(cand >= 0, batch.tokens[cand.clamp(min=0)], -1)
    match = cand_tok == y.unsqueeze(1)
    hit = match.any(dim=1) & active
    child = cand.gather(1, match.to(torch.int8).argmax(dim=1, keepdim=True)).squeeze(1)
    col = num_acc.clamp(max=accepted.shape[1] - 1).unsqueeze(1)
    old = accepted.gather(1, col).squeeze(1)
    accepted.scatter_(1, col, torch.where(hit, child - batch.root_index, old).unsqueeze(1))
    num_acc += hit.to(num_acc.dtype)
    cur.copy_(torch.where(hit, child, cur))
    stop = active & ~hit
    bonus.copy_(torch.where(stop, y, bonus))
    active &= hit


class TopDownVerifier(Verifier):
    """Top-down traversal; subclasses implement ``solve`` (and ``solve_reference``)."""

    # shuffle the child multiset into i.i.d. order (draft-model trees); False: priority order
    shuffle: ClassVar[bool] = True
    # only the first (shuffled) draft may be descended into (single-path Naive)
    single_path: ClassVar[bool] = False
    # the solver works on the child list in priority order without multiplicity
    use_children: ClassVar[bool] = False

    def uniform_shape(self, batch: TreeBatch) -> tuple[int, int]:
        s = batch.children.shape[1] if self.use_children else batch.slots.shape[1]
        return batch.max_depth + 1, 3 * s + 2

    def uniform_keys(self, batch: TreeBatch) -> np.ndarray:
        """Role keys of the layout above: ``t * 2**20 + part * 2**16 + i`` for part 0..2 (shuffle
        key, acceptance test, spare of slot/round i), parts 3 and 4 for the residual and the
        bonus sample: independent of S, the batch's widest child multiset."""
        steps, cols = self.uniform_shape(batch)
        s = (cols - 2) // 3
        col = np.arange(cols, dtype=np.int64)
        part = np.where(col < 3 * s, col // max(s, 1), col - 3 * s + 3)
        index = np.where(col < 3 * s, col % max(s, 1), 0)
        return (np.arange(steps, dtype=np.int64)[:, None] << 20) + (part << 16)[None, :] + index[None, :]

    def reference_tree(self, tree_nodes, batch, logits, sampling_b, q, u_b) -> VerifyResult:
        return reference.topdown_tree(self, tree_nodes, batch, logits, sampling_b, q, u_b)

    # ---- solver hooks -------------------------------------------------------------------
    def node_target(self, logits_rows: torch.Tensor, sampling) -> torch.Tensor:
        """What ``solve`` needs from the target at the current nodes: p, [rows, vocab_size]."""
        return target_probs(logits_rows, sampling.temperature, sampling.top_k, sampling.top_p, self.dtype)

    def bonus(self, target: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Token emitted at a node without children: y ~ p. [rows]"""
        return sample_inverse_cdf(target, u)

    def solve(
        self,
        target: torch.Tensor,  # [rows, vocab_size] p at the current nodes
        q: torch.Tensor | None,  # [rows, vocab_size] draft law of the children, or None
        xs: torch.Tensor,  # [rows, S] child tokens (shuffled multiset or priority list), -1 pad
        u: torch.Tensor,  # [rows, 3S + 2] this step's uniforms
    ) -> torch.Tensor:  # [rows] output token y
        raise NotImplementedError

    # ---- driver -------------------------------------------------------------------------
    def _verify_batch(self, batch, target_logits, sampling, draft_probs, u) -> BatchVerifyResult:
        device = target_logits.device
        bsz = batch.batch_size
        cur = batch.root_index.clone()  # [batch_size] global index of the current node
        active = torch.ones(bsz, dtype=torch.bool, device=device)
        num_acc = torch.zeros(bsz, dtype=torch.int64, device=device)
        accepted = torch.full((bsz, max(batch.max_depth, 1)), -1, dtype=torch.int64, device=device)
        bonus = torch.zeros(bsz, dtype=torch.int64, device=device)
        table = batch.children if self.use_children else batch.slots
        s = table.shape[1]
        for t in range(batch.max_depth + 1):
            rows = active.nonzero().squeeze(1)  # [rows]
            if rows.numel() == 0:
                break
            nodes = cur[rows]
            target = self.node_target(target_logits[nodes], sampling.index(rows))
            ut = u[rows, t]  # [rows, 3S + 2]
            slot_nodes = table[nodes]  # [rows, S]
            slot_tokens = torch.where(slot_nodes >= 0, batch.tokens[slot_nodes.clamp(min=0)], -1)
            if self.shuffle:
                slot_tokens, slot_nodes = shuffle_slots(slot_tokens, slot_nodes, ut[:, :s])
            has_kids = slot_nodes[:, 0] >= 0
            y = torch.empty(rows.shape[0], dtype=torch.int64, device=device)  # [rows]
            leaf = (~has_kids).nonzero().squeeze(1)
            if leaf.numel():
                y[leaf] = self.bonus(target[leaf], ut[leaf, 3 * s + 1])
            k = has_kids.nonzero().squeeze(1)
            if k.numel():
                q = None if draft_probs is None else draft_probs[nodes[k]].to(self.dtype)
                y[k] = self.solve(target[k], q, slot_tokens[k], ut[k])
            # descend: first child in priority order whose token is y
            cand = slot_nodes[:, :1] if self.single_path else batch.children[nodes]  # [rows, C]
            descend(batch, rows, cand, y, cur, accepted, num_acc, bonus, active)
        return BatchVerifyResult(accepted=accepted, num_accepted=num_acc, bonus_tokens=bonus)
