"""Tree verification in place of vLLM's chain rejection sampler (V1 model runner).

Scope: the ``runner.rejection_sampler`` call contract of vLLM 0.32
(``forward(metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput``, see
``v1/sample/rejection_sampler.py``) for batches that contain draft trees; greedy verification is
``verifiers.get_verifier("greedy")`` (GOOSE, arXiv 2604.02047 Algorithm 3: walk from the root, at each
node descend to the child -- SPINE children first -- whose token is the target's argmax; the
argmax at the last accepted node is the bonus token).

Terms: *accepted* draft nodes form a root-to-node path; the *bonus* token is the target's token
after that path. Emitted tokens = accepted path tokens + bonus, written to
``sampled_token_ids[i, :a + 1]`` (``[batch_size, max_spec_len + 1]`` int32, padded with -1).

Logits layout (``SpecDecodeMetadata``): a request with ``n`` scheduled drafts owns ``n + 1``
consecutive rows ending at ``cu_num_sampled_tokens[i]``; row 0 is the root, row j node j, so
row j is exactly the verifier's "logits after node j's path". Worked example: drafts per request
``[3, 0, 2]`` -> ``cu_num_sampled_tokens [4, 5, 8]`` -> rows ``[0..3], [4], [5..7]``.

Which requests have trees is decided by the runner (``runner.ineligible_reason``): greedy
requests (verified by the greedy walk) and, unless ``sampling_verifier="none"``, sampled
requests whose law is softmax(logits / temperature) under top-k / top-p: by default NSS with
vLLM's own sampler (``_walk_sampled``: each visited row sampled as plain decoding samples its
row, with the request's own generator, so seeded requests emit plain vLLM's tokens), or one-hot
SpecInfer on exactly that law, all in one call, with counter-based uniforms of each request's
seed and position (``verifiers.uniforms``; ``sampling_verifier: deterministic``). A tree
request with ``logit_bias``, ``allowed_token_ids``, bad words, ``min_tokens``, penalties or a
sampled ``min_p`` has its tree rows edited as vLLM's sampler edits its one row
(``runner.RowEdits``, float32), each row with the output before it (``_row_pasts``), before its
verifier reads them; logprobs of the emitted tokens come from the rows that predicted them
(``_logprobs``). Requests with structured output have no drafts, so their row is the bonus row
and their token comes from vLLM's own sampler exactly as in plain decoding. A batch without any
draft never reaches this module (the runner gives such a step plain decoding's path:
``harvest_plain``); one with drafts
but no multi-node tree (vLLM's warm-up dummy call) goes to vLLM's original rejection sampler
unchanged. After the walk, the accepted nodes' K/V is moved to the slots the sequence needs
(``kv_moves.py``), before the step's reply.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from vllm_anisotropic import kernels as _kernels
from vllm_anisotropic.integration.vllm.engine import cpu_draw
from vllm_anisotropic.integration.vllm.engine.faults import agree, inject, report
from vllm_anisotropic.verifiers import SamplingTensors, get_verifier
from vllm_anisotropic.verifiers.greedy import walk_flat
from vllm_anisotropic.verifiers.sampling import SAMPLING_EPS
from vllm_anisotropic.verifiers.uniforms import counter_uniforms, request_seed

__all__ = ["TreeRejectionSampler", "warm_up_emit"]

PLACEHOLDER_TOKEN_ID = -1  # vLLM's rejection_sampler.PLACEHOLDER_TOKEN_ID

logger = logging.getLogger(__name__)


class TreeRejectionSampler(nn.Module):
    """Wraps vLLM's ``RejectionSampler``; verifies this step's trees with the greedy walk."""

    def __init__(self, original: nn.Module, runner, verifier: str = "greedy", sampling_verifier: str = "none") -> None:
        super().__init__()
        self.original = original
        self.sampler = original.sampler
        self.runner = runner  # reads runner.tree_step (set in _prepare_inputs) and runner.drafter
        self.verifier = get_verifier(verifier)
        self.sampling_verifier = None if sampling_verifier == "none" else get_verifier(sampling_verifier)
        # NSS on trees without draft probabilities: each visited row sampled by vLLM's own
        # sampler with the request's own generator (``_walk_sampled``)
        self.sampler_walk = sampling_verifier == "nss"
        # its draws: vLLM's sampler's, without the vocabulary sort where the top-p cannot move them
        self.draw = cpu_draw.checked(self.sampler.topk_topp_sampler) if self.sampler_walk else None

    def forward(self, metadata, draft_probs, logits: torch.Tensor, sampling_metadata):
        t0 = time.perf_counter()
        step = self.runner.take_tree_step()
        if step is None:
            return self.original(metadata, draft_probs, logits, sampling_metadata)
        trees = step.trees
        # each tree's logits rows and the trees with drafts, from vLLM's draft counts (a host
        # list: nothing read back from the device), checked against the trees: one compiled call.
        # Requests without a tree have no drafts: their token is vLLM's bonus sample, exactly as
        # in plain decoding (temperature, penalties, generators, logprobs all apply).
        num_draft = np.fromiter(metadata.num_draft_tokens, np.int64)
        batch_size = num_draft.shape[0]
        starts, walked = np.empty(trees.num_trees, np.int64), np.empty(trees.num_trees, np.int64)
        emit = _kernels.load("emit")
        num_walked, bad = emit.logits_starts(num_draft, step.rows, trees.offsets, starts, walked)
        if not num_walked:  # root-only trees: vLLM's sampler, and each row's last (bonus) row harvested
            out = self.original(metadata, draft_probs, logits, sampling_metadata)
            self._observe(step, starts + num_draft[step.rows], logits)
            return out
        if bad >= 0:
            tree = np.flatnonzero(step.rows == bad)
            expected = int(trees.sizes()[tree[0]]) - 1 if tree.size else 0
            raise RuntimeError(f"batch row {bad} has {num_draft[bad]} drafts but its draft tree {expected}")
        walked = walked[:num_walked]
        t_vllm = time.perf_counter()
        num_logprobs = sampling_metadata.max_num_logprobs
        bonus_md = sampling_metadata if num_logprobs is None else replace(sampling_metadata, max_num_logprobs=None)
        snapshot = {}
        if sampling_metadata.generators:
            mine = set(step.rows[walked].tolist())
            # the walked requests' own generators as the step found them (a verify fault restores them)
            snapshot = {i: g.get_state() for i, g in sampling_metadata.generators.items() if i in mine}
            if self.sampler_walk:
                # the generators of the trees the sampler walk draws from are its alone: plain
                # decoding draws once per emitted token, and so does the walk (``_walk_sampled``)
                bonus_md = replace(bonus_md, generators={i: g for i, g in sampling_metadata.generators.items()
                                                         if i not in mine})
        bonus_md = _unwalked_laws(bonus_md, step.rows[walked], logits.shape[-1])
        bonus_out = self.sampler(  # logprobs: below, for every emitted token at once
            logits=logits[metadata.bonus_logits_indices],
            sampling_metadata=bonus_md,
            predict_bonus_token=True,
        )
        t_vllm = time.perf_counter() - t_vllm  # vLLM's sampler: not the plugin's host work
        void = step.void  # None: every tree is this rank's
        failed = False
        try:
            inject("verify")
            accepted, num_accepted, bonus = self._verify(step, walked if void is None else walked[~void[walked]],
                                                         starts, logits, sampling_metadata)
        except Exception:  # noqa: BLE001 - contained (faults.py): root samples, the walked requests lose trees
            report(logger, "verify", [step.req_ids[t] for t in walked.tolist()])
            failed = True
        stage = "verify"
        group = getattr(self.runner, "tree_ranks", None)
        if group is not None:
            # tensor parallelism: the ranks agree on what none may verify (faults.py, "ranks"):
            # the trees any rank lacks, and every tree when any rank's verification raised
            flags = np.zeros(batch_size + 1, bool)
            if void is not None:
                flags[step.rows[void]] = True
            flags[-1] = failed
            agreed = agree(flags, group)
            if agreed.any():  # on every rank alike: the tables' refresh windows start over
                self.runner.drafter.forget_writes()
            if agreed[-1] and not failed:
                stage, failed = "ranks", True
                report(logger, stage, [step.req_ids[t] for t in walked.tolist()])
            void = agreed[step.rows]
        if failed:
            self.runner.drafter.contain(stage, [step.req_ids[t] for t in walked.tolist()])
            accepted, num_accepted, bonus = self._root_samples(step, walked, starts, metadata, logits,
                                                               sampling_metadata, snapshot)
        elif void is not None and void.any():
            voided = np.flatnonzero(void)
            ids = [step.req_ids[t] for t in voided.tolist()]
            report(logger, "ranks", ids)
            self.runner.drafter.contain("ranks", ids)
            mine = set(step.rows[voided].tolist())
            _, _, root = self._root_samples(step, voided, starts, metadata, logits, sampling_metadata,
                                            {i: g for i, g in snapshot.items() if i in mine})
            num_accepted[voided], bonus[voided] = 0, root[voided]  # nothing of a path this rank may have walked
        # what the step emits, in one compiled call (kernels/emit.py): each walked tree's row of
        # emitted tokens (path + bonus; the other rows keep vLLM's bonus sample), its path's nodes,
        # and the K/V moves of accepted nodes off the leading chain; to the device in one copy
        width = metadata.max_spec_len + 1
        host = np.full((batch_size, width), PLACEHOLDER_TOKEN_ID, np.int32)
        host[:, 0] = bonus_out.sampled_token_ids[:, 0].cpu().numpy()
        on_path = np.zeros(trees.num_nodes, bool)
        src = np.empty(trees.num_nodes, np.int64)  # moves <= accepted nodes <= nodes
        dst = np.empty_like(src)
        moves = emit.emit_rows(trees.tokens, trees.offsets, walked, step.rows, accepted, num_accepted, bonus,
                               step.node_rows, host, on_path, src, dst)
        out = torch.from_numpy(host).to(logits.device)
        # accepted nodes off the leading chain: their K/V to the slots the sequence needs
        t_kv = time.perf_counter()
        if moves:
            self.runner.move_kv(src[:moves], dst[:moves])
        t_kv = time.perf_counter() - t_kv
        self.runner.host_clock.add("kv", t_kv)
        if void is not None and void.any():  # trees no rank verified are not observed (nor learned from)
            keep = np.flatnonzero(~void)
            t_harvest = self._observe(step.select(keep), starts[keep], logits, accepted[keep], num_accepted[keep])
        else:
            t_harvest = self._observe(step, starts, logits, accepted, num_accepted, on_path)

        logprobs = None
        if num_logprobs is not None:
            # the logits row that predicted each emitted token: the root's for column 0, accepted
            # node j's for column j + 1 (row j of a tree is node j); a request without a tree
            # emits its bonus row's token at column 0
            source = (np.cumsum(num_draft + 1) - 1)[:, None] + np.zeros((1, width), np.int64)
            tree_rows = step.rows[walked]
            source[tree_rows, 0] = starts[walked]
            source[tree_rows, 1 : accepted.shape[1] + 1] = starts[walked, None] + np.maximum(accepted[walked], 0)
            logprobs = self._logprobs(logits, source, out, num_logprobs)
        from vllm.v1.outputs import SamplerOutput

        self.runner.host_clock.add("walk", time.perf_counter() - t0 - t_vllm - t_harvest - t_kv)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)

    def _logprobs(self, logits: torch.Tensor, source: np.ndarray, out: torch.Tensor, num_logprobs: int):
        """vLLM's ``LogprobsTensors`` of the emitted tokens ``out`` ``[batch, width]``, each from
        the logits row ``source`` names, as plain decoding computes them from its one row (raw
        log-softmax, or raw logits in ``raw_logits`` mode: ``runner.ineligible_reason`` gives
        trees to logprobs requests only in those modes); flattened ``[batch * width]`` with
        zeros where no token was emitted (vLLM filters them out with the valid-token mask)."""
        from vllm.v1.outputs import LogprobsTensors

        flat = out.flatten()
        valid = torch.nonzero(flat != PLACEHOLDER_TOKEN_ID).flatten()
        rows = torch.from_numpy(source.reshape(-1)).to(logits.device)[valid]
        picked = logits.index_select(0, rows).to(torch.float32)
        if self.sampler.logprobs_mode != "raw_logits":
            picked = self.sampler.compute_logprobs(picked)
        got = self.sampler.gather_logprobs(picked, num_logprobs, flat[valid].to(torch.int64))
        parts = []
        for part in (got.logprob_token_ids, got.logprobs, got.selected_token_ranks):
            full = part.new_zeros((flat.shape[0], *part.shape[1:]))
            full[valid] = part
            parts.append(full)
        return LogprobsTensors(*parts)

    def _observe(self, step, starts, logits, accepted=None, num_accepted=None, on_path=None) -> float:
        """The step's accepted paths to the drafter (metrics, learning); returns its seconds
        (the drafter times them as the harvest)."""
        t = time.perf_counter()
        num = step.trees.num_trees
        if accepted is None:
            accepted, num_accepted = np.full((num, 1), -1, np.int64), np.zeros(num, np.int64)
        self.runner.drafter.observe_step(step, accepted, num_accepted, starts, logits, on_path)
        return time.perf_counter() - t

    def _verify(self, step, walked, starts, logits, sampling_metadata):
        """``(accepted [T, D], num_accepted [T], bonus [T])`` of the ``walked`` trees (others: no
        path): greedy rows by the greedy walk, sampled rows (seeded or not) by the sampling
        verifier on the processed target law (temperature, top-k, top-p as vLLM's sampler
        applies them), all in one call, with counter-based uniforms of each request's seed and
        root position (``verifiers.uniforms``): a request's outcome does not depend on its
        batch mates, and every tensor-parallel rank draws the same."""
        trees, rows = step.trees, step.rows
        num = trees.num_trees
        temperature = sampling_metadata.temperature
        if temperature is None and not self.runner.row_edits and not logits.is_cuda and step.void is None:
            # the common CPU step: every tree greedy (vLLM's metadata has no temperatures when the
            # batch is all greedy), unedited, this rank's: the walk alone over every tree, its
            # arrays as they are (a root-only tree walks to no path: one argmax, no gather)
            return walk_flat(trees, logits, starts)
        depth = max(int(trees.depths.max(initial=0)), 1)
        accepted = np.full((num, depth), -1, np.int64)
        num_accepted = np.zeros(num, np.int64)
        bonus = np.zeros(num, np.int64)
        temps = None if temperature is None else temperature.cpu().numpy()  # one device-to-host copy
        sampled_mask = np.zeros(num, bool) if temps is None else temps[rows] >= SAMPLING_EPS
        edits = self.runner.row_edits
        edited = np.zeros(num, bool)
        if edits:  # requests with logits edits (runner.RowEdits): their rows are edited copies
            edited = np.fromiter((r in edits for r in step.req_ids), bool, num)
        greedy = walked[~sampled_mask[walked]]
        for index in (greedy[~edited[greedy]], greedy[edited[greedy]], walked[sampled_mask[walked]]):
            if index.size == 0:
                continue
            sub = trees if index.size == num else trees.select(index)  # index: ascending, so all = every tree
            if not sampled_mask[index[0]] and not edited[index[0]] and not logits.is_cuda:
                # the walk reads the rows it visits where they are (no copy of every tree row)
                a, n, y = walk_flat(sub, logits, starts[index])
            elif sampled_mask[index[0]] and self.sampler_walk and sub.draft_probs is None:
                a, n, y = self._walk_sampled(step, index, sub, starts, logits, sampling_metadata)
            else:
                a, n, y = self._verify_packed(step, index, sub, starts, logits, sampling_metadata,
                                              sampled=bool(sampled_mask[index[0]]))
            accepted[index, : a.shape[1]] = a[:, :depth]
            num_accepted[index] = n
            bonus[index] = y
        return accepted, num_accepted, bonus

    def _verify_packed(self, step, index, sub, starts, logits, sampling_metadata, sampled: bool):
        """Trees ``index`` packed for a verifier (CUDA greedy rows, or sampled rows)."""
        if sampled and self.sampling_verifier is None:
            raise RuntimeError(f"batch rows {step.rows[index].tolist()} sample with trees but no sampling verifier "
                               "is configured")
        tree_logits = self._tree_rows(step, index, sub, starts, logits, sampling_metadata)
        batch = sub.to_batch(device=tree_logits.device)
        if not sampled:
            res = self.verifier.verify_batch(batch, tree_logits)
        else:
            verifier = self.sampling_verifier
            engine_seed = getattr(self.runner.model_config, "seed", 0)
            seeds = [request_seed(self.runner.requests[r].sampling_params.seed, r, engine_seed)
                     for r in (step.req_ids[t] for t in index.tolist())]
            u = counter_uniforms(seeds, step.root_positions[index], verifier.uniform_keys(batch), tree_logits.device)
            sampling = _sampling_tensors(sampling_metadata, step.rows[index].tolist())
            # draft-model trees: row j of a tree is q after node j's path
            q = torch.cat(list(sub.draft_probs)).to(tree_logits.device) if verifier.requires_draft_probs else None
            res = verifier.verify_batch(batch, tree_logits, sampling, None, q, uniforms=u)
        return res.accepted.cpu().numpy(), res.num_accepted.cpu().numpy(), res.bonus_tokens.cpu().numpy()

    def _root_samples(self, step, walked, starts, metadata, logits, sampling_metadata, snapshot):
        """After a verify fault: nothing accepted, and each walked tree's token sampled from its
        root row by vLLM's sampler exactly as plain decoding samples that row (the request's
        output so far for its penalties, its generator first restored to ``snapshot``, the
        state the step found it in: one draw, as plain decoding's). One sampler call for the
        whole batch, rows aligned with ``sampling_metadata``; only the walked rows are kept."""
        gens = sampling_metadata.generators or {}
        for i, state in snapshot.items():
            gens[i].set_state(state)
        tree_rows = step.rows[walked]
        rows = metadata.bonus_logits_indices.clone()
        rows[torch.from_numpy(tree_rows).to(rows.device)] = torch.from_numpy(starts[walked]).to(rows)
        mine = set(tree_rows.tolist())
        out = self.sampler(logits=logits[rows], predict_bonus_token=False, sampling_metadata=replace(
            sampling_metadata, max_num_logprobs=None, generators={i: g for i, g in gens.items() if i in mine}))
        num = step.trees.num_trees
        bonus = np.zeros(num, np.int64)
        bonus[walked] = out.sampled_token_ids[:, 0].cpu().numpy()[tree_rows]
        return np.full((num, 1), -1, np.int64), np.zeros(num, np.int64), bonus

    def _tree_rows(self, step, index, sub, starts, logits, sampling_metadata) -> torch.Tensor:
        """The logits rows of trees ``index`` packed tree after tree (``sub``'s node order), each
        request's edits applied to every row of its tree in float32, as vLLM's sampler applies
        them to its one row (``runner.RowEdits``)."""
        sizes = sub.sizes()
        rows_index = np.repeat(starts[index], sizes) + (np.arange(sub.num_nodes) - np.repeat(sub.offsets[:-1], sizes))
        tree_logits = logits.index_select(0, torch.from_numpy(rows_index).to(logits.device))
        edits = self.runner.row_edits
        mine = [(e, t, a, b) for t, a, b in zip(index.tolist(), sub.offsets[:-1].tolist(), sub.offsets[1:].tolist())
                if (e := edits.get(step.req_ids[t])) is not None] if edits else []
        if mine:
            tree_logits = tree_logits.float()
            for e, t, a, b in mine:
                row = int(step.rows[t])
                past = None
                if e.path:
                    past = _row_pasts(sub.tokens[a:b], sub.parents[a:b], self.runner.input_batch.req_output_token_ids[row])
                e.apply(tree_logits[a:b], past, sampling_metadata, row)
        return tree_logits

    def _walk_sampled(self, step, index, sub, starts, logits, md):
        """NSS (arXiv 2602.16994 Alg. 1) on sampled trees ``index`` with vLLM's own sampler:
        from the root, the row of the current node is sampled exactly as plain decoding samples
        its one row (float32, the request's edits, temperature, top-k / top-p, then
        ``TopKTopPSampler`` with the request's own generator), and the walk descends while a
        child holds the sampled token (``walk_flat``'s priority); the first sampled token no
        child holds is the bonus. Every emitted token is vLLM's sample at its position, and each
        draws once from the request's generator, as plain decoding draws once per token: a
        seeded request emits the tokens plain vLLM emits with the same seed (float32), whatever
        its tree, batch mates or the allocator's cuts. Acceptance equals one-hot SpecInfer's
        (a child is taken with the target probability of its token). One sampler call per
        depth for all the trees still walking."""
        edits = self.runner.row_edits
        if edits and any(step.req_ids[t] in edits for t in index.tolist()):
            rows = self._tree_rows(step, index, sub, starts, logits, md).float()  # edited copies
            row_starts = sub.offsets[:-1].astype(np.int64)
        else:  # each visited row read where it is, one depth at a time (not a copy of every tree row)
            rows, row_starts = logits, starts[index]
        batch_rows = step.rows[index]
        dev = rows.device
        at = torch.from_numpy(batch_rows).to(md.temperature.device)
        temperature = md.temperature.index_select(0, at).to(dev)
        top_k = None if md.top_k is None else md.top_k.index_select(0, at.to(md.top_k.device))
        top_p = None if md.top_p is None else md.top_p.index_select(0, at.to(md.top_p.device))
        generators = md.generators or {}
        owned = [generators.get(int(r)) for r in batch_rows.tolist()]
        sample = self.draw

        def pick(trees: np.ndarray, packed: np.ndarray) -> np.ndarray:
            t = torch.from_numpy(trees)
            x = rows.index_select(0, torch.from_numpy(packed).to(dev)).float().div_(temperature[t.to(dev)].unsqueeze(1))
            gens = {j: g for j, g in enumerate(owned[k] for k in trees.tolist()) if g is not None}
            y, _ = sample(x, gens, None if top_k is None else top_k[t.to(top_k.device)],
                          None if top_p is None else top_p[t.to(top_p.device)])
            return y.cpu().numpy()

        return walk_flat(sub, rows, row_starts, pick)


def _unwalked_laws(md, walked_rows: np.ndarray, vocab: int):
    """vLLM's ``SamplingMetadata`` for the step's bonus sampler call, without its top-p (top-k)
    where only walked rows use one. Their bonus samples are replaced by their walks' tokens, and
    the other rows' top-p of 1.0 (top-k of ``vocab``) masks nothing a sample can take: a
    float32 probability of 0 is a logit over 87 below the row's maximum, and the Gumbel noise
    of vLLM's draw spans less than 41 (uniforms of at most 53 bits). On the CPU vLLM applies a top-p by sorting each row's whole vocabulary
    (``apply_top_k_top_p_pytorch``: ~2.8 ms a 49,152-token row on one Xeon core), so a step
    whose sampled requests all had trees sorted every one of their bonus rows for nothing.
    ``md`` as it is where the tensors live on a GPU (vLLM's kernels there do not sort)."""
    changes = {}
    for name, values, neutral in (("top_p", md.top_p, 1.0), ("top_k", md.top_k, vocab)):
        if values is None or values.device.type != "cpu":
            continue
        others = np.delete(values.numpy(), walked_rows)  # the rows whose bonus samples are kept
        if not bool((others < neutral).any()):
            changes[name] = None
    return replace(md, **changes) if changes else md


def warm_up_emit() -> None:
    """Compile the step's kernels of ``kernels/emit.py`` (or load them from numba's disk cache)
    for the arrays a step passes them, at the worker's start rather than in the first tree step:
    one tree of two nodes, its node accepted."""
    from vllm_anisotropic.tree import DraftTree, FlatTrees, NodeSource

    trees = FlatTrees.from_trees([DraftTree([0, 1], [-1, 0])])
    emit = _kernels.load("emit")
    zero, one = np.zeros(1, np.int64), np.ones(1, np.int64)
    on_path = np.zeros(2, bool)
    emit.logits_starts(one, zero, trees.offsets, np.empty(1, np.int64), np.empty(1, np.int64))
    emit.emit_rows(trees.tokens, trees.offsets, zero, zero, np.ones((1, 1), np.int64), one, one, one,
                   np.zeros((1, 2), np.int32), on_path, np.empty(1, np.int64), np.empty(1, np.int64))
    emit.harvest_rows(zero, trees.offsets, np.ones(1, bool), np.empty(2, np.int64))
    emit.count_step(trees.parents, trees.sources, trees.depths, trees.offsets, on_path, one, np.zeros(1, np.int8),
                    0, len(NodeSource))


def _row_pasts(tokens: np.ndarray, parents: np.ndarray, output: list[int]) -> list[list[int]]:
    """The output vLLM's sampler would see before each row of a tree: ``output`` (which ends
    with the root's token), then the path's tokens down to node j. Parents precede children.
    ``tokens [r, a, b]``, ``parents [-1, 0, 1]``, output ``[7, r]`` -> ``[[7, r], [7, r, a],
    [7, r, a, b]]``."""
    pasts = [list(output)]
    for j in range(1, len(tokens)):
        pasts.append(pasts[int(parents[j])] + [int(tokens[j])])
    return pasts


def _sampling_tensors(md, rows: list[int]) -> SamplingTensors:
    """Per-row temperature / top-k / top-p of batch ``rows`` from vLLM's ``SamplingMetadata``
    (its ``top_k`` / ``top_p`` are None when no request of the batch uses them)."""
    idx = torch.tensor(rows, dtype=torch.long)
    n = len(rows)
    return SamplingTensors(
        temperature=md.temperature.cpu()[idx].float(),
        top_k=md.top_k.cpu()[idx].long() if md.top_k is not None else torch.full((n,), -1, dtype=torch.long),
        top_p=md.top_p.cpu()[idx].float() if md.top_p is not None else torch.ones(n),
    )


def harvest_plain(runner, logits: torch.Tensor) -> None:
    """Non-speculative steps (no SpecDecodeMetadata): harvest root-only trees' rows.

    In a step without any scheduled drafts vLLM's logits have one row per request."""
    step = runner.take_tree_step()
    if step is None:
        return
    num = step.trees.num_trees
    runner.drafter.observe_step(step, np.full((num, 1), -1, np.int64), np.zeros(num, np.int64), step.rows, logits)
