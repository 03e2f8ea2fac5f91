"""The tree scheduler: KV repair after tree acceptance, and the batch budget allocator.

Scope: vLLM's V1 ``Scheduler`` with (1) the KV repair below (``update_from_output``) and (2)
the budget allocator's hook (``budget.BatchBudget``): the draft lists of the running requests
are cut once per step, before vLLM schedules them; the step's measured time and outcome refine
the allocator's models.

KV correctness after tree acceptance by recomputation (shared/notes section 3e, Option R).

Why: vLLM assumes accepted drafts are a prefix of the draft list, so that the KV written for
draft k at slot ``root + k`` is the KV of the k-th emitted token. In a tree the accepted path
is any root-to-node path (e.g. nodes 2 -> 7), whose KV sits at the wrong slots and was
computed at tree positions. After vLLM's own bookkeeping (``num_computed_tokens -=
rejected``) we also roll back the ``a`` accepted tokens: ``num_computed_tokens -= a``,
except a leading run of accepted nodes 1 -> 2 -> ... -> c (a chain at the front of the
tree, e.g. the GOOSE bypass spine): those sit at slot ``root + k`` and were computed at
position ``root + k`` attending exactly their ancestors, so their KV is vLLM's chain KV
already; the runner reports c per request (``ModelRunnerOutput.kv_in_place``, an extra
attribute that travels with the pickled output; without it every accepted token is re-run). The
next ``schedule()`` then re-runs them, as ordinary tokens at their true positions and slots,
in front of the new root and its drafts (query ``[a re-run, root, n drafts]``; the runner
indexes tree rows from the end of the query). Cost: ``a`` extra query tokens per step; no
cache copy.

Worked example: 100 tokens computed, root at position 100, 5 drafts, path of 2 accepted ->
vLLM leaves ``num_computed_tokens = 103`` (root + 2), we set ``101``; the request now holds
103 tokens, so the next step schedules tokens 101..102 again plus the new root 103 and its drafts.
"""

from __future__ import annotations

import time

from vllm.v1.core.sched.scheduler import Scheduler

__all__ = ["TreeScheduler"]


class TreeScheduler(Scheduler):
    """vLLM's scheduler + recompute of accepted tree tokens + the batch budget allocator."""

    drafts_arrive_with_output = True  # read by EngineCore.post_step (patches.py, patch 6)

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        from vllm_anisotropic.integration.vllm.budget import BatchBudget
        from vllm_anisotropic.integration.vllm.config import TreeSpecConfig
        from vllm_anisotropic.integration.vllm.metrics import budget_stats_path

        spec = vllm_config.speculative_config
        tree = TreeSpecConfig.from_additional_config(spec.method, vllm_config.additional_config)
        self.budget = BatchBudget(vllm_config.scheduler_config, vllm_config.model_config,
                                  spec.num_speculative_tokens, tree.engine, stats_path=budget_stats_path(),
                                  chains=tree.chain_steps)

    def schedule(self, *args, **kwargs):
        self.budget.cut(self.running)
        out = super().schedule(*args, **kwargs)
        self.budget.on_scheduled(out)
        # what the workers draft after this step: PLAIN (nothing) while the measured gate keeps
        # the next step plain, TREE or CHAIN (budget.BatchBudget.cut decides one step ahead);
        # pickled with the output
        t0 = time.perf_counter()
        out.tree_propose = self.budget.propose_next
        # the tenant (cache_salt) of each new request, for the worker's per-tenant adjacency
        # tables (proposers.adjacency.TenantTables): vLLM's NewRequestData does not carry it.
        # An extra attribute, pickled with the output to every worker like kv_in_place.
        out.tree_tenants = {r.req_id: self.requests[r.req_id].cache_salt for r in out.scheduled_new_reqs
                            if r.req_id in self.requests and self.requests[r.req_id].cache_salt is not None}
        self.budget.host_clock.add("scheduled", time.perf_counter() - t0)
        return out

    def update_draft_token_ids(self, draft_token_ids, *args, **kwargs):
        self.budget.on_draft_ids(draft_token_ids)
        return super().update_draft_token_ids(draft_token_ids, *args, **kwargs)

    def update_from_output(self, scheduler_output, model_runner_output):
        self.budget.on_output(scheduler_output, model_runner_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._apply_drafts(model_runner_output, outputs)
        sampled = model_runner_output.sampled_token_ids
        if not sampled:
            return outputs
        t0 = time.perf_counter()
        # accepted paths 1 -> 2 -> ... -> c keep their KV (runner.sample_tokens); re-run the rest
        kv_in_place = getattr(model_runner_output, "kv_in_place", None) or {}
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            request = self.requests.get(req_id)
            if not drafts or request is None or request.is_finished():
                continue
            index = model_runner_output.req_id_to_index.get(req_id)
            if index is None:
                continue
            num_accepted = max(len(sampled[index]) - 1, 0)
            rerun = num_accepted - min(kv_in_place.get(req_id, 0), num_accepted)
            if rerun:
                request.num_computed_tokens -= rerun
        if not self.running:
            self.budget.flush()
        self.budget.host_clock.add("update", time.perf_counter() - t0)
        return outputs

    def _apply_drafts(self, model_runner_output, outputs):
        """The next step's drafts, sent with this output by the runner (runner.sample_tokens):
        vLLM would fetch them with a second RPC per step in ``EngineCore.post_step``, which
        patches.py (patch 6) skips for this scheduler."""
        drafts = getattr(model_runner_output, "tree_drafts", None)
        if drafts is not None:
            self.update_draft_token_ids(drafts)
        return outputs
