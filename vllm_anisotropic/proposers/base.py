"""The proposer interface shared by GOOSE and every baseline.

Scope: the contract only. A ``Proposer`` holds configuration and anything shared across
requests (e.g. a hot-start adjacency table, one per tenant); ``Proposer.new_request(tenant)``
returns a per-request
``RequestState`` that drafts trees and learns from verification results:

* ``state.propose(context_tokens, max_nodes=None) -> DraftTree`` -- ``context_tokens`` is every
  token the request has (prompt + emitted output); its last token is the tree root (the last
  accepted token, not yet run through the model). A root-only tree means "plain decoding this
  step". ``max_nodes`` (root included) lowers the proposer's own budget for this call: the
  engine's drafter passes it when the allocator has been keeping far fewer nodes than the
  budget, so no time goes into building nodes that will be cut.
* ``state.propose_chain(context_tokens, max_drafts) -> DraftTree`` -- a chain alone, for
  proposers whose ``Proposer.drafts_chains(config)`` is true (GOOSE: its context-match spine):
  the measured gate's cheap speculative steps (``allocator.gate``).
* ``state.observe(tree, accepted, logits, prev_root=None)`` -- after verification: ``accepted`` are the
  accepted node indices (root excluded, root->leaf order, ``VerifyResult.accepted``) and
  ``logits`` the target logits of every verified node, ``[num_nodes, vocab_size]`` (row i =
  next-token logits after node i's path), or None when the caller cannot provide them.
* ``state.observe_later(tree, accepted)`` -- the same learning, to run later: returns a
  callable taking the ``logits``, bound now to whatever the next ``propose`` overwrites (the
  engine's drafter harvests a step's rows after it has proposed the next tree; see
  ``integration/vllm/engine/drafter.py``).
* ``state.observe_prefill(prompt_tokens, logits)`` -- optional harvest of the prefill
  (row j = logits after ``prompt_tokens[j]``).

``state.last_info`` describes the last proposal (mode, spine length, bypass, ...), for logs.
"""

from __future__ import annotations

import abc
import enum
import functools
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import numpy as np
import torch

from vllm_anisotropic.tree import DraftTree

__all__ = ["MODE_CODES", "ProposalMode", "ProposalInfo", "RequestState", "Proposer", "node_budget", "root_only"]


class ProposalMode(str, enum.Enum):
    """How a step's tree was built (GOOSE Appendix B.2 routing)."""

    TREE = "tree"  # a spine tree / branch tree
    BYPASS = "bypass"  # the context-match spine verified alone as a linear chain
    CHAIN = "chain"  # a baseline linear chain (PLD)
    PLAIN = "plain"  # root only: no source had anything; one plain decoding step


# int8 codes of the modes in per-step arrays (one per request of a batch proposal)
MODE_CODES: dict[ProposalMode, int] = {ProposalMode.PLAIN: 0, ProposalMode.TREE: 1, ProposalMode.BYPASS: 2,
                                       ProposalMode.CHAIN: 3}

@dataclass(frozen=True)
class ProposalInfo:
    mode: ProposalMode
    # number of SPINE nodes in the tree (context-match tokens)
    spine_len: int = 0
    # n of the matched n-gram (0: no match), its backward match length, consensus flag
    ngram: int = 0
    match_length: int = 0
    consensus: bool = False
    # spine ratio r used (GOOSE), nan for baselines
    spine_ratio: float = float("nan")


def node_budget(budget: int, max_nodes: int | None) -> int:
    """The node budget of one ``propose`` call: ``budget`` lowered to ``max_nodes`` (>= 1).

    ``node_budget(60, None) -> 60``; ``node_budget(60, 9) -> 9``; ``node_budget(4, 9) -> 4``.
    """
    return int(budget) if max_nodes is None else max(1, min(int(budget), int(max_nodes)))


def root_only(context_tokens) -> DraftTree:
    """The one-node tree of a plain decoding step (root = last context token)."""
    return DraftTree.chain([], root_token=int(context_tokens[-1]))


