"""Typed, validated proposer configuration (pydantic), defaults = the papers' hyperparameters.

Scope: one config model per proposer family; an unknown key is an error naming the valid keys
(the vLLM integration reads these from ``--speculative-config``). No algorithm here.

Defaults follow GOOSE arXiv 2604.02047 Table 5 and Sec. 5.1: node budget B = 60 (nodes *including*
the root, so at most 59 draft tokens), max branch depth D = 6, adjacency top-K = 10,
spine-branch ratio rho = 0.5, min branch score 0.01, n-gram lengths {3, 4, 5}, spine
continuation 20, EMA coefficient 0.3 (initial spine acceptance 0.3, Algorithm 2 line 3), spine
ratio tiers p_s < 0.2 -> 0.15, < 0.4 -> 0.30, else 0.50, linear bypass threshold 8.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from vllm_anisotropic.config_base import StrictConfig

__all__ = [
    "ProposerConfig",
    "PLDConfig",
    "AdjacencyConfig",
    "GooseConfig",
    "TokenRecyclingConfig",
    "IsotropicConfig",
    "DraftTreeConfig",
]


NgramSizes = tuple[Annotated[int, Field(ge=1)], ...]
"""n-gram lengths, each >= 1."""


class ProposerConfig(StrictConfig):
    """Base of the proposer configs (``config_base.StrictConfig``)."""


class PLDConfig(ProposerConfig):
    """Prompt Lookup Decoding: a linear chain copied from the latest n-gram match."""

    ngram_sizes: NgramSizes = Field(default=(3, 4, 5), min_length=1)
    """n-gram lengths tried, longest first (GOOSE Table 5: {3, 4, 5})."""
    max_continuation: int = Field(default=20, ge=1)
    """Maximum draft chain length copied after the match (GOOSE Table 5: 20)."""
    budget: int = Field(default=60, ge=1)
    """Node budget B including the root; the chain is cut to B - 1 tokens."""


class AdjacencyConfig(ProposerConfig):
    """Fields shared by the adjacency-table proposers (TR, Isotropic, GOOSE)."""

    budget: int = Field(default=60, ge=1)
    """Node budget B: tree nodes including the root (<= B - 1 draft tokens). Paper: 60."""
    max_depth: int = Field(default=6, ge=1)
    """Max depth D of a branch subtree, measured from its branching node. Paper: 6."""
    top_k: int = Field(default=10, ge=1)
    """Successors kept per adjacency-table key (top-K). Paper: 10."""
    bigram: bool = True
    """Use the bigram tier (key = last two tokens) before the unigram row (GOOSE Sec. 4.1)."""
    bigram_capacity: int = Field(default=65536, ge=1)
    """Max bigram entries (LRU eviction); bounds memory at capacity * top_k * 8 bytes + index."""
    min_branch_score: float = Field(default=0.01, ge=0.0, le=1.0)
    """Successors with a score (softmax probability) below this are pruned. Paper: 0.01."""
    refresh_steps: int = Field(default=0, ge=0, le=1 << 20)
    """A verified row whose table entries (its unigram row, and its bigram when the bigram tier
    is on) the table wrote in its last ``refresh_steps`` harvests (steps) is not harvested: the
    entries keep the earlier row's successors. 0: every row rewrites its entries (the papers'
    rule). Costs (vocab_size + bigram slots) * 4 bytes a table. Not in the papers. In GOOSE's
    engine path the skipped rows' vocabulary pass is skipped too: 16 cut the harvest's top-k by
    38 % at 8 requests and 48 % at 64 on a 2-core EPYC, but the float32 engine needed 2.4 %
    more steps at 8 requests and the exact harness lost 0.8 % of tau, which costs more than the
    host work saved (``docs/measurements/cpu/allocator_measurements.md``), hence off by default."""
    shared_table: bool = True
    """One adjacency table per tenant, inherited across that tenant's requests (TR's hot start);
    a tenant is vLLM's ``cache_salt`` (requests without one share a table). False gives every
    request an empty table of its own (no learning across requests at all)."""
    draft_state_bytes: int | None = Field(default=None, ge=1)
    """Host bytes of learned draft state per worker (each tensor-parallel rank): the tenants'
    adjacency tables and, for GOOSE, their cross-request stores. A tenant's share is fixed by the
    vocabulary and the keys above (``adjacency.tenant_bytes``), so one tenant never takes more;
    as many salted tenants are kept beside the unsalted one as fit (at least one), the least
    recently used dropped first (it starts cold again). None: room for 32 salted tenants at the
    model's vocabulary (GOOSE's defaults: 0.41 GB at a 49k vocabulary, 0.69 GB at 152k)."""


class GooseConfig(AdjacencyConfig):
    """GOOSE spine tree (arXiv 2604.02047 Algorithms 1-2, Appendix C.1) and its ablation switches."""

    ngram_sizes: NgramSizes = Field(default=(3, 4, 5), min_length=1)
    """Context-match n-gram lengths, longest first. Paper: {3, 4, 5}."""
    max_continuation: int = Field(default=20, ge=1)
    """Max spine (context-match continuation) length. Paper: 20."""
    spine_branch_ratio: float = Field(default=0.5, ge=0.0, le=1.0)
    """rho: share of the non-spine budget given to spine-node branches; 1 - rho to the root
    branches (Algorithm 1 lines 2-3). Paper: 0.5."""
    ema_coef: float = Field(default=0.3, gt=0.0, le=1.0)
    """EMA coefficient: p_s <- (1 - c) p_s + c * (spine acceptance of the step). Paper: 0.3."""
    initial_spine_acceptance: float = Field(default=0.3, ge=0.0, le=1.0)
    """Initial p_s (Algorithm 2 line 3). Paper: 0.3."""
    tier_thresholds: tuple[float, float] = (0.2, 0.4)
    """p_s boundaries of the spine-ratio tiers. Paper: 0.2, 0.4."""
    tier_ratios: tuple[float, float, float] = (0.15, 0.30, 0.50)
    """Spine ratio r for p_s below the first threshold, between, and above. Paper: .15/.30/.50."""
    bypass: bool = True
    """Linear bypass: verify the spine alone when the match is confident (Sec. 4.3)."""
    consensus_bypass: bool = True
    """Consensus (>= 2 n-gram lengths agree on the first token) triggers the bypass."""
    bypass_min_length: int = Field(default=8, ge=1)
    """Long-match bypass threshold in tokens. Paper: 8."""
    bypass_signal: Literal["draft_length", "match_length"] = "draft_length"
    """What 'long match' measures: the draft chain length |d| (Algorithm 2 line 6, Prop. 4
    proof) or the backward-extended matched length of the context suffix."""
    spine_branches: bool = True
    """Attach branches at spine nodes (ablation 'w/o spine branches' sets False: the whole
    branch budget goes to the root)."""
    context_spine: bool = True
    """Use context matches at all (ablation 'w/o context-match spine': TR-sourced tree only)."""
    cross_request_spine: bool = True
    """When the request's own context has no n-gram match, match into the finished requests of
    its tenant (``output_store.OutputStore``: the last ``store_prompt_tail`` prompt tokens and
    the output of each). Needs ``shared_table`` (the tenant boundary). Not in the paper."""
    store_capacity: int = Field(default=1 << 14, ge=64)
    """Tokens of finished requests the cross-request store keeps per tenant (oldest evicted)."""
    store_prompt_tail: int = Field(default=16, ge=0)
    """Prompt tokens stored before each output (the chat template's assistant header)."""


class TokenRecyclingConfig(AdjacencyConfig):
    """Token Recycling (Luo et al. 2025): unigram adjacency matrix + static imbalanced tree."""

    bigram: bool = False
    """TR uses the single-token (unigram) adjacency matrix."""
    min_branch_score: float = Field(default=0.0, ge=0.0, le=1.0)
    """TR fills its static tree without score pruning."""
    rank_decay: float = Field(default=1.5, gt=0.0)
    """Static template prior: the rank-j successor is accepted with prior ~ (j + 1) ** -rank_decay;
    the template keeps the B - 1 nodes of highest prior path product (depth <= max_depth)."""


class IsotropicConfig(AdjacencyConfig):
    """Isotropic(k): a uniform k-ary tree filled breadth-first from GOOSE's sources."""

    branching: int = Field(default=3, ge=1)
    """k, children per node (the paper compares k = 3 and k = 5)."""
    max_depth: int = Field(default=6, ge=1)
    """Depth cap D (same as GOOSE's branches). A full k-ary tree of B = 60 nodes stops at depth
    4 (k = 3) or 3 (k = 5); the cap only binds when pruning leaves nodes with < k candidates."""
    ngram_sizes: NgramSizes = Field(default=(3, 4, 5), min_length=1)
    """Context-match n-gram lengths (the match supplies the rank-0 child along its path)."""
    max_continuation: int = Field(default=20, ge=1)
    """Max context-match continuation."""


SHAPE_KEYS = ("trunk", "branches", "branch_length")  # draft_tree's fixed (L1, K, L2)


class DraftTreeConfig(ProposerConfig):
    """Delayed-expansion draft-model trees (arXiv 2602.16994 Def. 5.2; ``proposers.draft_model``):
    a trunk of ``trunk`` tokens from the draft model q, then ``branches`` paths of
    ``branch_length`` tokens. The paper's selector chooses (K, L1, L2) in {1..4} x {0..8}^2;
    the defaults are a fixed middle of that grid until the grid is measured here (issue 11)."""

    model: str
    """Directory of the draft model (a transformers checkpoint with the target's tokenizer)."""
    trunk: int = Field(default=2, ge=0, le=8)
    """L1: trunk tokens."""
    branches: int = Field(default=2, ge=1, le=4)
    """K: branches after the trunk (i.i.d. for sampled requests, the top K for greedy ones)."""
    branch_length: int = Field(default=2, ge=0, le=8)
    """L2: tokens per branch (0: the trunk alone, a chain)."""
    verifier: Literal["traversal", "specinfer", "spectr", "khisti", "naive", "naive_tree", "nss", "block"] = "traversal"
    """Multi-draft verifier of sampled requests (``verifiers`` registry; Traversal is the best on
    i.i.d. draft trees in arXiv 2602.16994; ``block`` verifies one path: branches 1, or
    branch_length 0). Greedy requests always take the greedy walk, which every one of these
    reduces to at temperature 0."""
    draft_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype q runs in; ``"auto"``: the target's (vLLM's ``--dtype``), float32 outside the engine.
    On a CPU without native bf16 (AVX2 only) a bf16 q is emulated: ``"float32"`` is faster there."""
    draft_quantization: Literal["auto", "none", "int8"] = "auto"
    """``"int8"``: q's linear layers (the output head included) with int8 weights (per output
    channel) and int8 activations (per row, at each call) through vLLM's oneDNN int8 GEMM, on
    vLLM's CPU platform only (refused elsewhere). A decode forward of q reads half the bytes
    (integration/vllm/kernels/cpu_gemm.py); its drafts may differ, the output cannot (the target
    verifies every draft). ``"auto"``: int8 on vLLM's CPU platform where the CPU has VNNI (int8
    dot products: AVX-512 VNNI, as on the CPUs it was measured on), else ``"none"``."""
    draft_device: Literal["auto", "cpu"] = "auto"
    """Device of q's weights and KV: ``"auto"``, the worker's (its GPU on a GPU worker, the CPU
    on vLLM's CPU build); ``"cpu"``: the host (on a GPU worker nothing is then reserved out of
    vLLM's KV memory; ``draft_kv_bytes``, if given, still bounds q's KV in host memory)."""
    draft_kv_bytes: int | None = Field(default=None, ge=1)
    """Bytes of q's KV the engine reserves out of the memory vLLM would give the target's KV
    cache (per worker), and the most q's KV takes (``draft_kv.DraftKV``: the rows of requests not
    drafting are dropped first, least recently drafted first, rebuilt when they draft again;
    a step's requests that still do not fit decode plainly that step). None: the share in which
    q holds as many tokens as the target's cache, memory x q's bytes per token / (q's + the
    target's)."""
    selector: str = "auto"
    """(K, L1, L2) chosen per request-step by a learned selector (``vllm_anisotropic.selector``):
    ``"auto"`` takes the selector shipped for this target and draft pair (of the pair's, the one
    timed with q in what ``draft_quantization`` resolves to: ``selector.shipped``), if there is one and no
    shape key (``trunk``, ``branches``, ``branch_length``) is given, else the fixed shape;
    ``"off"`` the fixed shape; or the directory of a selector (``vllm-anisotropic selector train``)."""

    @field_validator("selector")
    @classmethod
    def _selector_loads(cls, value: str) -> str:
        if value in ("auto", "off"):
            return value
        from vllm_anisotropic.selector.policy import ShapeSelector

        if not os.path.isdir(value):
            raise ValueError(f"selector {value!r} is not a directory; valid: 'auto', 'off', or the directory of a "
                             f"selector from `vllm-anisotropic selector train`")
        ShapeSelector.load(value)  # SelectorFileError (a ValueError) names what is wrong
        return value

    @model_validator(mode="after")
    def _selector_or_shape(self) -> "DraftTreeConfig":
        given = sorted(set(SHAPE_KEYS) & self.model_fields_set)
        if self.selector not in ("auto", "off") and given:
            raise ValueError(f"selector {self.selector!r} chooses (K, L1, L2) every step; drop {given}, or use "
                             f"selector 'off' for a fixed shape")
        return self

    @model_validator(mode="after")
    def _block_verifies_one_path(self) -> "DraftTreeConfig":
        if self.verifier == "block" and self.branches > 1 and self.branch_length > 0:
            raise ValueError(f"verifier 'block' verifies one path; got branches {self.branches}: use branches 1, or "
                             f"one of traversal, specinfer, spectr, khisti, naive, naive_tree, nss")
        return self

    @field_validator("model")
    @classmethod
    def _model_is_a_directory(cls, path: str) -> str:
        if not os.path.isdir(path):
            raise ValueError(f"model {path!r} is not a directory; valid: the directory of a transformers checkpoint "
                             f"sharing the target's tokenizer (e.g. `vllm-anisotropic models path qwen2.5-coder-0.5b`)")
        return path

    @property
    def budget(self) -> int:
        """Tree nodes including the root: 1 + L1 + K L2 (with a selector, of its largest shape)."""
        if self.selector not in ("auto", "off"):
            from vllm_anisotropic.selector.policy import ShapeSelector

            return 1 + ShapeSelector.load(self.selector).max_drafts
        return 1 + self.trunk + self.branches * self.branch_length
