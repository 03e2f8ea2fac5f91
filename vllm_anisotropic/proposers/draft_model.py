"""Draft-model trees with delayed expansion (arXiv 2602.16994, Def. 5.2): a trunk, then K branches.

Scope: drafting only. A small causal LM q (``DraftLM``, loaded with transformers, one KV cache
per request in a ``DraftSession``) drafts one ``DraftTree`` per step from a request's context
(one request here; the engine drafts a step's requests together, q batched over them on one
KV of all requests: ``draft_batch.py``, ``draft_kv.py``, the same trees):

1. the **trunk**: L1 tokens, each drawn from q given the context and the trunk so far;
2. the **branches**: K paths of L2 tokens from the trunk's end, each token drawn from q given
   its own path. Sampled requests: the K paths are i.i.d. (their first tokens may repeat: the
   tree is unmerged, multiplicity 1, as the OT verifiers' child multisets expect). Greedy
   requests: the trunk is q's greedy path, the K branches start with q's K most likely tokens
   at the trunk's end (distinct) and continue greedily.

Drawing a token "from q" means from q's logits processed exactly as vLLM processes the target's
for the request (temperature, top-k, top-p: ``verifiers.sampling.target_probs``), with inverse-
CDF sampling on uniforms from the request's generator (``sample_inverse_cdf``); seeded alike,
every tensor-parallel rank drafts the same tree.

The tree (``DraftTree``; sources ``DRAFT``):

* node order: the trunk (depth order), then the branch nodes depth-major (depth 1 of branches
  1..K, then depth 2, ...). Parents come first, so any prefix is a subtree; and the order is
  fixed by (K, L1, L2) alone, never by the sampled tokens. A budget allocator that cuts the
  list at a length chosen before drafting therefore keeps the first branches of i.i.d. draws,
  which are still i.i.d.: the OT verifiers' assumption holds (docs/verifiers.md).
* ``draft_probs`` (sampled requests): row i is the processed q after node i's path, the law the
  children of node i were drawn from (``tree.py``); leaf rows are zeros (never read). Greedy
  requests carry none (the greedy walk needs no q).
* ``values``: the q probability of the node's path (the product of its tokens' q under the
  request's processing; raw softmax for greedy requests). Diagnostic, and the acceptance model's
  input for greedy trees; for sampled trees they depend on the samples, so nothing may cut a
  sampled tree by them.

KV cache (one request, ``DraftSession``): a session keeps the KV of the tokens it has run
(``DraftSession.tokens``): the context it last drafted from plus that step's trunk. The next
step keeps the longest common prefix with the new context (an accepted trunk is not
recomputed) and runs only the rest; the branches run on K copies of the cache, dropped
afterwards. The engine's batched path keeps the same tokens per request in one slot of
``draft_kv.DraftKV`` instead (``DraftSession.slot``; its ``cache`` stays empty there).

Example (greedy, K = 2, L1 = 1, L2 = 2; q's greedy path after the root r is a, b, c; at a the
top two tokens are b and x, and x continues with y)::

    tokens  [r, a, b, x, c, y]
    parents [-1, 0, 1, 1, 2, 3]      # trunk a; branches a->b->c and a->x->y, depth-major
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from vllm_anisotropic.proposers.base import ProposalInfo, ProposalMode, Proposer, RequestState, node_budget, root_only
from vllm_anisotropic.proposers.draft_common import NO_DRAFTS, _draw, _law, _tree, attention_dims, shape_parents
from vllm_anisotropic.selector.features import root_features
from vllm_anisotropic.selector.policy import ShapeSelector
from vllm_anisotropic.selector.shape import DelayedShape
from vllm_anisotropic.tree import DraftTree
from vllm_anisotropic.verifiers.sampling import TargetSampling

__all__ = ["DelayedShape", "DraftLM", "DraftSession", "delayed_tree", "shape_parents", "DraftTreeProposer",
           "DraftTreeState", "check_same_vocabulary"]

GREEDY = TargetSampling(temperature=0.0)
DRAFT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
logger = logging.getLogger(__name__)


class DraftLM:
    """The draft model q: a transformers causal LM on ``device`` (its weights and KV there), no
    grad. Its logits come back to the host as float32 (``forward``, ``DraftKV.forward``): the
    laws and draws stay on the host, as the requests' generators and every TP rank's same tree
    need, one [rows, vocab] copy per forward."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.model_dir = str(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).to(device).eval()
        self.device = torch.device(device)
        self.dtype = dtype
        self.vocab_size = int(self.model.config.vocab_size)
        self.kv_bytes_per_token = kv_bytes_per_token(self.model.config, dtype)
        # q's decoder for ``DraftKV.forward`` as one callable (ids [T], positions [T], plan) ->
        # hidden [T, hidden], set by the engine on the CPU (integration/vllm/kernels/cpu_draft.py);
        # None: transformers' decoder
        self.layers_forward = None

    def new_session(self) -> "DraftSession":
        return DraftSession(self)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache) -> torch.Tensor:
        """q's logits after the last of ``input_ids`` [batch, 1, vocab_size] (float32); ``cache``
        extended in place. Only the last position goes through the output head."""
        out = self.model(input_ids=input_ids.to(self.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1:].float().cpu()


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V one token holds in a causal LM of transformers ``config`` in ``dtype``:
    layers x 2 x KV heads x head dim x element size."""
    _, kv_heads, head_dim = attention_dims(config)
    return int(config.num_hidden_layers) * 2 * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class DraftSession:
    """One request's KV cache in q, and the tokens it holds (module docstring)."""

    def __init__(self, lm: DraftLM) -> None:
        from transformers import DynamicCache

        self.lm = lm
        self._new_cache = DynamicCache
        self.cache = DynamicCache()
        self.tokens: list[int] = []
        self.forwarded = 0  # tokens run through q (for the incremental-cache tests and stats)
        self.last_step = 0  # the proposer's step in which it last drafted (the KV bound's LRU order)
        self.slot: int | None = None  # its row in the engine's ``draft_kv.DraftKV`` (None: none)

    def kv_bytes(self) -> int:
        """Bytes of K/V the session holds (its tokens in q's cache)."""
        return len(self.tokens) * self.lm.kv_bytes_per_token

    def root_logits(self, context: Sequence[int]) -> torch.Tensor:
        """q's logits after ``context`` [vocab_size]; the cache then holds exactly ``context``."""
        context = [int(t) for t in context]
        if not context:
            raise ValueError("the context must hold at least the root token")
        self.keep_common(context)
        return self.extend(context[len(self.tokens):])[0, -1]

    def keep_common(self, context: Sequence[int]) -> None:
        """Crop the cache to its longest common prefix with ``context``, short of the root (whose
        logits are needed: it always runs again)."""
        self.crop(min(self.common_prefix(context), len(context) - 1))

    def common_prefix(self, context) -> int:
        """How many of the cached tokens are ``context``'s first ones."""
        n = min(len(self.tokens), len(context))
        differ = np.flatnonzero(np.asarray(self.tokens[:n], np.int64) != np.asarray(context[:n], np.int64))
        return int(differ[0]) if differ.size else n

    def crop(self, keep: int) -> None:
        """Keep the first ``keep`` cached tokens."""
        if keep == 0:
            self.cache = self._new_cache()
        else:
            _crop(self.cache, keep)
        self.tokens = self.tokens[:keep]

    def extend(self, tokens: Sequence[int]) -> torch.Tensor:
        """Run ``tokens`` after the cached ones (batch 1): q's logits after the last [1, 1, vocab_size]."""
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        logits = self.lm.forward(ids, self.cache)
        self.tokens.extend(int(t) for t in tokens)
        self.forwarded += len(tokens)
        return logits

    def branch(self, k: int) -> "_Branches":
        """K copies of the cache for the branches; ``_Branches.close`` drops them."""
        return _Branches(self, k)


class _Branches:
    def __init__(self, session: DraftSession, k: int) -> None:
        self.session, self.k = session, k
        self.base = len(session.tokens)
        if k > 1:
            session.cache.batch_repeat_interleave(k)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per branch [K] -> logits [K, vocab_size]."""
        logits = self.session.lm.forward(tokens.view(self.k, 1).long(), self.session.cache)
        self.session.forwarded += self.k
        return logits[:, -1]

    def close(self) -> None:
        """Back to one sequence holding the tokens before the branches."""
        cache = self.session.cache
        if self.k > 1:
            cache.batch_select_indices(torch.tensor([0]))
        _crop(cache, self.base)


def _crop(cache, keep: int) -> None:
    """Keep the first ``keep`` tokens of ``cache`` (transformers' ``crop`` with the negative
    count: positive lengths are deprecated)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


def delayed_tree(session: DraftSession, context: Sequence[int], shape: DelayedShape,
                 sampling: TargetSampling = GREEDY, generator: torch.Generator | None = None,
                 root_law: torch.Tensor | None = None) -> DraftTree:
    """The (K, L1, L2) delayed tree of q after ``context`` (its last token is the root);
    ``root_law``: ``root_law(session, context, sampling)`` when the caller has it already."""
    parents = shape_parents(shape)
    n = parents.size
    tokens = np.zeros(n, np.int64)
    tokens[0] = int(context[-1])
    values = np.ones(n)
    rows = torch.zeros(n, session.lm.vocab_size) if not sampling.greedy else None
    law = root_law_of(session, context, sampling) if root_law is None else root_law  # [vocab]
    node = 0
    for _ in range(shape.trunk):  # the trunk: node i + 1 drawn after node i
        if rows is not None:
            rows[node] = law
        token = int(_draw(law[None], sampling, generator)[0])
        node += 1
        tokens[node], values[node] = token, values[node - 1] * float(law[token])
        if node < n - 1:  # q after the new node is needed only if something hangs below it
            law = _law(session.extend([token])[0, -1], sampling)[0]
    if shape.branch_length == 0:
        return _tree(tokens, parents, values, rows)
    k = shape.branches
    if rows is not None:
        rows[node] = law
    if sampling.greedy:
        first = torch.topk(law, k).indices  # [K] distinct, most likely first
    else:
        first = _draw(law.expand(k, -1), sampling, generator)  # [K] i.i.d.
    trunk_value = values[node]
    branches = session.branch(k)
    try:
        current, current_values = first, trunk_value * law[first].double().numpy()
        for depth in range(shape.branch_length):
            ids = 1 + shape.trunk + depth * k + np.arange(k)  # this depth's K nodes
            tokens[ids], values[ids] = current.numpy(), current_values
            if depth == shape.branch_length - 1:
                break
            laws = _law(branches.step(current), sampling)  # [K, vocab]
            if rows is not None:
                rows[ids] = laws
            current = _draw(laws, sampling, generator)
            current_values = current_values * laws.gather(1, current[:, None])[:, 0].double().numpy()
    finally:
        branches.close()
    return _tree(tokens, parents, values, rows)


def root_law_of(session: DraftSession, context: Sequence[int], sampling: TargetSampling) -> torch.Tensor:
    """[vocab] the law of the first draft after ``context`` (the session then holds ``context``)."""
    return _law(session.root_logits(context), sampling)[0]


def check_same_vocabulary(draft_dir: str | Path, target_dir: str | Path) -> None:
    """ValueError unless the draft's tokenizer maps every token string to the same id as the
    target's (same vocabulary, same special tokens): a draft token id must mean the same text."""
    from transformers import AutoTokenizer

    draft = AutoTokenizer.from_pretrained(str(draft_dir))
    target = AutoTokenizer.from_pretrained(str(target_dir))
    dv, tv = draft.get_vocab(), target.get_vocab()
    if dv != tv:
        only_draft = sorted(set(dv) - set(tv))[:5]
        moved = sorted(t for t in set(dv) & set(tv) if dv[t] != tv[t])[:5]
        raise ValueError(
            f"draft model {str(draft_dir)!r} does not share the target's tokenizer ({len(dv)} vs {len(tv)} "
            f"tokens; e.g. only in the draft: {only_draft}, different ids: {moved}); draft_tree needs a "
            f"draft model with the target's vocabulary (e.g. Qwen2.5-Coder-0.5B-Instruct for Qwen2.5-Coder-1.5B-Instruct)"
        )


class DraftTreeState(RequestState):
    """One request: its q session, sampling law and generator (set by the engine's drafter)."""

    # the measured gate rested the request since q last ran for it (set by the engine's drafter,
    # cleared by the batched step that catches q up: a resume, ``draft_batch``)
    resuming: bool = False
    # output tokens the request may still emit (set by the engine's drafter while the measured
    # gate sends a repay ratio; None: unknown): its catch-up must be repaid by them (draft_batch)
    remaining: int | None = None

    def __init__(self, proposer: "DraftTreeProposer") -> None:
        self.proposer = proposer
        self.session = proposer.lm.new_session()
        self.sampling: TargetSampling = GREEDY
        self.generator: torch.Generator | None = None
        self.last_info = ProposalInfo(ProposalMode.PLAIN)

    def set_sampling(self, sampling: TargetSampling, seed: int) -> None:
        """The request's law (q is processed alike) and the seed of its drafting uniforms."""
        self.sampling = sampling
        self.generator = torch.Generator().manual_seed(int(seed))

    def release(self) -> None:
        """Free q's KV cache (the request was preempted); the next proposal rebuilds it."""
        self.proposer.free_kv(self.session)
        self.session = self.proposer.lm.new_session()

    def finish(self, context_tokens=None) -> None:
        """The request finished or was aborted: its slot of q's KV is free."""
        self.proposer.free_kv(self.session)

    def propose(self, context_tokens: np.ndarray, max_nodes: int | None = None) -> DraftTree:
        """The shape's tree (the selector's choice for this context, if there is a selector), cut
        to ``max_nodes`` (a cut decided before any token is drawn)."""
        if not self.wants_q(context_tokens, max_nodes):
            return root_only(context_tokens)
        return self.draft(context_tokens, max_nodes)

    def selector_sampling(self) -> tuple[float, float]:
        """(temperature, top-p) of the request as the selector reads them: (0, 1) when greedy."""
        s = self.sampling
        return (0.0, 1.0) if s.greedy else (s.temperature, s.top_p)

    def wants_q(self, context_tokens: np.ndarray, max_nodes: int | None = None,
                may_draft: bool | None = None) -> bool:
        """Whether this step drafts at all: a budget above the root and, with a selector, some
        root entropy that would draft at this batch size (``may_draft``: the selector's answer
        when the batched drafter asked it for the whole step, ``ShapeSelector.may_draft_rows``;
        None: asked here). If not, the step is plain (``last_info``; the selector's
        ``NO_DRAFTS`` counted) and q does not run (q's cache catches up when drafting resumes)."""
        selector, shape = self.proposer.selector, self.proposer.shape
        if node_budget(1 + (shape.num_drafts if selector is None else selector.max_drafts), max_nodes) <= 1:
            self.last_info = ProposalInfo(ProposalMode.PLAIN)
            return False
        if selector is not None and may_draft is None:
            may_draft = selector.may_draft(len(context_tokens), *self.selector_sampling(), self.proposer.step_requests,
                                           self.proposer.step_batch)
        if selector is not None and not may_draft:
            self.proposer.count_shape(NO_DRAFTS)
            self.last_info = ProposalInfo(ProposalMode.PLAIN)
            return False
        return True

    def draft(self, context_tokens: np.ndarray, max_nodes: int | None = None) -> DraftTree:
        """``propose``'s tree once ``wants_q`` said yes."""
        root_law = None
        if self.proposer.selector is not None:
            root_law = root_law_of(self.session, context_tokens, self.sampling)
        shape = self.shape_for(context_tokens, root_law)
        tree = delayed_tree(self.session, context_tokens, shape, self.sampling, self.generator, root_law)
        return self.cut(tree, shape, max_nodes)

    def shape_for(self, context_tokens: np.ndarray, root_law: torch.Tensor | None) -> DelayedShape:
        """The shape of this request drafting alone (``DraftTreeProposer.step_shapes`` of one row)."""
        return self.proposer.step_shapes([self], [context_tokens], None if root_law is None else root_law[None])[0]

    def features(self, context_tokens: np.ndarray, root_law: torch.Tensor) -> np.ndarray:
        """The selector's features of this request-step (``root_law``: q's processed law at the root)."""
        return root_features(root_law, len(context_tokens), *self.selector_sampling(), self.proposer.step_requests)

    def cut(self, tree: DraftTree, shape: DelayedShape, max_nodes: int | None) -> DraftTree:
        """``tree`` (drafted in ``shape``) cut to the node budget after drawing, ``last_info`` set
        (a shape without drafts is a plain step)."""
        self.last_info = ProposalInfo(ProposalMode.TREE if shape.num_drafts else ProposalMode.PLAIN)
        limit = node_budget(1 + shape.num_drafts, max_nodes)
        return tree if limit >= tree.num_nodes else tree.truncate(limit)


class DraftTreeProposer(Proposer):
    """``draft_tree``: delayed-expansion trees from a draft model (module docstring)."""

    name = "draft_tree"

    def __init__(self, config, vocab_size: int | None = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        """``device`` / ``dtype``: what ``draft_device`` / ``draft_dtype`` "auto" mean (the
        engine passes its worker's device and the target's dtype); without them, the CPU and
        float32."""
        self.config = config
        self.shape = DelayedShape(config.branches, config.trunk, config.branch_length)
        device = str(device or "cpu") if config.draft_device == "auto" else config.draft_device
        dtype = (dtype or torch.float32) if config.draft_dtype == "auto" else DRAFT_DTYPES[config.draft_dtype]
        self.lm = DraftLM(config.model, dtype=dtype, device=device)
        # q's KV for the batched path (``draft_kv.DraftKV``, made at the first batched step);
        # ``kv_bound``: its bytes at most (None: no bound, offline use; the engine sets it from
        # what it reserves out of vLLM's KV memory)
        self._kv = None
        self.kv_bound: int | None = None
        self.step = 0  # drafting steps (begin_step), the sessions' LRU clock
        self.resume_s = 0.0  # seconds of q's catch-ups in neither gate arm: rested requests', new prompts' (take_resume_seconds)
        # q's long catch-ups (at least CATCHUP_MIN_TOKENS tokens: prompts, resumes): seconds and
        # tokens since the last ``take_catchup``, the scheduler's measure of a catch-up token
        self.catchup_s, self.catchup_tokens = 0.0, 0
        # catch-up tokens one remaining output token repays this step (the scheduler's, from the
        # measured gate: ``budget.BatchBudget.repay_next``); None: every request may catch up
        self.repay: float | None = None
        self.unrepaid = 0  # request-steps a long catch-up was left out since the last take_catchup
        # the learned (K, L1, L2) selector; "auto" is resolved by the engine's front door (it knows
        # the target): left unresolved here, it means the fixed shape
        self.selector = None
        if config.selector not in ("auto", "off"):
            self.selector = ShapeSelector.load(config.selector)
            if self.selector.verifier != config.verifier:
                logger.info("draft_tree: selector %s was trained for verifier %r; sampled requests are verified by %r "
                            "(the output law is the same, the shapes may pay less)", config.selector,
                            self.selector.verifier, config.verifier)
        # requests drafting in the current engine step (the selector's batch-size feature), and
        # all the step's requests (what the selector's ``max_batch_size`` bounds: begin_step)
        self.step_requests = 1
        self.step_batch = 1
        # "K,L1,L2" -> request-steps the selector chose it (a plain dict: the metrics' asdict copies
        # it, and dataclasses.asdict rebuilds a Counter from (key, value) pairs as new keys)
        self.shape_counts: dict[str, int] = {}
        if vocab_size is not None and self.lm.vocab_size != int(vocab_size):
            raise ValueError(f"draft model {config.model!r} has vocab_size {self.lm.vocab_size}, the target "
                             f"{vocab_size}; draft_tree needs a draft model with the target's vocabulary")

    def new_request(self, tenant: str | None = None) -> DraftTreeState:
        return DraftTreeState(self)

    def propose_batch(self, states, token_ids, rows, lengths, max_nodes=None, chain_drafts=None):
        """One engine step's trees of ``states`` (each ``DraftTreeState.propose``'s tree), q's
        forwards batched over the requests (``draft_batch.propose_draft_trees``)."""
        from vllm_anisotropic.proposers.draft_batch import propose_draft_trees

        if chain_drafts is not None:
            raise ValueError("draft_tree drafts no chains alone")
        return propose_draft_trees(self, states, token_ids, rows, lengths, max_nodes)

    def take_resume_seconds(self) -> float:
        seconds, self.resume_s = self.resume_s, 0.0
        return seconds

    def take_catchup(self) -> tuple[float, int, int]:
        out = (self.catchup_s, self.catchup_tokens, self.unrepaid)
        self.catchup_s, self.catchup_tokens, self.unrepaid = 0.0, 0, 0
        return out

    def begin_step(self, num_requests: int, batch_requests: int | None = None) -> None:
        self.step_requests = max(1, int(num_requests))
        self.step_batch = max(self.step_requests, int(batch_requests or 0))
        self.step += 1

    @property
    def kv(self):
        """q's KV of the engine's requests (``draft_kv.DraftKV``), bounded by ``kv_bound``."""
        from vllm_anisotropic.proposers.draft_kv import DraftKV

        if self._kv is None:
            self._kv = DraftKV(self.lm)
        self._kv.bound = self.kv_bound
        return self._kv

    def free_kv(self, session: DraftSession) -> None:
        """``session``'s slot of q's KV is free (its request finished or was preempted)."""
        if self._kv is not None:
            self._kv.free(session)

    def kv_stats(self) -> tuple[int, int, int]:
        """(bytes q's KV takes now, the most it took, sessions dropped to the bound)."""
        kv = self._kv
        return (0, 0, 0) if kv is None else (kv.bytes(), kv.peak, kv.evictions)

    @property
    def max_drafts(self) -> int:
        """The most drafts one request's tree can take (its shape's, or the selector's largest):
        the columns of q's KV a step may add after a context."""
        return self.shape.num_drafts if self.selector is None else int(self.selector.max_drafts)

    def step_shapes(self, states: list, contexts: list, root_laws: torch.Tensor | None) -> list:
        """The shapes of the drafting requests of one step (``states[r]`` with its context and its
        root law ``root_laws[r]``), from what is known before any draft is drawn (the i.i.d.
        branches stay i.i.d.), counted: the selector's ``choose_shapes`` (one shape for the step),
        or the fixed shape without a selector."""
        if self.selector is None:
            return [self.shape] * len(states)
        shapes = self.selector.choose_shapes(np.stack([s.features(c, law) for s, c, law
                                                       in zip(states, contexts, root_laws)]))
        for shape in shapes:
            self.count_shape(shape)
        return shapes

    def count_shape(self, shape: "DelayedShape") -> None:
        """One request-step the selector chose ``shape`` (the ``selector_shapes`` metric)."""
        key = f"{shape.branches},{shape.trunk},{shape.branch_length}"
        self.shape_counts[key] = self.shape_counts.get(key, 0) + 1
