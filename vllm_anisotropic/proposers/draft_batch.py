"""One engine step's draft-model trees for all its drafting requests, q's forwards batched.

Scope: ``DraftTreeProposer.propose_batch`` (the engine's drafter calls it once per step). The
trees are the ones ``draft_model.delayed_tree`` drafts one request at a time (same node order,
same draws from each request's generator in the same order, ``draft_probs`` the law each draw
came from); what changes is that each depth is one forward of q for every request of the step:

1. **catch-up**: each request's tokens q has not run yet (its accepted tokens and the root;
   a new request's prompt runs alone first, ``PREFILL_ALONE``) in one forward of all rows,
   which gives every root law at once;
2. **shapes**: the selector's (K, L1, L2) per request from its root law, or the fixed shape;
3. **trunk**: one forward per depth of one token per row, for every request whose trunk goes
   that deep; **branches**: each row repeated its request's K times, one forward per depth of
   one token per branch of every request. Whatever the shapes, the catch-up is followed by at
   most max(L1) + max(L2) - 1 forwards; a row with nothing to run at a depth rides along
   masked, like padding.

KV: ``DraftBatch`` joins the requests' caches (``DraftSession.cache``, one per request) into one
batch cache, each row's tokens from position 0 and zero padding after them, an attention mask of
the valid entries, and each row's own positions (RoPE): tokens appended in a step land after the
widest row, with masked holes before them in the narrower ones. ``split`` copies each row's valid
entries back into its session (the context plus the trunk, as ``delayed_tree`` leaves it); the
branch rows are dropped. Cost: the joined cache is a copy of the rows' KV, made once per step,
against one weight pass of q per depth for the whole batch instead of one per request.

q's head runs on the rows' last valid positions only (the decoder's hidden states, then the
output embedding): causal LMs whose logits are a linear map of the last hidden state (Llama,
Qwen2, Mistral families).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_anisotropic.proposers.base import MODE_CODES, root_only
from vllm_anisotropic.proposers.draft_common import _draw, _law, _tree, shape_parents
from vllm_anisotropic.tree import FlatTrees
from vllm_anisotropic.verifiers.sampling import target_probs

__all__ = ["DraftBatch", "DraftProposals", "copy_groups", "propose_draft_trees", "PREFILL_ALONE"]

# a request with more new tokens than this (a new prompt, a resumed preemption) runs them alone
# first: padding every row of the catch-up to a prompt's length would cost a prompt per row
PREFILL_ALONE = 32


@dataclass
class DraftProposals:
    """One step's proposals (``propose_draft_trees``): tree r is request r's."""

    trees: FlatTrees
    modes: np.ndarray  # [R] int8 ``base.MODE_CODES``
    prev_roots: np.ndarray  # [R] int64 the token before each root, -1: none


class DraftBatch:
    """Several requests' q caches as one padded batch (module docstring)."""

    def __init__(self, lm, sessions: list) -> None:
        from transformers import DynamicCache

        self.lm, self.sessions = lm, sessions
        lengths = [len(s.tokens) for s in sessions]
        width = max(lengths, default=0)
        rows = len(sessions)
        self.mask = torch.zeros(rows, width, dtype=torch.long)
        for b, n in enumerate(lengths):
            self.mask[b, :n] = 1
        self.next_position = torch.tensor(lengths, dtype=torch.long)  # [rows]
        self.tokens = [list(s.tokens) for s in sessions]  # what each row holds
        self.owner = list(range(rows))  # the session of each row (branch rows share their trunk's)
        self.cache = DynamicCache()
        if width:
            widest = sessions[int(np.argmax(lengths))].cache.layers
            for i, layer in enumerate(widest):
                heads, dim = layer.keys.shape[1], layer.keys.shape[3]
                keys = layer.keys.new_zeros(rows, heads, width, dim)
                values = layer.values.new_zeros(rows, heads, width, dim)
                for b, (s, n) in enumerate(zip(sessions, lengths)):
                    if n:
                        keys[b, :, :n] = s.cache.layers[i].keys[0]
                        values[b, :, :n] = s.cache.layers[i].values[0]
                self.cache.update(keys, values, i)

    @property
    def rows(self) -> int:
        return len(self.tokens)

    @torch.inference_mode()
    def forward(self, tokens: list[list[int]]) -> torch.Tensor:
        """Append row b's ``tokens[b]`` and run them: q's logits after each row's last token,
        ``[rows, vocab]`` float32. A row given no token (its tree needs nothing more at this depth)
        gets a masked column, like the padding, and a meaningless logits row."""
        counts = torch.tensor([len(t) for t in tokens], dtype=torch.long)
        width = int(counts.max())
        ids = torch.zeros(self.rows, width, dtype=torch.long)
        for b, t in enumerate(tokens):
            ids[b, : len(t)] = torch.tensor(t, dtype=torch.long)
        new = (torch.arange(width)[None, :] < counts[:, None]).long()
        mask = torch.cat([self.mask, new], dim=1)
        positions = self.next_position[:, None] + torch.arange(width)[None, :]
        model, device = self.lm.model, self.lm.device
        hidden = model.get_decoder()(input_ids=ids.to(device), attention_mask=mask.to(device),
                                     position_ids=positions.to(device), past_key_values=self.cache,
                                     use_cache=True).last_hidden_state
        last = hidden[torch.arange(self.rows, device=device), (counts - 1).clamp(min=0).to(device)]
        self.mask, self.next_position = mask, self.next_position + counts
        for row, owner, t in zip(self.tokens, self.owner, tokens):
            row.extend(int(x) for x in t)
            self.sessions[owner].forwarded += len(t)
        return model.get_output_embeddings()(last).float().cpu()  # the laws and draws on the host (DraftLM)

    def repeat(self, counts) -> None:
        """Row b becomes ``counts[b]`` consecutive rows (the branches of its trunk's end; 0 drops
        it); an int repeats every row that often."""
        counts = [counts] * self.rows if isinstance(counts, int) else [int(c) for c in counts]
        if all(c == 1 for c in counts):
            return
        index = torch.repeat_interleave(torch.arange(self.rows), torch.tensor(counts, dtype=torch.long))
        self.cache.batch_select_indices(index.to(self.lm.device))
        self.mask, self.next_position = self.mask[index], self.next_position[index]
        self.tokens = [list(self.tokens[b]) for b in index.tolist()]
        self.owner = [self.owner[b] for b in index.tolist()]

    def split(self) -> None:
        """Each row's valid entries back into its session (one cache per request again)."""
        from transformers import DynamicCache

        assert self.rows == len(self.sessions), "split before the branch rows are made"
        for b, session in enumerate(self.sessions):
            valid = torch.nonzero(self.mask[b]).flatten().to(self.lm.device)
            cache = DynamicCache()
            for i, layer in enumerate(self.cache.layers):
                cache.update(layer.keys[b : b + 1].index_select(2, valid).contiguous(),
                             layer.values[b : b + 1].index_select(2, valid).contiguous(), i)
            session.cache, session.tokens = cache, list(self.tokens[b])


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
    for r, state in enumerate(states):
        if state.wants_q(contexts[r], budgets[r]):
            drafting.append(r)
        else:
            trees[r] = root_only(contexts[r])
    for r in drafting:
        states[r].session.last_step = proposer.step  # the KV bound's LRU clock (fit_kv)
    for group in copy_groups(proposer, drafting, [len(contexts[r]) for r in drafting]):
        if len(group) == 1:
            # one request: its own cache in place (joining one row would copy its KV twice a step;
            # 0.91x of this path at one request on a 2-core EPYC, docs/measurements/cpu/draft_batch_2026_11_29.txt)
            r = group[0]
            trees[r] = states[r].draft(contexts[r], budgets[r])
            continue
        batch, logits = _catch_up(proposer.lm, [states[r].session for r in group], [contexts[r] for r in group])
        root_laws = _laws(logits, [states[r].sampling for r in group])
        shapes = [states[r].shape_for(contexts[r], root_laws[j]) for j, r in enumerate(group)]
        drawn = _delayed_trees(batch, shapes, [states[r] for r in group], root_laws,
                               [int(contexts[r][-1]) for r in group])
        del batch
        for r, shape, tree in zip(group, shapes, drawn):
            trees[r] = states[r].cut(tree, shape, budgets[r])
    modes = np.array([MODE_CODES[s.last_info.mode] for s in states], np.int8)
    prev_roots = np.where(lengths >= 2, token_ids[rows, np.maximum(lengths - 2, 0)], -1).astype(np.int64)
    return DraftProposals(FlatTrees.from_trees(trees), modes, prev_roots)


