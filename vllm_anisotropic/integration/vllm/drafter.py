"""The worker-side tree drafter: per-request proposer state and the req_id -> tree side table.

Scope: bookkeeping between vLLM's flat draft lists and our ``DraftTree``s. The tree runner
(``runner.py``) calls it at three points of a step:

1. ``propose_trees`` after the step's bookkeeping (where vLLM runs ``custom_class``
   proposers): one ``DraftTree`` per eligible request from its context (prompt + output); the
   list handed to vLLM is the tree's non-root tokens in value order, ``tree.tokens[1:]``.
2. ``take_tree`` in the next step's ``_prepare_inputs``: vLLM may schedule only a prefix of
   that list (token budget, ``max_model_len``); the tree is cut with ``truncate(1 + n)``,
   which is a valid subtree because nodes are in parent-before-child value order.
3. ``observe_batch`` after verification: the logits of every verified node (root included) go
   to the proposer state (adjacency-table harvest, spine-acceptance EMA), applied after the
   step's reply (``run_deferred``), so the next tree is proposed from the tables as they were
   one step earlier.

State lives per request (``Proposer.new_request(tenant)``, the tenant being the request's
``cache_salt``), created at the first proposal and
dropped when the request finishes or is aborted (``drop``); a preempted request keeps its
proposer state but loses its pending tree (``drop_tree``).

Example: tree tokens ``[r, 5, 9, 7]`` parents ``[-1, 0, 0, 1]`` -> vLLM draft list
``[5, 9, 7]``; vLLM schedules ``[5, 9]`` -> verified tree tokens ``[r, 5, 9]`` parents
``[-1, 0, 0]``.
"""

from __future__ import annotations

import functools
import logging
from typing import Sequence

import numpy as np
import torch

from vllm_anisotropic.allocator import AcceptanceConfig, AcceptanceModel, continuation_labels, rank_trees
from vllm_anisotropic.integration.vllm.config import TreeSpecConfig
from vllm_anisotropic.integration.vllm.cpu_gemm import use_vllm_cpu_gemm
from vllm_anisotropic.integration.vllm.host_clock import HostClock, timed
from vllm_anisotropic.integration.vllm.metrics import MetricsSink, TreeMetrics
from vllm_anisotropic.proposers import DraftTreeProposer, get_proposer
from vllm_anisotropic.proposers.adjacency import TopKRows
from vllm_anisotropic.proposers.base import RequestState
from vllm_anisotropic.tree import DraftTree

logger = logging.getLogger(__name__)

__all__ = ["TreeDrafter"]

OFFER_MIN_DRAFTS = 8  # the smallest draft list offered while the allocator keeps few nodes
OFFER_MEMORY = 0.8  # per-step decay of a request's recent-kept high-water mark
ACCEPTANCE_REFIT_EVERY = 16  # verified steps between refits of the acceptance model


