"""One engine step's draft-model trees for all its drafting requests, q's forwards batched.

Scope: ``DraftTreeProposer.propose_batch`` (the engine's drafter calls it once per step). The
trees are the ones ``draft_model.delayed_tree`` drafts one request at a time (same node order,
same draws from each request's generator in the same order, ``draft_probs`` the law each draw
came from); what changes is that each depth is one forward of q for every request of the step,
on q's KV of all requests (``draft_kv.DraftKV``: request b in row b for the step):

1. **catch-up**: each request's tokens q has not run yet (a new prompt, the accepted tokens,
   the root) in one packed forward of all rows, which gives every root law at once;
2. **shapes**: the selector's (K, L1, L2) from the root laws (one shape for the step's drafting
   requests, ``ShapeSelector.choose_shapes``), or the fixed shape;
3. **trunk**: one forward per depth of one token per row, for every request whose trunk goes
   that deep; **branches**: one forward per depth of the K tokens of every request's branches,
   as K lanes in the request's own row after its trunk. Whatever the shapes, the catch-up is
   followed by at most max(L1) + max(L2) - 1 forwards; a row with nothing to run at a depth
   adds no token.

A catch-up with a row whose request the measured gate rested since q last ran for it
(``DraftTreeState.resuming``, set by the engine's drafter: the tokens of the gate's plain steps,
and the prompt of a request that arrived during them) is a **resume**: its seconds are a cost of
the gate's switch, not of speculating, and the gate counts them in neither arm
(``Proposer.take_resume_seconds``). Without that, a closed gate's single exploring step paid
q's catch-up of every token decoded since, and of every prompt that arrived since, and the
speculative arm could read slower than plain where speculation paid (the trap of
docs/notebook/selector.md, T = 0.7 at one request). A **new prompt** (q's first run for a
request) is a cost of the request, once, which the repay rule below prices against its
remaining tokens: its share of the forward (by tokens) is counted in neither arm either. In the
arm, a prompt's step weighs on the few steps of a gate's warm-up (one request, 2-core EPYC: 0.53
s for 4 tokens against ~0.17 s a step; with one such step among the warm-up's 8 the arm reads
15.6 tokens/s, with three it would read 10.3, below plain's 10.9 x 1.1, where open it runs ~19). Tokens
a request decoded without q while the gate let it draft (the selector or the allocator's backoff
kept it plain) are the speculative arm's own cost. After a rest every request of the step
resumes (the gate decides for the whole step), so the forward timed is the resuming rows'
alone, but for a prompt that arrives in the very step drafting resumes: it is timed with them.

**Repay.** A catch-up longer than a drafting step leaves (a prompt, a resume, a session the KV
bound dropped) costs q ~3-4 ms a token on one core of the 2-core EPYC (a 300-token resume ~1 s,
two or three decode steps of the 1.5B target): at the end of a request it cannot pay. While the
scheduler sends a ratio (``proposer.repay``: the seconds an output token saves speculating at
the batch ahead (``budget.BatchBudget.cut``), from the gate's measured rates:
``SpeculationGate.token_saving_s``;
over the seconds q takes a caught-up token,
measured here: ``Proposer.take_catchup``), a request catches up only if its remaining output
tokens (``DraftTreeState.remaining``: ``max_tokens`` and the model length left) times the ratio
cover the tokens it would catch up; otherwise it decodes plainly this step (``unrepaid``) and
asks again the next. Both numbers come from the scheduler and the request, not from this
worker's clock, so every tensor-parallel rank decides alike.

The rows keep each request's context and trunk; the lanes are overwritten by the next step.
A request whose row does not fit q's KV bound drafts nothing this step (``DraftKV.fit``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm_anisotropic.proposers.base import MODE_CODES, ProposalInfo, ProposalMode, root_only
from vllm_anisotropic.proposers.draft_common import _draw, _law, _tree, shape_parents
from vllm_anisotropic.tree import FlatTrees
from vllm_anisotropic.verifiers.sampling import target_probs

__all__ = ["CATCHUP_MIN_TOKENS", "DraftProposals", "propose_draft_trees"]

# a catch-up of at least this many tokens (a forward's, all rows) measures q's cost a caught-up
# token (``Proposer.take_catchup``): per token, a forward's fixed cost (its weights streamed
# once, ~64 ms on the 2-core EPYC at one thread) weighs ~1 ms at 64 tokens, against ~3-4 ms of
# q's own work a token (docs/draft_tree.md)
CATCHUP_MIN_TOKENS = 64

@dataclass
class DraftProposals:
    """One step's proposals (``propose_draft_trees``): tree r is request r's."""

    trees: FlatTrees
    modes: np.ndarray  # [R] int8 ``base.MODE_CODES``
    prev_roots: np.ndarray  # [R] int64 the token before each root, -1: none


def _laws(logits: torch.Tensor, samplings: list) -> torch.Tensor:
    """``[rows, vocab]`` law of each row's draws: q processed like the target's for its request
    (``samplings[b]``; raw softmax for greedy ones), as ``draft_common._law`` does for one sampling."""
    sampled = [b for b, s in enumerate(samplings) if not s.greedy]
    if not sampled:
        return logits.softmax(dim=-1)
    out = torch.empty_like(logits)
    greedy = torch.tensor([b for b, s in enumerate(samplings) if s.greedy], dtype=torch.long)
    if greedy.numel():
        out[greedy] = logits[greedy].softmax(dim=-1)
    index = torch.tensor(sampled, dtype=torch.long)
    out[index] = target_probs(logits[index].float().cpu(),
                              torch.tensor([float(samplings[b].temperature) for b in sampled]),
                              torch.tensor([int(samplings[b].top_k) for b in sampled]),
                              torch.tensor([float(samplings[b].top_p) for b in sampled])).to(out)
    return out


def propose_draft_trees(proposer, states, token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
                        max_nodes: np.ndarray | None = None) -> DraftProposals:
    """The trees ``DraftTreeState.propose`` would draft for each of ``states`` (request r's
    context: ``token_ids[rows[r], :lengths[r]]``; ``max_nodes[r]`` its node budget, 0: the
    proposer's own), q's forwards batched over the requests (module docstring)."""
    n = len(states)
    contexts = [token_ids[rows[r], : lengths[r]] for r in range(n)]
    budgets = [None if max_nodes is None or max_nodes[r] <= 0 else int(max_nodes[r]) for r in range(n)]
    trees: list = [None] * n
    drafting = []
    may = [None] * n
    if proposer.selector is not None and n:  # one pass of the selector's network for the step
        temps, top_ps = zip(*(s.selector_sampling() for s in states))  # not q's laws (``_laws``)
        may = proposer.selector.may_draft_rows([len(c) for c in contexts], temps, top_ps,
                                               proposer.step_requests, proposer.step_batch).tolist()
    for r, state in enumerate(states):
        if state.wants_q(contexts[r], budgets[r], may[r]) and _repays(proposer, state, contexts[r]):
            drafting.append(r)
        else:
            trees[r] = root_only(contexts[r])
    for r in drafting:
        states[r].session.last_step = proposer.step  # the KV bound's LRU clock (DraftKV.place)
    kv = proposer.kv
    needs = [len(contexts[r]) + proposer.max_drafts for r in drafting]
    kept = kv.fit([states[r].session for r in drafting], needs)
    for j in sorted(set(range(len(drafting))) - set(kept)):  # over the bound: a plain step
        r = drafting[j]
        trees[r] = root_only(contexts[r])
        states[r].last_info = ProposalInfo(ProposalMode.PLAIN)
    drafting = [drafting[j] for j in kept]
    if drafting:
        kv.place([states[r].session for r in drafting], [needs[j] for j in kept])
        order = sorted(drafting, key=lambda r: states[r].session.slot)  # row b: slot b
        group = [states[r] for r in order]
        ordered = [contexts[r] for r in order]
        resuming = [s for s in group if s.resuming]
        forwarded = [s.session.forwarded for s in group]
        t0 = time.perf_counter()
        logits = _catch_up(kv, [s.session for s in group], ordered)  # q's rows back on the host: no sync
        seconds = time.perf_counter() - t0
        per_row = [s.session.forwarded - f for s, f in zip(group, forwarded)]
        caught_up = sum(per_row)
        if resuming:  # the gate rested these requests: their catch-up is a resume
            proposer.resume_s += seconds
            for s in resuming:
                s.resuming = False
        elif caught_up:  # new prompts: their share of the forward, by tokens, is the request's cost
            fresh = sum(t for t, f in zip(per_row, forwarded) if f == 0)
            proposer.resume_s += seconds * fresh / caught_up
        if caught_up >= CATCHUP_MIN_TOKENS and max(per_row) > proposer.max_drafts + 1:  # a long one: a token's cost
            proposer.catchup_s += seconds
            proposer.catchup_tokens += caught_up
        root_laws = _laws(logits, [s.sampling for s in group])
        shapes = proposer.step_shapes(group, ordered, root_laws)
        drawn = _delayed_trees(kv, shapes, group, root_laws, [int(c[-1]) for c in ordered])
        for r, shape, tree in zip(order, shapes, drawn):
            trees[r] = states[r].cut(tree, shape, budgets[r])
    modes = np.array([MODE_CODES[s.last_info.mode] for s in states], np.int8)
    prev_roots = np.where(lengths >= 2, token_ids[rows, np.maximum(lengths - 2, 0)], -1).astype(np.int64)
    return DraftProposals(FlatTrees.from_trees(trees), modes, prev_roots)


def _repays(proposer, state, context: np.ndarray) -> bool:
    """Whether ``state``'s catch-up of ``context`` is worth it (module docstring, "repay"): a
    catch-up longer than a drafting step leaves (``max_drafts`` + 1 tokens) only where the
    request's remaining output tokens, times ``proposer.repay`` (the catch-up tokens one output
    token repays), cover it. Without a ratio or a known remainder: yes."""
    repay, remaining = proposer.repay, state.remaining
    if repay is None or remaining is None:
        return True
    lag = len(context) - state.session.common_prefix(context)
    if lag <= proposer.max_drafts + 1 or remaining * repay >= lag:
        return True
    proposer.unrepaid += 1
    state.last_info = ProposalInfo(ProposalMode.PLAIN)
    return False


def _run(kv, sessions: list, tokens: list[list[int]]) -> torch.Tensor:
    """Chain tokens ``tokens[b]`` after session b's (row b's) tokens: logits after each row's last."""
    starts = [len(s.tokens) for s in sessions]
    logits = kv.forward(len(sessions), tokens, starts, [None] * len(sessions), starts)
    for session, t in zip(sessions, tokens):
        session.tokens.extend(int(x) for x in t)
        session.forwarded += len(t)
    return logits