def copy_groups(proposer, drafting: list, widths: list) -> list[list]:
    """The drafting requests in the groups one step drafts together: all of them at once, unless
    the proposer has a KV bound (``kv_bound``), in which case each group's joined copy, every
    row as wide as the group's longest context and repeated for up to the most branches a
    shape can have, fits half of it (the sessions held between steps have the other half,
    ``DraftTreeProposer.fit_kv``). The requests go by context length, so a group's rows are
    alike in width; a request whose copy alone is over drafts alone on its own cache."""
    if proposer.kv_bound is None or len(drafting) <= 1:
        return [list(drafting)] if drafting else []
    per_row = proposer.lm.kv_bytes_per_token * max(1, proposer.max_branches)
    budget = proposer.kv_bound // 2
    groups, group = [], []
    for j in sorted(range(len(drafting)), key=lambda j: widths[j]):  # each row the widest of its group so far
        if group and (len(group) + 1) * widths[j] * per_row > budget:
            groups.append(group)
            group = []
        group.append(drafting[j])
    return groups + [group]


def _catch_up(lm, sessions: list, contexts: list) -> tuple[DraftBatch, torch.Tensor]:
    """Each session cropped to its common prefix with its context (the root always runs again),
    a long remainder run alone (``PREFILL_ALONE``), then the rows joined and the rest of every
    context (accepted tokens, then the root) run in one forward: ``(batch, root logits [rows,
    vocab])``, each session's context all cached."""
    contexts = [[int(t) for t in c] for c in contexts]
    for session, context in zip(sessions, contexts):
        session.keep_common(context)
        if len(context) - 1 - len(session.tokens) > PREFILL_ALONE:
            session.extend(context[len(session.tokens) : -1])
    batch = DraftBatch(lm, sessions)
    logits = batch.forward([context[len(held):] for held, context in zip(batch.tokens, contexts)])
    return batch, logits