class RequestState(abc.ABC):
    """Per-request drafting state; see module docstring for the call protocol."""

    last_info: ProposalInfo = ProposalInfo(ProposalMode.PLAIN)

    @abc.abstractmethod
    def propose(self, context_tokens: np.ndarray, max_nodes: int | None = None) -> DraftTree: ...

    # top-k of the target's softmax rows this state harvests (``adjacency.TopKRows`` may stand
    # in for ``logits`` in ``observe``); None: it reads no logits
    harvest_top_k: int | None = None

    def propose_chain(self, context_tokens: np.ndarray, max_drafts: int) -> DraftTree:
        """A chain alone, at most ``max_drafts`` tokens below the root (the measured gate's chain
        steps, ``allocator.gate``); only proposers whose ``drafts_chains`` says so have one."""
        raise NotImplementedError(f"{type(self).__name__} drafts no chains alone")

    def observe(self, tree: DraftTree, accepted: Sequence[int], logits: torch.Tensor | None,
                prev_root: int | None = None) -> None:
        """Learn from a verified tree (``prev_root``: the context token before its root, for
        states keyed by it; None: the one ``propose`` saw last); default: nothing to learn."""

    def observe_later(self, tree: DraftTree, accepted: Sequence[int]) -> Callable[[torch.Tensor | None], None]:
        """``observe(tree, accepted, logits)`` to call after the next ``propose``; a state whose
        ``observe`` reads what ``propose`` sets binds it here."""
        return functools.partial(self.observe, tree, accepted)

    def observe_prefill(self, prompt_tokens, logits: torch.Tensor | None) -> None:
        """Harvest prefill logits; default: nothing."""

    def finish(self, context_tokens=None) -> None:
        """The request finished or was aborted (``context_tokens``: its prompt and output, when
        the caller has them); default: nothing to keep."""


class Proposer(abc.ABC):
    """A configured drafting method; ``new_request()`` makes the per-request state."""

    name: ClassVar[str]
    # the most nodes one of its trees can have, root included, when the proposer guarantees a
    # bound (the engine's drafter then cuts a proposal to a request's room only when that room
    # is smaller); None: no guarantee, every proposal is cut
    max_tree_nodes: int | None = None

    @abc.abstractmethod
    def new_request(self, tenant: str | None = None) -> RequestState:
        """A new request's state. ``tenant``: vLLM's ``cache_salt`` of the request; a proposer
        that learns across requests learns per tenant (``adjacency.TenantTables``)."""

    @classmethod
    def drafts_chains(cls, config) -> bool:
        """Whether states made with ``config`` have a ``propose_chain`` (a chain cheaper than
        their trees); default: no."""
        return False

    def take_resume_seconds(self) -> float:
        """Seconds of its drafting since the last call that were resumes: a draft model catching
        up on what the target decoded while the measured gate rested its requests (the plain
        steps' tokens, the prompts that arrived meanwhile). A cost of the gate's switch, which
        the gate counts in neither arm (``budget.BatchBudget.on_output``); default: none."""
        return 0.0

    def take_catchup(self) -> tuple[float, int, int]:
        """A draft model's catch-up account since the last call: (seconds, tokens) of its long
        catch-ups (a forward with a prompt or a resume, at least ``draft_batch.CATCHUP_MIN_TOKENS``
        tokens: what a caught-up token costs, for the scheduler's repay ratio,
        ``budget.BatchBudget.repay_next``), and the request-steps the repay rule left without
        drafts (the gate counts a step of those alone in neither arm); default: none."""
        return 0.0, 0, 0

    def begin_step(self, num_requests: int, batch_requests: int | None = None) -> None:
        """The next ``num_requests`` ``propose`` calls draft one engine step's trees (the engine's
        drafter says so first), of the step's ``batch_requests`` (all its requests, drafting or not;
        None: ``num_requests``); default: nothing to adapt."""
