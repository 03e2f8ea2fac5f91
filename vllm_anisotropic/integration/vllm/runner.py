"""The tree model runner: vLLM's V1 ``CPUModelRunner`` with draft trees instead of chains.

Scope: the per-step glue (shared/notes/vllm-0.32-spec-decode-map.md sections 2-3):

* drafter: ``drafter.TreeDrafter``, built through vLLM's ``custom_class`` factory, runs after
  bookkeeping (``propose_draft_token_ids``) and returns ``tree.tokens[1:]`` per request;
* ``_prepare_inputs``: after vLLM's (contiguous positions and slots), each request with
  scheduled drafts gets its pending tree cut to the scheduled prefix, and the positions of its
  ``n`` node rows -- the last ``n`` rows of its query, counted from the end because a
  recompute rollback puts ``a`` re-run tokens in front -- become ``root position + depth``.
  Slots stay contiguous (each node keeps a KV slot of its own). Worked example: query
  ``[x, root, n1, n2, n3]`` at positions ``[9, 10, 11, 12, 13]``, tree depths ``[0, 1, 1, 2]``
  -> positions ``[9, 10, 11, 11, 12]``;
* ``_build_attention_metadata``: the step's ``TreePlan`` (node rows + ancestor masks) is
  attached to every layer's attention metadata for ``attention.TreeCPUAttentionImpl``;
* ``rejection_sampler``: ``sampler.TreeRejectionSampler`` (greedy tree walk + harvest);
* KV after acceptance: the scheduler re-runs the accepted tokens (``scheduler.py``).

Tree eligibility (``tree_eligible``): a request gets trees when its next token is the argmax
of the raw logits, or sampled from softmax(logits / temperature) under top-k / top-p (verified
by the sampling verifier); every other request decodes without drafts, exactly as vLLM would.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_anisotropic.integration.vllm.drafter import TreeDrafter
from vllm_anisotropic.integration.vllm.sampler import TreeRejectionSampler, harvest_plain
from vllm_anisotropic.tree import DraftTree

logger = logging.getLogger(__name__)

__all__ = ["TreeCPUModelRunner", "TreeStep", "TreePlan", "tree_eligible"]

DRAFTER_CLS = f"{TreeDrafter.__module__}.{TreeDrafter.__qualname__}"
_SAMPLING_EPS = 1e-5  # vLLM's greedy threshold (sampling_params._SAMPLING_EPS)


@dataclass
class TreePlan:
    """Tree rows of one step, for the attention override (shared by every layer).

    ``req_index[r]``: batch row of tree request r; ``num_nodes[r]``: its draft nodes n_r (root
    excluded); ``masks[r]``: ``[n_r, n_r]`` bool ancestor mask among the draft nodes (node i
    may attend node j); the node rows are the last n_r query rows of request ``req_index[r]``.
    ``chain_prefix[r]``: c_r, the leading nodes 1..c_r that form a chain below the root; their
    rows are causal already (ancestors = every earlier node), so only rows c_r+1..n_r are
    recomputed (missing entries: 0). ``cache`` holds gather indices built by the first layer
    and reused by the others.
    """

    req_index: list[int]
    num_nodes: list[int]
    masks: list[np.ndarray]
    chain_prefix: list[int] = field(default_factory=list)
    cache: dict = field(default_factory=dict)


@dataclass
class TreeStep:
    """Trees verified in one step: ``trees[batch row]`` (root-only trees included, to harvest
    the root row), ``req_ids`` the batch's request ids in row order."""

    req_ids: list[str]
    trees: dict[int, DraftTree]


def chain_prefix(tree: DraftTree) -> int:
    """Largest c with ``parents[1..c] == [0..c-1]``: nodes 1..c form a chain below the root.

    ``parents [-1, 0, 1, 0, 2] -> 2``; a pure chain of n nodes -> n.
    """
    parents = tree.parents[1:]
    off = np.nonzero(parents != np.arange(len(parents)))[0]
    return int(off[0]) if len(off) else len(parents)


def tree_eligible(sampling_params, sampling_trees: bool = False) -> bool:
    """True when the next token's law is what the tree verifiers reproduce: ``argmax(raw
    logits)`` (greedy), or with ``sampling_trees`` softmax(logits / temperature) under top-k /
    top-p; nothing else may edit the logits or need per-token outputs the verifiers lack."""
    sp = sampling_params
    if sp is None or (sp.temperature >= _SAMPLING_EPS and not sampling_trees):
        return False
    return (
        sp.logprobs is None
        and getattr(sp, "min_p", 0.0) == 0.0
        and sp.presence_penalty == 0.0
        and sp.frequency_penalty == 0.0
        and sp.repetition_penalty == 1.0
        and not sp.logit_bias
        and not sp.allowed_token_ids
        and not getattr(sp, "bad_words", None)
        and not getattr(sp, "_bad_words_token_ids", None)
        and sp.min_tokens == 0
        and getattr(sp, "structured_outputs", None) is None
    )


