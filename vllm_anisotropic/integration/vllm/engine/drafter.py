"""The worker-side tree drafter: per-request proposer state and the step's trees as flat arrays.

Scope: bookkeeping between vLLM's flat draft lists and our trees. The tree runner
(``runner.py``) calls it at three points of a step, each on the whole batch at once:

1. ``propose_trees`` after the step's bookkeeping (where vLLM runs ``custom_class``
   proposers): the next trees of every eligible request as one ``FlatTrees`` (GOOSE: one batched
   proposal, ``goose.propose_spine_trees``; other proposers one tree per request, packed), ranked
   by the acceptance model (``allocator.rank_flat``); vLLM gets each tree's non-root tokens in
   value order.
2. ``take_step`` in the next step's ``_prepare_inputs``: vLLM may schedule only a prefix of each
   list (token budget, ``max_model_len``, the allocator's cut); the pending trees are cut to it
   (``FlatTrees.prefix``: value order makes every prefix a subtree) and checked against it.
   The result (``StepTrees``) is what the positions, the attention plan and the walk read.
3. ``observe_step`` after verification: the metrics now; the learning (adjacency-table
   harvest from one top-k over the verified rows the tables keep, the spine-acceptance EMA) after the step's
   reply (``run_deferred``), so the next tree is proposed from the tables as they were one step
   earlier.

State lives per request (``Proposer.new_request(tenant)``, the tenant being the request's
``cache_salt``), created at the first proposal and dropped when the request finishes or is
aborted (``drop``); a preempted request keeps its proposer state but loses its pending tree
(``drop_tree``).

Example: pending tree tokens ``[r, 5, 9, 7]`` parents ``[-1, 0, 0, 1]`` -> vLLM draft list
``[5, 9, 7]``; vLLM schedules ``[5, 9]`` -> verified tree tokens ``[r, 5, 9]`` parents
``[-1, 0, 0]``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from vllm_anisotropic import kernels as _kernels
from vllm_anisotropic.allocator import AcceptanceConfig, AcceptanceModel, rank_flat
from vllm_anisotropic.integration.vllm.frontdoor.config import TreeSpecConfig
from vllm_anisotropic.integration.vllm.kernels.cpu_draft import use_vllm_cpu_layers, warm_up
from vllm_anisotropic.integration.vllm.kernels.cpu_gemm import BUCKETS, resolve_quantization, use_vllm_cpu_gemm
from vllm_anisotropic.integration.vllm.engine.faults import inject, report, tp_size
from vllm_anisotropic.integration.vllm.engine.faults import tp_rank as _tp_rank
from vllm_anisotropic.integration.vllm.engine.host_clock import HostClock, timed
from vllm_anisotropic.integration.vllm.engine.labels import LabelQueue
from vllm_anisotropic.integration.vllm.engine.metrics import MetricsSink, TreeMetrics
from vllm_anisotropic.proposers import DraftTreeProposer, get_proposer, proposer_config
from vllm_anisotropic.proposers.adjacency import TopKRows, topk_scores
from vllm_anisotropic.proposers.base import MODE_CODES, ProposalMode, RequestState
from vllm_anisotropic.tree import DraftTree, FlatTrees

logger = logging.getLogger(__name__)

__all__ = ["TreeDrafter", "StepTrees"]

OFFER_MIN_DRAFTS = 8  # the smallest draft list offered while the allocator keeps few nodes
OFFER_MEMORY = 0.8  # per-step decay of a request's recent-kept high-water mark
ACCEPTANCE_REFIT_EVERY = 16  # verified steps between refits of the acceptance model
# proposals between labelling passes: the trees that wait for their labels are taken in one
# pass every few steps (one call's fixed cost for several steps' trees; a tree needs up to
# label_depth more tokens anyway); the label of a tree whose request finishes in between is lost
LABEL_EVERY = 4
_PLAIN = MODE_CODES[ProposalMode.PLAIN]


@dataclass
class _Proposal:
    """Trees proposed after one step; each waits for a step that schedules its request."""

    trees: FlatTrees
    probs: np.ndarray | None  # [num_nodes] calibrated P(on the accepted path), roots 1; None: not ranked
    prev_roots: np.ndarray  # [R] int64 token before each root (the root's bigram key), -1: none
    modes: np.ndarray  # [R] int8 proposal modes (base.MODE_CODES)
    chains: bool  # a chain step's chains: verified without harvesting their rows
    void: bool = False  # another rank's drafts this rank has no tree for (``_void``)


@dataclass
class StepTrees:
    """The trees one step verifies, in batch-row order (``TreeDrafter.take_step``).

    ``rows[t]`` is tree t's batch row; ``trees`` holds each tree cut to what vLLM scheduled
    (root-only trees of tree steps included: their root row is harvested); ``req_ids[t]`` its
    request."""

    req_ids: list[str]
    rows: np.ndarray  # [T] int64
    trees: FlatTrees
    prev_roots: np.ndarray  # [T] int64
    modes: np.ndarray  # [T] int8
    chains: np.ndarray  # [T] bool: a chain step's chain (verified, its rows not harvested)
    node_rows: np.ndarray | None = None  # [T] query row of each tree's node 1 (set by the runner)
    root_positions: np.ndarray | None = None  # [T] position of each root (set by the runner)
    # [T] bool: scheduled drafts this rank had no tree for (tensor parallelism, ``_void``):
    # verified by no rank, never observed; None: none
    void: np.ndarray | None = None

    def select(self, index: np.ndarray) -> "StepTrees":
        """Trees ``index`` (ascending) of the step, with their rows and node rows."""
        pick = lambda a: None if a is None else a[index]  # noqa: E731
        return StepTrees([self.req_ids[t] for t in index.tolist()], self.rows[index], self.trees.select(index),
                         self.prev_roots[index], self.modes[index], self.chains[index], pick(self.node_rows),
                         pick(self.root_positions), pick(self.void))


class TreeDrafter:
    """Built by the tree runner through vLLM's ``custom_class`` path: ``cls(vllm_config)``."""

    tp_size = 1  # the tensor-parallel world size (set in __init__)

    def __init__(self, vllm_config) -> None:
        spec = vllm_config.speculative_config
        # During construction vLLM's config reads method "custom_class"; the real method is
        # stored with the tunables in additional_config (patches.py / config.py).
        stored = (vllm_config.additional_config or {}).get("vllm_anisotropic") or {}
        method = stored.get("method") or spec.method
        self.config = TreeSpecConfig.from_additional_config(method, vllm_config.additional_config)
        vocab_size = vllm_config.model_config.get_vocab_size()
        name, options = self.config.proposer_name, self.config.proposer_options
        if name == "draft_tree":  # q on the worker's device, in the target's dtype, unless the config names them
            self.proposer = DraftTreeProposer(proposer_config(name, **options), vocab_size,
                                              device=vllm_config.device_config.device,
                                              dtype=vllm_config.model_config.dtype)
        else:
            self.proposer = get_proposer(name, vocab_size=vocab_size, **options)
        if isinstance(self.proposer, DraftTreeProposer):
            # q's decoder layers on vLLM's CPU kernels where it can (cpu_draft.py), its other
            # linears (the output head; all of them otherwise) through vLLM's CPU GEMM (cpu_gemm.py)
            from vllm.platforms import current_platform

            quantization = resolve_quantization(self.proposer.config.draft_quantization, current_platform.is_cpu())
            selector = self.proposer.selector
            if selector is not None and selector.draft_quantization != quantization:
                logger.warning("draft_tree: selector %s was timed with q in %r; q runs in %r here (its shapes may "
                               "pay less: docs/selector.md)", self.proposer.config.selector,
                               selector.draft_quantization, quantization)
            fused = use_vllm_cpu_layers(self.proposer.lm, quantization)
            use_vllm_cpu_gemm(self.proposer.lm.model, quantization)
            if fused:
                logger.info("draft model: GEMMs warmed up at %d row counts in %.1f s", len(BUCKETS),
                            warm_up(self.proposer.lm))
        self.max_draft_tokens: int = int(spec.num_speculative_tokens)
        self.max_model_len: int = int(vllm_config.model_config.max_model_len)
        self.tp_size = tp_size()  # > 1: take_step leaves another rank's drafts void rather than raise
        self.states: dict[str, RequestState] = {}
        # req_id -> vLLM cache_salt of requests that have one (scheduler.TreeScheduler.schedule):
        # the tenant whose adjacency table the request reads and feeds
        self.tenants: dict[str, str] = {}
        # req_id -> (the proposal holding its next tree, the tree's index there): kept until a
        # step schedules the request (one that is not scheduled meanwhile keeps its drafts)
        self.pending: dict[str, tuple[_Proposal, int]] = {}
        # req_id -> kept draft nodes of its pending tree after its grammar pruned it (the
        # scheduler's ``tree_kept``, tree_grammar.py): that tree's kept nodes go first in take_step
        self.reorders: dict[str, list[int]] = {}
        # requests the measured gate rested (``rest``) since they last drafted: a draft model's
        # catch-up when they draft again is a resume, counted in neither of the gate's arms
        self.rested: set[str] = set()
        self.chain_drafts = int(self.config.engine.allocator_chain_drafts)
        # budget allocator (budget.py): calibrated P(node on the accepted path) of each pending
        # tree's draft list, learned from every offered tree; None when the allocator is off
        self.acceptance = (AcceptanceModel(AcceptanceConfig(refit_every=ACCEPTANCE_REFIT_EVERY))
                           if self.config.engine.allocator == "auto" else None)
        # every offered tree, cut or not, is labelled from the tokens that follow its root once
        # they are known (labels.py), up to the acceptance model's depth buckets
        self.label_depth = self.acceptance.config.max_depth if self.acceptance is not None else 0
        self.unlabelled = LabelQueue(self.label_depth)
        self._proposals = 0  # propose_trees calls (labelling runs every LABEL_EVERY)
        # backoff while the allocator keeps cutting a request's tree to nothing: after the
        # k-th zero cut in a row the request skips min(2**(k-1), allocator_backoff) proposals (no
        # tree, no harvest: plain decoding at plain decoding's host cost), then offers again
        self.zero_streak: dict[str, int] = {}
        self.skip: dict[str, int] = {}
        self.max_backoff = int(self.config.engine.allocator_backoff)
        # what the allocator has been keeping per request: a high-water mark of the scheduled
        # draft counts that decays by OFFER_MEMORY a step. The next tree is built with at most
        # max(OFFER_MIN_DRAFTS, allocator_offer_factor x mark) drafts: nodes the allocator would
        # cut cost proposal time (the tree build, the probabilities) and buy nothing
        self.offer_factor = float(self.config.engine.allocator_offer_factor) if self.acceptance is not None else 0.0
        self.kept_mark: dict[str, float] = {}
        # learning from verified rows waiting to run (observe_step -> run_deferred): (its host-clock
        # phase, the requests it concerns, the work)
        self._deferred: list[tuple[str, list[str], object]] = []
        # requests whose trees are off after a contained fault of any stage (``contain``,
        # faults.py): no more trees for them (plain decoding's output)
        self.disabled: set[str] = set()
        # tree counters -> stats file (VLLM_ANISOTROPIC_TREE_STATS), /metrics and the log (metrics.py)
        self.metrics = TreeMetrics()
        if isinstance(self.proposer, DraftTreeProposer):
            self.metrics.draft_quantization = quantization
            self.metrics.selector_shapes = self.proposer.shape_counts  # the proposer counts, the sink writes
        self.sink = MetricsSink(self.metrics, rank=_tp_rank())
        self.host_clock = HostClock()  # the worker's host work per phase (host_clock.py)

    # ------------------------------------------------------------------ vLLM custom_class API
    def propose(self, *args, **kwargs):
        """vLLM's chain ``propose`` is not used: the tree runner calls ``propose_trees``."""
        raise RuntimeError("TreeDrafter runs only inside vllm-anisotropic's tree model runner")

    def load_model(self, *args, **kwargs) -> None:
        """No draft model: drafts come from the context and the target's own logits."""

    def warm_up(self, token_dtype=np.int32, logits_dtype=torch.float32, vocab_size: int | None = None,
                cpu_logits: bool = True) -> None:
        """Load the step's compiled kernels of the workers' side now, at the worker's start
        (after vLLM's start-up scan, which must not meet numba: ``kernels``), not in the first
        tree steps, where the whole batch waits: the proposal (not draft_tree's: q is loaded
        with its proposer), the allocator's ranking (``rank_flat``) and offers, the harvest's
        top-k over logits rows of the model's dtype (``logits_dtype``, CPU), the table update it
        feeds, the label queue (``kernels.label``) and the acceptance model's refit
        (``kernels.fit``; it compiled at the first labels, mid-batch, ~0.7 s), and GOOSE's
        cross-request store (``kernels.store``). Measured in vLLM (SmolLM2-135M,
        16 requests, 2-core Xeon): a first tree step with the ranking, top-k and table update
        not loaded took 6.1 s with numba's disk cache empty and 0.3 s with it filled. One
        throwaway proposal, ranking and learning with a throwaway proposer of the same
        configuration over a token array of vLLM's dtype (``token_dtype``; draft_tree: ranking
        and labels of a stand-in tree); nothing of it is kept."""
        if getattr(self.proposer, "propose_batch", None) is None:
            return  # nothing compiled to load
        t0 = time.perf_counter()
        tokens = np.tile(np.arange(8, dtype=token_dtype), 8).reshape(1, -1)
        proposer = state = out = None
        if isinstance(self.proposer, DraftTreeProposer):
            # q is loaded with the proposer (a throwaway one would load it again); the kernels
            # around it run on a stand-in tree: a trunk of two and a branch (without them its
            # first tree steps compiled the ranking, offers, labels and refit, ~4.7 s in two
            # steps with numba's disk cache empty, which closed the gate at one request)
            trees = FlatTrees.from_trees([DraftTree(tokens=np.arange(4, dtype=np.int64), parents=[-1, 0, 1, 0])])
        else:
            vocab_size = vocab_size or self.proposer.vocab_size
            proposer = type(self.proposer)(self.proposer.config, vocab_size)
            state = proposer.new_request()
            out = proposer.propose_batch([state], tokens, np.zeros(1, np.int64), np.array([tokens.shape[1]], np.int64))
            trees = out.trees
            if getattr(state, "store", None) is not None:  # the cross-request store's update and lookup (kernels.store)
                state.finish(tokens[0])
                alone = np.arange(16, dtype=token_dtype).reshape(1, -1)  # no match of its own: the store is asked
                proposer.propose_batch([proposer.new_request()], alone, np.zeros(1, np.int64), np.array([16], np.int64))
        if self.acceptance is not None and trees.num_nodes > 1:
            trees, _ = rank_flat(trees, self.acceptance)
        self._offers(["warm-up"], np.ones(1, np.int64))  # the offers' kernel (kernels.allocate.offer_budgets)
        learn = getattr(proposer, "learn_batch", None)
        if learn is not None:  # its keys and spine counts, and the harvest's top-k and table update
            top = None
            k = state.harvest_top_k or 0
            if k and vocab_size:
                logits = torch.zeros((trees.num_nodes, vocab_size), dtype=logits_dtype)
                top = functools.partial(TopKRows.of, logits, k)
                if cpu_logits:  # the top-k on one thread and on threads (kernels.split); a GPU's runs on the device
                    for rows in (1, 16):
                        topk_scores(torch.zeros((rows, vocab_size), dtype=logits_dtype), k)
            learn([state], trees, np.zeros(trees.num_nodes, bool), out.prev_roots, top)
        if self.acceptance is not None:  # the label queue's kernels and the refit (kernels.fit, ~0.7 s to compile)
            model = type(self.acceptance)(self.acceptance.config)
            queue = LabelQueue(self.label_depth)
            queue.offer(trees, np.arange(trees.num_trees), ["warm-up"] * trees.num_trees, np.zeros(trees.num_trees, np.int64))
            histograms = queue.take(["warm-up"], np.full(1, tokens.shape[1], np.int64), tokens, model.config)
            if histograms is not None:
                model.add(histograms)
            model.update(np.ones(2, np.int64), np.ones(2, np.int64), np.array([0.5, 0.5]), np.array([True, False]))
            model.parameters()
        logger.debug("vllm-anisotropic: proposer kernels loaded in %.2f s", time.perf_counter() - t0)

    # ------------------------------------------------------------------ pending trees
    def pending_probs(self, req_ids: Sequence[str]) -> list:
        """Per request, its pending tree's draft-node probabilities (the allocator's input), or
        None (no tree, or a chain step's chain: nothing ranks it)."""
        out = []
        for r in req_ids:
            entry = self.pending.get(r)
            if entry is None or entry[0].probs is None:
                out.append(None)
                continue
            p, k = entry
            out.append(p.probs[p.trees.offsets[k] + 1:p.trees.offsets[k + 1]])
        return out

    def pending_chains(self, req_ids: Sequence[str]) -> list[int]:
        """Per request, the leading chain of its pending tree (0: none)."""
        out = []
        for r in req_ids:
            entry = self.pending.get(r)
            out.append(0 if entry is None else int(entry[0].trees.chain_prefix()[entry[1]]))  # cached on the trees
        return out

    def pending_parents(self, req_ids: Sequence[str]) -> dict[str, list[int]]:
        """Per request, its pending tree's draft-node parents (local, 0: the root; empty: no tree)."""
        out = {}
        for r in req_ids:
            entry = self.pending.get(r)
            if entry is None:
                out[r] = []
            else:
                p, k = entry
                out[r] = p.trees.parents[p.trees.offsets[k] + 1:p.trees.offsets[k + 1]].tolist()
        return out

    # ------------------------------------------------------------------ step protocol
    def propose_trees(
        self,
        req_ids: Sequence[str],
        eligible: Sequence[bool],
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,  # [max_num_reqs]
        token_ids_cpu: np.ndarray,  # [max_num_reqs, max_model_len]
        laws: Sequence | None = None,
        chains: bool = False,
        repay: float | None = None,
        remaining: Sequence[int] | None = None,
    ) -> list[list[int]]:
        """One draft list per batch row: the non-root tokens of the request's new tree.

        ``laws``: per batch row, ``(TargetSampling, seed)`` of the request (the runner's
        ``request_law``), read when a proposer that samples from a draft model creates the
        request's state (``DraftTreeState.set_sampling``); None: greedy.
        ``chains``: the measured gate chose a chain step (``allocator.gate``): each request's
        chain alone (``propose_chain``, at most ``allocator_chain_drafts`` tokens), not ranked,
        not labelled, and its verified rows not harvested (``observe_step``); a request whose
        chain is the root alone gets no pending tree (a plain row); the backoff neither applies
        nor counts.
        ``repay``: the catch-up tokens one output token repays at this batch size (the
        scheduler's ``tree_repay``), with ``remaining``, per batch row, the output tokens the
        request may still emit: a draft model catches a request up only where they cover it
        (``draft_batch``, "Repay"); None: no such rule."""
        inject("propose")
        self._proposals += 1
        if self.unlabelled and self._proposals % LABEL_EVERY == 0:
            # after the reply with the other learning: the batch's token rows stay as they are
            # until the next step's _update_states, which runs the deferred work first
            ids = list(req_ids)
            self._deferred.append(("label", ids, functools.partial(
                self._label, ids, num_tokens_no_spec[: len(ids)].astype(np.int64), token_ids_cpu)))  # a copy
        drafting = self._drafting_rows(req_ids, eligible, sampled_token_ids, chains)
        self.proposer.begin_step(len(drafting), len(req_ids))
        if not drafting:
            return [[] for _ in req_ids]
        rows = np.asarray(drafting, np.int64)
        lengths = np.asarray(num_tokens_no_spec[rows], np.int64)
        ids = [req_ids[i] for i in drafting]
        states = self._states_of(drafting, ids, laws)
        if self.rested:  # a draft model's catch-up after the gate's rest is a resume (draft_batch)
            for r, state in zip(ids, states):
                if r in self.rested and hasattr(state, "resuming"):
                    state.resuming = True
            self.rested.difference_update(ids)
        if hasattr(self.proposer, "repay"):  # a draft model: its long catch-ups must repay (draft_batch)
            self.proposer.repay = repay if remaining is not None else None
            if remaining is not None:
                for i, state in zip(drafting, states):
                    state.remaining = int(remaining[i])
        room = np.maximum(np.minimum(self.max_draft_tokens, self.max_model_len - lengths - 1), 0)
        trees, modes, prev_roots = self._propose(states, ids, token_ids_cpu, rows, lengths, room, chains)
        self._count_draft_kv()
        cap = getattr(self.proposer, "max_tree_nodes", None)  # a proposer's guaranteed bound: cut only near the end
        if cap is None or int(room.min()) + 1 < cap:
            trees = trees.prefix(room + 1)
        if trees.draft_probs is not None and self.acceptance is not None:
            # sampled draft-model trees: the allocator's probabilities (and any reordering by
            # them) depend on the tree's shape and the acceptance model alone, never on the
            # sampled tokens (a cut that looked at the samples would break the i.i.d. branches
            # the multi-draft verifiers assume, docs/verifiers.md)
            trees = FlatTrees(trees.offsets, trees.tokens, trees.parents, trees.sources, np.ones(trees.num_nodes),
                              trees.depths, trees.multiplicity, trees.draft_probs)
        probs = None
        if self.acceptance is not None and not chains:
            trees, probs = rank_flat(trees, self.acceptance)
            offered = np.flatnonzero(trees.sizes() > 1)
            self.unlabelled.offer(trees, offered, [ids[k] for k in offered.tolist()], lengths[offered])
        proposal = _Proposal(trees, probs, prev_roots, modes, chains)
        pending = range(len(ids))
        if chains:
            # a chain step's request without a draft (no context match) stays a plain row: no
            # tree pending, so nothing in the reply, the step's inputs or its harvest (a chain's
            # rows are not harvested, and GOOSE learns nothing from a chain without nodes);
            # counted now as its verified root-only tree would be
            alone = trees.sizes() == 1
            if alone.any():
                pending = np.flatnonzero(~alone).tolist()
                self.metrics.record_root_only(modes[alone], [ids[k] for k in np.flatnonzero(alone).tolist()],
                                              self.sink.trace)
        for k in pending:
            self.pending[ids[k]] = (proposal, k)
        tokens = trees.tokens.tolist()
        offsets = trees.offsets.tolist()
        out: list[list[int]] = [[] for _ in req_ids]
        for k, i in enumerate(drafting):
            out[i] = tokens[offsets[k] + 1:offsets[k + 1]]
        return out

    def reserve_draft_kv(self, available: int, target_bytes_per_token: float, device) -> int:
        """What vLLM may give the target's KV cache out of ``available`` bytes of ``device`` (the
        worker's) once q's KV is reserved (draft_tree; other methods reserve nothing):
        ``draft_kv_bytes``, or by default the share in which q holds as many tokens as the
        target's cache. The reserve becomes q's KV bound (``draft_kv.DraftKV``). q on the host beside a GPU worker (``draft_device`` "cpu")
        takes nothing from the device; ``draft_kv_bytes``, if given, still bounds it."""
        if not isinstance(self.proposer, DraftTreeProposer):
            return available
        lm = self.proposer.lm
        reserve = self.proposer.config.draft_kv_bytes
        if lm.device.type != torch.device(device).type:
            self.proposer.kv_bound = reserve
            self.metrics.draft_kv_bound_bytes = int(reserve or 0)
            logger.info("draft_tree: the draft model's KV is on %s, nothing reserved out of %s's KV memory "
                        "(bound: %s)", lm.device, device, reserve)
            return available
        if reserve is None:
            reserve = int(available * lm.kv_bytes_per_token / (lm.kv_bytes_per_token + target_bytes_per_token))
        if reserve >= available:
            raise ValueError(f"draft_tree: draft_kv_bytes {reserve} leaves nothing of the {available} bytes vLLM "
                             f"has for the KV cache; give a smaller draft_kv_bytes, or more KV memory")
        self.proposer.kv_bound = self.metrics.draft_kv_bound_bytes = int(reserve)
        logger.info("draft_tree: %.1f MiB of the %.1f MiB of KV memory reserved for the draft model's KV "
                    "(%d bytes a token; the target's %.0f)", reserve / 2**20, available / 2**20,
                    lm.kv_bytes_per_token, target_bytes_per_token)
        return available - reserve

    def _drafting_rows(self, req_ids, eligible, sampled_token_ids, chains: bool) -> list[int]:
        """Batch rows that draft this step; every row's old pending tree is dropped. Not
        drafting: no sampled token (a partial prefill chunk or a discarded request), not
        eligible, trees turned off after a fault, or skipping under the zero-cut backoff."""
        drafting = []
        for i, r in enumerate(req_ids):
            self.pending.pop(r, None)  # the batch's old trees are gone: a new one or none
            if self.reorders:
                self.reorders.pop(r, None)
            if sampled_token_ids[i] and eligible[i] and r not in self.disabled:
                if chains or self.skip.get(r, 0) <= 0:
                    drafting.append(i)
                else:
                    self.skip[r] -= 1
        return drafting

    def _states_of(self, drafting: list[int], ids: list[str], laws) -> list:
        """The proposer state of each drafting request, created on its first proposal (with its
        sampling law where the proposer samples from a draft model)."""
        states = []
        for i, r in zip(drafting, ids):
            state = self.states.get(r)
            if state is None:
                state = self.states[r] = self.proposer.new_request(self.tenants.get(r))
                if laws is not None and laws[i] is not None and hasattr(state, "set_sampling"):
                    state.set_sampling(*laws[i])
                self.metrics.live_requests = len(self.states)
                self._count_tables()
            states.append(state)
        return states

    def _propose(self, states, ids, token_ids_cpu, rows, lengths, room, chains):
        """(trees, modes, prev_roots) of the drafting requests: one batched call when the
        proposer has one (GOOSE), else one ``propose`` per request."""
        if chains:
            limits = np.minimum(self.chain_drafts, room)
        offers = None if chains else self._offers(ids, room)
        batch = getattr(self.proposer, "propose_batch", None)
        if batch is not None:
            out = batch(states, token_ids_cpu, rows, lengths, offers, limits if chains else None)
            return out.trees, out.modes, out.prev_roots
        trees, modes = [], []
        for k, state in enumerate(states):
            context = token_ids_cpu[rows[k], :lengths[k]]
            if chains:
                tree = state.propose_chain(context, int(limits[k]))
            else:
                tree = state.propose(context, None if offers is None or offers[k] <= 0 else int(offers[k]))
            trees.append(tree)
            modes.append(MODE_CODES.get(getattr(getattr(state, "last_info", None), "mode", None), _PLAIN))
        prev_roots = np.where(lengths >= 2, token_ids_cpu[rows, np.maximum(lengths - 2, 0)], -1).astype(np.int64)
        return FlatTrees.from_trees(trees), np.asarray(modes, np.int8), prev_roots

    def _offers(self, ids, room) -> np.ndarray | None:
        """Node budgets (root included) of the next proposals, 0 = the proposer's own: at most
        max(OFFER_MIN_DRAFTS, allocator_offer_factor x the request's kept mark) drafts."""
        if not self.offer_factor:
            return None
        marks = np.fromiter((self.kept_mark.get(r, -1.0) for r in ids), np.float64, len(ids))
        out = np.empty(len(ids), np.int64)
        _kernels.load("allocate").offer_budgets(marks, np.asarray(room, np.int64), self.offer_factor, OFFER_MIN_DRAFTS,
                                                out)
        return out

    def _offer(self, req_id: str, room: int) -> int | None:
        """Node budget (root included) of ``req_id``'s next proposal; None = the proposer's own."""
        out = self._offers([req_id], np.array([room]))
        return None if out is None or out[0] <= 0 else int(out[0])

    def rest(self, req_ids: Sequence[str]) -> list[list[int]]:
        """No drafts for the next step (the scheduler's measured gate keeps it plain): no tree,
        no scoring, no labelling; the adjacency tables harvest nothing until drafting resumes
        (a plain step then costs what plain decoding costs). Offered trees waiting for their
        labels keep waiting: the tokens they need stay in the request's context. The requests
        are marked rested: a draft model's catch-up when they draft again is a resume."""
        for r in req_ids:
            self.pending.pop(r, None)
        self.rested.update(req_ids)
        return [[] for _ in req_ids]

    def _label(self, req_ids, num_tokens_no_spec, token_ids_cpu) -> None:
        """Feed the acceptance model every offered tree whose next ``label_depth`` tokens (or as
        many as its depth) are now known, labelled from those tokens (``labels.LabelQueue``,
        ``allocator.flat_continuation_labels``): verified or cut, every node teaches the model."""
        histograms = self.unlabelled.take(req_ids, num_tokens_no_spec, token_ids_cpu, self.acceptance.config)
        if histograms is not None:
            self.acceptance.add(histograms)
            self.acceptance.parameters()  # a due refit here, not in the next proposal's ranking

    def take_step(self, req_ids: Sequence[str], scheduled: dict) -> StepTrees | None:
        """The pending trees of the batch's requests (``req_ids`` in batch-row order), each cut
        to its ``scheduled`` draft prefix (vLLM's ``scheduled_spec_decode_tokens``), or None.

        Scheduled tokens that are not a prefix of a tree's draft list, or drafts for a request
        without a pending tree: with one rank a bookkeeping bug, and it raises (verifying it as
        a tree would be wrong); under tensor parallelism also what a fault on this rank alone
        leaves behind (the drafts are rank 0's), so the request gets a *void* tree (its drafts
        as a chain, ``StepTrees.void``) that no rank verifies (``faults.agree``, in the sampler)."""
        rows, entries, lists = [], [], []
        for i, r in enumerate(req_ids):
            entry = self.pending.pop(r, None)
            drafts = scheduled.get(r, ())
            if entry is None:
                if not drafts:
                    continue
                if self.tp_size == 1:
                    raise RuntimeError(f"request {r}: {len(drafts)} drafts scheduled but no tree pending")
                entry = _void(drafts)
            elif self.reorders and (kept := self.reorders.pop(r, None)) is not None:
                entry = _kept_first(*entry, kept)
            rows.append(i)
            entries.append(entry)
            lists.append(drafts)
        if not entries:
            return None
        counts = np.fromiter((len(d) for d in lists), np.int64, len(lists))
        trees, prev_roots, modes, offered, chains = _gather(entries)
        cut, bad = _scheduled_prefixes(trees, counts, lists)
        if bad is not None:
            t = int(np.flatnonzero(bad)[0])
            if self.tp_size == 1:
                sizes = trees.sizes()
                if counts[t] > sizes[t] - 1:
                    raise RuntimeError(f"request {req_ids[rows[t]]}: {counts[t]} drafts scheduled, its tree has "
                                       f"{sizes[t] - 1}")
                raise RuntimeError(
                    f"request {req_ids[rows[t]]}: scheduled drafts {list(lists[t])[:8]}... are not a prefix of the "
                    f"pending tree's draft list {trees.tree(t).tokens[1:9].tolist()}...")
            for t in np.flatnonzero(bad).tolist():
                entries[t] = _void(lists[t])
            trees, prev_roots, modes, offered, chains = _gather(entries)
            cut = trees.prefix(counts + 1)
        void = np.fromiter((p.void for p, _ in entries), bool, len(entries))
        trees = cut
        if self.acceptance is not None:
            live = np.flatnonzero(~void)
            self._kept(req_ids, [rows[t] for t in live.tolist()], offered[live], counts[live].tolist())
        return StepTrees([req_ids[i] for i in rows], np.asarray(rows, np.int64), trees, prev_roots, modes, chains,
                         void=void if void.any() else None)

    def _kept(self, req_ids, rows, offered, counts) -> None:
        """The allocator's cut of each offered tree: the kept marks (the next offer) and the
        backoff after zero cuts."""
        for i, size, n in zip(rows, offered.tolist(), counts):
            if size <= 1:
                continue
            r = req_ids[i]
            self.kept_mark[r] = max(float(n), OFFER_MEMORY * self.kept_mark.get(r, 0.0))
            if n == 0:
                streak = self.zero_streak[r] = self.zero_streak.get(r, 0) + 1
                self.skip[r] = min(2 ** (streak - 1), self.max_backoff)
            else:
                self.zero_streak.pop(r, None)

    @timed("harvest")
    def observe_step(self, step: StepTrees, accepted: np.ndarray, num_accepted: np.ndarray, row_starts: np.ndarray,
                     logits: torch.Tensor, on_path: np.ndarray | None = None) -> None:
        """After verification: count the step's trees now, learn from them after the reply.

        ``accepted`` ``[T, max_depth]`` local node indices of each tree's accepted path (-1
        padded; root-only trees: none), ``num_accepted`` ``[T]``; tree t's ``num_nodes`` logits
        rows start at ``row_starts[t]`` (row j after node j's path); ``on_path``: the accepted
        paths' nodes when the caller marked them (``FlatTrees.path_mask``; None: marked here).
        The rows the harvesting proposers read are kept (CUDA: copied on the device now, their
        memory back to vLLM's allocator; CPU: the step's logits tensor is held and its rows read
        in place, nothing writing it after the sampler); the top-k of them, the stats file, the
        table updates and the EMA run later (``run_deferred``): right after the worker's reply,
        while the scheduler process cuts and schedules the next step (``patches.py`` patch 7,
        multiprocess executors), or else at the start of the next step
        (``runner.TreeRunnerMixin._update_states``), in both cases before anything else of the
        next step: the same order on every tensor-parallel rank and in every executor. The next
        proposal therefore does not see this step's rows yet (one step of lag in the adjacency
        table and the spine EMA; drafts only, never outputs)."""
        trees = step.trees
        if on_path is None:
            on_path = trees.path_mask(accepted, num_accepted)
        self.metrics.record_step(trees, on_path, num_accepted, step.modes, step.req_ids, self.sink.trace)
        # the stats file, at most once a second: after the reply, a phase of its own
        self._deferred.append(("stats", (), self.sink.tick))
        states = [self.states.get(r) for r in step.req_ids]
        harvest = ~step.chains
        k = max((st.harvest_top_k or 0 for st, h in zip(states, harvest.tolist()) if st is not None and h), default=0)
        picked = index = None
        if k:  # every harvested tree's rows (root rows included), tree by tree
            index = np.empty(trees.num_nodes, np.int64)
            num_rows = _kernels.load("emit").harvest_rows(np.asarray(row_starts, np.int64), trees.offsets, harvest,
                                                          index)
            index = index[:num_rows]
            if logits.device.type == "cpu":
                # read in place by the deferred top-k: after the sampler nothing writes a step's
                # logits, and the next step's are a new tensor (a copy cost ~0.37 ms a step at
                # 72 bf16 rows of 49,152)
                picked = logits
            else:  # a device copy: the logits' memory goes back to vLLM's allocator
                picked, index = logits.index_select(0, torch.from_numpy(index).to(logits.device)), None
        self._deferred.append(("harvest", step.req_ids, functools.partial(
            self._learn, states, trees, on_path, accepted, num_accepted, step.prev_roots,
            harvest if k else np.zeros_like(harvest), picked, index, k)))

    def _learn(self, states, trees: FlatTrees, on_path, accepted, num_accepted, prev_roots, harvest, picked, index,
               k) -> None:
        """The proposer's learning from a step's trees, with the top-k of their rows (rows
        ``index`` of ``picked``, None: all of them; those of the trees with ``harvest``):
        batched when the proposer has ``learn_batch`` (GOOSE), which asks for the rows its
        tables keep, else one top-k of every row and each state's ``observe``; the other trees'
        states learn without rows."""
        inject("harvest")

        def rows(nodes: np.ndarray | None) -> TopKRows:  # positions among the harvested trees' nodes (None: all)
            t0 = time.perf_counter()
            top = TopKRows.of(picked, k, index if nodes is None else nodes if index is None else index[nodes])
            self.host_clock.add("topk", time.perf_counter() - t0)  # the vocabulary pass (device work on a GPU)
            return top

        learn = getattr(self.proposer, "learn_batch", None)
        if learn is not None:
            if harvest.all() or not harvest.any():
                learn(states, trees, on_path, prev_roots, rows if picked is not None else None)
                return
            for part, part_rows in ((np.flatnonzero(harvest), rows), (np.flatnonzero(~harvest), None)):
                sub = trees.select(part)
                learn([states[t] for t in part.tolist()], sub, sub.path_mask(accepted[part], num_accepted[part]),
                      prev_roots[part], part_rows if picked is not None else None)
            return
        top = rows(None) if picked is not None else None
        offsets = trees.offsets.tolist()
        taken = 0
        for t, state in enumerate(states):
            n = offsets[t + 1] - offsets[t]
            tree_rows = top[taken : taken + n] if harvest[t] else None
            taken += n if harvest[t] else 0
            if state is not None:
                state.observe(trees.tree(t), accepted[t, : num_accepted[t]].tolist(), tree_rows,
                              prev_root=int(prev_roots[t]))

    def run_deferred(self) -> None:
        """Apply the learning ``observe_step`` left for later, oldest first."""
        if self._deferred:
            self._run_deferred()

    def _run_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        clock = self.host_clock
        for phase, req_ids, work in deferred:
            t0, topk0 = time.perf_counter(), clock.seconds.get("topk", 0.0)
            try:
                work()
            except Exception:  # noqa: BLE001 - contained: the requests decode on without trees
                report(logger, "harvest", req_ids)
                self.contain("harvest", req_ids, live=False)
            # the phase's own seconds (the top-k inside it has its own phase)
            clock.add(phase, time.perf_counter() - t0 - (clock.seconds.get("topk", 0.0) - topk0))

    def contain(self, stage: str, req_ids: Sequence[str], live: bool = True) -> None:
        """A contained fault of ``stage`` (faults.py) concerning ``req_ids``: counted, and those
        requests are proposed no more trees. A tree already proposed stays pending: its drafts
        may be with the scheduler already (a deferred harvest runs after the next proposal
        was sent), and a step that schedules them needs it. ``live``: the ids are requests of
        the current batch; else (deferred work) only those still holding proposer state, so
        that a finished request leaves no entry behind (``drop`` removes the others')."""
        ids = [r for r in req_ids if (live or r in self.states) and r not in self.disabled]
        self.disabled.update(ids)
        self.metrics.faults[stage] = self.metrics.faults.get(stage, 0) + 1
        self.metrics.disabled_requests += len(ids)

    def drop(self, req_id: str, context_tokens=None) -> None:
        """The request finished or was aborted (``context_tokens``: its prompt and output)."""
        state = self.states.pop(req_id, None)
        if state is not None:
            # its tokens go into the cross-request store after the step's reply, with the
            # harvests (``run_deferred``): ~0.2-0.6 ms a request, 64 at once when a batch finishes
            self._deferred.append(("finish", [req_id], functools.partial(
                state.finish, None if context_tokens is None else np.array(context_tokens))))
        self.tenants.pop(req_id, None)
        self.rested.discard(req_id)
        self._forget_pending(req_id)
        self.zero_streak.pop(req_id, None)
        self.skip.pop(req_id, None)
        self.kept_mark.pop(req_id, None)
        self.unlabelled.drop(req_id)
        self.disabled.discard(req_id)
        self.metrics.live_requests = len(self.states)
        if state is not None and isinstance(self.proposer, DraftTreeProposer):
            self.proposer.free_kv(state.session)  # its slot now (the deferred finish frees it again)
        self._count_draft_kv()
        if state is not None and not getattr(getattr(self.proposer, "config", None), "shared_table", True):
            self._count_tables()  # its own table is gone
        # at most once a second (~1 ms a write in the engine): the runner forces one when the
        # batch drains (``TreeRunnerMixin._update_states``)
        self.sink.tick()

    def _count_draft_kv(self) -> None:
        """draft_tree's KV gauges: what q's sessions hold, and the sessions dropped to the bound."""
        if isinstance(self.proposer, DraftTreeProposer):
            (self.metrics.draft_kv_bytes, self.metrics.draft_kv_peak_bytes,
             self.metrics.draft_kv_evictions) = self.proposer.kv_stats()

    def _count_tables(self) -> None:
        """The table gauges (at admission and finish, not per step): salted tenant tables held,
        the bytes of every adjacency table in use (tenants' and requests' own, each once), of
        the cross-request stores held, and the budget of both (``draft_state_bytes``)."""
        tables = getattr(self.proposer, "tables", None)
        self.metrics.tenant_tables = getattr(tables, "num_tenants", 0)
        self.metrics.state_budget_bytes = int(getattr(self.proposer, "state_budget", None) or 0)
        stores = getattr(self.proposer, "stores", None)
        self.metrics.store_bytes = sum(s.memory_bytes() for s in stores.all()) if stores is not None else 0
        self.metrics.table_bytes = sum(t.memory_bytes()["total"] for t in self._held_tables())

    def _held_tables(self) -> list:
        """Every adjacency table in use, each once: the tenants' and the requests' own."""
        tables = getattr(self.proposer, "tables", None)
        held = {id(t): t for t in (tables.all() if tables is not None else ())}
        for state in self.states.values():
            table = getattr(state, "table", None)
            if table is not None:
                held[id(table)] = table
        return list(held.values())

    def forget_writes(self) -> None:
        """Every adjacency table's refresh window starts over (``AdjacencyTable.forget_writes``):
        called by every tensor-parallel rank in the same step when the ranks' trees differ or a
        rank's verification failed (``sampler``, after ``faults.agree``). One rank's missed
        harvest would otherwise leave its windows out of step with the other ranks' for as
        long as a key recurs within them, and their trees differing."""
        for table in self._held_tables():
            table.forget_writes()

    def drop_tree(self, req_id: str) -> None:
        """The request was preempted: its pending drafts are gone, and a draft model's KV cache
        for it is freed (rebuilt from the context when it runs again)."""
        self._forget_pending(req_id)
        release = getattr(self.states.get(req_id), "release", None)
        if release is not None:
            release()
            self._count_draft_kv()

    def _forget_pending(self, req_id: str) -> None:
        self.pending.pop(req_id, None)
        self.reorders.pop(req_id, None)