def _catch_up(kv, sessions: list, contexts: list) -> torch.Tensor:
    """Each session (row b) cropped to its common prefix with its context (the root always runs
    again), then the rest of every context (a new prompt, accepted tokens, the root) in one packed
    forward: the root logits [rows, vocab]."""
    for session, context in zip(sessions, contexts):
        session.keep_common(context)
    return _run(kv, sessions, [context[len(s.tokens):].tolist() for s, context in zip(sessions, contexts)])


def _delayed_trees(kv, shapes: list, states: list, laws: torch.Tensor, roots: list) -> list:
    """``draft_model.delayed_tree`` for every row b (request ``states[b]``, its context in row b,
    ``laws`` ``[rows, vocab]`` the root laws, ``shapes[b]`` its (K, L1, L2)): one forward per
    trunk depth for all rows whose trunk goes that deep, then one per branch depth for all
    branches of all rows (``DraftKV``'s lanes); each request's draws from its own generator in
    ``delayed_tree``'s order. The sessions end holding their context and trunk."""
    rows = len(states)
    sessions = [s.session for s in states]
    parents = [shape_parents(shape) for shape in shapes]
    size = [p.size for p in parents]
    samplings = [s.sampling for s in states]
    tokens = [np.zeros(n, np.int64) for n in size]
    values = [np.ones(n) for n in size]
    q_rows = [None if samplings[b].greedy else torch.zeros(size[b], laws.shape[-1]) for b in range(rows)]
    for b in range(rows):
        tokens[b][0] = roots[b]
    laws = laws.clone()  # row b's law is replaced as its trunk grows
    for depth in range(max(shape.trunk for shape in shapes)):  # node depth + 1 drawn after node depth
        step = [[] for _ in range(rows)]
        for b, state in enumerate(states):
            if shapes[b].trunk <= depth:
                continue
            if q_rows[b] is not None:
                q_rows[b][depth] = laws[b]
            token = int(_draw(laws[b][None], samplings[b], state.generator)[0])
            tokens[b][depth + 1], values[b][depth + 1] = token, values[b][depth] * float(laws[b, token])
            if depth + 1 < size[b] - 1:  # q after the new node only if something hangs below it
                step[b] = [token]
        if any(step):
            ran = [b for b in range(rows) if step[b]]
            logits = _run(kv, sessions, step)
            laws[ran] = _laws(logits[ran], [samplings[b] for b in ran])
    ks = [shape.branches if shape.branch_length else 0 for shape in shapes]
    current, current_values = {}, {}
    for b, state in enumerate(states):  # the first branch nodes, drawn from the law after the trunk
        if ks[b]:
            end = shapes[b].trunk
            if q_rows[b] is not None:
                q_rows[b][end] = laws[b]
            current[b] = (torch.topk(laws[b], ks[b]).indices if samplings[b].greedy
                          else _draw(laws[b].expand(ks[b], -1), samplings[b], state.generator))
            current_values[b] = values[b][end] * laws[b][current[b]].double().numpy()
    bases = [len(s.tokens) for s in sessions]  # the trunk's end: the branches' lanes start here
    for depth in range(max((shape.branch_length for shape in shapes), default=0)):
        step = [[] for _ in range(rows)]
        for b in current:
            shape = shapes[b]
            if shape.branch_length <= depth:
                continue
            ids = 1 + shape.trunk + depth * shape.branches + np.arange(shape.branches)  # this depth's K nodes
            tokens[b][ids], values[b][ids] = current[b].numpy(), current_values[b]
            if depth < shape.branch_length - 1:
                step[b] = [int(t) for t in current[b].tolist()]
        if not any(step):
            break
        logits = kv.forward(rows, step, [bases[b] + depth * ks[b] for b in range(rows)],
                            [ks[b] or None for b in range(rows)], bases, want="all")
        first = 0
        for b, state in enumerate(states):
            if not step[b]:
                continue
            sessions[b].forwarded += ks[b]
            law = _law(logits[first : first + ks[b]], samplings[b])
            first += ks[b]
            ids = 1 + shapes[b].trunk + depth * ks[b] + np.arange(ks[b])
            if q_rows[b] is not None:
                q_rows[b][ids] = law
            current[b] = _draw(law, samplings[b], state.generator)
            current_values[b] = current_values[b] * law.gather(1, current[b][:, None])[:, 0].double().numpy()
    return [_tree(tokens[b], parents[b], values[b], q_rows[b]) for b in range(rows)]
