"""The tree speculative methods vLLM accepts from this plugin, and their tunables: one place.

Scope: names, defaults, validation and transport of the configuration. No vLLM import here
(``patches.py`` wires it into vLLM's config classes).

Usage::

    LLM(model, speculative_config={"method": "goose"})                       # paper defaults
    LLM(model, speculative_config={"method": "goose", "budget": 40, "top_k": 8})
    vllm serve MODEL --speculative-config '{"method": "goose", "max_depth": 4}'

Methods (``speculative_config["method"]``) and the proposer each one runs
(``vllm_anisotropic.proposers`` registry name):

=================  ==========  ====================================================
method             proposer    tunables (pydantic config, defaults = paper values)
=================  ==========  ====================================================
goose              goose       ``proposers.config.GooseConfig`` (B=60, D=6, K=10, ...)
pld                pld         ``proposers.config.PLDConfig``
token_recycling    tr          ``proposers.config.TokenRecyclingConfig``
isotropic          iso3        ``proposers.config.IsotropicConfig`` (``branching`` = k)
draft_tree         draft_tree  ``proposers.config.DraftTreeConfig`` (``model``, ``trunk``,
                               ``branches``, ``branch_length``; issue 11, in progress)
=================  ==========  ====================================================

plus the engine-side keys of ``EngineTreeConfig`` (``verifier``, ``sampling_verifier``,
``allocator``, ``allocator_probe_every``, ``allocator_gate``, ``allocator_gate_margin``, ``allocator_gate_explore_every``,
``allocator_offer_factor``, ``allocator_backoff``, ``cost_model``,
``cost_model_online``).

How tunables travel (vLLM's ``SpeculativeConfig`` is a pydantic dataclass with
``extra="forbid"``, so it cannot carry them): in the front-end process the plugin wraps
``EngineArgs.create_speculative_config``; before vLLM validates the dict it removes every key
that is not a ``SpeculativeConfig`` field, validates those keys here (an unknown key is a
ValueError naming every valid one), and stores the validated options under
``additional_config["vllm_anisotropic"]``. ``VllmConfig`` (additional_config included) is
pickled to the EngineCore and worker processes, where the drafter reads it back with
``TreeSpecConfig.from_additional_config``. Setting
``additional_config={"vllm_anisotropic": {...}}`` directly works too (same validation).

``num_speculative_tokens`` (a vLLM key) is the cap on draft tokens (= tree nodes minus the
root) handed to vLLM per step; when omitted it defaults to ``budget - 1`` (59 for GOOSE).
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vllm_anisotropic.allocator.config import GateConfig
from vllm_anisotropic.proposers import PROPOSERS, drafts_chains, proposer_config

__all__ = [
    "TREE_METHODS",
    "DRAFT_MODEL_METHODS",
    "ADDITIONAL_CONFIG_KEY",
    "EngineTreeConfig",
    "TreeSpecConfig",
    "split_speculative_dict",
]

# vLLM ``speculative_config["method"]`` -> proposer registry name
TREE_METHODS: dict[str, str] = {
    "goose": "goose",
    "pld": "pld",
    "token_recycling": "tr",
    "isotropic": "iso3",
    "draft_tree": "draft_tree",
}

# methods whose trees carry draft probabilities (sampled from a draft model q): their sampled
# requests are verified by the multi-draft verifier their config names (``verifier``), the
# others' by the point-mass verifiers of ``sampling_verifier``
DRAFT_MODEL_METHODS = frozenset({"draft_tree"})

ADDITIONAL_CONFIG_KEY = "vllm_anisotropic"


class EngineTreeConfig(BaseModel):
    """Engine-side tunables, independent of the proposer."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True, extra="forbid")

    verifier: Literal["greedy"] = "greedy"
    """Tree verifier for temperature-0 requests: the GOOSE greedy walk (arXiv 2604.02047 Alg. 3),
    which emits exactly plain greedy decoding's tokens. (``draft_tree`` has its own
    ``verifier`` key: the multi-draft verifier of its sampled requests, ``DraftTreeConfig``.)"""

    sampling_verifier: Literal["nss", "deterministic", "none"] = "nss"
    """Tree verifier for sampled requests (temperature > 0, with top-k / top-p): the trees
    have chosen, not sampled, children, so the verifiers for point-mass drafts apply:
    ``nss`` (each row on the path sampled by vLLM's own sampler with the request's own
    generator, descending while a child holds the sample: a seeded request emits exactly the
    tokens plain vLLM emits with that seed, whatever its tree and batch mates) or
    ``deterministic`` (one-hot SpecInfer, children tried in priority order, counter-based
    uniforms: the target's law, not plain vLLM's tokens). Both accept a child with the target
    probability of its token. ``none``: sampled requests decode without trees. Penalties, logit bias, bad words, min_p,
    min_tokens, allowed token ids and raw logprobs keep trees (each tree row edited as vLLM edits its
    one row, ``runner.RowEdits``); structured output decodes without trees (plain decoding
    through vLLM's sampler, lossless), counted by reason on /metrics."""

    allocator: Literal["auto", "off"] = "auto"
    """Budget-aware batch allocator (ECHO, arXiv 2604.09603): ``auto`` cuts every
    request's value-ordered draft list each step where the expected accepted tokens stop
    paying for the step time a calibrated cost model predicts (0 drafts = plain decoding);
    ``off`` verifies the proposer's whole tree (up to ``num_speculative_tokens``) every step."""

    allocator_probe_every: int = Field(default=32, ge=0)
    """While the allocator keeps no drafts, every this-many-th such step verifies one draft
    node anyway, so the cost model keeps measuring what tree rows cost (0: never)."""

    allocator_gate: bool = True
    """With the allocator on, speculate at a batch size only while decode steps with drafts
    have measured more tokens per second than plain decode steps at that batch size
    (``allocator.SpeculationGate``; docs/allocator.md). false: the allocator's prediction alone
    decides."""

    allocator_gate_margin: float = Field(default=GateConfig.model_fields["margin"].default, ge=0.0, lt=1.0)
    """The gate speculates at a batch size only where speculative steps measured faster than
    plain ones by more than this fraction, and takes tree steps over chain steps likewise
    (``allocator.GateConfig.margin`` has the default and why)."""

    allocator_gate_explore_every: int = Field(default=32, ge=2)
    """A closed gate speculates every this-many-th step at a batch size (so it can re-open; more
    often, down to every this // 8-th, while speculation nearly pays: ``GateConfig.explore_shortfall``),
    and every 4 x this-many-th an open gate decodes plainly for a block of 4 steps (so it can
    close): costs ~1/this of the difference either way."""

    allocator_chains: bool = True
    """With the gate on, and for proposers that draft a chain alone (GOOSE: the context-match
    spine), the gate measures *chain steps* beside plain and tree steps: each request's chain of
    at most ``allocator_chain_drafts`` tokens, with no branches, ranking, cut or harvest, at the
    host cost of vLLM's ``ngram`` step; it speculates with whichever kind has measured faster
    at the batch size (docs/allocator.md). false: tree steps only."""

    allocator_chain_drafts: int = Field(default=5, ge=1)
    """Most draft tokens of a chain step (vLLM's ``ngram`` with k = 5 is the chain method that
    gained at sixteen requests on the AMX Xeon; docs/allocator.md)."""

    allocator_offer_factor: float = Field(default=4.0, ge=0.0)
    """With the allocator on, each request's next tree is built with at most
    max(8, this x the most draft nodes the allocator recently kept for it) drafts (a high-water
    mark decaying 20 % a step), so no proposal time goes into nodes it would cut; the list can
    grow by this factor every step when the allocator keeps all of it. 0: always build the
    proposer's whole budget."""

    allocator_backoff: int = Field(default=16, ge=0)
    """With the allocator on, after the k-th step in a row in which it cut a request to no
    draft at all, that request skips min(2**(k-1), this) proposals (no tree built, scored or
    harvested). 0: propose every step."""

    cost_model: str | None = None
    """Path of a cost-model JSON (``allocator.CostModel.to_json``) to start from instead of
    the start-up sweep of real forwards. Must name an existing file (checked at start-up)."""

    cost_model_online: bool = True
    """Refine the cost model from every measured step (false: keep the start-up fit or the
    ``cost_model`` file as it is)."""

    deterministic: bool = False
    """Tree decisions that depend on the tokens alone, never on measured times, so that the same
    requests in the same order give the same trees, steps and outputs run after run (bf16 and
    unseeded sampling included, which otherwise follow the batch shapes the gate and the cost
    model choose): the gate and the online cost model off; the allocator cuts with the
    ``cost_model`` file as it is, or, without one, keeps every tree whole (up to
    ``num_speculative_tokens``). Seeded requests in float32 need no such option: their tokens are
    plain vLLM's whatever the trees."""

    @model_validator(mode="after")
    def _deterministic_needs_no_clock(self) -> "EngineTreeConfig":
        clocked = [k for k in ("allocator_gate", "cost_model_online") if k in self.model_fields_set and getattr(self, k)]
        if self.deterministic and clocked:
            raise ValueError(f"deterministic: true turns {' and '.join(clocked)} off (they follow measured step times); "
                             f"valid: leave {' and '.join(clocked)} unset or false, or deterministic false")
        return self

    @field_validator("cost_model")
    @classmethod
    def _cost_model_is_a_file(cls, path: str | None) -> str | None:
        # Refused here, in the front end, rather than as a FileNotFoundError in EngineCore.
        if path and not os.path.isfile(path):
            raise ValueError(
                f"cost_model {path!r} is not a file; valid: the path of a cost-model JSON "
                f"(allocator.CostModel.to_json), or leave cost_model unset for the start-up sweep"
            )
        return path


