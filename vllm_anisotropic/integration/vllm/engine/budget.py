"""The budget allocator at vLLM's scheduler step: one cut of every request's draft list per step.

Scope: the engine side of the batch allocator (the math is ``vllm_anisotropic.allocator``). Owned by
``scheduler.TreeScheduler`` in the EngineCore process, so the decision is made once per step
for the whole batch and every tensor-parallel rank receives the same scheduled drafts.

Per step (``EngineCore.step``: ``schedule`` -> ``execute_model`` -> ``sample_tokens`` ->
``update_from_output``, then ``update_draft_token_ids``):

1. ``on_draft_ids``: the drafter's ``DraftTokenIds`` carries ``tree_probs`` (extra attribute set
   by the runner, ``runner.TreeRunnerMixin.take_draft_token_ids``): per request, the
   calibrated P(node on the accepted path) of its draft list in value order (the worker's
   ``allocator.AcceptanceModel``, learned from every verified tree).
2. ``cut`` (before vLLM's ``schedule``): ``allocator.allocate`` over the running requests with
   drafts, under vLLM's caps (``max_num_batched_tokens`` minus the tokens already owed,
   ``num_speculative_tokens``, ``max_model_len``), the cost model and the acceptance
   probabilities; ``request.spec_token_ids`` is cut to its prefix n_i (0 = plain decoding for
   that request). A prefix of a value-ordered list is a subtree, so the worker verifies the
   tree ``truncate(1 + n_i)``. Every ``probe_every``-th step that would verify no draft at all
   verifies the single most likely node instead, so the tree-row terms of the cost model stay
   measured (the cost of a probe is one query row). Before all that, the measured gate
   (``allocator.SpeculationGate``) may decide the step is plain: at this batch size, decode
   steps with drafts have delivered fewer tokens per second than steps without. The gate
   decides one step ahead: the decision for step t + 1 is made in step t's cut and sent to the
   workers with step t's scheduler output (``propose_next`` -> ``tree_propose``), so that
   while it stays closed the workers draft nothing (no trees, no harvest, no scoring) and a
   plain step costs what plain decoding costs. With ``chains`` (GOOSE) the gate may instead
   choose a *chain step* (``allocator.gate``, third arm): the workers draft each request's
   chain alone (no ranking, labelling or harvest) and ``_chain_step`` keeps it as drafted, at
   most ``allocator_chain_drafts`` tokens.
3. ``on_scheduled``: the step's composition (requests, query tokens, tree rows, context tokens
   of the tree rows, requests with drafts).
4. ``on_output``: the step's wall time (``update_from_output`` - start of ``cut``: the cut,
   vLLM's scheduling, forward, sampling, verification and the next proposals) refines the cost
   model online; the worker's start-up sweep (``cost_calibration`` on the first
   ``ModelRunnerOutput``) fits it first. Decode steps (no prompt tokens) also feed the gate:
   their emitted tokens and time, in the speculative arm (the gate let the step draft, or
   drafts verified) or the plain arm (neither, no accepted tokens re-run, and the workers
   draft nothing after the step); the steps where the gate switches arms are neither arm's
   (``on_scheduled``). The workers' seconds spent proposing the next step's drafts
   (``tree_propose_s``, timed by the runner) are moved out of the step that proposed them:
   the cost model never sees them (they are sunk when the allocator cuts), the gate charges
   them to the step that verifies the drafts, less the draft model's catch-up of what the
   target decoded while the gate rested drafting and its share of new prompts (``tree_resume_s``,
   ``proposers.draft_batch``): a cost of the switch or of the request, in neither arm. A draft model's long catch-ups
   (``tree_catchup``: seconds and tokens) measure what q takes a caught-up token; with the
   gate's saving a token at the batch ahead (``SpeculationGate.token_saving_s``, ``cut``) they
   make the ratio sent with the next proposal (``repay_next`` -> ``tree_repay``): a request whose
   remaining tokens would not repay q's catch-up decodes plainly (``proposers.draft_batch``).
   Predicted vs realized accepted drafts feed the metrics.

Cost-model start: a linear prior (``PRIOR_BASE_S`` + ``PRIOR_PER_TOKEN_S`` per query token)
until the sweep arrives, or the JSON file named by the ``cost_model`` tunable.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import numpy as np

from vllm_anisotropic import kernels
from vllm_anisotropic.allocator import (CHAIN, PLAIN, TREE, CostModel, CostSample, GateConfig, SpeculationGate,
                                       allocate_flat)
from vllm_anisotropic.allocator.cost import nnls_normal
from vllm_anisotropic.integration.vllm.engine.faults import inject
from vllm_anisotropic.integration.vllm.engine.host_clock import HostClock, timed

logger = logging.getLogger(__name__)
log = logging.getLogger("vllm.anisotropic")

__all__ = ["BatchBudget", "BudgetMetrics"]

PRIOR_BASE_S = 0.02
PRIOR_PER_TOKEN_S = 0.0005
LOG_INTERVAL_S = 10.0
WRITE_INTERVAL_S = 1.0
SCORE_BATCH = 64  # measured steps scored against the cost model in one vectorised call
CATCHUP_DECAY = 0.8  # weight of the earlier catch-up measures at each new one (repay_next)


@dataclass
class BudgetMetrics:
    """Cumulative allocator counters (scheduler process); written next to the tree stats."""

    steps: int = 0  # decode steps where a request had drafts to cut, or the gate made plain
    steps_without_drafts: int = 0  # of which: the allocator kept no draft at all
    chain_steps: int = 0  # of the steps: chain steps of the gate (the proposers' chains alone, not cut)
    chain_drafts: int = 0  # draft tokens those chain steps verified
    probe_steps: int = 0
    gate_plain_steps: int = 0  # of the steps without drafts: those the measured gate made plain
    tree_rows: int = 0  # draft nodes kept by the allocator
    tree_rows_offered: int = 0  # draft nodes the proposers offered
    tree_rows_within_caps: int = 0  # of those, what vLLM's caps allowed (token budget, k, max_model_len)
    given_up_accepted: float = 0.0  # expected accepted drafts of the nodes within the per-request caps not kept
    predicted_accepted: float = 0.0  # sum of kept nodes' probabilities (steps that ran)
    realized_accepted: int = 0  # drafts actually accepted in those steps
    cost_samples: int = 0
    cost_abs_rel_err: float = 0.0  # sum of |predicted - measured| / measured step seconds
    last_budget: int = 0  # tree rows kept in the latest step
    grammar_pruned_nodes: int = 0  # offered draft nodes a structured-output grammar rejected (tree_grammar.py)
    grammar_reordered_trees: int = 0  # of the pruned trees, those whose kept nodes the workers moved to the front
    draft_resume_seconds: float = 0.0  # the draft model's catch-ups after the gate rested drafting, of new prompts (no arm's)
    draft_unrepaid_catchups: int = 0  # request-steps without drafts: q's catch-up would not be repaid
    last_predicted_speedup: float = 1.0

    def summary_line(self) -> str:
        steps = max(self.steps, 1)
        err = self.cost_abs_rel_err / self.cost_samples if self.cost_samples else float("nan")
        return (
            f"vllm-anisotropic budget: steps {self.steps}, mean tree rows {self.tree_rows / steps:.1f} "
            f"of {self.tree_rows_offered / steps:.1f} offered, steps without drafts "
            f"{self.steps_without_drafts / steps:.2f} (gate {self.gate_plain_steps / steps:.2f}), chain steps "
            f"{self.chain_steps / steps:.2f}, accepted predicted {self.predicted_accepted:.0f} "
            f"realized {self.realized_accepted}, cost model error {err:.3f}"
        )


class _ChainCost:
    """The cost model for steps whose drafts are all chains: tree rows are plain query tokens."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._params = None  # (the wrapped model's kernel_params, ours)

    @property
    def spec_request_weight(self) -> float:
        return self.cost.spec_request_weight

    def predict(self, num_reqs, query_tokens, tree_rows, ctx_tokens=0, spec_reqs=None):
        if spec_reqs is None:
            spec_reqs = np.minimum(np.asarray(num_reqs), np.asarray(tree_rows))
        return self.cost.predict(num_reqs, query_tokens, np.zeros_like(np.asarray(tree_rows)), 0, spec_reqs)

    def kernel_params(self):
        """The wrapped model's, with every tree-row term zero (rows are plain query tokens);
        recomputed only when the wrapped model's change."""
        params = self.cost.kernel_params()
        if self._params is None or self._params[0] is not params:
            knots, at_knots, tail = params
            tail = tail.copy()
            tail[3:7] = 0.0  # b_on, b_on_r, b_t, b_c
            self._params = (params, (knots, at_knots, tail))
        return self._params[1]


