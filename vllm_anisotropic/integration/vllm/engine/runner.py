"""The tree model runner: vLLM's V1 model runner with draft trees instead of chains.

``TreeRunnerMixin`` holds the tree logic; ``TreeCPUModelRunner`` puts it on vLLM's
``CPUModelRunner`` (tree attention: ``attention.py``), ``gpu_runner.TreeGPUModelRunner`` on
``GPUModelRunner`` (tree attention: ``gpu_attention.py``).

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
* KV after acceptance: the sampler moves the accepted nodes' K/V to the slots the sequence needs
  before the reply (``kv_moves.py``); nothing is re-run.

Tree eligibility (``ineligible_reason``): a request gets trees when its next token is the argmax
of its edited logits (bias, allowed tokens, bad words, min_tokens, penalties: ``RowEdits``), or
sampled from softmax(logits / temperature) under top-k / top-p of them (verified by the
sampling verifier); a grammar (structured output) prunes the trees and masks every tree row in
the scheduler (``tree_grammar.py``): the runner sends each such tree's parents with its drafts.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_anisotropic import kernels as _kernels
from vllm_anisotropic.allocator import CHAIN, PLAIN, TREE
from vllm_anisotropic.integration.vllm.frontdoor.config import DRAFT_MODEL_METHODS, request_tree_options
from vllm_anisotropic.integration.vllm.engine.drafter import StepTrees, TreeDrafter
from vllm_anisotropic.integration.vllm.engine.faults import report, tp_group
from vllm_anisotropic.integration.vllm.engine.host_clock import HostClock, timed
from vllm_anisotropic.integration.vllm.engine.kv_moves import KVMover
from vllm_anisotropic.integration.vllm.engine.sampler import TreeRejectionSampler, harvest_plain
from vllm_anisotropic.tree import DraftTree, FlatTrees
from vllm_anisotropic.verifiers.sampling import TargetSampling

logger = logging.getLogger(__name__)

__all__ = ["TreeRunnerMixin", "TreeCPUModelRunner", "TreePlan", "RowEdits", "node_masks", "ineligible_reason",
           "scatter_device_positions", "scatter_tree_positions", "warm_up_step_rows"]

DRAFTER_CLS = f"{TreeDrafter.__module__}.{TreeDrafter.__qualname__}"
_SAMPLING_EPS = 1e-5  # vLLM's greedy threshold (sampling_params._SAMPLING_EPS)


@dataclass
class TreePlan:
    """Tree rows of one step, for the attention override (shared by every layer).

    ``req_index[r]``: batch row of tree request r; ``trees``: their trees (roots included), tree r
    of request ``req_index[r]``, whose ``n_r`` draft nodes (``num_nodes``) are the last n_r query
    rows of that request. ``chain_prefix[r]``: c_r, the leading nodes 1..c_r that form a chain
    below the root (``FlatTrees.chain_prefix`` unless given); their rows are causal already
    (ancestors = every earlier node), so only rows c_r+1..n_r are recomputed. ``query_end[r]``:
    end of request r's query rows; ``seq_lens[r]``: its KV length after the step (the GPU plan
    needs both). ``cache`` holds what the first layer builds for the others (and the derived
    arrays below).
    """

    req_index: list[int]
    trees: FlatTrees
    chain_prefix: np.ndarray | None = None
    query_end: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    cache: dict = field(default_factory=dict)
    clock: HostClock | None = None  # where the attention override adds the seconds of its plan

    def __post_init__(self) -> None:
        self.chain_prefix = self.trees.chain_prefix() if self.chain_prefix is None else np.asarray(self.chain_prefix,
                                                                                                  np.int64)

    @property
    def num_nodes(self) -> np.ndarray:
        """``[R]`` int64 draft nodes of each tree (root excluded)."""
        return self.trees.sizes() - 1

    @property
    def masks(self) -> list[np.ndarray]:
        """``[n_r, n_r]`` bool ancestor masks among the draft nodes (``node_masks``), built once."""
        if "masks" not in self.cache:
            self.cache["masks"] = node_masks(self.trees, np.arange(self.trees.num_trees))
        return self.cache["masks"]


def node_masks(trees: FlatTrees, index: np.ndarray) -> list[np.ndarray]:
    """``[n, n]`` bool ancestor masks among the draft nodes (root excluded) of trees ``index``
    (mask[i, j]: node i + 1 may attend node j + 1), from the packed ancestor bits.
    ``parents [-1, 0, 0, 1]`` -> ``[[1,0,0],[0,1,0],[1,0,1]]``."""
    sizes = trees.sizes()
    if int(sizes[index].max(initial=0)) > 64:  # beyond one 64-bit word: per tree
        return [trees.tree(int(t)).ancestor_mask[1:, 1:] for t in index]
    bits = trees.ancestor_bits()
    out = []
    for t in index.tolist():
        a, b = int(trees.offsets[t]), int(trees.offsets[t + 1])
        shifts = np.arange(1, b - a, dtype=np.uint64)
        out.append(((bits[a + 1 : b, None] >> shifts[None, :]) & np.uint64(1)).astype(bool))
    return out


def ineligible_reason(sampling_params, sampling_trees: bool = False, logprobs_trees: bool = True,
                      sampled_grammar_trees: bool = True) -> str | None:
    """Why a request decodes without trees (a label of ``tree_requests_without_trees``), or
    None when it gets them: its next token is ``argmax`` (greedy) or, with ``sampling_trees``,
    a sample of softmax(logits / temperature) under top-k / top-p, of the logits after the
    request's edits (``logit_bias``, ``allowed_token_ids``, bad words, ``min_tokens``,
    penalties, sampled ``min_p``: the tree sampler applies them to every tree row, each row with
    the output before it, ``RowEdits``; greedy ``min_p`` leaves the argmax alone, as vLLM applies
    it to sampled rows only). A grammar (structured output) keeps trees: the scheduler prunes
    them by the grammar and masks every tree row (``tree_grammar.py``); not for sampled requests
    when ``sampled_grammar_trees`` is off (draft-model trees verified with their draft law q:
    pruning sampled branches by their tokens would leave branches that are no longer draws
    from q). Logprobs keep trees when ``logprobs_trees`` (vLLM's ``logprobs_mode`` is
    raw: the tree sampler reports each emitted token's from the row that predicted it)."""
    sp = sampling_params
    if sp is None:
        return "no_sampling_params"
    if not request_tree_options(sp.extra_args).drafts:
        return "request_opt_out"
    greedy = sp.temperature < _SAMPLING_EPS
    if not greedy and not sampling_trees:
        return "sampled"
    if sp.logprobs is not None and not logprobs_trees:
        return "logprobs"
    if not greedy and not sampled_grammar_trees and getattr(sp, "structured_outputs", None) is not None:
        return "structured_output"
    return None


@dataclass(frozen=True)
class RowEdits:
    """A tree request's edits of its logits rows, exactly as vLLM's sampler edits its one row
    (float32, same order, vLLM's own functions for the path-dependent ones): ``allowed`` token
    ids (every other token -inf), bad words, ``min_tokens`` (stop tokens -inf while short),
    ``logit_bias``, presence / frequency / repetition penalties, then (sampled requests) ``min_p``
    at the request's temperature. Row j of a tree is the logits after node j's path, so the
    path-dependent edits (``path``) read the request's output tokens followed by that path.
    From ``SamplingParams``: ``logit_bias={5: 2.0}`` -> tokens [5], values [2.0]."""

    bias_tokens: torch.Tensor | None
    bias_values: torch.Tensor | None
    allowed: torch.Tensor | None
    min_tokens: int = 0
    stop_tokens: torch.Tensor | None = None
    penalties: bool = False
    bad_words: bool = False
    min_p: float = 0.0  # sampled requests only (vLLM applies min_p after the temperature)
    temperature: float = 1.0

    @property
    def path(self) -> bool:
        """Whether an edit depends on the tokens before the row (``apply`` needs ``past``)."""
        return self.penalties or self.bad_words or self.min_tokens > 0

    @classmethod
    def of(cls, sp) -> "RowEdits | None":
        bias, allowed = sp.logit_bias or {}, sp.allowed_token_ids or []
        penalties = sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0
        bad_words = bool(getattr(sp, "bad_words", None) or getattr(sp, "_bad_words_token_ids", None))
        stops = sorted(sp.all_stop_token_ids) if sp.min_tokens else []
        min_p = float(getattr(sp, "min_p", 0.0)) if sp.temperature >= _SAMPLING_EPS else 0.0
        if not (bias or allowed or penalties or bad_words or sp.min_tokens or min_p):
            return None
        return cls(
            torch.tensor(list(bias), dtype=torch.long) if bias else None,
            torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None,
            torch.tensor(sorted(allowed), dtype=torch.long) if allowed else None,
            int(sp.min_tokens), torch.tensor(stops, dtype=torch.long) if stops else None, penalties, bad_words,
            min_p, float(sp.temperature),
        )

    def apply(self, rows: torch.Tensor, past: list[list[int]] | None = None, metadata=None, index: int = -1) -> None:
        """Edit float32 ``rows`` ``[n, vocab]`` in place. ``past[j]``: the tokens vLLM's sampler
        would see as the output before row j (the request's output, then node j's path);
        ``metadata``: the step's ``SamplingMetadata``, ``index`` the request's batch row (its
        bad words, prompt and penalty values)."""
        dev = rows.device
        if self.allowed is not None:
            keep = rows[:, self.allowed.to(dev)]
            rows.fill_(float("-inf"))
            rows[:, self.allowed.to(dev)] = keep
        if self.bad_words and metadata.bad_words_token_ids and index in metadata.bad_words_token_ids:
            from vllm.v1.sample.ops.bad_words import apply_bad_words

            words = metadata.bad_words_token_ids[index]
            apply_bad_words(rows, {j: words for j in range(rows.shape[0])}, past)
        if self.stop_tokens is not None:
            short = torch.tensor([j for j, p in enumerate(past) if len(p) < self.min_tokens], dtype=torch.long)
            if short.numel():
                rows[short.to(dev)[:, None], self.stop_tokens.to(dev)[None, :]] = float("-inf")
        if self.bias_tokens is not None:
            rows[:, self.bias_tokens.to(dev)] += self.bias_values.to(dev)
        if self.penalties:
            from vllm.v1.sample.ops.penalties import apply_all_penalties

            n = rows.shape[0]
            one = slice(index, index + 1)
            apply_all_penalties(rows, metadata.prompt_token_ids[one].expand(n, -1),
                                metadata.presence_penalties[one].expand(n), metadata.frequency_penalties[one].expand(n),
                                metadata.repetition_penalties[one].expand(n), past)
        if self.min_p:
            # vLLM divides by the temperature, then masks the tokens whose probability is below
            # min_p x the row's largest (MinPLogitsProcessor); the verifier divides the same rows
            # by the same temperature again, so the same tokens are out and the rest unchanged
            scaled = rows / torch.tensor(self.temperature, dtype=torch.float32, device=dev)
            probs = scaled.softmax(dim=-1)
            floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(self.min_p, dtype=torch.float32, device=dev)
            rows.masked_fill_(probs < floor, float("-inf"))


def request_law(req_id: str, sampling_params, engine_seed) -> tuple[TargetSampling, int]:
    """The request's token law as the tree verifiers apply it, and the seed of its drafting
    uniforms (a draft model samples its trees under the same law): the request's own seed, else
    one derived from the engine seed and the request id, so every tensor-parallel rank drafts
    the same tree. Mixed with a constant, so the drafting stream never equals the stream vLLM
    seeds from the same number for the request's verification uniforms (equal streams would
    correlate the drafts with their acceptance tests)."""
    sp = sampling_params
    base = sp.seed if sp.seed is not None else zlib.crc32(req_id.encode()) ^ int(engine_seed or 0)
    seed = int(np.random.SeedSequence([int(base) & 0xFFFFFFFFFFFF, _DRAFT_STREAM]).generate_state(1, np.uint64)[0] >> 1)
    law = TargetSampling(temperature=float(sp.temperature), top_k=int(sp.top_k) if sp.top_k and sp.top_k > 0 else -1,
                         top_p=float(sp.top_p))
    return law, seed


_DRAFT_STREAM = 0xD8AF7  # the draft-sampling stream's tag in request_law


def warm_up_step_rows() -> None:
    """Compile ``kernels.plan.step_rows``, ``scheduled_prefixes`` and ``gather_prefix`` (take_step's
    cut; or load them from numba's disk cache) for the arrays a step passes them, at the worker's
    start rather than in the first tree step: one two-node tree."""
    one, offsets = np.ones(1, np.int64), np.array([0, 2], np.int64)
    plan = _kernels.load("plan")
    plan.scheduled_prefixes(offsets, one.repeat(2), one, one, np.empty_like(one), np.empty(1, bool))
    plan.gather_prefix(offsets, one, one.repeat(2), np.array([-1, 0], np.int64), np.zeros(2, np.int8), np.ones(2),
                       np.array([0, 1], np.int64))
    plan.step_rows(offsets, np.array([-1, 0], np.int64), np.array([0, 1], np.int64), one, np.empty_like(one),
                   np.empty((3, 1), np.int64), np.empty_like(one))


def scatter_tree_positions(positions: torch.Tensor, nodes: np.ndarray) -> None:
    """``positions[rows] = positions[roots] + depths`` for every node row of the batch, ``nodes``
    ``[3, num_node_rows]`` int64 (rows, root rows, depths: ``kernels.plan.step_rows``), from one
    host-to-device copy. Example: positions ``[9, 10, 11, 12, 13]``, rows ``[2, 3, 4]``, roots
    ``[1, 1, 1]``, depths ``[1, 1, 2]`` -> ``[9, 10, 11, 11, 12]``."""
    if nodes.shape[1] == 0:
        return
    if positions.device.type == "cpu":  # in place through numpy (vLLM's CPU positions: ~7 torch calls less)
        host = positions.numpy()
        host[nodes[0]] = host[nodes[1]] + nodes[2]
        return
    scatter_device_positions(positions, nodes)


def scatter_device_positions(positions: torch.Tensor, nodes: np.ndarray) -> None:
    """``scatter_tree_positions`` with torch ops on ``positions``' device (a GPU worker's)."""
    idx = torch.from_numpy(nodes).to(positions.device, non_blocking=True)
    positions[idx[0]] = positions[idx[1]] + idx[2].to(positions.dtype)


class TreeRunnerMixin:
    """Tree drafting, tree positions, tree attention plan and tree walk for a V1 model runner."""

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
        from vllm_anisotropic.integration.vllm.frontdoor.vllm_surface import check_runner

        check_runner(self)
        self._builtin_logits_processors(vllm_config)
        if self.uses_mrope:
            raise NotImplementedError("vllm-anisotropic tree decoding does not support M-RoPE models yet")
        assert isinstance(self.drafter, TreeDrafter), type(self.drafter)
        config = self.drafter.config
        self.rejection_sampler = TreeRejectionSampler(
            self.rejection_sampler, self, verifier=config.walk_verifier, sampling_verifier=config.sampled_verifier
        )
        # fixed for the engine's life: read once, not per step
        self._sampling_trees = config.sampled_verifier != "none"  # sampled requests get trees
        # logprobs requests get trees when vLLM reports raw values (TreeRejectionSampler._logprobs)
        self._logprobs_trees = getattr(self.model_config, "logprobs_mode", "raw_logprobs") in ("raw_logprobs",
                                                                                              "raw_logits")
        self._draft_model = config.method in DRAFT_MODEL_METHODS  # proposals sample under the request's law
        # sampled draft-model trees whose verifier reads q cannot be grammar-pruned (ineligible_reason)
        verifier = self.rejection_sampler.sampling_verifier
        self._sampled_grammar_trees = not (self._draft_model and verifier is not None and verifier.requires_draft_probs)
        self._tree_step: StepTrees | None = None
        self._tree_plan: TreePlan | None = None
        self._kv_mover: KVMover | None = None  # K/V slot moves after acceptance (kv_moves.py)
        self._eligible_cache: dict[str, bool] = {}  # req_id -> gets trees (dropped on finish)
        self._structured: set[str] = set()  # tree requests with a grammar (their trees' parents go to the scheduler)
        self.row_edits: dict[str, RowEdits] = {}  # tree requests with logit_bias / allowed_token_ids
        self._propose_s = 0.0  # seconds drafting since the last output (sent as tree_propose_s)
        self._resume_s = 0.0  # of them, a draft model's catch-up after the gate rested drafting (tree_resume_s)
        # a draft model's catch-up account since the last output (tree_catchup): seconds and tokens
        # of its long catch-ups, request-steps the repay rule left without drafts
        self._catchup = (0.0, 0, 0)
        # tensor parallelism: the CPU group on which the ranks agree on each step's verifiable
        # trees after a fault on one rank (faults.agree, in the sampler); None with one rank
        self.tree_ranks = tp_group()

    def _builtin_logits_processors(self, vllm_config) -> None:
        """The logits processors plain decoding has (min_tokens, logit_bias, min_p): with any
        speculative config vLLM builds min_tokens' alone (``build_logitsprocs``), because its
        rejection sampler cannot apply the others to draft rows; it refuses min_p and
        logit_bias requests up front (patches.py, patch 9, lets them through for tree methods).
        Here requests with min_p decode with greedy trees or without drafts, logit_bias ones
        with trees whose rows the tree sampler edits itself (``RowEdits``); the processors
        apply to the one row every request samples from vLLM's sampler."""
        from vllm.utils.torch_utils import PIN_MEMORY
        from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

        batch = self.input_batch
        have = {type(p) for p in batch.logitsprocs.all}
        procs = list(batch.logitsprocs.all) + [
            ctor(vllm_config, self.device, PIN_MEMORY)
            for ctor in BUILTIN_LOGITS_PROCESSORS if ctor not in have]
        batch.logitsprocs = LogitsProcessors(procs)
        batch.sampling_metadata = batch._make_sampling_metadata()

    # ------------------------------------------------------------------ request lifecycle
    @property
    def host_clock(self) -> HostClock:
        return self.drafter.host_clock

    def _update_states(self, scheduler_output):
        # the previous step's harvest, unless the worker ran it after its reply (after_reply)
        self.drafter.run_deferred()
        t0 = time.perf_counter()
        self.drafter.tenants.update(getattr(scheduler_output, "tree_tenants", None) or {})
        # sorted: vLLM's id sets iterate in an order of the process's string hash seed, which
        # differs between tensor-parallel ranks; the drops queue the finished requests' store
        # inserts, whose order the next trees read (unsorted, TP = 2 ranks drafted different
        # trees after a wave of 32 seeded requests finished in one step: test_engine_tp.py)
        for req_id in sorted(scheduler_output.finished_req_ids):
            self.drafter.drop(req_id, self._context(req_id))
            self._eligible_cache.pop(req_id, None)
            self.row_edits.pop(req_id, None)
            self._structured.discard(req_id)
        for req_id in sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()):
            self.drafter.drop_tree(req_id)
        kept = getattr(scheduler_output, "tree_kept", None)
        if kept:  # grammar-pruned trees (scheduler.TreeScheduler, tree_grammar.py)
            self.drafter.reorders.update(kept)
        for stage, ids in getattr(scheduler_output, "tree_faults", None) or ():
            # contained in the scheduler (scheduler.TreeScheduler._budget): counted here, with the rest
            self.drafter.contain(stage, [r for r in ids if r in self.requests])
        self.host_clock.add("states", time.perf_counter() - t0)
        out = super()._update_states(scheduler_output)
        if scheduler_output.finished_req_ids and not self.input_batch.num_reqs:
            self.drafter.sink.tick(force=True)  # the batch drained: the stats file is current
        return out

    def _context(self, req_id: str) -> np.ndarray | None:
        """The request's tokens (prompt and output) while it still has its batch row, or None."""
        i = self.input_batch.req_id_to_index.get(req_id)
        if i is None:
            return None
        return self.input_batch.token_ids_cpu[i, : int(self.input_batch.num_tokens_no_spec[i])]

    def after_reply(self) -> None:
        """Called by the worker process after it has sent a reply (``patches.py`` patch 7): the
        step's deferred harvest runs while the scheduler prepares the next step."""
        self.drafter.run_deferred()

    # ------------------------------------------------------------------ inputs
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        if scheduler_output.scheduled_spec_decode_tokens:
            out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        else:
            # No drafts scheduled: vLLM's _prepare_inputs would still build spec-decode metadata
            # (it asks only whether a speculative config exists, ``use_spec_decode``), which
            # the step then drops (below). Plain decoding's branch directly: ~0.1 ms a step.
            spec, self.speculative_config = self.speculative_config, None
            try:
                out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
            finally:
                self.speculative_config = spec
        t0 = time.perf_counter()
        logits_indices, spec_decode_metadata, max_num_sampled = out
        if spec_decode_metadata is not None and not any(spec_decode_metadata.num_draft_tokens):
            # No drafts anywhere in this step (the allocator kept none, or nothing was proposed):
            # vLLM would still build spec-decode metadata and run its rejection sampler for one
            # bonus row per request. Its logits rows are the plain ones (each query's last), so
            # the step takes plain decoding's sampler path instead (``_sample``, root rows
            # harvested by ``harvest_plain``): the same tokens, without the spec-decode host work.
            out = (logits_indices, None, max_num_sampled)
        self._tree_step, self._tree_plan = None, None
        num_reqs = self.input_batch.num_reqs
        step = self.drafter.take_step(self.input_batch.req_ids[:num_reqs], scheduler_output.scheduled_spec_decode_tokens)
        plan = None
        if step is not None:
            self._tree_step = step
            trees = step.trees
            n = trees.sizes() - 1  # [T] draft nodes of each tree
            ends = self.query_start_loc.np[1 : num_reqs + 1][step.rows].astype(np.int64)
            total = trees.num_nodes - trees.num_trees
            # the node rows are the last n rows of each query, a node's position is its root's
            # plus its depth; and each tree's leading chain: one compiled call (kernels/plan.py)
            step.node_rows, chain = np.empty_like(n), np.empty_like(n)
            node_positions = np.empty((3, total), np.int64)
            _kernels.load("plan").step_rows(trees.offsets, trees.parents, trees.depths, ends, step.node_rows,
                                            node_positions, chain)
            step.root_positions = (self.input_batch.num_computed_tokens_cpu[step.rows]
                                   + np.asarray(num_scheduled_tokens)[step.rows] - n - 1).astype(np.int64)
            if total:
                scatter_tree_positions(self.positions, node_positions)
                # trees whose draft nodes are not one chain below the root need the tree rows
                planned = np.flatnonzero(chain < n)
                if planned.size:
                    batch_rows = step.rows[planned]
                    num_computed = self.input_batch.num_computed_tokens_cpu[batch_rows]
                    plan = TreePlan(batch_rows.tolist(), trees.select(planned), chain[planned], ends[planned].tolist(),
                                    (num_computed + np.asarray(num_scheduled_tokens)[batch_rows]).astype(np.int64).tolist())
        if plan is not None:
            plan.clock = self.host_clock
            self._tree_plan = plan
        self.host_clock.add("prepare", time.perf_counter() - t0)
        return out

    def _attention_plan(self, plan: TreePlan):
        """What the attention override reads (``TreePlan`` on CPU; the GPU runner converts it)."""
        return plan

    def _build_attention_metadata(self, *args, **kwargs):
        attn_metadata, common = super()._build_attention_metadata(*args, **kwargs)
        plan, self._tree_plan = self._tree_plan, None
        if plan is not None:
            plan = self._attention_plan(plan)
        per_layer = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
        for group in per_layer:
            for md in group.values():
                md.tree_plan = plan
        return attn_metadata, common

    def _eligible(self, req_id: str) -> bool:
        """Whether the request gets trees (``ineligible_reason``), computed once (its sampling
        parameters are fixed); a request without counts its reason on /metrics, one with
        logits edits registers them for the tree sampler (``row_edits``)."""
        ok = self._eligible_cache.get(req_id)
        if ok is None:
            sp = self.requests[req_id].sampling_params
            reason = ineligible_reason(sp, self._sampling_trees, self._logprobs_trees, self._sampled_grammar_trees)
            ok = self._eligible_cache[req_id] = reason is None
            if reason is not None:
                counts = self.drafter.metrics.without_trees
                counts[reason] = counts.get(reason, 0) + 1
            else:
                if (edits := RowEdits.of(sp)) is not None:
                    self.row_edits[req_id] = edits
                if getattr(sp, "structured_outputs", None) is not None:
                    self._structured.add(req_id)
        return ok

    def take_tree_step(self) -> StepTrees | None:
        step, self._tree_step = self._tree_step, None
        return step

    def move_kv(self, src_rows: np.ndarray, dst_rows: np.ndarray) -> None:
        """Copy the K/V of this step's query rows ``src_rows`` to the slots of ``dst_rows`` in
        every layer (``kv_moves.py``), through the step's slot mapping (KV cache group 0)."""
        slots = self.input_batch.block_table[0].slot_mapping.gpu
        index = torch.from_numpy(np.concatenate([src_rows, dst_rows])).to(slots.device)
        picked = slots.index_select(0, index).long()
        mover = self._kv_mover
        if mover is None or not mover.caches or mover.caches[0][0].data_ptr() != self._first_cache_ptr():
            mover = self._kv_mover = KVMover.from_layers(self.compilation_config.static_forward_context.values())
        mover.move(picked[: src_rows.shape[0]], picked[src_rows.shape[0]:])

    def warm_up_kv_moves(self) -> None:
        """Build the K/V mover and load its compiled kernel (``kernels/kv.py``) for these caches'
        element types now, at the worker's start, not in the first step that moves: slot 0 onto
        itself in every cache (nothing changes), by the one-thread and the threaded kernel (``KVMover.warm_up``)."""
        self._kv_mover = KVMover.from_layers(self.compilation_config.static_forward_context.values())
        self._kv_mover.warm_up()

    def _first_cache_ptr(self) -> int:
        for layer in self.compilation_config.static_forward_context.values():
            cache = getattr(layer, "kv_cache", None)
            if isinstance(cache, torch.Tensor) and cache.dim() == 4 and cache.numel():
                return cache.data_ptr()
        return -1

    # ------------------------------------------------------------------ sampling
    def _sample(self, logits, spec_decode_metadata):
        out = super()._sample(logits, spec_decode_metadata)
        if spec_decode_metadata is None and logits is not None:
            harvest_plain(self, logits)  # no drafts anywhere this step: root rows only
        return out

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        """vLLM skips the drafter for the whole batch when any request is within
        ``num_speculative_tokens`` of ``max_model_len`` (its drafters run a forward of that many
        tokens), and then schedules ``num_speculative_tokens`` *zero* drafts for every request:
        no trees, verified by vLLM's chain sampler. The tree drafter runs no forward and sizes
        each tree to its own request's room (``TreeDrafter.propose_trees``), so it always fits."""
        return common_attn_metadata is not None

    def take_draft_token_ids(self):
        out = super().take_draft_token_ids()
        t0 = time.perf_counter()
        if out is not None and self.drafter.acceptance is not None:
            # the allocator's input (budget.BatchBudget.on_draft_ids): travels with the pickled output
            out.tree_probs = self.drafter.pending_probs(out.req_ids)
            # leading chain of each pending tree: cuts inside it need no masked tree attention
            out.tree_chains = self.drafter.pending_chains(out.req_ids)
        if out is not None and self._structured:
            # the scheduler prunes these trees by their grammars and masks each node's row
            # (scheduler.TreeScheduler.update_draft_token_ids, tree_grammar.py)
            out.tree_parents = self.drafter.pending_parents([r for r in out.req_ids if r in self._structured])
        self.host_clock.add("reply", time.perf_counter() - t0)
        return out

    def calibrate_step_cost(self, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), repeats: int = 3) -> list:
        """Time real forwards of ``q`` query tokens (vLLM's ``_dummy_run``: ``min(q, max_num_seqs)``
        requests) for the allocator's cost model; the samples travel to the scheduler with the
        next ``ModelRunnerOutput`` (``cost_calibration``)."""
        limit = min(self.scheduler_config.max_num_batched_tokens, max(sizes))
        max_reqs = self.scheduler_config.max_num_seqs
        samples = []
        for q in sorted({min(s, limit) for s in sizes}):
            times = []
            for _ in range(repeats + 1):  # the first run warms the shape up
                self._sync_device()
                t0 = time.perf_counter()
                self._dummy_run(q)
                self._sync_device()
                times.append(time.perf_counter() - t0)
            samples.append((min(q, max_reqs), q, 0, 0, 0, float(np.median(times[1:]))))
        logger.info("vllm-anisotropic cost sweep: %s", [(q, round(s * 1e3, 2)) for _, q, _, _, _, s in samples])
        samples += self._tree_cost_samples(samples, repeats)
        self._cost_calibration = samples
        return samples

    def _tree_cost_samples(self, forwards: list, repeats: int) -> list:
        """Calibration samples of steps with tree rows, where the attention backend spends extra
        work on them (none here: the GPU runner's tree rows ride in the same kernel call)."""
        return []

    def _sync_device(self) -> None:
        if torch.cuda.is_available() and getattr(self.device, "type", "cpu") == "cuda":
            torch.cuda.synchronize(self.device)

    def sample_tokens(self, grammar_output):
        out = super().sample_tokens(grammar_output)
        # extra attributes travel with the pickled output; never set on vLLM's shared empty one
        carries = hasattr(out, "sampled_token_ids") and out is not EMPTY_MODEL_RUNNER_OUTPUT
        calibration = getattr(self, "_cost_calibration", None)
        if calibration and carries:
            out.cost_calibration, self._cost_calibration = calibration, None
        # seconds this step spent drafting for the next one (the gate charges them to the next
        # step: budget.BatchBudget.on_output)
        propose_s, self._propose_s = self._propose_s, 0.0
        resume_s, self._resume_s = self._resume_s, 0.0
        if propose_s and carries:
            out.tree_propose_s = propose_s
            if resume_s:
                out.tree_resume_s = resume_s
        catchup, self._catchup = self._catchup, (0.0, 0, 0)
        if (catchup[1] or catchup[2]) and carries:
            out.tree_catchup = catchup
        # The next step's drafts travel with this reply (scheduler.TreeScheduler applies them
        # in update_from_output), so the engine core skips vLLM's second RPC of the step
        # (``take_draft_token_ids`` in ``EngineCore.post_step``; patches.py patch 6).
        drafts = self.take_draft_token_ids() if carries else None
        if drafts is not None:
            out.tree_drafts = drafts
        return out

    # ------------------------------------------------------------------ drafting
    @timed("propose")
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        assert isinstance(sampled_token_ids, list)
        req_ids = list(self.input_batch.req_ids)
        kind = int(getattr(scheduler_output, "tree_propose", TREE))
        if kind == PLAIN:
            # the measured gate keeps the next step plain: no trees (so no harvest next step)
            return self.drafter.rest(req_ids)
        t0 = time.perf_counter()
        eligible = [self._eligible(r) for r in req_ids]
        laws = None
        if self._draft_model and any(r not in self.drafter.states for r in req_ids):
            laws = [request_law(r, self.requests[r].sampling_params, self.model_config.seed)
                    if r not in self.drafter.states else None for r in req_ids]
        repay = getattr(scheduler_output, "tree_repay", None)  # the measured gate's (budget.BatchBudget.repay_next)
        try:
            remaining = self._remaining(req_ids) if repay is not None and self._draft_model else None
            drafts = self.drafter.propose_trees(
                req_ids,
                eligible,
                sampled_token_ids,
                self.input_batch.num_tokens_no_spec,
                self.input_batch.token_ids_cpu,
                laws,
                chains=kind == CHAIN,
                repay=repay,
                remaining=remaining,
            )
        except Exception:  # noqa: BLE001 - contained (faults.py): no drafts, the batch's drafting requests lose trees
            ids = [r for r, ok in zip(req_ids, eligible) if ok and r not in self.drafter.disabled]
            report(logger, "propose", ids)
            self.drafter.contain("propose", ids)
            drafts = [[] for _ in req_ids]
        self._propose_s += time.perf_counter() - t0
        self._resume_s += self.drafter.proposer.take_resume_seconds()
        account = self.drafter.proposer.take_catchup()
        if account[1] or account[2]:
            self._catchup = tuple(a + b for a, b in zip(self._catchup, account))
        return drafts

    def _remaining(self, req_ids: list[str]) -> list[int]:
        """Per batch row, the output tokens the request may still emit: its ``max_tokens`` less
        those it has, and no more than the model length leaves."""
        out = []
        for i, r in enumerate(req_ids):
            state = self.requests[r]
            emitted = len(state.output_token_ids)
            left = self.max_model_len - int(self.input_batch.num_tokens_no_spec[i])
            max_tokens = state.sampling_params.max_tokens if state.sampling_params is not None else None
            out.append(left if max_tokens is None else min(int(max_tokens) - emitted, left))
        return out


