"""Step-latency model: seconds of one target forward as a function of what it verifies.

Scope: the cost model of the budget allocator (issue 10). It predicts the wall time of one
engine step from four totals of the step and refines itself from measured step times. It
does not time anything itself (the engine's calibration sweep and its step loop do) and it
never imports vLLM or torch.

Source: the step is the denominator of ECHO's speedup proxy (arXiv 2604.09603, Sec. 2,
Eq. 1), and ECHO's compute-bound law T_ver = T_AR (1 + gamma [K_total - K_max]^+) (Sec. 2,
Eq. 2) is the special case "flat, then linear" of the piecewise-linear form below.

Terms
-----
num_reqs (R)
    Requests in the step (decoding and prefilling alike).
query_tokens (Q)
    Every query row the forward computes: one root per decoding request, prefill chunks,
    re-run tokens (the KV repair of docs/engine.md step 6) and tree rows.
tree_rows (T)
    Draft nodes verified in the step (the rows after each root). ``T <= Q``.
ctx_tokens (C)
    Sum over tree rows of the context each attends to (its request's length). The CPU path
    recomputes tree rows with a masked SDPA over the request's KV, so this is a real cost there.
spec_reqs (D)
    Requests with at least one draft verified in the step (chain or tree). Each costs host work
    a plain row does not: its tree is cut, packed and walked, its verified rows harvested, its
    next tree drafted and scored; and the step takes vLLM's speculative path (per-draft logits
    rows, the rejection sampler) once any request has drafts.

The form (all coefficients >= 0, fitted by non-negative least squares)::

    seconds = b0 + b_R R                          # launch + per-request bookkeeping
            + sum_j s_j seg_j(Q)                  # piecewise linear in Q, knots k_0=0 < k_1 < ...
            + b_on [T > 0] + b_onR R [T > 0]      # the switch to the tree path (H100: 1 -> 2 rows)
            + b_T T + b_C C                       # extra work per tree row (masked recompute)
            + b_spec [D > 0] + b_D D              # the speculative path, per speculating request
            + b_S S                               # S = 1 for a whole engine step, 0 for a bare forward

    seg_j(Q) = clip(Q - k_j, 0, k_{j+1} - k_j)    (the last segment is unbounded)

so the Q part is continuous, piecewise linear with slope s_j on [k_j, k_{j+1}], and, since every
coefficient is >= 0, the prediction is non-decreasing in R, Q, T, C and D. Worked example:
knots [0, 16, 64], Q = 40 -> seg = [16, 24, 0]; Q = 100 -> seg = [16, 48, 36].

Why this form (the data it has to fit):
- CPU, 2 cores, SmolLM2-135M (issue 10): a GOOSE tree cut to 4 nodes runs at 1.22x plain, 8
  nodes 1.02x, 60 nodes ~0.25x at one request: cost about linear in Q (one segment).
- H100, graph-captured step (docs/gpu.md Sec. 2): flat in Q up to ~16-32 rows per request at
  small batch (small s_j), a jump from 1 to 2 rows per request (b_on, b_onR: SDPA's decode path
  against its general path; the jump grows with the batch), linear once R x rows >= ~1000
  (a large last slope). Fitted per (shape, context) table of docs/measurements/h100/
  verify_cost.json (42 points each, knots 0, 2, 4, ..., 1024), the mean absolute relative
  error is 0.9 / 2.9 % (0.5B, context 512 / 2048) and 0.9 / 2.3 % (1.5B);
  ``tests/test_allocator.py`` re-fits them. One fit over both contexts: 7 %, because the
  attention of the *root* rows over their context is not a feature (it costs the same with or
  without drafts; the online refit follows the current context mix).
- ECHO Eq. 2 is flat-then-linear in the total verified tokens: two segments.

Why S: the start-up sweep times bare forwards (vLLM's ``_dummy_run``), while an engine step
also samples, verifies, harvests, drafts and schedules. Measured on the tiny test model: 2.5 ms
per bare forward of 8 requests, 22 ms per engine step. Without S the two conflict on the same
(R, Q) and the relative fit (below) sides with the small bare forwards; with S the sweep fixes
the *shape* in Q and the online steps the level. Predictions are of engine steps (S = 1); S
is 0 in every fit of a sweep alone, so ``b_S`` stays 0 until online steps arrive.

Fit: weighted by 1 / seconds (the *relative* error is minimised, so a 3 ms and a 300 ms step
count alike, and a step that stalled for a reason outside the model has a relative residual
bounded by 1, which limits its pull); columns normalised; a tiny ridge makes the solution
unique. Online: the last ``window`` measured steps are kept in a ring buffer with weights
``forget**age``; the calibration sweep stays in the fit with weights decaying to a floor (the
whole sweep weighs at least ``calibration_floor`` online steps); the coefficients are refitted
every ``refit_every`` samples. Memory is bounded by the window; the refit is deterministic, so
the same sample sequence gives the same predictions on every process (tensor-parallel ranks
included).

Serialization: versioned JSON (``to_json``/``from_json``), never pickle. Floats are written
with Python's shortest round-trip repr, so a reloaded model predicts bit-identically.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from typing import NamedTuple

import numpy as np

from vllm_anisotropic import kernels

from .config import CostModelConfig

__all__ = [
    "COST_MODEL_FORMAT",
    "COST_MODEL_VERSION",
    "CostModel",
    "CostSample",
    "cost_features",
    "default_knots",
    "nnls",
    "nnls_normal",
    "query_segments",
]

logger = logging.getLogger(__name__)

COST_MODEL_FORMAT = "vllm_anisotropic.allocator.CostModel"
COST_MODEL_VERSION = 3
_COLUMNS = 6  # a sample row: R, Q, T, C, D, seconds
# the named coefficients after the Q slopes, in column order (``cost_features``)
_TAIL = ("tree_switch", "tree_switch_per_request", "tree_row", "tree_ctx", "spec_switch", "spec_request",
         "step_overhead")


class CostSample(NamedTuple):
    """One measured step: what it verified and how long it took."""

    num_reqs: int
    query_tokens: int
    tree_rows: int
    ctx_tokens: int
    spec_reqs: int
    seconds: float


def default_knots(max_query_tokens: float) -> np.ndarray:
    """Knots 0, 2, 4, 8, ... below ``max_query_tokens`` (a geometric grid: latency regimes of
    an accelerator change by factors, not by fixed steps). ``default_knots(100) -> [0,2,4,8,16,32,64]``.
    """
    top = max(float(max_query_tokens), 2.0)
    k = [0.0]
    p = 2.0
    while p < top:
        k.append(p)
        p *= 2.0
    return np.asarray(k, np.float64)


def query_segments(query_tokens, knots: np.ndarray) -> np.ndarray:
    """[num_samples, num_knots] amount of Q inside each knot segment.

    ``seg_j(Q) = clip(Q - k_j, 0, k_{j+1} - k_j)``, last segment unbounded; the rows sum to Q.
    ``knots [0,16,64], Q [40, 100] -> [[16,24,0], [16,48,36]]``.
    """
    q = np.asarray(query_tokens, np.float64).reshape(-1, 1)
    k = np.asarray(knots, np.float64)
    width = np.append(np.diff(k), np.inf)  # [num_knots]
    return np.clip(q - k[None, :], 0.0, width[None, :])


def feature_names(knots: np.ndarray) -> list[str]:
    """Names of the columns of ``cost_features`` (also the JSON keys of the coefficients)."""
    segs = [f"q_slope[{float(k):g}]" for k in knots]
    return ["base", "per_request", *segs, *_TAIL]


def cost_features(num_reqs, query_tokens, tree_rows, ctx_tokens, spec_reqs, knots: np.ndarray,
                  engine_step=1.0) -> np.ndarray:
    """[num_samples, num_features] design matrix of the cost form (module docstring).

    Columns: 1, R, seg_0(Q) .. seg_m(Q), [T>0], R [T>0], T, C, [D>0], D, S (1 for a whole
    engine step, 0 for a bare calibration forward). Arguments broadcast.
    ``R=2, Q=10, T=8, C=800, D=2, knots [0,4] -> [1, 2, 4, 6, 1, 2, 8, 800, 1, 2, 1]``.
    """
    r, q, t, c, d, e = np.broadcast_arrays(
        np.asarray(num_reqs, np.float64), np.asarray(query_tokens, np.float64),
        np.asarray(tree_rows, np.float64), np.asarray(ctx_tokens, np.float64),
        np.asarray(spec_reqs, np.float64), np.asarray(engine_step, np.float64),
    )
    r, q, t, c, d, e = (x.reshape(-1) for x in (r, q, t, c, d, e))
    on = (t > 0).astype(np.float64)
    spec = (d > 0).astype(np.float64)
    return np.column_stack([np.ones_like(r), r, query_segments(q, knots), on, r * on, t, c, spec, d, e])


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin_{x >= 0} ||a x - b||_2: Lawson & Hanson's active-set algorithm (1974, Ch. 23).

    ``a`` [num_rows, num_cols], ``b`` [num_rows]. Deterministic (a fixed pivot rule and SVD
    least-squares sub-solves). ``nnls([[1,0],[0,1]], [1,-1]) -> [1, 0]``.
    """
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    m, n = a.shape
    assert b.shape == (m,)
    x = np.zeros(n)
    passive = np.zeros(n, bool)
    tol = _nnls_tol(a)
    grad = a.T @ (b - a @ x)  # [num_cols] negative gradient of 0.5 ||a x - b||^2
    for _ in range(max_iter or 3 * n + 10):
        free = ~passive
        if not free.any() or grad[free].max() <= tol:
            break
        j = int(np.argmax(np.where(free, grad, -np.inf)))  # most violated KKT condition
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if np.all(z[passive] > tol):
                break
            # step from x towards z until the first passive coefficient hits 0, drop it
            neg = passive & (z <= tol)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                z = np.zeros(n)
                break
        x = z
        grad = a.T @ (b - a @ x)
    return x