class BatchBudget:
    """Scheduler-side allocator state (see module docstring)."""

    def __init__(self, scheduler_config, model_config, num_speculative_tokens: int, engine_config,
                 stats_path: str | None = None, chains: bool = False) -> None:
        """``chains``: the proposer drafts chains alone and ``allocator_chains`` is on
        (``TreeSpecConfig.chain_steps``): the gate measures chain steps as a third arm."""
        # deterministic: no decision from a measured time (config.EngineTreeConfig.deterministic)
        clockless = bool(engine_config.deterministic)
        self.enabled = engine_config.allocator == "auto" and (not clockless or bool(engine_config.cost_model))
        self.probe_every = int(engine_config.allocator_probe_every)
        self.gate = (SpeculationGate(GateConfig(explore_every=int(engine_config.allocator_gate_explore_every),
                                                margin=float(engine_config.allocator_gate_margin),
                                                chains=bool(chains)))
                     if self.enabled and engine_config.allocator_gate and not clockless else None)
        self.chain_drafts = int(engine_config.allocator_chain_drafts)
        self.online = bool(engine_config.cost_model_online) and not clockless
        self.max_batched = int(scheduler_config.max_num_batched_tokens)
        self.max_model_len = int(model_config.max_model_len)
        self.max_per_request = int(num_speculative_tokens)
        if engine_config.cost_model:
            with open(engine_config.cost_model, encoding="utf-8") as f:
                self.cost = CostModel.from_json(f.read())
            self.calibrated = True
        else:
            self.cost = CostModel.linear(PRIOR_BASE_S, PRIOR_PER_TOKEN_S)
            self.calibrated = False
        self._chain_cost: _ChainCost | None = None  # self.cost seen as chains only (made again when it changes)
        self.probs: dict[str, np.ndarray] = {}
        self.chains: dict[str, int] = {}  # req_id -> leading draft nodes that form a chain below the root
        self.metrics = BudgetMetrics()
        self.stats_path = stats_path
        self._kept: dict[str, float] = {}  # req_id -> predicted accepted of the kept prefix
        self._ctx: dict[str, int] = {}  # req_id -> context length at the cut
        self._step: tuple | None = None  # (R, Q, T, C, D, t0, arm) of the step in flight
        self._unscored: list[tuple] = []  # measured steps whose cost-model error is not counted yet
        self._decoding: dict[str, int] = {}  # req_id -> accepted tokens it re-runs, of requests past their prompt
        self._t_cut = time.perf_counter()  # start of the latest cut
        # the kind the measured gate chose for the step being scheduled (its drafts were proposed
        # for it): TREE or CHAIN, the gate's arm whatever the allocator then keeps; PLAIN: none
        self._drafting = PLAIN
        # worker seconds spent proposing the drafts of the step after the one just measured
        # (``tree_propose_s`` of the previous output): moved from that step's time to the step
        # that verifies them
        self._propose_carry = 0.0
        # the gate's decision for the coming step (None: none made yet, ask at the cut), and
        # what the workers draft after the step being scheduled (``propose_next``: PLAIN =
        # nothing, TREE, CHAIN; sent with the scheduler output: TreeScheduler.schedule -> runner)
        self._allowed: int | None = None
        self.start_coefficients: dict[str, float] = {}  # the cost model fitted on the worker's start-up sweep
        self.propose_next = TREE
        # the catch-up tokens one output token repays in the step proposed next (the gate's saving
        # a token over a draft model's measured seconds a caught-up token; sent as ``tree_repay``,
        # proposers/draft_batch.py "Repay"); None: unknown, or nothing to repay
        self.repay_next: float | None = None
        self._catchup = [0.0, 0.0]  # decayed sums of a draft model's long catch-ups: seconds, tokens
        self._unrepaid_next = 0  # requests of the step proposed next left without drafts by the repay rule
        self.host_clock = HostClock()  # the allocator's host work per phase (host_clock.py)
        self._last_log = -LOG_INTERVAL_S
        self._last_write = -WRITE_INTERVAL_S

    # ------------------------------------------------------------------ 1
    @timed("update")
    def on_draft_ids(self, draft_token_ids) -> None:
        probs = getattr(draft_token_ids, "tree_probs", None)
        if probs is None:
            return
        chains = getattr(draft_token_ids, "tree_chains", None) or [0] * len(probs)
        for req_id, p, c in zip(draft_token_ids.req_ids, probs, chains):
            self.chains[req_id] = int(c)  # a chain step's chain has no probabilities (nothing ranks it)
            if p is None:
                self.probs.pop(req_id, None)
            else:
                self.probs[req_id] = np.asarray(p, np.float64)

    # ------------------------------------------------------------------ 2
    @timed("cut")
    def cut(self, running, ahead: int | None = None) -> None:
        """Cut ``request.spec_token_ids`` of the running requests (see module docstring).
        ``ahead``: the requests the coming steps will run (the scheduler's running and waiting
        ones, at most ``max_num_seqs``, the largest of its last steps since the batch was last
        empty; None: ``running``'s), the batch size a draft model's
        catch-up is priced at (``repay_next``): a batch that dropped to two requests while two
        more wait to be admitted decodes at four from the next step, where the drafting the
        catch-up buys stops (a bench cell at four requests paid ~1 s of q's catch-ups each time
        its batch refilled, 2026-12-07)."""
        inject("allocator")
        self._t_cut = time.perf_counter()  # the step's time starts here: the cut is part of its cost
        self._kept, self._ctx = {}, {}
        # decode requests (past their prompt) and the accepted tree tokens each re-runs
        # (owed tokens beyond the new root): the gate's arms (step 4)
        self._decoding = {r.request_id: r.num_tokens - r.num_computed_tokens - 1 for r in running
                          if r.num_computed_tokens >= r.num_prompt_tokens}
        live = {r.request_id for r in running}
        for req_id in [r for r in self.chains if r not in live]:
            self.probs.pop(req_id, None)
            del self.chains[req_id]
        self._drafting = PLAIN
        self.repay_next = None
        if not self.enabled:
            return
        # the gate's decision for this step was made one step ahead (so that the workers draft
        # only for steps that may speculate, and the kind of drafts the step verifies); the
        # decision for the next step is made now
        mode = TREE
        if self.gate is not None:
            mode = self._allowed if self._allowed is not None else self.gate.decide(len(running))
            self._allowed = self.propose_next = self.gate.decide(len(running)) if running else mode
            self._drafting = mode
            if self.propose_next != PLAIN and self._catchup[1] > 0:
                # an empty batch with nothing waiting (a request arriving alone) decodes at one
                saving = self.gate.token_saving_s(max(len(running) if ahead is None else ahead, 1))
                if saving is not None:
                    self.repay_next = saving * self._catchup[1] / self._catchup[0]
        if mode == CHAIN:
            self._chain_step(running)
            return
        reqs, probs = [], []
        owed = 0
        for r in running:
            owed += max(r.num_tokens - r.num_computed_tokens, 0)
            if r.spec_token_ids and r.request_id in self.probs:
                p = self.probs[r.request_id][: len(r.spec_token_ids)]
                if len(p) == len(r.spec_token_ids):
                    reqs.append(r)
                    probs.append(p)
        if mode == PLAIN:
            self._gate_plain(running, probs)
            return
        if not reqs:
            return
        self._refresh_cost()
        # the step's lists in one array: one allocation over it, its chains-only cut as limits
        lengths = np.fromiter((len(p) for p in probs), np.int64, len(probs))
        flat = np.clip(np.concatenate(probs), 0.0, 1.0)
        ctx = np.fromiter((r.num_computed_tokens for r in reqs), np.float64, len(reqs))
        headroom = np.fromiter((self.max_model_len - r.num_tokens - 1 for r in reqs), np.int64, len(reqs))
        caps = dict(num_reqs=len(running), fixed_query_tokens=max(owed, len(running)),
                    token_budget=max(self.max_batched - owed, 0), max_per_request=self.max_per_request,
                    headroom=headroom, base_tokens=len(running))
        chains = np.fromiter((self.chains.get(r.request_id, 0) for r in reqs), np.int64, len(reqs))
        alloc = self._allocate(flat, lengths, ctx, chains, caps)
        cuts = alloc.cuts.copy()
        m = self.metrics
        m.steps += 1
        m.tree_rows_offered += int(flat.size)
        # E_i(n), the expected accepted drafts of request i's first n nodes, at its cut (kept)
        # and at its cap (what the cut gave up), in one compiled call
        kept = np.empty(len(reqs))
        within_caps, given_up, drafts = kernels.load("allocate").cut_accounts(
            flat, lengths, -1 if self.max_per_request is None else int(self.max_per_request), headroom, cuts, kept)
        m.tree_rows_within_caps += min(within_caps, caps["token_budget"])
        m.given_up_accepted += given_up
        if drafts == 0:
            m.steps_without_drafts += 1
            if self.probe_every and m.steps_without_drafts % self.probe_every == 0:
                starts = np.concatenate([[0], np.cumsum(lengths[:-1])])
                best = int(np.argmax(flat[starts]))
                cuts[best] = 1
                kept[best] = flat[starts[best]]
                drafts = 1
                m.probe_steps += 1
        m.last_budget = int(drafts)
        m.tree_rows += m.last_budget
        m.last_predicted_speedup = float(alloc.speedup)
        for r, n, e, c in zip(reqs, cuts.tolist(), kept.tolist(), ctx.tolist()):
            r.spec_token_ids = r.spec_token_ids[:n]
            if n:
                self._kept[r.request_id] = e
                self._ctx[r.request_id] = int(c)

    def _allocate(self, flat: np.ndarray, lengths: np.ndarray, ctx: np.ndarray, chains: np.ndarray, caps: dict):
        """The step's allocation: over the whole lists, and over their leading chains alone.
        A chain is verified by vLLM's own causal attention (no masked recompute of tree rows),
        so its rows cost query tokens only: the cost model's tree terms do not apply. The
        chains-only cut is kept when it predicts the higher rate."""
        alloc = allocate_flat(flat, lengths, self.cost, ctx_lens=ctx, **caps)
        if chains.any():
            if self._chain_cost is None or self._chain_cost.cost is not self.cost:
                self._chain_cost = _ChainCost(self.cost)
            chain_alloc = allocate_flat(flat, lengths, self._chain_cost, limits=chains, **caps)
            if chain_alloc.rate > alloc.rate:
                alloc = chain_alloc
        return alloc

    def warm_up(self) -> None:
        """Compile the cut's kernels (``kernels.allocate``), or load them from numba's disk
        cache, at the scheduler's start rather than in the first tree step, where the whole
        batch waits for them (the workers' kernels: ``TreeDrafter.warm_up``). One allocation of
        one request and one of two, each with its chains-only cut, through ``_allocate``
        itself, and its accounts, and one cost-model least squares; nothing of it is kept (``_chain_cost`` is made
        again for the fitted model)."""
        if not self.enabled:
            return
        for batch in (1, 2):
            lengths = np.full(batch, 2, np.int64)
            flat = np.tile(np.array([0.9, 0.6]), batch)
            caps = dict(num_reqs=batch, fixed_query_tokens=batch, token_budget=max(self.max_batched - batch, 0),
                        max_per_request=self.max_per_request, headroom=[self.max_model_len - 2] * batch,
                        base_tokens=batch)
            alloc = self._allocate(flat, lengths, np.ones(batch), np.ones(batch, np.int64), caps)
            kernels.load("allocate").cut_accounts(flat, lengths, -1, np.full(batch, 9, np.int64), alloc.cuts.copy(),
                                                  np.empty(batch))  # the cut's accounts
        nnls_normal(np.eye(2), np.ones(2))  # the cost model's refit (kernels.fit.nnls_gram)

    def _refresh_cost(self) -> None:
        """Refit the cost model on the steps measured since its last fit (every
        ``refit_every``), now that an allocation needs it; their errors are scored first."""
        if self.cost.stale:
            self._score()
            self.cost.refit()

    def _gate_step(self, running) -> list | None:
        """The running requests with drafts, for a step whose kind the gate chose (plain or
        chains), counted as a step; None (not counted) when no request has drafts or decodes."""
        drafted = [r for r in running if r.spec_token_ids]
        if not drafted and not self._decoding:
            return None
        self.metrics.steps += 1
        return drafted

    def _gate_plain(self, running, probs) -> None:
        """The gate made this step plain: no drafts, no probe, no allocation. Counted as a step
        when some request had drafts or is decoding (the worker drafts nothing while the gate
        stays closed, so most such steps arrive without drafts)."""
        drafted = self._gate_step(running)
        if drafted is None:
            return
        m = self.metrics
        m.steps_without_drafts += 1
        m.gate_plain_steps += 1
        m.tree_rows_offered += int(sum(len(p) for p in probs))
        m.last_budget = 0
        m.last_predicted_speedup = 1.0
        for r in drafted:
            r.spec_token_ids = []

    def _chain_step(self, running) -> None:
        """The gate chose a chain step: every request verifies its chain as proposed (the
        workers drafted chains alone: no probabilities, no allocation), at most
        ``chain_drafts`` tokens, and a tree that arrived instead (the first step, before the
        workers heard of the gate) only its leading chain."""
        drafted = self._gate_step(running)
        if drafted is None:
            return
        m = self.metrics
        m.chain_steps += 1
        kept = 0
        for r in drafted:
            n = min(len(r.spec_token_ids), self.chains.get(r.request_id, 0), self.chain_drafts)
            r.spec_token_ids = r.spec_token_ids[:n]
            kept += n
        m.chain_drafts += kept
        m.last_budget = kept
        if not kept:
            m.steps_without_drafts += 1

    # ------------------------------------------------------------------ 3
    @timed("scheduled")
    def on_scheduled(self, scheduler_output) -> None:
        num = scheduler_output.num_scheduled_tokens
        if not num:
            self._step = None
            return
        spec = scheduler_output.scheduled_spec_decode_tokens
        # tree rows = rows past each request's leading chain (the masked recompute); chain rows
        # are plain query tokens
        beyond = {rid: max(len(v) - self.chains.get(rid, 0), 0) for rid, v in spec.items()}
        rows = sum(beyond.values())
        ctx = sum(n * self._ctx.get(rid, 0) for rid, n in beyond.items())
        speculating = sum(1 for v in spec.values() if v)
        # the gate's arm: None (prompt tokens in the step), speculative (the gate let the step
        # draft, whatever the allocator kept: a step whose drafts were all cut still paid for
        # proposing, scoring, allocating and harvesting them; or it verified drafts), plain
        # (none of that, no accepted tokens re-run, and the workers draft nothing after it), or
        # None for the two steps where the gate switches arms (GateConfig.block says why): the
        # plain step that drafts for the next, and the one that re-runs what the last
        # speculative step accepted (sustained speculation re-runs inside verifying steps).
        # Without a gate the arm is never read.
        decode = not scheduler_output.scheduled_new_reqs and all(rid in self._decoding for rid in num)
        arm = None
        if decode:
            if self._drafting != PLAIN and speculating == 0 and self._unrepaid_next:
                arm = None  # requests the repay rule left plain, the others cut: no measure of speculating
            elif self._drafting != PLAIN or speculating > 0:
                arm = self._drafting if self._drafting != PLAIN else TREE
            elif self.propose_next == PLAIN and not any(self._decoding[rid] > 0 for rid in num):
                arm = PLAIN
        self._step = (len(num), scheduler_output.total_num_scheduled_tokens, rows, ctx, speculating, self._t_cut, arm)

    # ------------------------------------------------------------------ 4
    @timed("on_output")
    def on_output(self, scheduler_output, model_runner_output) -> None:
        now = time.perf_counter()
        calibration = getattr(model_runner_output, "cost_calibration", None)
        if calibration and not self.calibrated:
            self._score()  # the steps so far were predicted by the prior
            self.cost = CostModel.fit([CostSample(*s) for s in calibration], config=self.cost.config)
            self.calibrated = True
            self.start_coefficients = self.cost.coefficients
            logger.info("vllm-anisotropic cost model fitted on %d start-up forwards (error %.3f): %s",
                        len(calibration), self.cost.fit_error(), self.cost.coefficients)
        step, self._step = self._step, None
        m = self.metrics
        # the workers' time proposing the next step's drafts: a cost of the next step (the gate
        # charges it there), sunk when the allocator cuts (the cost model leaves it out)
        propose_s = float(getattr(model_runner_output, "tree_propose_s", 0.0) or 0.0)
        resume_s = float(getattr(model_runner_output, "tree_resume_s", 0.0) or 0.0)
        m.draft_resume_seconds += resume_s
        seconds_up, tokens_up, refused = getattr(model_runner_output, "tree_catchup", None) or (0.0, 0, 0)
        if seconds_up > 0 and tokens_up > 0:  # the latest ~1 / (1 - CATCHUP_DECAY) measures weigh most
            self._catchup = [CATCHUP_DECAY * self._catchup[0] + float(seconds_up),
                             CATCHUP_DECAY * self._catchup[1] + float(tokens_up)]
        m.draft_unrepaid_catchups += refused
        self._unrepaid_next = refused
        if step is not None:
            r, q, t, c, d, t0, arm = step
            seconds = now - t0 - propose_s
            gate_seconds = seconds + self._propose_carry
            self._propose_carry = propose_s - resume_s
            if seconds > 0:
                # scored and fitted in batches (``_score``; ``_refresh_cost`` at the next cut that
                # allocates): a step the gate keeps plain pays for no prediction and no fit
                self._unscored.append((r, q, t, c, d, seconds))
                if len(self._unscored) >= SCORE_BATCH:
                    self._score()
                if self.online:
                    self.cost.update(CostSample(r, q, t, c, d, seconds), refit=False)
        else:
            self._propose_carry += propose_s - resume_s
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        if step is not None and arm is not None and self.gate is not None and sampled:
            rows = [index.get(rid) for rid in scheduler_output.num_scheduled_tokens]
            tokens = sum(len(sampled[i]) for i in rows if i is not None and i < len(sampled))
            self.gate.observe(r, arm, tokens, gate_seconds)
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            i = index.get(rid)
            if not drafts or i is None or rid not in self._kept or i >= len(sampled):
                continue
            m.predicted_accepted += self._kept[rid]
            m.realized_accepted += max(len(sampled[i]) - 1, 0)

    @timed("stats")
    def tick(self) -> None:
        """The stats file at most once a second and the summary line every 10 s, after
        ``on_output`` (a phase of its own: a cost per second, not per step)."""
        self._tick(time.perf_counter())

    def flush(self) -> None:
        """Write the stats file now (the batch drained)."""
        self._tick(time.perf_counter(), force=True)

    def _score(self) -> None:
        """Cost-model error of the measured steps not yet scored, predicted in one call by the
        model in use when they ran: the model changes only at a refit (``cut``) or at the
        start-up fit, and both score the pending steps first."""
        if not self._unscored:
            return
        rows = np.asarray(self._unscored, np.float64)  # [num_steps, 6]
        self._unscored = []
        predicted = np.atleast_1d(self.cost.predict(*rows[:, :5].T))
        self.metrics.cost_samples += len(rows)
        self.metrics.cost_abs_rel_err += float(np.sum(np.abs(predicted - rows[:, 5]) / rows[:, 5]))

    def _tick(self, now: float, force: bool = False) -> None:
        if self.stats_path and (force or now - self._last_write >= WRITE_INTERVAL_S):
            self._score()
            from vllm_anisotropic.integration.vllm.engine.metrics import write_json_atomic

            self._last_write = now
            stats = asdict(self.metrics)
            if self.gate is not None:
                stats["gate"] = {str(k): v for k, v in self.gate.rates().items()}
            if self.start_coefficients:
                stats["cost_model_start"] = self.start_coefficients
            if self.enabled:
                stats["cost_model_now"] = self.cost.coefficients  # after the online refits
            write_json_atomic(self.stats_path, stats)
        if self.enabled and self.metrics.steps and now - self._last_log >= LOG_INTERVAL_S:
            self._last_log = now
            self._score()
            log.info(self.metrics.summary_line())
