"""PLD baseline and plain autoregressive decoding behind the proposer interface.

Scope: ``PLDProposer`` drafts one linear chain: the continuation of the longest-n context match
(Saxena 2023, "Prompt Lookup Decoding"; GOOSE arXiv 2604.02047 Sec. 5.1 baseline), built on the
incremental ``ContextMatcher`` (whose stateless oracle is ``proposers.pld``). ``ARProposer``
drafts nothing: every step verifies the root alone, i.e. plain greedy decoding (tau = 1).
"""

from __future__ import annotations

import numpy as np

from vllm_anisotropic.proposers.base import ProposalInfo, ProposalMode, Proposer, RequestState, node_budget, root_only
from vllm_anisotropic.proposers.config import PLDConfig, ProposerConfig
from vllm_anisotropic.proposers.context_match import ContextMatcher
from vllm_anisotropic.tree import DraftTree, NodeSource

__all__ = ["PLDProposer", "PLDState", "ARProposer", "ARConfig"]


class PLDState(RequestState):
    def __init__(self, config: PLDConfig) -> None:
        self.config = config
        self.matcher = ContextMatcher(config.ngram_sizes, config.max_continuation)
        self.last_info = ProposalInfo(ProposalMode.PLAIN)

    def propose(self, context_tokens, max_nodes: int | None = None) -> DraftTree:
        context = np.asarray(context_tokens)
        self.matcher.sync(context)
        hit = self.matcher.match(min(self.config.max_continuation, node_budget(self.config.budget, max_nodes) - 1))
        if not hit.found:
            self.last_info = ProposalInfo(ProposalMode.PLAIN)
            return root_only(context)
        self.last_info = ProposalInfo(
            ProposalMode.CHAIN, spine_len=len(hit.draft), ngram=hit.ngram, match_length=hit.match_length, consensus=hit.consensus
        )
        return DraftTree.chain(hit.draft, root_token=int(context[-1]), source=NodeSource.SPINE)


class PLDProposer(Proposer):
    name = "pld"

    def __init__(self, config: PLDConfig | None = None, vocab_size: int | None = None) -> None:
        self.config = config or PLDConfig()

    def new_request(self, tenant: str | None = None) -> PLDState:
        return PLDState(self.config)


class ARConfig(ProposerConfig):
    """Plain autoregressive decoding has no options."""


class _ARState(RequestState):
    def propose(self, context_tokens, max_nodes: int | None = None) -> DraftTree:
        return root_only(context_tokens)


class ARProposer(Proposer):
    name = "ar"

    def __init__(self, config: ARConfig | None = None, vocab_size: int | None = None) -> None:
        self.config = config or ARConfig()

    def new_request(self, tenant: str | None = None) -> RequestState:
        return _ARState()
