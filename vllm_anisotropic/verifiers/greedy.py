"""Unified greedy walk with source priority (GOOSE, arXiv 2604.02047 Algorithm 3 and Appendix B.3).

Scope: temperature-0 verification of any tree (spine trees, top-k trees, draft-model trees).
At each node the walk follows the child whose token equals the target's argmax, checking
SPINE children before BRANCH/DRAFT children (``tree.SOURCE_PRIORITY``; equal priority: lower
node index first). It stops when no child matches and emits the argmax at the last accepted
node as the bonus token. The walk ignores the sampling parameters: it *is* the greedy
(temperature 0) target, argmax of the raw logits, exactly as vLLM's greedy sampler.
Uses no randomness (the uniform block is drawn for a uniform interface but unused).

Cost: one argmax per *visited* node row (at most max_depth + 1 rows per tree), nothing else;
no softmax, no draft probabilities, no per-node processing of the vocabulary. On a CPU the
argmax is numpy's (``host_rows_argmax``: SIMD, ~15x faster than torch's CPU argmax on a
float32 row); bf16 rows by a compiled argmax on their 16 bits (``kernels.vocab.argmax_rows``).

On a CPU, ``walk_flat`` walks a step's trees in their flat form (``tree.FlatTrees``, the
engine's per-step batch): per depth step one ``host_rows_argmax`` over the rows the walk visits, then
one compiled descent over every active tree (``kernels.walk.descend_flat``: the first child in priority order
whose token is the argmax). It replaces the ~20 small tensor ops per depth step of the packed
walk, each ~5-10 us on a CPU, and the packing itself; ``verify_host`` is the same walk for a
list of ``DraftTree``s.

On a GPU (``dense=None`` and CUDA logits, or ``dense=True``) the walk instead takes one argmax
over every node row of the batch and descends with fixed shapes (``descend_all``): no host
synchronization until the caller reads the result, at the price of argmaxes of rows the walk
never visits (cheap on a GPU, not on a CPU).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_anisotropic import kernels
from vllm_anisotropic.kernels.split import run_rows
from vllm_anisotropic.tree import DraftTree, FlatTrees, PRIORITY_BY_CODE
from vllm_anisotropic.verifiers.base import BatchVerifyResult, VerifyResult
from vllm_anisotropic.verifiers.topdown import TopDownVerifier, descend, descend_all

__all__ = ["GreedyVerifier", "host_rows_argmax", "rows_argmax", "walk_flat"]

# GPU half rows widened to float32 per chunk: 64 x 151,936 x 4 B = 39 MB (CPU rows: host_rows_argmax)
ARGMAX_CHUNK_ROWS = 64


def rows_argmax(
    logits: torch.Tensor,  # [num_nodes, vocab_size] any float dtype
    rows: torch.Tensor,  # [num_rows] int64 row indices into ``logits``
    chunk_rows: int = ARGMAX_CHUNK_ROWS,
) -> torch.Tensor:
    """argmax over the vocabulary of ``logits[rows]``: [num_rows] int64, first index on ties
    (NaN counts as the largest value, as in torch).

    CPU rows go through ``host_rows_argmax`` (numpy's SIMD argmax). On a GPU, bf16/fp16 rows
    are gathered and widened to float32 ``chunk_rows`` at a time before the argmax: exact
    (every half value is a float32 value, so the argmax, its tie-breaking and NaN handling are
    those of the raw logits).
    """
    if logits.device.type == "cpu":
        return torch.from_numpy(host_rows_argmax(logits, rows.numpy()))
    if logits.dtype in (torch.float32, torch.float64):
        return logits[rows].argmax(dim=-1)
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=logits.device)
    for j in range(0, rows.shape[0], chunk_rows):
        out[j : j + chunk_rows] = logits[rows[j : j + chunk_rows]].float().argmax(dim=-1)
    return out


def host_rows_argmax(logits: torch.Tensor, rows: np.ndarray) -> np.ndarray:
    """``rows_argmax`` of CPU logits as an int64 numpy array (same ties and NaN rule as torch's).
    float32 rows by numpy's SIMD argmax in place (a 49k-vocab row: ~2-6 us, against ~30-40 us
    for torch's CPU argmax); bf16 rows by ``kernels.vocab.argmax_rows`` on their 16 bits, no
    widened copy; other dtypes by torch."""
    rows = np.asarray(rows, np.int64)
    if logits.dtype in (torch.float32, torch.float64):
        x = logits.detach().numpy()
        return np.fromiter((x[r].argmax() for r in rows.tolist()), np.int64, rows.shape[0])
    if logits.dtype == torch.bfloat16:
        out = np.empty(rows.shape[0], np.int64)
        vocab = kernels.load("vocab")  # threads: a part of 32 rows or more (kernels.split)
        run_rows(vocab.argmax_rows, vocab.argmax_rows_threads, rows.shape[0], 32,
                 logits.detach().view(torch.int16).numpy(), rows, out)
        return out
    return np.fromiter((logits[r].float().numpy().argmax() for r in rows.tolist()), np.int64, rows.shape[0])


class GreedyVerifier(TopDownVerifier):
    name = "greedy"
    shuffle = False
    use_children = True

    def node_target(self, logits_rows, sampling) -> torch.Tensor:
        # [rows] argmax token of the raw target logits (the temperature-0 target)
        return rows_argmax(logits_rows, torch.arange(logits_rows.shape[0], device=logits_rows.device))

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

    # None: the sync-free dense walk on CUDA logits, the visited-rows walk elsewhere
    dense: bool | None = None

    def _verify_batch(self, batch, target_logits, sampling, draft_probs, u) -> BatchVerifyResult:
        dense = self.dense if self.dense is not None else target_logits.is_cuda
        if dense:
            return self._verify_batch_dense(batch, target_logits)
        return self._verify_batch_sparse(batch, target_logits)

    def _verify_batch_dense(self, batch, target_logits) -> BatchVerifyResult:
        """Every node row's argmax at once, then ``max_depth + 1`` fixed-shape descents."""
        device = target_logits.device
        bsz = batch.batch_size
        y_all = target_logits.argmax(dim=-1)  # [num_nodes]; half rows: exact, first index on ties
        cur = batch.root_index.clone()
        active = torch.ones(bsz, dtype=torch.bool, device=device)
        num_acc = torch.zeros(bsz, dtype=torch.int64, device=device)
        accepted = torch.full((bsz, max(batch.max_depth, 1)), -1, dtype=torch.int64, device=device)
        bonus = torch.zeros(bsz, dtype=torch.int64, device=device)
        for _ in range(batch.max_depth + 1):
            descend_all(batch, batch.children[cur], y_all[cur], cur, accepted, num_acc, bonus, active)
        return BatchVerifyResult(accepted=accepted, num_accepted=num_acc, bonus_tokens=bonus)

    def _verify_batch_sparse(self, batch, target_logits) -> BatchVerifyResult:
        """The walk of ``TopDownVerifier._verify_batch`` specialised to temperature 0: per depth
        step one argmax per active tree, then descend to the first child (priority order) whose
        token is the argmax. Draft probabilities and uniforms are not read."""
        device = target_logits.device
        bsz = batch.batch_size
        cur = batch.root_index.clone()  # [batch_size] global index of the current node
        active = torch.ones(bsz, dtype=torch.bool, device=device)
        num_acc = torch.zeros(bsz, dtype=torch.int64, device=device)
        accepted = torch.full((bsz, max(batch.max_depth, 1)), -1, dtype=torch.int64, device=device)
        bonus = torch.zeros(bsz, dtype=torch.int64, device=device)
        for _ in range(batch.max_depth + 1):
            rows = active.nonzero().squeeze(1)  # [rows]
            if rows.numel() == 0:
                break
            nodes = cur[rows]
            y = rows_argmax(target_logits, nodes)  # [rows]
            cand = batch.children[nodes]  # [rows, max_children] priority order, -1 padded
            descend(batch, rows, cand, y, cur, accepted, num_acc, bonus, active)
        return BatchVerifyResult(accepted=accepted, num_accepted=num_acc, bonus_tokens=bonus)

    def verify_host(self, trees, logits: torch.Tensor, starts: list[int] | None = None) -> list[VerifyResult]:
        """The same walk for CPU logits, tree by tree (module docstring).

        ``logits``: ``[sum of num_nodes, vocab_size]``, tree k's ``num_nodes`` rows in node
        order after tree k - 1's; or, with ``starts``, any rows, tree k's ``num_nodes`` rows
        from row ``starts[k]`` on (the engine's logits as they are, no copy of the tree rows).
        Returns one ``VerifyResult`` per tree: the same accepted path and bonus token as
        ``verify_batch`` (same argmax, same child priority).
        """
        if starts is None:
            offsets, total = [], 0
            for tree in trees:
                offsets.append(total)
                total += tree.num_nodes
            if total != logits.shape[0]:
                raise ValueError(f"{total} tree nodes but {logits.shape[0]} logits rows")
        else:
            offsets = [int(s) for s in starts]
            if len(offsets) != len(trees):
                raise ValueError(f"{len(offsets)} starts for {len(trees)} trees")
            bad = [k for k, (s, t) in enumerate(zip(offsets, trees)) if s < 0 or s + t.num_nodes > logits.shape[0]]
            if bad:
                raise ValueError(f"trees {bad} run past the {logits.shape[0]} logits rows")
        kids = [tree.children_lists() for tree in trees]
        tokens = [tree.tokens.tolist() for tree in trees]
        cur = [0] * len(trees)
        accepted: list[list[int]] = [[] for _ in trees]
        bonus = [0] * len(trees)
        active = list(range(len(trees)))
        while active:
            rows = torch.tensor([offsets[b] + cur[b] for b in active], dtype=torch.int64, device=logits.device)
            still = []
            for b, y in zip(active, rows_argmax(logits, rows).tolist()):
                toks = tokens[b]
                child = next((c for c in kids[b][cur[b]] if toks[c] == y), -1)
                if child < 0:
                    bonus[b] = y
                else:
                    accepted[b].append(child)
                    cur[b] = child
                    still.append(b)
            active = still
        return [VerifyResult(a, y) for a, y in zip(accepted, bonus)]


_RANKS = PRIORITY_BY_CODE.astype(np.int8)  # the walk's child priority of each source code


def warm_up_walk() -> None:
    """Compile the CPU walk's kernel (or load it from numba's disk cache) for the bf16 logits a
    step passes it, at the CPU worker's start rather than in the first tree step: a one-node
    tree over one row, then 16 (the walk on threads where the process has them: ``kernels.split``),
    and the argmax of 1 and 64 rows (edited greedy rows: ``host_rows_argmax``)."""
    for num in (1, 16):
        trees = FlatTrees.from_trees([DraftTree(tokens=[0], parents=[-1])] * num)
        walk_flat(trees, torch.zeros(num, 8, dtype=torch.bfloat16), np.arange(num, dtype=np.int64))
    for num in (1, 64):
        host_rows_argmax(torch.zeros(num, 8, dtype=torch.bfloat16), np.arange(num, dtype=np.int64))


def walk_flat(trees: FlatTrees, logits: torch.Tensor, starts: np.ndarray,
              pick=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The greedy walk of every tree of a flat batch: tree t's ``num_nodes`` logits rows start
    at ``starts[t]`` (row j after node j's path). Returns ``accepted [T, max(max_depth, 1)]``
    local node indices (-1 padded), ``num_accepted [T]`` and ``bonus [T]``, all int64: the
    path and bonus token ``GreedyVerifier.verify_batch`` gives (same argmax, same priority).

    ``pick(trees, rows) -> tokens``: the token of each of the still-walking ``trees`` (indices
    into the batch, int64) from its logits ``rows``, one call per depth; default the argmax.
    Any per-row draw of the target's token walks the same way (the engine samples with vLLM's
    own sampler: ``integration/vllm/engine/sampler.py``): the walk descends while a child
    holds the drawn token, and the first drawn token no child holds is the bonus. Without
    ``pick``, CPU bf16 logits walk every depth in one compiled call (``kernels.walk.walk_rows``)."""
    num = trees.num_trees
    ranks = _RANKS[trees.sources]
    max_depth = int(trees.depths.max(initial=0))
    accepted = np.full((num, max(max_depth, 1)), -1, np.int64)
    num_accepted = np.zeros(num, np.int64)
    bonus = np.zeros(num, np.int64)
    starts = np.asarray(starts, np.int64)
    if pick is None and logits.device.type == "cpu" and logits.dtype == torch.bfloat16:
        # every depth in one compiled call, the argmax of each visited row read in place on its
        # 16 bits (float32 rows stay with numpy's argmax, depth by depth: ~1.4-1.8x faster a row
        # than the compiled one, which pays for the per-depth calls from a few rows a depth on)
        walk = kernels.load("walk")  # threads: a part of 8 trees or more (kernels.split)
        run_rows(walk.walk_rows, walk.walk_rows_threads, num, 8, logits.detach().view(torch.int16).numpy(),
                 trees.tokens, trees.parents, ranks, trees.offsets, starts, accepted, num_accepted, bonus)
        return accepted, num_accepted, bonus
    cur = np.zeros(num, np.int64)
    active = np.ones(num, bool)
    y = np.zeros(num, np.int64)
    descend = kernels.load("walk").descend_flat
    if pick is None:
        argmax = host_rows_argmax if logits.device.type == "cpu" else (
            lambda x, r: rows_argmax(x, torch.from_numpy(r).to(x.device)).cpu().numpy())
        pick = lambda idx, rows: argmax(logits, rows)  # noqa: E731
    live = num
    while live:
        idx = np.flatnonzero(active)
        y[idx] = pick(idx, starts[idx] + cur[idx])
        live = descend(trees.tokens, trees.parents, ranks, trees.offsets, active, y, cur, accepted, num_accepted,
                            bonus)
    return accepted, num_accepted, bonus
