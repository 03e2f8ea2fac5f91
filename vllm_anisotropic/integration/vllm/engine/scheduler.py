"""The tree scheduler: vLLM's scheduler with the batch budget allocator's hooks.

Scope: vLLM's V1 ``Scheduler`` with the budget allocator (``budget.BatchBudget``): the draft
lists of the running requests are cut once per step, before vLLM schedules them; the step's
measured time and outcome refine the allocator's models; the next step's drafts arrive with
the step's output (one RPC per step, ``patches.py`` patch 6).

Structured outputs: the trees of requests with a grammar are pruned by it when they arrive, and
each scheduled node's logits row gets the grammar mask of its own path (``tree_grammar.py``).

KV after tree acceptance needs nothing here: vLLM's own rollback (``num_computed_tokens -=
rejected``) leaves ``root + 1 .. root + a`` computed, and the worker has already moved the
accepted nodes' K/V to exactly those slots before replying (``kv_moves.py``), so nothing is
re-run and vLLM's bookkeeping is right as it stands.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds

from vllm_anisotropic.integration.vllm.engine.faults import inject, report
from vllm_anisotropic.integration.vllm.engine.tree_grammar import TreeGrammars
from vllm_anisotropic.integration.vllm.frontdoor.config import request_tree_options

AHEAD_STEPS = 8  # steps over which the batch ahead is the largest seen (schedule)

__all__ = ["TreeScheduler"]

logger = logging.getLogger(__name__)


class TreeScheduler(Scheduler):
    """vLLM's scheduler + the batch budget allocator."""

    drafts_arrive_with_output = True  # read by EngineCore.post_step (patches.py, patch 6)

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        from vllm_anisotropic.integration.vllm.engine.budget import BatchBudget
        from vllm_anisotropic.integration.vllm.frontdoor.config import TreeSpecConfig
        from vllm_anisotropic.integration.vllm.engine.metrics import budget_stats_path

        spec = vllm_config.speculative_config
        tree = TreeSpecConfig.from_additional_config(spec.method, vllm_config.additional_config)
        # req_id -> its extra_args "tree_max_nodes" (> 0), or 0 after a contained allocator fault
        self.node_caps: dict[str, int] = {}
        self._faults: list[tuple[str, list[str]]] = []  # contained faults the workers hear of next step
        self.grammars = TreeGrammars()  # pruned trees of structured-output requests (tree_grammar.py)
        self._ahead = deque(maxlen=AHEAD_STEPS)  # the batch ahead of the last steps (schedule)
        self._node_bitmask = None  # [num_speculative_tokens, vocab_size / 32] int32, the node rows' buffer
        self._max_drafts = int(spec.num_speculative_tokens)
        self.budget = BatchBudget(vllm_config.scheduler_config, vllm_config.model_config,
                                  spec.num_speculative_tokens, tree.engine, stats_path=budget_stats_path(),
                                  chains=tree.chain_steps)
        self.budget.warm_up()  # the cut's compiled kernels (after the workers' start: kernels/__init__.py)

    def add_request(self, request, *args, **kwargs):
        # a request's own cap on its draft nodes (extra_args "tree_max_nodes", validated in the
        # front end: patches.py, patch 9); "trees": false never drafts (runner.ineligible_reason)
        cap = request_tree_options(request.sampling_params.extra_args if request.sampling_params else None).max_nodes
        if cap:
            self.node_caps[request.request_id] = cap
        return super().add_request(request, *args, **kwargs)

    def _cap_drafts(self) -> None:
        """Cut the draft lists of requests with a node cap to their first ``cap`` nodes (the
        lists are in value order, so a prefix is the best subtree of that size; 0: none);
        forget the caps of requests that left."""
        for req_id, cap in list(self.node_caps.items()):
            r = self.requests.get(req_id)
            if r is None:
                del self.node_caps[req_id]
            elif len(r.spec_token_ids) > cap:
                r.spec_token_ids = r.spec_token_ids[:cap]

    def schedule(self, *args, **kwargs):
        if self.node_caps:
            self._cap_drafts()
        # the batch the coming steps run, a draft model's catch-up priced there (budget.cut): the
        # running and waiting requests, at most max_num_seqs, the largest of the last AHEAD_STEPS
        # steps (a request that replaces a finished one can arrive a step after the dip); an
        # empty batch starts the window again (the engine does not schedule while idle: a
        # request arriving after a drained batch of eight is not priced at eight)
        if not self.running:
            self._ahead.clear()
        self._ahead.append(min(len(self.running) + len(self.waiting), self.max_num_running_reqs))
        self._budget("cut", self.running, max(self._ahead))
        out = super().schedule(*args, **kwargs)
        self._budget("on_scheduled", out)
        if self._faults:  # pickled to every worker (runner._update_states counts them)
            out.tree_faults, self._faults = self._faults, []
        if self.grammars.trees:  # requests that left
            for req_id in [r for r in self.grammars.trees if r not in self.requests]:
                self.grammars.forget(req_id)
        if self.grammars.reorders:  # pruned trees whose kept nodes the workers move to the front
            out.tree_kept, self.grammars.reorders = self.grammars.reorders, {}
            self.budget.metrics.grammar_reordered_trees += len(out.tree_kept)
        # what the workers draft after this step: PLAIN (nothing) while the measured gate keeps
        # the next step plain, TREE or CHAIN (budget.BatchBudget.cut decides one step ahead);
        # pickled with the output
        t0 = time.perf_counter()
        out.tree_propose = self.budget.propose_next
        if self.budget.repay_next is not None:  # a draft model's catch-ups that must repay (draft_batch)
            out.tree_repay = self.budget.repay_next
        # the tenant (cache_salt) of each new request, for the worker's per-tenant adjacency
        # tables (proposers.adjacency.TenantTables): vLLM's NewRequestData does not carry it.
        # An extra attribute, pickled with the output to every worker.
        out.tree_tenants = {r.req_id: self.requests[r.req_id].cache_salt for r in out.scheduled_new_reqs
                            if r.req_id in self.requests and self.requests[r.req_id].cache_salt is not None}
        self.budget.host_clock.add("scheduled", time.perf_counter() - t0)
        return out

    def _budget(self, hook: str, *args) -> None:
        """``self.budget.<hook>(*args)``, contained (faults.py, stage "allocator"): on an
        exception the running requests' drafts are dropped (this step is plain for them) and
        they get no more (a node cap of 0 here; the workers stop drafting for them when they
        hear of it with the next step's output, ``tree_faults``)."""
        try:
            getattr(self.budget, hook)(*args)
        except Exception:  # noqa: BLE001
            ids = [r.request_id for r in self.running]
            report(logger, "allocator", ids)
            for r in self.running:
                r.spec_token_ids = []
                self.node_caps[r.request_id] = 0
            self._faults.append(("allocator", ids))

    def update_draft_token_ids(self, draft_token_ids, *args, **kwargs):
        # trees of structured-output requests: pruned by their grammar first (the allocator ranks
        # what is left), then set as they are; vLLM's validate_tokens would read them as a chain
        tree_parents = getattr(draft_token_ids, "tree_parents", None)
        mine = []
        if tree_parents:
            for i, req_id in enumerate(draft_token_ids.req_ids):
                r = self.requests.get(req_id)
                if req_id in tree_parents and r is not None and not r.is_finished() and not r.is_prefill_chunk:
                    self._prune(r, draft_token_ids, i)
                    mine.append(i)
        self._budget("on_draft_ids", draft_token_ids)
        if not mine:
            return super().update_draft_token_ids(draft_token_ids, *args, **kwargs)
        for i in mine:
            self.requests[draft_token_ids.req_ids[i]].spec_token_ids = draft_token_ids.draft_token_ids[i]
        skip = set(mine)
        keep = [i for i in range(len(draft_token_ids.req_ids)) if i not in skip]
        rest = DraftTokenIds([draft_token_ids.req_ids[i] for i in keep], [draft_token_ids.draft_token_ids[i] for i in keep])
        return super().update_draft_token_ids(rest, *args, **kwargs)

    def _prune(self, request, draft_token_ids, i: int) -> None:
        """``self.grammars.prune`` of request ``i``'s tree, contained (faults.py, stage "grammar"):
        on an exception its drafts are dropped (the walk restores its grammar) and it gets no
        more (a node cap of 0; the workers hear of it with the next step's output)."""
        try:
            inject("grammar")
            self.budget.metrics.grammar_pruned_nodes += self.grammars.prune(
                self.structured_output_manager, request, draft_token_ids, i)
        except Exception:  # noqa: BLE001
            report(logger, "grammar", [request.request_id])
            draft_token_ids.draft_token_ids[i] = []
            if getattr(draft_token_ids, "tree_probs", None) is not None:
                draft_token_ids.tree_probs[i] = None
            if getattr(draft_token_ids, "tree_chains", None) is not None:
                draft_token_ids.tree_chains[i] = 0
            self.grammars.forget(request.request_id)
            self.node_caps[request.request_id] = 0
            self._faults.append(("grammar", [request.request_id]))

    def get_grammar_bitmask(self, scheduler_output):
        """vLLM's grammar bitmask, with the rows of tree requests' draft nodes filled from each
        node's own path (``tree_grammar.TreeGrammars.node_rows``); vLLM fills the root row."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        trees = [r for r, drafts in spec.items() if drafts and r in self.grammars.trees]
        if not trees:
            return super().get_grammar_bitmask(scheduler_output)
        hidden = set(trees)
        scheduler_output.scheduled_spec_decode_tokens = {r: d for r, d in spec.items() if r not in hidden}
        try:
            out = super().get_grammar_bitmask(scheduler_output)  # the tree requests' root rows only
        finally:
            scheduler_output.scheduled_spec_decode_tokens = spec
        if out is None:
            return None
        if self._node_bitmask is None:
            self._node_bitmask = self.structured_output_manager.backend.allocate_token_bitmask(max(1, self._max_drafts))
        ids, rows = out.structured_output_request_ids, out.grammar_bitmask
        nodes = {r: self.grammars.node_rows(self.requests[r], spec[r], self._node_bitmask) for r in ids if r in hidden}
        stride = self._max_drafts + 1
        # a tree request here has drafts, so 0.32's layout (1 row for it) is always shorter than 0.33's
        if rows.shape[0] == len(ids) * stride:
            # vLLM 0.33: each request owns a block of 1 + num_speculative_tokens rows (root first)
            rows = rows.copy()
            for k, r in enumerate(ids):
                if r in nodes:
                    rows[k * stride + 1:k * stride + 1 + len(nodes[r])] = nodes[r]
        else:
            # vLLM 0.32: 1 + (scheduled drafts) rows per request, back to back (root first)
            parts, at = [], 0
            for r in ids:
                width = 1 if r in nodes else 1 + len(spec.get(r, ()))
                parts.append(rows[at:at + width])
                if r in nodes:
                    parts.append(nodes[r])
                at += width
            rows = np.concatenate(parts)
        out.grammar_bitmask = rows
        out.num_acceptable_drafts = [len(spec.get(r, ())) for r in ids]
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        self._budget("on_output", scheduler_output, model_runner_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._apply_drafts(model_runner_output, outputs)
        if not self.running:
            self.budget.flush()
        else:
            self._budget("tick")
        return outputs

    def _apply_drafts(self, model_runner_output, outputs):
        """The next step's drafts, sent with this output by the runner (runner.sample_tokens):
        vLLM would fetch them with a second RPC per step in ``EngineCore.post_step``, which
        patches.py (patch 6) skips for this scheduler."""
        drafts = getattr(model_runner_output, "tree_drafts", None)
        if drafts is not None:
            self.update_draft_token_ids(drafts)
        return outputs