def _split_options(method: str, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine options, proposer options); a key both configs know is the proposer's
    (``draft_tree``'s ``verifier`` names its multi-draft verifier)."""
    proposer_fields = PROPOSERS[TREE_METHODS[method]][1].model_fields
    engine = {k: v for k, v in options.items() if k in EngineTreeConfig.model_fields and k not in proposer_fields}
    return engine, {k: v for k, v in options.items() if k not in engine}


def _valid_keys(method: str) -> list[str]:
    config_cls = PROPOSERS[TREE_METHODS[method]][1]
    return sorted(set(config_cls.model_fields) | set(EngineTreeConfig.model_fields))


class TreeSpecConfig(BaseModel):
    """Validated method + options, as stored in ``additional_config["vllm_anisotropic"]``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str
    options: dict[str, Any] = {}

    @classmethod
    def build(cls, method: str, options: dict[str, Any]) -> "TreeSpecConfig":
        """Validate ``options`` for ``method``; ValueError naming valid methods/keys."""
        if method not in TREE_METHODS:
            raise ValueError(f"unknown vllm-anisotropic method {method!r}; valid: {sorted(TREE_METHODS)}")
        valid = _valid_keys(method)
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown speculative_config key(s) {unknown} for method {method!r}; valid "
                f"vllm-anisotropic keys: {valid} (plus vLLM's SpeculativeConfig fields such as "
                f"num_speculative_tokens)"
            )
        engine, proposer = _split_options(method, options)
        EngineTreeConfig(**engine)
        proposer_config(TREE_METHODS[method], **proposer)
        options = dict(options)
        if method in DRAFT_MODEL_METHODS and options.get("sampling_verifier", "none") != "none":
            raise ValueError(f"{method!r} verifies sampled requests with its 'verifier' key; sampling_verifier takes "
                             f"only 'none' there (sampled requests then decode without trees)")
        return cls(method=method, options=options)

    @property
    def engine(self) -> EngineTreeConfig:
        return EngineTreeConfig(**_split_options(self.method, self.options)[0])

    @property
    def sampled_verifier(self) -> str:
        """The verifier of sampled requests' trees, or "none" (they decode without trees)."""
        if self.method in DRAFT_MODEL_METHODS:
            if self.options.get("sampling_verifier") == "none":
                return "none"
            return proposer_config(self.proposer_name, **self.proposer_options).verifier
        return self.engine.sampling_verifier

    @property
    def walk_verifier(self) -> str:
        """The verifier of temperature-0 requests' trees: always the greedy walk."""
        return "greedy"

    @property
    def proposer_name(self) -> str:
        return TREE_METHODS[self.method]

    @property
    def proposer_options(self) -> dict[str, Any]:
        return _split_options(self.method, self.options)[1]

    @property
    def budget(self) -> int:
        """Tree nodes including the root (the proposer config's ``budget``)."""
        return int(proposer_config(self.proposer_name, **self.proposer_options).budget)

    @property
    def chain_steps(self) -> bool:
        """Whether the measured gate may choose chain steps (``allocator_chains`` and a
        proposer that drafts chains alone: ``Proposer.drafts_chains``)."""
        e = self.engine
        return (e.allocator == "auto" and e.allocator_gate and e.allocator_chains
                and drafts_chains(self.proposer_name, **self.proposer_options))

    def to_additional_config(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_additional_config(cls, method: str, additional_config: dict | None) -> "TreeSpecConfig":
        stored = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {}
        if not isinstance(stored, dict) or not isinstance(stored.get("options", {}), dict):
            raise ValueError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] must be a dict of tunables, e.g. "
                f"{{'budget': 40}}, or {{'method': {method!r}, 'options': {{...}}}}; got {stored!r}"
            )
        options = dict(stored.get("options", {})) if "options" in stored or "method" in stored else dict(stored)
        stored_method = stored.get("method", method)
        if stored_method != method:
            raise ValueError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] is for method {stored_method!r} "
                f"but speculative_config selects {method!r}"
            )
        return cls.build(method, options)


