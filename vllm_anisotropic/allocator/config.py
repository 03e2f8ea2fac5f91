"""Typed, validated tunables of the budget allocator's two models (pydantic).

Scope: the cost model's fit and online-refinement knobs and the acceptance model's calibration
and gating knobs. No algorithm here; the math that reads each field lives next to its use in
``cost.py`` and ``acceptance.py``. An unknown key is an error that names the valid keys.

Defaults: ECHO (arXiv 2604.09603) publishes no AUC threshold for its "sweet spots" (Sec. 3.2
only says AUC_d > xi); 0.70 is ours ("acceptable discrimination" in Hanley & McNeil's scale,
the paper ECHO cites for the AUC). Everything else is ours and documented per field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from vllm_anisotropic.config_base import StrictConfig

__all__ = ["AcceptanceConfig", "AllocatorModelConfig", "CostModelConfig", "GateConfig", "GatingMode"]

GatingMode = Literal["sparse", "dense"]


class AllocatorModelConfig(StrictConfig):
    """Base of the allocator model configs (``config_base.StrictConfig``)."""


class CostModelConfig(AllocatorModelConfig):
    """Fit and online refinement of the step-latency model (``cost.CostModel``)."""

    ridge: float = Field(default=1e-6, ge=0.0)
    """Ridge weight on the column-normalised coefficients: makes the non-negative least
    squares solution unique (so every process that fits the same samples gets the same
    coefficients) without visibly biasing it."""
    window: int = Field(default=512, ge=1)
    """Online step-time samples kept (a ring buffer): bounds memory and refit time."""
    forget: float = Field(default=0.99, gt=0.0, le=1.0)
    """Per-update decay of every retained sample's weight: an online sample of age a weighs
    forget**a (effective memory ~ 1 / (1 - forget) = 100 steps)."""
    calibration_floor: float = Field(default=2.0, ge=0.0)
    """Calibration-sweep samples decay like online ones, but the sweep as a whole never weighs
    less than this many online steps (spread evenly over its samples), so the regions the
    online steps never visit keep their calibrated shape while the visited ones follow the
    online data (the online window weighs ~1 / (1 - forget) = 100)."""
    refit_every: int = Field(default=32, ge=1)
    """Refit the coefficients after this many online samples. A refit (non-negative least
    squares over the window, on its normal equations: ``kernels.fit.nnls_gram``) costs ~0.3-0.4
    ms on a 2-core CPU (~0.7-1.1 ms by the SVD sub-solves it replaced); 32 keeps it near 0.01 ms
    a step, well inside the window's memory of ~100 steps."""


class AcceptanceConfig(AllocatorModelConfig):
    """Calibration of node values into P(node on the accepted path) (``acceptance.AcceptanceModel``)."""

    max_depth: int = Field(default=8, ge=1)
    """Depth buckets 1..max_depth; deeper nodes share the last bucket."""
    num_bins: int = Field(default=128, ge=4)
    """Histogram bins over logit(value) in [logit_min, logit_max], per (source, depth): the
    sufficient statistics of the Platt fit and of the AUC."""
    logit_min: float = -10.0
    """Lower edge of the histogram on the logit scale (values below fall in the first bin)."""
    logit_max: float = 10.0
    """Upper edge of the histogram on the logit scale (values above fall in the last bin)."""
    prior_strength: float = Field(default=1.0, gt=0.0)
    """Precision of the Gaussian prior on the Platt coefficients, centred on the identity map
    (intercept 0, slope 1: calibrated probability = value), in units of Fisher information:
    one observation at probability p carries p (1 - p) <= 1/4, so 1.0 is worth ~4-40
    observations. Measured (GOOSE on SmolLM2-135M, 18 prompts, held-out half of the steps):
    1.0 predicts the branch nodes' accepted count within 4 %, 10.0 over-predicts it by 16 %."""
    prior_intercept: float = 0.0
    """Centre of the prior's intercept: before any label P = sigmoid(prior_intercept + logit(v)).
    0 trusts the proposer's values until labels arrive. -2 (a value of 0.5 counts as 0.12) was
    tried against GOOSE's over-rated first values (README demo 1.00x / 1.01x against 0.97-0.99x
    with 0) but made a short draft-tree run keep no draft at all: q's values are calibrated far
    better than GOOSE's, and one intercept serves every source."""
    decay: float = Field(default=1.0, gt=0.0, le=1.0)
    """Per-update decay of every histogram count (1 = remember everything; 0.995 forgets with
    a half-life of ~140 updates)."""
    refit_every: int = Field(default=1, ge=1)
    """Refit the Platt coefficients after every this many ``update`` calls (predictions in
    between use the last fit), and after updates 1, 2, 4, ... below it (the first data move the
    map most). The engine's drafter sets 16: one refit costs ~0.7 ms of host
    time, measured as 1.2 ms of a 38 ms step at one request at a time when refitted every step."""
    newton_steps: int = Field(default=12, ge=1)
    """Newton iterations of each refit (a fixed count, so the fit is deterministic)."""
    gating: GatingMode = "sparse"
    """ECHO sparse gating (arXiv 2604.09603, Sec. 3.2): ``sparse`` resolves the value only at
    sweet-spot (source, depth) keys and uses one pooled rate at the others; ``dense`` resolves
    it everywhere."""
    auc_threshold: float = Field(default=0.70, ge=0.5, le=1.0)
    """A (source, depth) key is a sweet spot when AUC(value vs accepted) > this (ECHO's xi)."""
    min_class_count: float = Field(default=50.0, ge=1.0)
    """Accepted and rejected (decayed) counts a key needs before its AUC decides anything; below,
    the key is *warming up* and uses the prior-shrunk Platt fit."""