def _nnls_tol(a: np.ndarray) -> float:
    m, n = a.shape
    return 10.0 * np.finfo(np.float64).eps * max(m, n) * max(np.abs(a).sum(axis=0).max(initial=0.0), 1.0)


def nnls_normal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``nnls`` by its normal equations, compiled (``kernels.fit.nnls_gram``): one ``a^T a``, then
    Cholesky sub-solves of at most ``num_cols`` unknowns, the same pivot rule and tolerance; for
    ``a`` of full column rank (the cost fit's ridge rows make it so), where it agrees with
    ``nnls`` to the rounding of ``a^T a`` (its condition number squared). Falls back to ``nnls``
    where a Cholesky pivot is not positive (a singular block). ``nnls_normal([[1,0],[0,1]], [1,-1]) -> [1, 0]``."""
    a = np.ascontiguousarray(a, np.float64)
    b = np.ascontiguousarray(b, np.float64)
    n = a.shape[1]
    x = np.empty(n)
    if kernels.load("fit").nnls_gram(a.T @ a, a.T @ b, _nnls_tol(a), 3 * n + 10, x):
        return x
    return nnls(a, b)


class CostModel:
    """Predicts one step's seconds from (R, Q, T, C, D); fitted by ``fit``, refined by ``update``.

    Example::

        model = CostModel.fit(samples)                  # a calibration sweep (CostSample rows)
        model.predict(8, 8 + 40, 40, 40 * 512, 8)       # 8 requests, 40 tree rows, all speculating
        model.update(CostSample(8, 48, 40, 20480, 8, 0.0123))   # a measured step
        CostModel.from_json(model.to_json())            # identical predictions
    """

    def __init__(
        self,
        knots,
        weights,
        config: CostModelConfig | None = None,
        calibration: np.ndarray | None = None,
    ) -> None:
        self.config = config or CostModelConfig()
        # [num_knots] float64, k_0 = 0 < k_1 < ...
        self.knots = np.asarray(knots, np.float64)
        if self.knots.ndim != 1 or self.knots.size < 1 or self.knots[0] != 0 or np.any(np.diff(self.knots) <= 0):
            raise ValueError(f"knots must start at 0 and increase strictly, got {self.knots.tolist()}")
        self.weights = weights  # [num_features] float64 >= 0 (the property below)
        if self.weights.shape != (len(feature_names(self.knots)),):
            raise ValueError(f"weights must have {len(feature_names(self.knots))} entries (one per feature)")
        if np.any(self.weights < 0) or not np.all(np.isfinite(self.weights)):
            raise ValueError("weights must be finite and >= 0 (the model is monotone by construction)")
        # [num_calibration, 6] rows (R, Q, T, C, D, seconds) of the sweep the model was fitted on
        self.calibration = (np.zeros((0, _COLUMNS)) if calibration is None
                            else np.asarray(calibration, np.float64).reshape(-1, _COLUMNS))
        self._online: deque[tuple[float, ...]] = deque(maxlen=self.config.window)
        self._updates = 0  # online samples seen since the calibration fit
        self._since_refit = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def linear(cls, base_s: float, per_token_s: float, config: CostModelConfig | None = None) -> CostModel:
        """seconds = base_s + per_token_s * Q (one segment): the CPU shape, and ECHO Eq. 2 with K_max = 0."""
        w = np.zeros(len(feature_names(np.zeros(1))))
        w[0], w[2] = base_s, per_token_s
        return cls(np.zeros(1), w, config)

    @classmethod
    def from_coefficients(cls, knots, config: CostModelConfig | None = None, **coef: float) -> CostModel:
        """Build from named coefficients: ``base``, ``per_request``, ``slopes`` (one per knot),
        ``tree_switch``, ``tree_switch_per_request``, ``tree_row``, ``tree_ctx``, ``spec_switch``,
        ``spec_request``, ``step_overhead``; missing = 0."""
        knots = np.asarray(knots, np.float64)
        slopes = np.asarray(coef.pop("slopes", np.zeros(len(knots))), np.float64)
        if slopes.shape != knots.shape:
            raise ValueError("slopes needs one entry per knot")
        names = ["base", "per_request", *_TAIL]
        unknown = sorted(set(coef) - set(names))
        if unknown:
            raise ValueError(f"unknown coefficient(s) {unknown}; valid: {sorted(names + ['slopes'])}")
        v = {k: float(coef.get(k, 0.0)) for k in names}
        w = [v["base"], v["per_request"], *slopes, *(v[k] for k in _TAIL)]
        return cls(knots, w, config)

    @classmethod
    def fit(cls, samples, knots=None, config: CostModelConfig | None = None) -> CostModel:
        """Fit on a calibration sweep: rows (num_reqs, query_tokens, tree_rows, ctx_tokens, spec_reqs, seconds).

        Knots default to ``default_knots(max Q of the sweep)``. The sweep should vary the tree
        rows at a fixed number of requests *and* include steps with prefill tokens, or T and
        Q - R are collinear (the ridge then splits their weight; predictions on the sweep's own
        manifold are unaffected).
        """
        data = _as_samples(samples)
        if data.shape[0] == 0:
            raise ValueError("fit needs at least one sample")
        k = default_knots(data[:, 1].max()) if knots is None else np.asarray(knots, np.float64)
        model = cls(k, np.zeros(len(feature_names(k))), config, calibration=data)
        model.weights = _weighted_fit(data, np.ones(len(data)), model.knots, model.config.ridge, np.zeros(len(data)))
        return model

    # ------------------------------------------------------------------ prediction
    @property
    def coefficients(self) -> dict[str, float]:
        """Named coefficients (seconds per unit of each feature)."""
        return dict(zip(feature_names(self.knots), (float(w) for w in self.weights)))

    @property
    def ctx_weight(self) -> float:
        """Seconds per context token of a tree row (b_C): the allocator's per-node linear cost."""
        return self._coefficient("tree_ctx")

    @property
    def spec_request_weight(self) -> float:
        """Seconds per speculating request (b_D): the fixed host cost of giving a request drafts."""
        return self._coefficient("spec_request")

    def _coefficient(self, name: str) -> float:
        """One of the named coefficients after the Q slopes (``_TAIL``)."""
        return float(self.weights[2 + self.knots.size + _TAIL.index(name)])

    def predict(self, num_reqs, query_tokens, tree_rows, ctx_tokens=0.0, spec_reqs=None):
        """Seconds of a step (float for scalar inputs, else an array of the broadcast shape).

        ``spec_reqs`` (D) defaults to ``min(R, T)``: every tree row's request speculates, as many
        requests as there are rows (exact for the calibration sweep's D = 0 at T = 0).

        Evaluated without the design matrix (the allocator calls this on every candidate total
        of a step): the Q part is ``np.interp`` over its values at the knots,
        f(k_j) = sum_{l < j} s_l (k_{l+1} - k_l), extended past the last knot with its slope.
        Equal to ``cost_features(...) @ weights`` up to rounding.
        """
        if spec_reqs is None:
            spec_reqs = np.minimum(np.asarray(num_reqs, np.float64), np.asarray(tree_rows, np.float64))
        r, q, t, c, d = np.broadcast_arrays(
            np.asarray(num_reqs, np.float64), np.asarray(query_tokens, np.float64),
            np.asarray(tree_rows, np.float64), np.asarray(ctx_tokens, np.float64), np.asarray(spec_reqs, np.float64),
        )
        m = self.knots.size
        w = self.weights
        slopes = w[2: 2 + m]
        b_on, b_on_r, b_t, b_c, b_spec, b_d, b_step = w[2 + m:]
        at_knots = np.concatenate([[0.0], np.cumsum(slopes[:-1] * np.diff(self.knots))])  # [num_knots] f(k_j)
        top = self.knots[-1]
        f_q = np.interp(np.minimum(q, top), self.knots, at_knots) + slopes[-1] * np.maximum(q - top, 0.0)
        on = t > 0
        out = w[0] + w[1] * r + f_q + on * (b_on + b_on_r * r) + b_t * t + b_c * c + (d > 0) * b_spec + b_d * d + b_step
        return float(out) if out.ndim == 0 else out

    @property
    def weights(self) -> np.ndarray:
        """[num_features] float64 >= 0, the columns of ``cost_features`` (set as a whole: a fit
        assigns new weights, and ``kernel_params`` is recomputed from them)."""
        return self._weights

    @weights.setter
    def weights(self, value) -> None:
        self._weights = np.asarray(value, np.float64)
        self._kernel_params = None

    def kernel_params(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``predict`` as arrays for the compiled allocator (``kernels.allocate.step_seconds``):
        ``(knots [m], f at the knots [m], tail [10])``, tail = (w0, w_request, last Q slope,
        b_on, b_on_r, b_t, b_c, b_spec, b_d, b_step). Computed once per set of weights (the
        allocator asks every step)."""
        if self._kernel_params is None:
            m = self.knots.size
            w = self.weights
            slopes = w[2: 2 + m]
            at_knots = np.concatenate([[0.0], np.cumsum(slopes[:-1] * np.diff(self.knots))])
            b_on, b_on_r, b_t, b_c, b_spec, b_d, b_step = w[2 + m:]
            tail = np.array([w[0], w[1], slopes[-1], b_on, b_on_r, b_t, b_c, b_spec, b_d, b_step], np.float64)
            self._kernel_params = (self.knots, at_knots, tail)
        return self._kernel_params

    def fit_error(self, samples=None) -> float:
        """Mean absolute relative error |pred - seconds| / seconds over ``samples`` (default: the
        calibration sweep plus the online window)."""
        if samples is None:
            data, _, step = self._retained()
        else:
            data = _as_samples(samples)
            step = np.ones(len(data))  # given samples are engine steps, as predict() assumes
        if data.shape[0] == 0:
            return float("nan")
        pred = cost_features(*data[:, :5].T, self.knots, step) @ self.weights
        return float(np.mean(np.abs(pred - data[:, 5]) / data[:, 5]))

    # ------------------------------------------------------------------ online refinement
    def update(self, sample, refit: bool = True) -> None:
        """Add one measured step (a ``CostSample`` or 6-tuple); refit every ``refit_every`` calls.

        ``refit=False`` only records the step: the caller refits when it next needs a prediction
        (``refresh``). The engine's scheduler does that, so that the steps in which nothing is
        allocated (the measured gate keeps them plain) pay for no fit at all."""
        row = tuple(float(x) for x in sample)
        if len(row) != _COLUMNS or not row[5] > 0 or not all(map(math.isfinite, row)):
            raise ValueError("a cost sample is (num_reqs, query_tokens, tree_rows, ctx_tokens, spec_reqs, seconds > 0), "
                             f"got {sample}")
        self._online.append(row)  # type: ignore[arg-type]
        self._updates += 1
        self._since_refit += 1
        if refit:
            self.refresh()

    @property
    def stale(self) -> bool:
        """``refit_every`` or more steps arrived since the last fit."""
        return self._since_refit >= self.config.refit_every

    def refresh(self) -> bool:
        """Refit if ``stale``; True if it did."""
        if not self.stale:
            return False
        self.refit()
        return True

    def refit(self) -> None:
        """Refit the coefficients on the calibration sweep and the online window (their weights)."""
        data, w, step = self._retained()
        self._since_refit = 0
        if data.shape[0]:
            self.weights = _weighted_fit(data, w, self.knots, self.config.ridge, step)

    def _retained(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """([num_samples, 6] rows, [num_samples] weights, [num_samples] engine-step flags):
        calibration forwards (flag 0) then online engine steps (flag 1), oldest first."""
        cfg = self.config
        online = np.asarray(self._online, np.float64).reshape(-1, _COLUMNS)
        age = np.arange(len(online) - 1, -1, -1, dtype=np.float64)  # newest has age 0
        w_online = cfg.forget**age
        n_cal = max(len(self.calibration), 1)
        w_cal = np.full(len(self.calibration), max(cfg.calibration_floor / n_cal, cfg.forget**self._updates))
        flags = np.concatenate([np.zeros(len(self.calibration)), np.ones(len(online))])
        return np.concatenate([self.calibration, online]), np.concatenate([w_cal, w_online]), flags

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> str:
        """Versioned JSON: config, knots, named coefficients, retained samples, counters."""
        return json.dumps({
            "format": COST_MODEL_FORMAT,
            "version": COST_MODEL_VERSION,
            "config": self.config.model_dump(),
            "knots": self.knots.tolist(),
            "coefficients": self.coefficients,
            "calibration": self.calibration.tolist(),
            "online": [list(r) for r in self._online],
            "updates": self._updates,
            "since_refit": self._since_refit,
        })

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        d = json.loads(text)
        if d.get("format") != COST_MODEL_FORMAT or d.get("version") != COST_MODEL_VERSION:
            raise ValueError(f"not a {COST_MODEL_FORMAT} v{COST_MODEL_VERSION} document: {d.get('format')} v{d.get('version')}")
        knots = np.asarray(d["knots"], np.float64)
        names = feature_names(knots)
        if sorted(d["coefficients"]) != sorted(names):
            raise ValueError(f"coefficients must be exactly {names}")
        model = cls(knots, [d["coefficients"][k] for k in names], CostModelConfig(**d["config"]),
                    calibration=np.asarray(d["calibration"], np.float64).reshape(-1, _COLUMNS))
        model._online.extend(tuple(r) for r in d["online"])
        model._updates = int(d["updates"])
        model._since_refit = int(d["since_refit"])
        return model


def _as_samples(samples) -> np.ndarray:
    """[num_samples, 6] float64 rows (R, Q, T, C, D, seconds), validated."""
    data = np.asarray([tuple(s) for s in samples], np.float64).reshape(-1, _COLUMNS)
    if np.any(data[:, 5] <= 0) or not np.all(np.isfinite(data)):
        raise ValueError("every sample needs finite values and seconds > 0")
    if np.any(data[:, 2] > data[:, 1]):
        raise ValueError("tree_rows cannot exceed query_tokens (tree rows are query rows)")
    if np.any(data[:, 4] > data[:, 0]):
        raise ValueError("spec_reqs cannot exceed num_reqs (speculating requests are requests)")
    return data


def _weighted_fit(data: np.ndarray, weight: np.ndarray, knots: np.ndarray, ridge: float, engine_step) -> np.ndarray:
    """Coefficients >= 0 minimising sum_s weight_s ((pred_s - y_s) / y_s)^2 + ridge ||w * scale||^2.

    ``data`` [num_samples, 6], ``weight`` [num_samples]. Columns are scaled to unit max so the
    ridge and the NNLS tolerance see comparable numbers; all-zero columns keep weight 0.
    """
    x = cost_features(*data[:, :5].T, knots, engine_step)  # [num_samples, num_features]
    y = data[:, 5]
    row = np.sqrt(weight) / y  # relative error: divide each row by its own seconds
    scale = np.abs(x).max(axis=0)
    live = scale > 0
    xs = x[:, live] / scale[live]
    a = np.vstack([xs * row[:, None], np.sqrt(ridge) * np.eye(int(live.sum()))])
    b = np.concatenate([y * row, np.zeros(int(live.sum()))])
    w = np.zeros(x.shape[1])
    w[live] = nnls_normal(a, b) / scale[live]
    return w