def _kept_first(proposal: _Proposal, k: int, kept: list[int]) -> tuple[_Proposal, int]:
    """Tree ``k`` of ``proposal`` as a proposal of its own, its ``kept`` draft nodes (local
    indices, ascending, ancestor-closed) first and the others after them, each group in its old
    order (parents still precede children): the scheduled drafts of a grammar-pruned tree are a
    prefix of it. Draft nodes ``[1, 2, 3]``, kept ``[2]`` -> node order ``[0, 2, 1, 3]``."""
    tree = proposal.trees.select([k])
    n = tree.num_nodes
    mask = np.zeros(n, bool)
    mask[0] = True
    mask[np.asarray(kept, np.int64)] = True
    order = np.concatenate([np.flatnonzero(mask), np.flatnonzero(~mask)])
    probs = None if proposal.probs is None else proposal.probs[proposal.trees.offsets[k] + order]
    one = np.array([k])
    return _Proposal(tree.permuted(order), probs, proposal.prev_roots[one], proposal.modes[one], proposal.chains), 0


def _gather(entries: list) -> tuple:
    """The trees of ``entries`` (``(proposal, index)``, almost always of one proposal: the
    previous step's) in their order: ``(trees, prev_roots, modes, offered sizes, chains)``."""
    proposal = entries[0][0]
    if all(p is proposal for p, _ in entries):
        if len(entries) == proposal.trees.num_trees and all(k == t for t, (_, k) in enumerate(entries)):
            # every tree of the proposal, in its order (each request scheduled): as they are
            return (proposal.trees, proposal.prev_roots, proposal.modes, proposal.trees.sizes(),
                    np.full(len(entries), proposal.chains))
        index = np.fromiter((k for _, k in entries), np.int64, len(entries))
        return (proposal.trees.select(index), proposal.prev_roots[index], proposal.modes[index],
                proposal.trees.sizes()[index], np.full(len(entries), proposal.chains))
    trees = FlatTrees.concat([p.trees.select([k]) for p, k in entries])
    return (trees, np.array([p.prev_roots[k] for p, k in entries], np.int64),
            np.array([p.modes[k] for p, k in entries], np.int8), trees.sizes(),
            np.array([p.chains for p, _ in entries], bool))


