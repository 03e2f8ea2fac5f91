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

Which requests have trees is decided by the runner (``runner.tree_eligible``): greedy
requests (verified by the greedy walk) and, unless ``sampling_verifier="none"``, sampled
requests whose law is softmax(logits / temperature) under top-k / top-p (verified by the
sampling verifier -- one-hot SpecInfer by default -- on exactly that law, seeded requests with
their own generator). Requests with penalties, bias, bad words, min_p, min_tokens, logprobs or
structured output have no drafts, so their row is the bonus row and their token comes from
vLLM's own sampler exactly as in plain decoding. A batch without any draft never reaches this
module (the runner gives such a step plain decoding's path: ``harvest_plain``); one with drafts
but no multi-node tree (vLLM's warm-up dummy call) goes to vLLM's original rejection sampler
unchanged.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from vllm_anisotropic.integration.vllm.metrics import kv_in_place
from vllm_anisotropic.tree import pack_trees
from vllm_anisotropic.verifiers import SamplingTensors, get_verifier
from vllm_anisotropic.verifiers.sampling import SAMPLING_EPS

__all__ = ["TreeRejectionSampler"]

PLACEHOLDER_TOKEN_ID = -1  # vLLM's rejection_sampler.PLACEHOLDER_TOKEN_ID


class TreeRejectionSampler(nn.Module):
    """Wraps vLLM's ``RejectionSampler``; verifies this step's trees with the greedy walk."""

    def __init__(self, original: nn.Module, runner, verifier: str = "greedy", sampling_verifier: str = "none") -> None:
        super().__init__()
        self.original = original
        self.sampler = original.sampler
        self.runner = runner  # reads runner.tree_step (set in _prepare_inputs) and runner.drafter
        self.verifier = get_verifier(verifier)
        self.sampling_verifier = None if sampling_verifier == "none" else get_verifier(sampling_verifier)
        # Uniforms of unseeded sampled trees. A generator of our own, seeded alike in every
        # worker: under tensor parallelism each rank verifies the same trees with the same
        # uniforms, so every rank's drafter sees the same accepted paths (rank 0's output is
        # the one vLLM uses; a rank drafting a different next tree would verify wrong rows).
        # On the runner's device: a CPU generator cannot draw CUDA uniforms.
        device = getattr(runner, "device", "cpu")
        self.generator = torch.Generator(device=device).manual_seed(int(getattr(runner.model_config, "seed", 0) or 0))

    def forward(self, metadata, draft_probs, logits: torch.Tensor, sampling_metadata):
        t0 = time.perf_counter()
        step = self.runner.take_tree_step()
        walk = {} if step is None else {i: t for i, t in step.trees.items() if t.num_nodes > 1}
        if not walk:
            out = self.original(metadata, draft_probs, logits, sampling_metadata)
            if step is not None:
                self._harvest_roots(step, metadata, logits)
            return out

        num_draft = list(metadata.num_draft_tokens)
        batch_size = len(num_draft)
        # [batch_size] row index after each request's last row
        cu_sampled = metadata.cu_num_sampled_tokens.tolist()
        # Requests without a tree have no drafts: their token is vLLM's bonus sample, exactly
        # as in plain decoding (temperature, penalties, generators, logprobs all apply).
        for i in range(batch_size):
            if num_draft[i] and i not in walk:
                raise RuntimeError(f"batch row {i} has {num_draft[i]} drafts but no draft tree")
        t_vllm = time.perf_counter()
        bonus_out = self.sampler(
            logits=logits[metadata.bonus_logits_indices],
            sampling_metadata=sampling_metadata,
            predict_bonus_token=True,
        )
        t_vllm = time.perf_counter() - t_vllm  # vLLM's sampler: not the plugin's host work
        # [batch_size, 1]
        bonus = bonus_out.sampled_token_ids
        width = metadata.max_spec_len + 1
        out = torch.full((batch_size, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=logits.device)
        out[:, 0] = bonus[:, 0].to(torch.int32)

        rows_of = {i: slice(cu_sampled[i] - num_draft[i] - 1, cu_sampled[i]) for i in walk}
        results = self._verify(walk, rows_of, logits, sampling_metadata)
        # emitted tokens of every tree row, written to the device in one copy
        host = torch.full((batch_size, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
        harvest = []
        for i, res in sorted(results.items()):
            tree = walk[i]
            tokens = res.emitted_tokens(tree)
            host[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
            in_place = kv_in_place(res.accepted)  # accepted path 1 -> ... -> c: KV already right
            if in_place:
                self.runner.kv_in_place[step.req_ids[i]] = in_place
            harvest.append((step.req_ids[i], tree, res.accepted, rows_of[i]))
        for i, tree in step.trees.items():  # root-only trees: harvest the root row
            if tree.num_nodes == 1:
                harvest.append((step.req_ids[i], tree, [], slice(cu_sampled[i] - 1, cu_sampled[i])))
        rows = sorted(results)
        out[rows] = host[rows].to(out.device)
        t_harvest = time.perf_counter()
        self.runner.drafter.observe_batch(harvest, logits)  # timed as the harvest
        t_harvest = time.perf_counter() - t_harvest

        logprobs = None
        if bonus_out.logprobs_tensors is not None:
            # Only non-tree rows ask for logprobs (tree requests never do); their one emitted
            # token sits at column 0. vLLM filters the flattened [batch_size * width] logprobs
            # with the valid-token mask, so each row's bonus logprobs are repeated per column.
            lp = bonus_out.logprobs_tensors
            logprobs = type(lp)(
                lp.logprob_token_ids.repeat_interleave(width, dim=0),
                lp.logprobs.repeat_interleave(width, dim=0),
                lp.selected_token_ranks.repeat_interleave(width, dim=0),
            )
        from vllm.v1.outputs import SamplerOutput

        self.runner.host_clock.add("walk", time.perf_counter() - t0 - t_vllm - t_harvest)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)

    def _verify(self, walk: dict, rows_of: dict, logits: torch.Tensor, sampling_metadata) -> dict:
        """batch row -> ``VerifyResult``: greedy rows by the greedy walk, sampled rows by the
        sampling verifier on the processed target law (temperature, top-k, top-p as vLLM's
        sampler applies them); a seeded request draws its uniforms from its own generator."""
        temperature = sampling_metadata.temperature
        temps = None if temperature is None else temperature.tolist()  # one device-to-host copy
        greedy, sampled = [], []
        for i in sorted(walk):
            (greedy if temps is None or temps[i] < SAMPLING_EPS else sampled).append(i)
        if sampled and self.sampling_verifier is None:
            raise RuntimeError(f"batch rows {sampled} sample with trees but no sampling verifier is configured")
        results = {}
        if greedy:
            results.update(self._verify_rows(self.verifier, greedy, walk, rows_of, logits, None, None))
        generators = sampling_metadata.generators or {}
        unseeded = [i for i in sampled if i not in generators]
        if unseeded:
            results.update(self._verify_rows(self.sampling_verifier, unseeded, walk, rows_of, logits,
                                             _sampling_tensors(sampling_metadata, unseeded), self.generator))
        for i in sampled:
            if i in generators:
                results.update(self._verify_rows(self.sampling_verifier, [i], walk, rows_of, logits,
                                                 _sampling_tensors(sampling_metadata, [i]), generators[i]))
        return results

    @staticmethod
    def _verify_rows(verifier, rows, walk, rows_of, logits, sampling, generator) -> dict:
        trees = [walk[i] for i in rows]
        if sampling is None and not logits.is_cuda and hasattr(verifier, "verify_host"):
            # the walk reads the rows it visits where they are (no copy of every tree row)
            return dict(zip(rows, verifier.verify_host(trees, logits, [rows_of[i].start for i in rows])))
        # [sum of num_nodes, vocab_size]; tree k's rows are its 1 + n logits rows
        tree_logits = torch.cat([logits[rows_of[i]] for i in rows])
        batch = pack_trees(trees, device=tree_logits.device)
        if sampling is None:
            out = verifier.verify_batch(batch, tree_logits)
        elif getattr(verifier, "requires_draft_probs", False):
            # draft-model trees: row j of a tree is q after node j's path (``DraftTree.draft_probs``)
            q = torch.cat([t.draft_probs for t in trees]).to(tree_logits.device)
            out = verifier.verify_batch(batch, tree_logits, sampling, generator, q)
        else:
            out = verifier.verify_batch(batch, tree_logits, sampling, generator)
        return dict(zip(rows, out.to_list()))

    def _harvest_roots(self, step, metadata, logits) -> None:
        cu_sampled = metadata.cu_num_sampled_tokens.tolist()
        items = [(step.req_ids[i], tree, [], slice(cu_sampled[i] - 1, cu_sampled[i])) for i, tree in step.trees.items()]
        self.runner.drafter.observe_batch(items, logits)


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
    runner.drafter.observe_batch([(step.req_ids[i], tree, [], slice(i, i + 1)) for i, tree in step.trees.items()], logits)
