"""Acceptance model: a node's (source, depth, value) -> calibrated P(node on the accepted path).

Scope: the allocator's numerator. It learns online, from verified steps, how often a node with
a given proposer value is *on the accepted path* (its token was accepted: the greedy walk or
the sampling verifier reached it), separately per draft source (spine / branch / draft) and
depth, and it measures which (source, depth) keys have values that actually discriminate
accepted from rejected nodes. It does not look at tokens, logits or trees (``tree_probs.py``
maps trees to and from the flat arrays used here) and never imports vLLM.

Source: ECHO (arXiv 2604.09603), Sec. 3.2 "Sparse Gating at Sweet Spots" and App. C.4
"Adaptive Calibration": the discriminative power of draft confidence depends on depth; measure
AUC(confidence vs accepted) per depth during warm-up and gate only at the "sweet spots" where it
is high. Platt scaling (Platt 1999) for the calibration map.

Terms
-----
value v
    ``DraftTree.values[i]``: the proposer's estimate that the path root -> i is accepted.
on the accepted path
    The label: node i's token is part of the accepted prefix of this step. The expected
    accepted length of a tree is sum_i P(i on the accepted path) (linearity of expectation).
key
    A (source, depth bucket) pair; depth bucket = min(depth, max_depth), bucket 0 (the root)
    is never used.
sweet spot / flat / warming
    A key with enough accepted *and* rejected observations (``min_class_count`` each) is a
    sweet spot when AUC > ``auc_threshold`` and flat otherwise; a key without enough data is
    warming up.

The calibration map per key (Platt, with the proposer as prior)::

    P(on path | v) = sigmoid(alpha + beta * logit(v)),  beta >= 0 (isotonic in v)
    (alpha, beta) = MAP under the prior N((a0, 1), I / prior_strength),  a0 = prior_intercept

so with no data alpha = a0 = 0, beta = 1 and P = v exactly: the model is usable from the first
step and moves to the data as they arrive (refits after updates 1, 2, 4, ... and then every
``refit_every``: GOOSE's first values over-rate their nodes many times over). Sufficient
statistics are per-key histograms over logit(v) (counts n_b, accepted a_b, sum of logits):
memory is fixed (4 sources x (max_depth+1) x num_bins), an update is a ``bincount`` each (the engine's
label queue bins its nodes itself and ``add``s the histograms), and the
MAP is a fixed number of vectorised Newton steps on the binned likelihood
sum_b [a_b log s_b + (n_b - a_b) log(1 - s_b)], s_b = sigmoid(alpha + beta xbar_b), with xbar_b
the mean logit of the bin.

Gating (``gating="sparse"``, the default; ECHO Sec. 3.2): at *flat* keys the value does not
separate accepted from rejected nodes, so the model does not resolve it there: beta = 0 and
P = sigmoid(alpha), one pooled rate for the key. At sweet spots and warming keys the full map
is used. Which depths we gate at is therefore measured, not fixed: ``sweet_spot_depths()``
lists them (per source, or per depth pooled over sources as in ECHO's Fig. 2), ``auc()`` gives
the numbers. Combined with the tree constraint of ``tree_probs.py`` (a child is never more
likely than its parent), a low calibrated probability at a sweet spot cuts the whole subtree
below it, which is ECHO's "truncate" decision; a flat key never cuts on its own.

Measured (GOOSE, B = 60, on SmolLM2-135M in float32 through ``bench.harness``, 6 prompts each of
HumanEval, GSM8K and MT-Bench x 96 tokens: 592 verified trees, 26,549 nodes). AUC of the value
vs on-the-accepted-path, BRANCH nodes, depths 1..6: 0.86, 0.85, 0.84, 0.76, 0.74, 0.74 (293,
192, 118, 85, 44, 31 accepted), so with the defaults the gate resolves the value at branch
depths 1-4 (sweet spots), depths 5-6 are still warming up (< 50 accepted). SPINE nodes are too
few to decide (<= 28 accepted per depth; AUC 0.54 / 0.55 at depths 1 / 2): warming, prior-shrunk
Platt. Calibration on the held-out half of the steps (interleaved split): accepted draft tokens
per step realized 1.395, predicted from the raw values 1.870, from this model 1.458; Brier score
per node 0.0268 -> 0.0245.

AUC from the histograms: AUC = P(v_pos > v_neg) + P(v_pos = v_neg) / 2 with values equal when
they share a bin (bins are 20/128 = 0.16 logit wide by default, so ties bias it by little).

Deterministic (fixed iteration counts, no randomness) and serialisable to versioned JSON.
"""

from __future__ import annotations

import json

