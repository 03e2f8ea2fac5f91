"""The tree scheduler: vLLM's scheduler with the batch budget allocator's hooks.

Scope: vLLM's V1 ``Scheduler`` with the budget allocator (``budget.BatchBudget``): the draft
lists of the running requests are cut once per step, before vLLM schedules them; the step's
measured time and outcome refine the allocator's models; the next step's drafts arrive with
the step's output (one RPC per step, ``patches.py`` patch 6).

KV after tree acceptance needs nothing here: vLLM's own rollback (``num_computed_tokens -=
rejected``) leaves ``root + 1 .. root + a`` computed, and the worker has already moved the
accepted nodes' K/V to exactly those slots before replying (``kv_moves.py``), so nothing is
re-run and vLLM's bookkeeping is right as it stands.
"""

from __future__ import annotations

import logging
import time

from vllm.v1.core.sched.scheduler import Scheduler

from vllm_anisotropic.integration.vllm.engine.faults import report
from vllm_anisotropic.integration.vllm.frontdoor.config import request_tree_options

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
        self.budget = BatchBudget(vllm_config.scheduler_config, vllm_config.model_config,
                                  spec.num_speculative_tokens, tree.engine, stats_path=budget_stats_path(),
                                  chains=tree.chain_steps)

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
        self._budget("cut", self.running)
        out = super().schedule(*args, **kwargs)
        self._budget("on_scheduled", out)
        if self._faults:  # pickled to every worker (runner._update_states counts them)
            out.tree_faults, self._faults = self._faults, []
        # what the workers draft after this step: PLAIN (nothing) while the measured gate keeps
        # the next step plain, TREE or CHAIN (budget.BatchBudget.cut decides one step ahead);
        # pickled with the output
        t0 = time.perf_counter()
        out.tree_propose = self.budget.propose_next
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
        self._budget("on_draft_ids", draft_token_ids)
        return super().update_draft_token_ids(draft_token_ids, *args, **kwargs)

    def update_from_output(self, scheduler_output, model_runner_output):
        self._budget("on_output", scheduler_output, model_runner_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._apply_drafts(model_runner_output, outputs)
        if not self.running:
            self.budget.flush()
        return outputs

    def _apply_drafts(self, model_runner_output, outputs):
        """The next step's drafts, sent with this output by the runner (runner.sample_tokens):
        vLLM would fetch them with a second RPC per step in ``EngineCore.post_step``, which
        patches.py (patch 6) skips for this scheduler."""
        drafts = getattr(model_runner_output, "tree_drafts", None)
        if drafts is not None:
            self.update_draft_token_ids(drafts)
        return outputs