class TreeCPUModelRunner(TreeRunnerMixin, CPUModelRunner):
    """V1 CPU model runner with tree drafting, tree positions, tree attention and tree walk."""

    # (tree requests, draft nodes per tree, context tokens per tree) of the start-up tree-row
    # timings: the shapes the allocator chooses between at 1..8 requests
    TREE_COST_SHAPES = ((1, 4, 256), (1, 16, 256), (1, 16, 1024), (2, 8, 512), (4, 4, 256), (4, 16, 512), (8, 8, 512))

    def _tree_cost_samples(self, forwards: list, repeats: int) -> list:
        """The tree rows (``attention.TreeCPUAttentionImpl.tree_rows``: path rounds through vLLM's
        kernel, or the masked recompute for bushy trees) are work a bare forward of the same
        query tokens does not do: each re-reads the tree requests' context per layer. Without these samples the cost model's tree
        terms stay 0 until online steps teach them, and the allocator keeps trees at 4 and 8
        requests that run ~2x a plain step (goose-b4 at c = 4: 10.9 of 48 ms per step, cProfile).

        Each shape (Rt tree requests of n star-shaped nodes over ``ctx`` context tokens) is
        timed on every attention layer's real KV cache (the plan's gather indices built afresh,
        as in a step), and becomes the sample ``(Rt, Rt + Rt n, Rt n, Rt n ctx, Rt, forward(Rt +
        Rt n) + tree time)``, the forward interpolated from the sweep."""
        from types import SimpleNamespace

        from vllm_anisotropic.integration.vllm.kernels.attention import TreeCPUAttentionImpl

        layers = [m for m in self.compilation_config.static_forward_context.values()
                  if isinstance(getattr(m, "impl", None), TreeCPUAttentionImpl) and getattr(m, "kv_cache", None) is not None
                  and m.kv_cache.dim() == 4 and hasattr(m, "isa")]
        if not layers:
            return []
        q_sizes = np.array([q for _, q, *_ in forwards], np.float64)
        q_secs = np.array([s for *_, s in forwards], np.float64)
        impl0 = layers[0].impl
        num_blocks, _, block_size, _ = layers[0].kv_cache.shape
        samples, timed = [], []
        for rt, n, ctx in self.TREE_COST_SHAPES:
            seq_len = ctx + n
            per_req = -(-seq_len // block_size)
            if rt * per_req > num_blocks:
                continue
            num_tokens = rt * (n + 1)
            query = torch.zeros(num_tokens, impl0.num_heads, impl0.head_size, dtype=self.model_config.dtype)
            kv_rows = torch.zeros(num_tokens, impl0.num_kv_heads, impl0.head_size, dtype=self.model_config.dtype)
            output = torch.zeros_like(query)
            md = SimpleNamespace(
                seq_lens=torch.full((rt,), seq_len, dtype=torch.int32),
                query_start_loc=torch.arange(0, num_tokens + 1, n + 1, dtype=torch.int32),
                block_table=torch.arange(rt * per_req, dtype=torch.int32).view(rt, per_req),
            )
            # every node a child of the root (each row sees itself), every row recomputed (chain 0)
            star = FlatTrees.from_trees([DraftTree(tokens=np.zeros(n + 1, np.int64), parents=[-1] + [0] * n)] * rt)
            times = []
            for _ in range(repeats + 1):
                plan = TreePlan(list(range(rt)), star, chain_prefix=np.zeros(rt, np.int64))
                t0 = time.perf_counter()
                for layer in layers:
                    layer.impl.tree_rows(layer, query, kv_rows, kv_rows, layer.kv_cache, md, plan, output)
                times.append(time.perf_counter() - t0)
            tree_s = float(np.median(times[1:]))
            q = rt + rt * n
            samples.append((rt, q, rt * n, rt * n * ctx, rt, float(np.interp(q, q_sizes, q_secs)) + tree_s))
            timed.append((rt, n, ctx, round(tree_s * 1e3, 2)))
        logger.info("vllm-anisotropic tree-row cost sweep (requests, nodes, context -> ms over %d layers): %s",
                    len(layers), timed)
        return samples