class TreeDrafter:
    """Built by the tree runner through vLLM's ``custom_class`` path: ``cls(vllm_config)``."""

    def __init__(self, vllm_config) -> None:
        spec = vllm_config.speculative_config
        # During construction vLLM's config reads method "custom_class"; the real method is
        # stored with the tunables in additional_config (patches.py / config.py).
        stored = (vllm_config.additional_config or {}).get("vllm_anisotropic") or {}
        method = stored.get("method") or spec.method
        self.config = TreeSpecConfig.from_additional_config(method, vllm_config.additional_config)
        vocab_size = vllm_config.model_config.get_vocab_size()
        self.proposer = get_proposer(self.config.proposer_name, vocab_size=vocab_size, **self.config.proposer_options)
        if isinstance(self.proposer, DraftTreeProposer):
            use_vllm_cpu_gemm(self.proposer.lm.model)  # q's linears take vLLM's CPU kernels (cpu_gemm.py)
        self.max_draft_tokens: int = int(spec.num_speculative_tokens)
        self.max_model_len: int = int(vllm_config.model_config.max_model_len)
        self.states: dict[str, RequestState] = {}
        # req_id -> vLLM cache_salt of requests that have one (scheduler.TreeScheduler.schedule):
        # the tenant whose adjacency table the request reads and feeds
        self.tenants: dict[str, str] = {}
        self.trees: dict[str, DraftTree] = {}
        # requests whose pending tree is a chain step's chain (``propose_trees(chains=True)``):
        # verified without harvesting their rows
        self.chain_trees: set[str] = set()
        self.chain_drafts = int(self.config.engine.allocator_chain_drafts)
        # budget allocator (budget.py): calibrated P(node on the accepted path) of each pending
        # tree's draft list, learned from every verified tree; None when the allocator is off
        self.acceptance = (AcceptanceModel(AcceptanceConfig(refit_every=ACCEPTANCE_REFIT_EVERY))
                           if self.config.engine.allocator == "auto" else None)
        self.probs: dict[str, list[float]] = {}
        # req_id -> [(tokens the request had when the tree was proposed, the offered tree)]: every
        # offered tree, cut or not, is labelled from the tokens that follow its root once they
        # are known (allocator.continuation_labels), up to the acceptance model's depth buckets
        self.unlabelled: dict[str, list[tuple[int, DraftTree]]] = {}
        self.label_depth = self.acceptance.config.max_depth if self.acceptance is not None else 0
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
        # harvests of verified rows waiting to run (observe_batch -> run_deferred)
        self._deferred: list = []
        # tree counters -> stats file (VLLM_ANISOTROPIC_TREE_STATS), /metrics and the log (metrics.py)
        self.metrics = TreeMetrics()
        if isinstance(self.proposer, DraftTreeProposer):
            self.metrics.selector_shapes = self.proposer.shape_counts  # the proposer counts, the sink writes
        self.sink = MetricsSink(self.metrics, rank=_tp_rank())
        self.host_clock = HostClock()  # the worker's host work per phase (host_clock.py)

    # ------------------------------------------------------------------ vLLM custom_class API
    def propose(self, *args, **kwargs):
        """vLLM's chain ``propose`` is not used: the tree runner calls ``propose_trees``."""
        raise RuntimeError("TreeDrafter runs only inside vllm-anisotropic's tree model runner")

    def load_model(self, *args, **kwargs) -> None:
        """No draft model: drafts come from the context and the target's own logits."""

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
    ) -> list[list[int]]:
        """One draft list per batch row: ``tree.tokens[1:]`` of the request's new tree.

        ``laws``: per batch row, ``(TargetSampling, seed)`` of the request (the runner's
        ``request_law``), read when a proposer that samples from a draft model creates the
        request's state (``DraftTreeState.set_sampling``); None: greedy.
        ``chains``: the measured gate chose a chain step (``allocator.gate``): each request's
        chain alone (``propose_chain``, at most ``allocator_chain_drafts`` tokens), not ranked,
        not labelled, and its verified rows not harvested (``observe_batch``); the backoff
        neither applies nor counts."""
        new: dict[str, DraftTree] = {}
        starts: dict[str, int] = {}  # req_id -> its token count, the root being the last token
        if self.unlabelled:
            self._label(req_ids, num_tokens_no_spec, token_ids_cpu)
        # no sampled token: a partial prefill chunk or a discarded request; a skip: the backoff
        drafting = [bool(sampled_token_ids[i]) and bool(eligible[i]) and (chains or self.skip.get(r, 0) <= 0)
                    for i, r in enumerate(req_ids)]
        self.proposer.begin_step(sum(drafting))
        for i, req_id in enumerate(req_ids):
            num_tokens = int(num_tokens_no_spec[i])
            if not drafting[i]:
                if sampled_token_ids[i] and eligible[i] and not chains:
                    self.skip[req_id] -= 1
                self.trees.pop(req_id, None)
                continue
            state = self.states.get(req_id)
            if state is None:
                state = self.states[req_id] = self.proposer.new_request(self.tenants.get(req_id))
                if laws is not None and laws[i] is not None and hasattr(state, "set_sampling"):
                    state.set_sampling(*laws[i])
                self.metrics.live_requests = len(self.states)
                self.metrics.tenant_tables = getattr(getattr(self.proposer, "tables", None), "num_tenants", 0)
            room = min(self.max_draft_tokens, self.max_model_len - num_tokens - 1)
            if chains:
                tree = state.propose_chain(token_ids_cpu[i, :num_tokens], min(self.chain_drafts, max(room, 0)))
            else:
                tree = state.propose(token_ids_cpu[i, :num_tokens], self._offer(req_id, room))
            assert int(tree.tokens[0]) == int(token_ids_cpu[i, num_tokens - 1]), "root must be the last token"
            tree = tree.truncate(max(room, 0) + 1)
            if tree.draft_probs is not None and self.acceptance is not None:
                tree = shape_only(tree)
            new[req_id] = tree
            starts[req_id] = num_tokens
        self.probs = {}
        self.chain_trees = set(new) if chains else set()
        if self.acceptance is not None and new and not chains:
            self._rank(new)
        for req_id, tree in new.items():
            self.trees[req_id] = tree
            if self.acceptance is not None and tree.num_nodes > 1 and not chains:
                self.unlabelled.setdefault(req_id, []).append((starts[req_id], tree))
        return [new[r].tokens[1:].tolist() if r in new else [] for r in req_ids]

    def rest(self, req_ids: Sequence[str]) -> list[list[int]]:
        """No drafts for the next step (the scheduler's measured gate keeps it plain): no tree,
        no scoring, no labelling; the adjacency tables harvest nothing until drafting resumes
        (a plain step then costs what plain decoding costs). Offered trees waiting for their
        labels keep waiting: the tokens they need stay in the request's context."""
        for req_id in req_ids:
            self.trees.pop(req_id, None)
        self.probs = {}
        self.chain_trees = set()
        return [[] for _ in req_ids]

    def _rank(self, new: dict[str, DraftTree]) -> None:
        """Calibrated probabilities of the new trees' nodes (the allocator's input), each tree
        reordered so that they descend (``allocator.rank_trees``): a prefix cut keeps what the
        acceptance model rates highest, whatever order the proposer's values gave."""
        trees, probs = rank_trees(list(new.values()), self.acceptance)
        for req_id, tree, p in zip(list(new), trees, probs):
            new[req_id] = tree
            self.probs[req_id] = p.tolist()

    def _label(self, req_ids, num_tokens_no_spec, token_ids_cpu) -> None:
        """Feed the acceptance model every offered tree whose next ``label_depth`` tokens (or as
        many as its depth) are now known, labelled from those tokens (module ``allocator.
        tree_probs.continuation_labels``): verified or cut, every node teaches the model."""
        trees, continuations = [], []
        for i, req_id in enumerate(req_ids):
            waiting = self.unlabelled.get(req_id)
            if not waiting:
                continue
            num_tokens = int(num_tokens_no_spec[i])
            still = []
            for start, tree in waiting:
                need = min(tree.max_depth, self.label_depth)
                if num_tokens - start >= need:
                    trees.append(tree)
                    continuations.append(token_ids_cpu[i, start : start + need])
                else:
                    still.append((start, tree))
            self.unlabelled[req_id] = still
        if trees:
            self.acceptance.update(*continuation_labels(trees, continuations))

    def _offer(self, req_id: str, room: int) -> int | None:
        """Node budget (root included) of ``req_id``'s next proposal; None = the proposer's own."""
        mark = self.kept_mark.get(req_id)
        if not self.offer_factor or mark is None:
            return None
        drafts = max(OFFER_MIN_DRAFTS, int(np.ceil(self.offer_factor * mark)))
        return None if drafts >= room else drafts + 1

    def take_tree(self, req_id: str, scheduled: Sequence[int]) -> DraftTree | None:
        """The pending tree of ``req_id`` cut to the ``scheduled`` draft prefix, or None.

        Raises when vLLM scheduled tokens that are not a prefix of the tree's draft list
        (that would be a bookkeeping bug; verifying it as a tree would be wrong).
        """
        tree = self.trees.pop(req_id, None)
        if tree is None:
            if scheduled:
                raise RuntimeError(f"request {req_id}: {len(scheduled)} drafts scheduled but no tree pending")
            return None
        n = len(scheduled)
        if n > tree.num_nodes - 1 or not np.array_equal(tree.tokens[1 : 1 + n], np.asarray(scheduled, np.int64)):
            raise RuntimeError(
                f"request {req_id}: scheduled drafts {list(scheduled)[:8]}... are not a prefix of the "
                f"pending tree's draft list {tree.tokens[1:9].tolist()}..."
            )
        if self.acceptance is not None and tree.num_nodes > 1:
            self.kept_mark[req_id] = max(float(n), OFFER_MEMORY * self.kept_mark.get(req_id, 0.0))
            if n == 0:
                streak = self.zero_streak[req_id] = self.zero_streak.get(req_id, 0) + 1
                self.skip[req_id] = min(2 ** (streak - 1), self.max_backoff)
            else:
                self.zero_streak.pop(req_id, None)
        return tree.truncate(n + 1)

    def observe(self, req_id: str, tree: DraftTree, accepted: list[int], logits: torch.Tensor | None) -> None:
        """After verification: logits ``[num_nodes, vocab_size]``, row i after node i's path."""
        state = self.states.get(req_id)
        self._record(req_id, state, tree, accepted)
        if state is not None:
            state.observe(tree, accepted, logits)

    def _record(self, req_id: str, state, tree: DraftTree, accepted) -> None:
        mode = getattr(state.last_info.mode, "value", None) if state is not None else None  # this tree's proposal
        self.metrics.record(req_id, tree, accepted, mode, trace=self.sink.trace)
        self.sink.tick()

    @timed("harvest")
    def observe_batch(self, items, logits: torch.Tensor) -> None:
        """``observe`` for every tree of a step, with one top-k over all their logits rows.

        ``items``: ``(req_id, tree, accepted, rows)`` with ``rows`` the slice of ``logits``
        holding the tree's ``num_nodes`` rows. The harvesting proposers read only the top-k of
        each row: one softmax + top-k over the concatenated rows and one device-to-host copy
        replace one per request (``adjacency.TopKRows``).

        The harvest runs later (``run_deferred``): the step's reply, with the next step's
        drafts, does not wait for it. The metrics are counted now; the rows are copied now
        (vLLM may reuse the logits buffer); the states' learning is bound now
        (``RequestState.observe_later``) and applied after the next proposal, so that proposal
        does not yet see this step's rows (one step of lag in the adjacency table and the spine
        EMA; drafts only, never outputs). Where it runs: right after the worker's reply, while
        the scheduler process cuts and schedules the next step and this worker would only wait
        (``patches.py`` patch 7, multiprocess executors), or else at the start of the next step
        (``runner.TreeRunnerMixin._update_states``), in both cases before anything else of the
        next step: the same order on every tensor-parallel rank and in every executor.
        """
        if self.chain_trees:  # a chain step's chains: learn (spine EMA, metrics) without the rows
            for req_id, tree, accepted, rows in [it for it in items if it[0] in self.chain_trees]:
                self.observe(req_id, tree, accepted, None)
            items = [it for it in items if it[0] not in self.chain_trees]
        ks = [st.harvest_top_k for st in (self.states.get(r) for r, *_ in items) if st is not None]
        ks = [k for k in ks if k]
        if not ks:
            for req_id, tree, accepted, rows in items:
                self.observe(req_id, tree, accepted, logits[rows])
            return
        index = torch.cat([torch.arange(r.start, r.stop) for *_, r in items]).to(logits.device)
        picked = logits.index_select(0, index)  # [num_rows, vocab_size], a copy
        later = []
        for req_id, tree, accepted, rows in items:
            state = self.states.get(req_id)
            self._record(req_id, state, tree, accepted)
            later.append((state.observe_later(tree, accepted) if state is not None else None, rows.stop - rows.start))
        self._deferred.append(functools.partial(_harvest, later, picked, max(ks)))

    def run_deferred(self) -> None:
        """Apply the harvests ``observe_batch`` left for later, oldest first."""
        if self._deferred:
            self._run_deferred()

    @timed("harvest")
    def _run_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for work in deferred:
            work()

    def drop(self, req_id: str) -> None:
        """The request finished or was aborted."""
        state = self.states.pop(req_id, None)
        if state is not None:
            # its tokens go into the cross-request store after the step's reply, with the
            # harvests (``run_deferred``): ~0.2-0.6 ms a request, 64 at once when a batch finishes
            self._deferred.append(state.finish)
        self.tenants.pop(req_id, None)
        self.trees.pop(req_id, None)
        self.zero_streak.pop(req_id, None)
        self.skip.pop(req_id, None)
        self.kept_mark.pop(req_id, None)
        self.unlabelled.pop(req_id, None)
        self.metrics.live_requests = len(self.states)
        # at most once a second (~1 ms a write in the engine): the runner forces one when the
        # batch drains (``TreeRunnerMixin._update_states``)
        self.sink.tick()

    def drop_tree(self, req_id: str) -> None:
        """The request was preempted: its pending drafts are gone, and a draft model's KV cache
        for it is freed (rebuilt from the context when it runs again)."""
        self.trees.pop(req_id, None)
        release = getattr(self.states.get(req_id), "release", None)
        if release is not None:
            release()


def _harvest(later, picked: torch.Tensor, k: int) -> None:
    """One top-k over a step's copied rows, then each state's bound ``observe``."""
    top = TopKRows.of(picked, k)
    offset = 0
    for observe, n in later:
        if observe is not None:
            observe(top[offset : offset + n])
        offset += n


def shape_only(tree: DraftTree) -> DraftTree:
    """A sampled draft-model tree with every value 1: the allocator's probabilities (and any
    reordering by them) then depend on the tree's shape and the acceptance model alone, never
    on the sampled tokens. A cut that looked at the samples would break the i.i.d. branches
    the multi-draft verifiers assume (docs/verifiers.md); the acceptance model learns, for these
    trees, P(accepted | source, depth)."""
    return DraftTree(tree.tokens, tree.parents, tree.sources, np.ones(tree.num_nodes), tree.draft_probs,
                     tree.multiplicity)


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 outside a distributed setup)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no process group yet / not distributed
        return 0