def _scheduled_prefixes(trees: FlatTrees, counts: np.ndarray, lists: list) -> tuple[FlatTrees, np.ndarray | None]:
    """``(cut, bad)``: each tree cut to its first ``counts[t]`` draft nodes (at most all it has),
    and ``[T]`` bool: tree t has fewer draft nodes than ``counts[t]``, or its first ``counts[t]``
    draft tokens are not ``lists[t]``; ``bad`` None when every tree is fine (the common case).
    One compiled pass (``kernels.plan.scheduled_prefixes``); the trees are gathered only when a
    tree is cut, in a second (``gather_prefix``; ``FlatTrees.prefix`` where the trees carry
    multiplicities or draft laws)."""
    flat = np.fromiter(itertools.chain.from_iterable(lists), np.int64)
    keep = np.empty(trees.num_trees, np.int64)
    bad = np.empty(trees.num_trees, bool)
    plan = _kernels.load("plan")
    num_bad, cut = plan.scheduled_prefixes(trees.offsets, trees.tokens, counts, flat, keep, bad)
    bad = bad if num_bad else None
    if not cut:
        return trees, bad
    if trees.multiplicity is not None or trees.draft_probs is not None:
        return trees.prefix(keep), bad
    return FlatTrees(*plan.gather_prefix(trees.offsets, keep, trees.tokens, trees.parents, trees.sources, trees.values,
                                         trees.depths)), bad


def _void(drafts) -> tuple[_Proposal, int]:
    """A request's scheduled ``drafts`` as a chain below a placeholder root, marked void: the
    tree a rank takes where it has none of its own for them (tensor parallelism, ``take_step``)."""
    tree = DraftTree.chain(list(drafts))
    return _Proposal(FlatTrees.from_trees([tree]), None, np.array([-1], np.int64), np.array([_PLAIN], np.int8),
                     True, void=True), 0