def split_speculative_dict(spec: dict[str, Any], vllm_fields: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a user's ``speculative_config`` dict into (vLLM keys, our keys).

    ``{"method": "goose", "budget": 40, "num_speculative_tokens": 20}`` ->
    ``({"method": "goose", "num_speculative_tokens": 20}, {"budget": 40})``.
    Dashes are read as underscores, like vLLM does.
    """
    ours, theirs = {}, {}
    for key, value in spec.items():
        k = key.replace("-", "_")
        (theirs if k in vllm_fields else ours)[k] = value
    return theirs, ours


# ---------------------------------------------------------------- per-request control
# ``SamplingParams.extra_args`` keys (``"vllm_xargs"`` in an OpenAI request body) that steer one
# request's trees; every ``extra_args`` key starting with "tree" is ours and validated.
REQUEST_KEYS: dict[str, str] = {
    "trees": "bool (or 0 / 1): false = this request decodes without drafts (default true)",
    "tree_max_nodes": "int >= 0: at most this many draft nodes per step for this request (0 = none)",
}


class RequestTreeOptions(BaseModel):
    """One request's tree options, from its ``extra_args`` (``request_tree_options``)."""

    model_config = ConfigDict(frozen=True)

    trees: bool = True
    max_nodes: int | None = None  # None: the allocator's and the proposer's own limits

    @property
    def drafts(self) -> bool:
        return self.trees and self.max_nodes != 0


def request_tree_options(extra_args: dict[str, Any] | None) -> RequestTreeOptions:
    """``extra_args`` -> the request's tree options; ValueError naming the bad key or value and
    the valid ones. ``{"trees": False}`` -> no drafts; ``{"tree_max_nodes": 4}`` -> at most 4
    draft nodes per step; keys not starting with "tree" are left to whoever reads them."""
    ours = {k: v for k, v in (extra_args or {}).items() if isinstance(k, str) and k.startswith("tree")}
    unknown = sorted(set(ours) - set(REQUEST_KEYS))
    if unknown:
        raise ValueError(f"unknown vllm-anisotropic request option(s) {unknown} in extra_args (vllm_xargs); valid: "
                         + "; ".join(f"{k} ({doc})" for k, doc in REQUEST_KEYS.items()))
    trees = ours.get("trees", True)
    # over HTTP vLLM's vllm_xargs turns JSON false into 0 (its values are str | int | float)
    trees = {0: False, 1: True, "false": False, "true": True}.get(
        trees.lower() if isinstance(trees, str) else trees, trees) if not isinstance(trees, bool) else trees
    if not isinstance(trees, bool):
        raise ValueError(f"extra_args['trees'] must be true or false (or 1 / 0), got {trees!r}")
    cap = ours.get("tree_max_nodes")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise ValueError(f"extra_args['tree_max_nodes'] must be an integer >= 0, got {cap!r}")
    return RequestTreeOptions(trees=trees, max_nodes=cap)