class TreeCPUModelRunner(CPUModelRunner):
    """V1 CPU model runner with tree drafting, tree positions, tree attention and tree walk."""

    def __init__(self, vllm_config, device) -> None:
        spec = vllm_config.speculative_config
        method, model = spec.method, spec.model
        # vLLM builds drafters only for its own method names: build ours through its
        # custom_class factory (``cls(vllm_config)``), then restore the method name.
        spec.method, spec.model = "custom_class", DRAFTER_CLS
        try:
            super().__init__(vllm_config, device)
        finally:
            spec.method, spec.model = method, model
        if self.uses_mrope:
            raise NotImplementedError("vllm-anisotropic tree decoding does not support M-RoPE models yet")
        assert isinstance(self.drafter, TreeDrafter), type(self.drafter)
        engine = self.drafter.config.engine
        self.rejection_sampler = TreeRejectionSampler(
            self.rejection_sampler, self, verifier=engine.verifier, sampling_verifier=engine.sampling_verifier
        )
        self._tree_step: TreeStep | None = None
        self._tree_plan: TreePlan | None = None
        # req_id -> accepted nodes whose KV is already in place (path 1 -> 2 -> ... -> c)
        self.kv_in_place: dict[str, int] = {}

    # ------------------------------------------------------------------ request lifecycle
    def _update_states(self, scheduler_output):
        for req_id in scheduler_output.finished_req_ids:
            self.drafter.drop(req_id)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self.drafter.drop_tree(req_id)
        return super()._update_states(scheduler_output)

    # ------------------------------------------------------------------ inputs
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._tree_step, self._tree_plan = None, None
        num_reqs = self.input_batch.num_reqs
        req_ids = list(self.input_batch.req_ids[:num_reqs])
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        trees: dict[int, DraftTree] = {}
        plan = TreePlan([], [], [])
        query_end = self.query_start_loc.np[1 : num_reqs + 1]
        for i, req_id in enumerate(req_ids):
            if req_id not in self.drafter.trees:
                continue
            scheduled = spec_tokens.get(req_id, ())
            tree = self.drafter.take_tree(req_id, scheduled)
            trees[i] = tree
            n = tree.num_nodes - 1
            if n == 0:
                continue
            end = int(query_end[i])
            root_row = end - n - 1
            # positions of the node rows: root position + depth (rows counted from the end)
            depths = torch.from_numpy(tree.depths[1:]).to(self.positions.dtype)
            self.positions[end - n : end] = self.positions[root_row] + depths
            prefix = chain_prefix(tree)
            if prefix == n:  # a chain: vLLM's causal attention is already the tree mask
                continue
            plan.req_index.append(i)
            plan.num_nodes.append(n)
            plan.masks.append(tree.ancestor_mask[1:, 1:])
            plan.chain_prefix.append(prefix)
        if trees:
            self._tree_step = TreeStep(req_ids, trees)
        if plan.req_index:
            self._tree_plan = plan
        return out

    def _build_attention_metadata(self, *args, **kwargs):
        attn_metadata, common = super()._build_attention_metadata(*args, **kwargs)
        plan, self._tree_plan = self._tree_plan, None
        per_layer = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
        for group in per_layer:
            for md in group.values():
                md.tree_plan = plan
        return attn_metadata, common

    def take_tree_step(self) -> TreeStep | None:
        step, self._tree_step = self._tree_step, None
        return step

    # ------------------------------------------------------------------ sampling
    def _sample(self, logits, spec_decode_metadata):
        out = super()._sample(logits, spec_decode_metadata)
        if spec_decode_metadata is None and logits is not None:
            harvest_plain(self, logits)  # no drafts anywhere this step: root rows only
        return out

    def sample_tokens(self, grammar_output):
        out = super().sample_tokens(grammar_output)
        # Tell the scheduler which accepted tokens need no re-run (scheduler.TreeScheduler);
        # an output without the attribute makes it re-run every accepted token (always safe).
        kv_in_place, self.kv_in_place = self.kv_in_place, {}
        if kv_in_place and hasattr(out, "sampled_token_ids"):
            out.kv_in_place = kv_in_place
        return out

    # ------------------------------------------------------------------ drafting
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        assert isinstance(sampled_token_ids, list)
        req_ids = list(self.input_batch.req_ids)
        sampling_trees = self.drafter.config.engine.sampling_verifier != "none"
        eligible = [tree_eligible(self.requests[r].sampling_params, sampling_trees) for r in req_ids]
        return self.drafter.propose_trees(
            req_ids,
            eligible,
            sampled_token_ids,
            self.input_batch.num_tokens_no_spec,
            self.input_batch.token_ids_cpu,
        )