class GateConfig(AllocatorModelConfig):
    """The measured per-batch-size gate (``gate.SpeculationGate``). All values are ours."""

    min_steps: int = Field(default=8, ge=1)
    """Decode steps each arm needs at a batch size before the rates decide anything. The
    warm-up alternates one speculative step and one plain block, of which the engine counts
    ``block`` - 2 to ``block`` - 1 steps as plain: ~3 x this many decisions per bucket."""
    block: int = Field(default=4, ge=1)
    """Every switch from speculation to plain decoding lasts this many steps at a batch size,
    so that plain steps can be measured apart from speculation: in the engine, the first step
    of a plain block re-runs the tokens the speculative step before it accepted and the last
    drafts for the speculative step after it, and neither is counted in an arm (budget.py),
    so only the ones in between are the plain arm's. Measured on the AMX Xeon at 9-16 requests
    (SmolLM2-135M): a plain step followed by a drafting one took 49.8-60.8 ms against 43.4 ms
    for one between plain steps, 2-12 ms beyond the proposing the runner times; with single
    plain steps between speculative ones every warm-up and exploring plain step was such a
    step, the plain arm read 269 tokens/s where vLLM's plain engine ran the same cell's steps
    at 329, and the gate stayed open on a losing arm (docs/allocator.md). The engine needs at
    least 3."""
    margin: float = Field(default=0.10, ge=0.0, lt=1.0)
    """The gate exploits speculation only while its arm's rate exceeds the plain arm's by more
    than this fraction (and takes tree steps over chain steps only where they are faster by
    more than it); within it, plain. Two reasons. The arms are estimates from a few dozen steps
    each where a cell is short (~100 decode steps at sixteen requests), and a tie is not a
    reason to speculate: at sixteen requests they stood at 322.6 vs 326.7 tokens/s and the gate
    stayed open on that 1 % while the cell lost. And speculation costs outside its own steps,
    which the arms do not see: requests advance by their own accepted drafts, so they finish
    out of step, a draining batch takes more steps and new requests' prompts arrive one or two
    a step (129 requests at 64 in process, one run each: 38 steps admitted new requests, 6.06 s,
    against plain vLLM's 32, 5.51 s). Where speculation pays on the AMX Xeon (1 to 8 requests) the arms
    differ by 25-56 %. Measured side by side (bench, 8-64 requests, 3 repeats): 10 % against
    3 % gave 1.07x / 1.07x / 1.08x / 1.01x against 1.09x / 0.98x / 0.96x / 0.97x of plain
    decoding at 8 / 16 / 32 / 64 requests (docs/allocator.md). A margin of its own at 3 % for
    trees over chains measured no better (0.97-0.99x of this one at 1 / 8 / 16 requests, tune
    split; docs/measurements/cpu/allocator_measurements.md): at one request what sends an engine
    to chains is its arms' noise, not the margin."""
    explore_every: int = Field(default=32, ge=2)
    """A closed gate lets every this-many-th decision at a batch size speculate (one step), so
    it re-opens when speculation starts paying: costs ~1/this of the difference."""
    explore_shortfall: float = Field(default=0.2, gt=0.0, le=1.0)
    """A closed gate explores every ``explore_every``-th decision while speculation falls short
    of opening by this fraction or more, and proportionally more often when it falls short by
    less (down to every ``explore_every`` // 8-th): an exploring step then costs at most ~this /
    ``explore_every`` of the tokens (0.6 % at the defaults) plus the switch steps around it (the
    plain step that drafts for it and the one that re-runs what it accepted: ~10 % of a step
    each at 64 requests on the AMX Xeon, docs/allocator.md), and an arm that nearly pays is
    measured often enough to open within ~100 decode steps (a sixteen-request bench cell on the
    AMX Xeon). Measured there, in process, 48 prompts: chain steps at 530-550 tokens/s against
    plain's 597 while the requests were young, 550-960 later; every 32nd decision took ~200
    decisions to open the gate again (docs/allocator.md)."""
    explore_plain_every: int | None = Field(default=None, ge=2)
    """An open gate starts a plain block (``block`` steps) every this-many-th decision at a
    batch size, to refresh the plain arm: costs ~``block``/this of the difference. None:
    ``block`` x ``explore_every`` (128 at the defaults: 1/32, as for a closed gate)."""
    decay: float = Field(default=0.995, gt=0.0, le=1.0)
    """Decay of both arms' sums per decode step at the batch size (memory ~ 1 / (1 - decay) =
    200 steps, of which ~6 are the other arm's exploration steps)."""
    clip: float = Field(default=3.0, gt=1.0)
    """A step's seconds count at most this many times the median of its bucket's recent steps
    (stalls from outside the engine; genuinely slower steps stay below ~3x)."""
    window: int = Field(default=64, ge=4)
    """Recent steps per bucket whose median sets the clip (clipping starts after window / 4)."""
    chains: bool = False
    """Measure chain steps (the proposer's chain alone: no branches, ranking, cut or harvest)
    as a third arm beside plain and tree steps, and speculate with the faster kind
    (``gate.SpeculationGate.kind``). The engine sets it for proposers that draft chains
    (``Proposer.drafts_chains``) unless ``allocator_chains`` is false."""
    exact_buckets: int = Field(default=4, ge=1)
    """Batch sizes up to this have their own bucket; larger ones share power-of-two buckets
    (5..8 -> 8). Each bucket pays its own warm-up (~3 x ``min_steps`` decisions). With the
    warm-up of the time (2 x 16 decisions, half of them drafting) and exact buckets up to 8, a
    batch of 8 draining to 0 warmed up 7, 6, 5 afresh, about 30% of the steps of a 24-prompt
    cell at concurrency 8, drafting where it loses. A shared bucket's rates are dominated by its
    largest batch size, where speculation pays least: the error leans towards plain decoding."""
