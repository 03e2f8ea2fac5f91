"""Draft proposers: one interface (``base.Proposer`` / ``base.RequestState``), one registry.

Scope: drafting of ``DraftTree``s, training-free (context and target logits) or from a draft
model (``draft_tree``). Algorithms (one module each):

=========================  ===================================================  ==============
name                       algorithm                                            module
=========================  ===================================================  ==============
ar                         plain decoding (root-only trees)                     prompt_lookup
pld                        Prompt Lookup Decoding chain (Saxena 2023)           prompt_lookup
tr                         Token Recycling: unigram matrix + static BFS tree    token_recycling
iso3, iso5                 Isotropic(k): k-ary BFS tree, GOOSE's sources        isotropic
goose                      GOOSE spine tree (arXiv 2604.02047 Alg. 1-2)               goose
goose-no-spine-branches    ablation: all branch budget at the root              goose
goose-unigram              ablation: no bigram tier                             goose
goose-no-bypass            ablation: never verify the spine alone               goose
goose-no-spine             ablation: no context-match spine (TR-sourced tree)   goose
draft_tree                 delayed-expansion draft-model tree (arXiv 2602.16994)  draft_model
=========================  ===================================================  ==============

``get_proposer(name, vocab_size=None, **options)`` builds one; options are the fields of the
method's pydantic config (``config.py``), an unknown option is a ValueError naming the valid
ones. ``proposers.pld.propose_prompt_lookup`` is the stateless PLD kernel (matcher oracle).
"""

from __future__ import annotations

from typing import Any

from vllm_anisotropic.proposers.adjacency import AdjacencyTable
from vllm_anisotropic.proposers.base import ProposalInfo, ProposalMode, Proposer, RequestState
from vllm_anisotropic.proposers.config import (
    GooseConfig,
    IsotropicConfig,
    PLDConfig,
    DraftTreeConfig,
    ProposerConfig,
    TokenRecyclingConfig,
)
from vllm_anisotropic.proposers.context_match import ContextMatch, ContextMatcher
from vllm_anisotropic.proposers.draft_model import DraftTreeProposer
from vllm_anisotropic.proposers.goose import GooseProposer, build_spine_tree
from vllm_anisotropic.proposers.isotropic import IsotropicProposer
from vllm_anisotropic.proposers.prompt_lookup import ARConfig, ARProposer, PLDProposer
from vllm_anisotropic.proposers.token_recycling import TokenRecyclingProposer

__all__ = [
    "PROPOSERS",
    "get_proposer",
    "drafts_chains",
    "proposer_config",
    "Proposer",
    "RequestState",
    "ProposalInfo",
    "ProposalMode",
    "AdjacencyTable",
    "ContextMatch",
    "ContextMatcher",
    "build_spine_tree",
    "GooseConfig",
    "PLDConfig",
    "TokenRecyclingConfig",
    "IsotropicConfig",
]

# name -> (proposer class, config class, preset options applied before the user's)
PROPOSERS: dict[str, tuple[type[Proposer], type[ProposerConfig], dict[str, Any]]] = {
    "ar": (ARProposer, ARConfig, {}),
    "pld": (PLDProposer, PLDConfig, {}),
    "tr": (TokenRecyclingProposer, TokenRecyclingConfig, {}),
    "iso3": (IsotropicProposer, IsotropicConfig, {"branching": 3}),
    "iso5": (IsotropicProposer, IsotropicConfig, {"branching": 5}),
    "goose": (GooseProposer, GooseConfig, {}),
    "goose-no-spine-branches": (GooseProposer, GooseConfig, {"spine_branches": False}),
    "goose-unigram": (GooseProposer, GooseConfig, {"bigram": False}),
    "goose-no-bypass": (GooseProposer, GooseConfig, {"bypass": False}),
    "goose-no-spine": (GooseProposer, GooseConfig, {"context_spine": False}),
    "draft_tree": (DraftTreeProposer, DraftTreeConfig, {}),
}


def proposer_config(name: str, **options) -> ProposerConfig:
    """The validated config of ``name`` with ``options`` applied over its presets."""
    try:
        _, config_cls, preset = PROPOSERS[name]
    except KeyError:
        raise ValueError(f"unknown proposer {name!r}; valid names: {sorted(PROPOSERS)}") from None
    return config_cls(**{**preset, **options})


def get_proposer(name: str, vocab_size: int | None = None, **options) -> Proposer:
    """Build the proposer registered under ``name`` (ValueError naming valid names/keys)."""
    config = proposer_config(name, **options)
    cls = PROPOSERS[name][0]
    return cls(config, vocab_size=vocab_size)


def drafts_chains(name: str, **options) -> bool:
    """Whether the proposer ``name`` with ``options`` drafts chains alone (``propose_chain``)."""
    return PROPOSERS[name][0].drafts_chains(proposer_config(name, **options))