def _delayed_trees(batch: DraftBatch, shapes: list, states: list, laws: torch.Tensor, roots: list) -> list:
    """``draft_model.delayed_tree`` for every row of ``batch`` (one request each, its context
    cached, ``laws`` ``[rows, vocab]`` the root laws, ``shapes[b]`` row b's (K, L1, L2)): one
    forward per trunk depth for all rows whose trunk goes that deep, then one per branch depth
    for all branches of all rows (rows that need nothing at a depth ride along masked); each
    request's draws from its own generator in ``delayed_tree``'s order. The sessions end holding
    their context and trunk."""
    rows = batch.rows
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
            logits = batch.forward(step)
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
    batch.split()  # the sessions keep context + trunk; the branches run on the joined copy
    if current:
        batch.repeat(ks)
        first_row = np.cumsum([0] + ks[:-1])  # request b's branches are rows first_row[b] ..
        for depth in range(max(shape.branch_length for shape in shapes)):
            step = [[] for _ in range(sum(ks))]
            for b in current:
                shape = shapes[b]
                if shape.branch_length <= depth:
                    continue
                ids = 1 + shape.trunk + depth * shape.branches + np.arange(shape.branches)  # this depth's K nodes
                tokens[b][ids], values[b][ids] = current[b].numpy(), current_values[b]
                if depth < shape.branch_length - 1:
                    for i, t in enumerate(current[b].tolist()):
                        step[first_row[b] + i] = [int(t)]
            if not any(step):
                break
            logits = batch.forward(step)
            for b, state in enumerate(states):
                first = first_row[b]
                if b not in current or not step[first]:
                    continue
                law = _law(logits[first : first + ks[b]], samplings[b])
                ids = 1 + shapes[b].trunk + depth * ks[b] + np.arange(ks[b])
                if q_rows[b] is not None:
                    q_rows[b][ids] = law
                current[b] = _draw(law, samplings[b], state.generator)
                current_values[b] = current_values[b] * law.gather(1, current[b][:, None])[:, 0].double().numpy()
    return [_tree(tokens[b], parents[b], values[b], q_rows[b]) for b in range(rows)]