import numpy as np

from ..tree import NodeSource
from .config import AcceptanceConfig

__all__ = [
    "ACCEPTANCE_MODEL_FORMAT",
    "ACCEPTANCE_MODEL_VERSION",
    "AcceptanceModel",
    "histogram_auc",
    "logit",
    "sigmoid",
]

ACCEPTANCE_MODEL_FORMAT = "vllm_anisotropic.allocator.AcceptanceModel"
ACCEPTANCE_MODEL_VERSION = 1
NUM_SOURCES = len(NodeSource)
_EPS = 1e-9
_STEP_SIZES = np.array([1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.0])  # line search of ``_fit``


def logit(v) -> np.ndarray:
    """log(v / (1 - v)) with v clipped to [1e-9, 1 - 1e-9]."""
    v = np.clip(np.asarray(v, np.float64), _EPS, 1.0 - _EPS)
    return np.log(v) - np.log1p(-v)


def sigmoid(z) -> np.ndarray:
    """1 / (1 + exp(-z)), computed without overflow."""
    z = np.asarray(z, np.float64)
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def histogram_auc(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """AUC of a score from class histograms over ordered bins; ties (same bin) count 1/2.

    ``pos``, ``neg`` [..., num_bins] (weights of accepted / rejected per bin); returns [...],
    NaN where a class is empty. AUC = sum_b pos_b (negatives strictly below b + neg_b / 2) / (P N).
    ``pos [0,1], neg [1,0] -> 1.0``; ``pos [1,1], neg [1,1] -> 0.5``.
    """
    below = np.cumsum(neg, axis=-1) - neg  # [..., num_bins] negatives in lower bins
    num = np.sum(pos * (below + 0.5 * neg), axis=-1)
    den = pos.sum(axis=-1) * neg.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


class AcceptanceModel:
    """Online-calibrated P(node on the accepted path) per (source, depth); see module docstring.

    Example::

        model = AcceptanceModel()
        p = model.predict(sources, depths, values)   # == values before any update
        model.update(sources, depths, values, on_accepted_path)
        model.auc_by_depth(), model.sweet_spot_depths()
    """

    def __init__(self, config: AcceptanceConfig | None = None) -> None:
        self.config = cfg = config or AcceptanceConfig()
        if not cfg.logit_max > cfg.logit_min:
            raise ValueError("logit_max must exceed logit_min")
        shape = (NUM_SOURCES, cfg.max_depth + 1, cfg.num_bins)
        # [3, num_sources, max_depth + 1, num_bins] decayed counts: observations, accepted, sum of
        # logit(v) (``count``, ``accepted``, ``logit_sum``): one array, so that an update decays and
        # adds them in one call each
        self.histograms = np.zeros((3,) + shape)
        self._params: tuple[np.ndarray, np.ndarray] | None = None  # (alpha, beta) [num_sources, max_depth + 1]
        self._stale_updates = 0  # updates since the last fit (refit after config.refit_every)
        self._updates = 0  # updates ever: the first refits come after 1, 2, 4, ... of them

    @property
    def count(self) -> np.ndarray:
        """[num_sources, max_depth + 1, num_bins] decayed observations (a view of ``histograms``)."""
        return self.histograms[0]

    @property
    def accepted(self) -> np.ndarray:
        """The decayed accepted observations (a view of ``histograms``)."""
        return self.histograms[1]

    @property
    def logit_sum(self) -> np.ndarray:
        """The decayed sums of logit(value) (a view of ``histograms``)."""
        return self.histograms[2]

    # ------------------------------------------------------------------ indexing
    def _keys(self, sources, depths, values) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Validated (source, depth bucket, bin, logit) arrays, each [num_nodes]."""
        cfg = self.config
        s = np.asarray(sources, np.int64).reshape(-1)
        d = np.asarray(depths, np.int64).reshape(-1)
        v = np.asarray(values, np.float64).reshape(-1)
        if not (s.shape == d.shape == v.shape):
            raise ValueError(f"sources, depths, values need one entry per node: {s.shape}, {d.shape}, {v.shape}")
        if np.any((s <= int(NodeSource.ROOT)) | (s >= NUM_SOURCES)):
            raise ValueError("sources must be draft sources (SPINE, BRANCH, DRAFT); the root is not a draft")
        if np.any(d < 1):
            raise ValueError("draft nodes have depth >= 1")
        if np.any(~np.isfinite(v)) or np.any(v < 0) or np.any(v > 1):
            raise ValueError("values must be probabilities in [0, 1]")
        x = logit(v)
        # bin b covers logit in [lo + b w, lo + (b+1) w), w = (hi - lo) / num_bins; outside -> edge bins
        b = np.floor((x - cfg.logit_min) / (cfg.logit_max - cfg.logit_min) * cfg.num_bins)
        b = np.clip(b, 0, cfg.num_bins - 1).astype(np.int64)
        return s, np.minimum(d, cfg.max_depth), b, x

    # ------------------------------------------------------------------ learning
    def update(self, sources, depths, values, on_accepted_path) -> None:
        """Add one verified step's nodes (all [num_nodes]; labels bool: token accepted)."""
        s, d, b, x = self._keys(sources, depths, values)
        y = np.asarray(on_accepted_path, np.float64).reshape(-1)
        if y.shape != s.shape:
            raise ValueError("on_accepted_path needs one entry per node")
        flat = np.ravel_multi_index((s, d, b), self.count.shape)  # [num_nodes]
        size = self.count.size
        self.add(np.stack([np.bincount(flat, minlength=size), np.bincount(flat, weights=y, minlength=size),
                           np.bincount(flat, weights=x, minlength=size)]).reshape(self.histograms.shape))

    def add(self, histograms: np.ndarray) -> None:
        """Add one update's nodes as histograms ``[3, num_sources, max_depth + 1, num_bins]``
        (counts, accepted counts, sums of logit(value) by ``_keys``' keys), as ``update`` bins
        them: the engine's label queue bins its nodes in one compiled pass
        (``kernels.label.take_labels``)."""
        if histograms.shape != self.histograms.shape:
            raise ValueError(f"histograms must have shape {self.histograms.shape}, got {histograms.shape}")
        if self.config.decay < 1.0:
            self.histograms *= self.config.decay
        self.histograms += histograms
        self._stale_updates += 1
        self._updates += 1
        # refit after config.refit_every updates, and sooner while the data are few (after
        # updates 1, 2, 4, 8, ...): until the first refit the map is the prior's, whatever the
        # first labels say
        early = self._updates < self.config.refit_every and self._updates & (self._updates - 1) == 0
        if early or self._stale_updates >= self.config.refit_every:
            self._params = None

    def predict(self, sources, depths, values) -> np.ndarray:
        """[num_nodes] calibrated P(on the accepted path) = sigmoid(alpha_k + beta_k logit(v))."""
        s, d, _, x = self._keys(sources, depths, values)
        alpha, beta = self.parameters()
        return sigmoid(alpha[s, d] + beta[s, d] * x)

    # ------------------------------------------------------------------ gating
    def class_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(accepted, rejected) decayed counts per key, each [num_sources, max_depth + 1]."""
        pos = self.accepted.sum(axis=-1)
        return pos, self.count.sum(axis=-1) - pos

    def auc(self) -> np.ndarray:
        """[num_sources, max_depth + 1] AUC(value vs on accepted path) per key; NaN without both classes."""
        return histogram_auc(self.accepted, self.count - self.accepted)

    def auc_by_depth(self) -> np.ndarray:
        """[max_depth + 1] AUC per depth bucket, sources pooled (ECHO's per-depth view); [0] is NaN."""
        pos = self.accepted.sum(axis=0)
        return histogram_auc(pos, self.count.sum(axis=0) - pos)

    def key_status(self) -> np.ndarray:
        """[num_sources, max_depth + 1] int8: 0 warming up, 1 flat (value ignored), 2 sweet spot."""
        cfg = self.config
        pos, neg = self.class_counts()
        ready = (pos >= cfg.min_class_count) & (neg >= cfg.min_class_count)
        sweet = ready & (np.nan_to_num(self.auc(), nan=0.0) > cfg.auc_threshold)
        return np.where(sweet, 2, np.where(ready, 1, 0)).astype(np.int8)

    def sweet_spot_depths(self, source: NodeSource | int | None = None) -> list[int]:
        """Depth buckets that are sweet spots: of one source's keys, or (``None``) per depth with
        the sources pooled, as ECHO reports them. Empty until the warm-up has enough data."""
        cfg = self.config
        if source is not None:
            status = self.key_status()[int(source)]
            return [int(d) for d in range(1, cfg.max_depth + 1) if status[d] == 2]
        pos = self.accepted.sum(axis=(0, 2))
        neg = self.count.sum(axis=(0, 2)) - pos
        auc = np.nan_to_num(self.auc_by_depth(), nan=0.0)
        ok = (pos >= cfg.min_class_count) & (neg >= cfg.min_class_count) & (auc > cfg.auc_threshold)
        return [int(d) for d in range(1, cfg.max_depth + 1) if ok[d]]

    # ------------------------------------------------------------------ fit
    def parameters(self) -> tuple[np.ndarray, np.ndarray]:
        """(alpha, beta), each [num_sources, max_depth + 1]; refitted lazily after updates."""
        if self._params is None:
            self._params = self._fit()
            self._stale_updates = 0
        return self._params

    def _fit(self) -> tuple[np.ndarray, np.ndarray]:
        """MAP Platt coefficients per key by damped Newton on the binned likelihood (compiled:
        ``kernels.fit.newton_platt``).

        Objective per key (minimised): NLL(alpha, beta) + k/2 ((alpha - a0)^2 + (beta - 1)^2),
        k = prior_strength, a0 = prior_intercept; gradient g = sum_b (n_b s_b - a_b) [1, xbar_b]
        + k [alpha - a0, beta - 1], Hessian sum_b n_b s_b (1 - s_b) [1, xbar_b]^T [1, xbar_b] + k I.
        beta is projected on [0, inf) after each step (isotonic), and each step is the best of a
        few step sizes along the Newton direction (backtracking: the objective never increases).
        Flat keys under sparse gating: beta = 0 and alpha alone, prior centred on the logit of the
        key's mean value.
        """
        cfg = self.config
        k = cfg.prior_strength
        n, a = self.count, self.accepted
        centers = cfg.logit_min + (np.arange(cfg.num_bins) + 0.5) * (cfg.logit_max - cfg.logit_min) / cfg.num_bins
        with np.errstate(invalid="ignore", divide="ignore"):
            xbar = np.where(n > 0, self.logit_sum / np.where(n > 0, n, 1.0), centers)  # [S, D+1, num_bins]
        alpha = np.full(n.shape[:2], cfg.prior_intercept)
        beta = np.ones(n.shape[:2])
        # keys without data keep the prior's MAP (alpha a0, beta 1); the others are fitted on the
        # bins any of them uses (GOOSE fills 16 of the 36 keys)
        active = n.sum(-1) > 0  # [S, D+1]
        if active.any():
            used = n[active].sum(0) > 0  # [num_bins]
            from vllm_anisotropic import kernels  # numba on first use, never at import (kernels/__init__.py)

            # C order whatever numpy's indexing returns (F for several keys): one compiled signature,
            # the one the drafter's warm-up loads
            rows = [np.ascontiguousarray(x[active][:, used]) for x in (n, a, xbar)]
            alpha[active], beta[active] = kernels.load("fit").newton_platt(
                *rows, float(k), int(cfg.newton_steps), float(cfg.prior_intercept), _STEP_SIZES)
        if cfg.gating == "sparse":
            flat = self.key_status() == 1
            if flat.any():
                total = np.maximum(n.sum(-1), 1e-12)
                mean_v = (n * sigmoid(xbar)).sum(-1) / total  # the proposer's average claim at the key
                a0 = logit(mean_v)
                alpha_flat = a0.copy()
                for _ in range(cfg.newton_steps):
                    s = sigmoid(alpha_flat)[..., None] * np.ones_like(n)
                    g = (n * s - a).sum(-1) + k * (alpha_flat - a0)
                    hh = (n * s * (1.0 - s)).sum(-1) + k
                    alpha_flat = alpha_flat - np.clip(g / hh, -4.0, 4.0)
                alpha = np.where(flat, alpha_flat, alpha)
                beta = np.where(flat, 0.0, beta)
        return alpha, beta

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> str:
        """Versioned JSON: config and the three histograms (the fit is recomputed on load)."""
        return json.dumps({
            "format": ACCEPTANCE_MODEL_FORMAT,
            "version": ACCEPTANCE_MODEL_VERSION,
            "config": self.config.model_dump(),
            "count": self.count.tolist(),
            "accepted": self.accepted.tolist(),
            "logit_sum": self.logit_sum.tolist(),
        })

    @classmethod
    def from_json(cls, text: str) -> AcceptanceModel:
        d = json.loads(text)
        if d.get("format") != ACCEPTANCE_MODEL_FORMAT or d.get("version") != ACCEPTANCE_MODEL_VERSION:
            raise ValueError(f"not a {ACCEPTANCE_MODEL_FORMAT} v{ACCEPTANCE_MODEL_VERSION} document: {d.get('format')} v{d.get('version')}")
        model = cls(AcceptanceConfig(**d["config"]))
        for name in ("count", "accepted", "logit_sum"):
            arr = np.asarray(d[name], np.float64)
            if arr.shape != model.count.shape:
                raise ValueError(f"{name} must have shape {model.count.shape}, got {arr.shape}")
            getattr(model, name)[...] = arr  # (a view of model.histograms)
        return model
