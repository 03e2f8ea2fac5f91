"""Structured outputs with draft trees: grammar-pruned trees and a grammar mask per tree row.

Scope: the scheduler side of a structured-output request (JSON schema, regex, choice, grammar)
that drafts trees. vLLM keeps each request's grammar (``StructuredOutputGrammar``: xgrammar,
guidance, outlines, lm-format-enforcer) in the scheduler process and handles drafts as a
*chain*: ``validate_tokens`` keeps the longest grammar-valid prefix of the draft list, and
``grammar_bitmask`` fills the mask of row j from the state after drafts 1..j. For a tree both
are wrong (node j's state follows node j's own path, not the nodes listed before it), so:

* **prune** (``prune_tree``, when the drafts arrive): a depth-first walk of the tree from the
  request's grammar state; a node whose token the state at its parent rejects is dropped with
  its subtree. The kept nodes keep their order (a value order stays one: parents first), so
  every prefix the allocator cuts is still a subtree. The worker's pending tree is reordered the
  same way (``TreeGrammars.reorders`` travels with the next ``SchedulerOutput`` as
  ``tree_kept``; ``drafter.TreeDrafter.take_step``);
* **mask** (``tree_bitmask_rows``, when the step is scheduled): row j (node j) gets the mask of
  the state after node j's path; the root's row is vLLM's own. vLLM's runner applies the rows
  to the logits rows in its usual layout (root, then nodes in list order), so the tree
  verifier reads the target law masked at every node, as plain decoding masks its one row.

Lossless: a pruned node could never be accepted (its probability under the masked law is 0),
and every verified row is masked exactly as plain decoding would mask it at that prefix.

Terms: *tokens* ``[n]`` and *parents* ``[n]`` describe draft nodes 1..n of one tree in list
order; ``parents[j - 1]`` is node j's parent as a local index (0: the root). Worked example:
tokens ``[a, b, c]``, parents ``[0, 0, 1]`` (b a sibling of a, c a child of a), the grammar
rejects ``a`` -> kept nodes ``[2]``, pruned tree tokens ``[b]``, parents ``[0]``.

Each walk leaves the grammar in the state it found it (every accepted token rolled back).
A request still reasoning (vLLM's reasoning parser, grammar not yet in force) drafts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_anisotropic.tree import chain_length

__all__ = ["walk_tree_grammar", "prune_tree", "tree_bitmask_rows", "TreeGrammars"]


def walk_tree_grammar(grammar, request_id: str, tokens, parents, fill=None) -> np.ndarray:
    """``[n]`` bool: node j + 1 is reachable under the grammar (its token valid at its parent's
    state, its parent reachable). ``fill(j, grammar)``, if given, is called at every reachable
    node j + 1 with the grammar in the state after that node's path (for its mask row).

    Depth-first (children in list order), so the walk moves along one path at a time: each
    reachable node costs one check, one accept and one rollback. The grammar is left as found."""
    tokens = [int(t) for t in tokens]
    parents = np.asarray(parents, np.int64)
    n = len(tokens)
    valid = np.zeros(n, bool)
    children: list[list[int]] = [[] for _ in range(n + 1)]  # by local index, 0 = root
    for j in range(n):
        children[int(parents[j])].append(j + 1)
    depth = np.zeros(n + 1, np.int64)
    held = 0  # tokens accepted beyond the request's state: the depth of the walk's current node
    stack = children[0][::-1]
    try:
        while stack:
            j = stack.pop()
            p = int(parents[j - 1])
            if held > depth[p]:  # back up to the parent's state
                grammar.rollback(int(held - depth[p]))
                held = int(depth[p])
            token = tokens[j - 1]
            if grammar.is_terminated() or not grammar.validate_tokens([token]):
                continue  # unreachable: so is its subtree
            if not grammar.accept_tokens(request_id, [token]):
                raise RuntimeError(f"request {request_id}: grammar accepted token {token} in validation, "
                                   "then refused it")
            held += 1
            depth[j] = held
            valid[j - 1] = True
            if fill is not None:
                fill(j - 1, grammar)
            stack.extend(children[j][::-1])
    finally:
        if held:
            grammar.rollback(held)
    return valid


def prune_tree(grammar, request_id: str, tokens, parents) -> tuple[np.ndarray, np.ndarray]:
    """``(kept, pruned_parents)``: the local indices (1-based, in list order) of the reachable
    draft nodes, and their parents renumbered within the pruned tree (0: the root).
    tokens ``[a, b, c]``, parents ``[0, 0, 1]``, ``a`` rejected -> ``([2], [0])``."""
    parents = np.asarray(parents, np.int64)
    valid = walk_tree_grammar(grammar, request_id, tokens, parents)
    kept = np.flatnonzero(valid) + 1
    renumber = np.zeros(len(parents) + 1, np.int64)  # old local index -> new (root 0 -> 0)
    renumber[kept] = np.arange(1, kept.size + 1)
    return kept, renumber[parents[kept - 1]]


def tree_bitmask_rows(grammar, request_id: str, tokens, parents, bitmask, full_mask: int = -1) -> None:
    """Fill ``bitmask[j]`` ``[n, vocab_size / 32]`` (int32, the backend's layout) with the mask of
    the state after node j + 1's path, as vLLM fills a row (``StructuredOutputManager
    ._fill_bitmasks``: every token allowed once the grammar has terminated). Every node must be
    reachable (a pruned tree)."""

    def fill(j: int, g) -> None:
        if g.is_terminated():
            bitmask[j].fill_(full_mask)
        else:
            g.fill_bitmask(bitmask, j)

    valid = walk_tree_grammar(grammar, request_id, tokens, parents, fill)
    if not valid.all():
        bad = int(np.flatnonzero(~valid)[0]) + 1
        raise RuntimeError(f"request {request_id}: scheduled draft node {bad} (token {int(tokens[bad - 1])}) is "
                           "not reachable under its grammar; its tree was not pruned")


@dataclass
class TreeGrammars:
    """The scheduler's view of the trees of structured-output requests, between the drafts'
    arrival and the step that verifies them.

    ``trees[req_id]``: the pruned tree's ``(tokens, parents)`` (what the request's
    ``spec_token_ids`` hold before the allocator cuts them); ``reorders[req_id]``: kept node
    indices of trees whose kept nodes are not their first ones (the worker reorders its pending
    tree so that the kept nodes come first; sent once, with the next ``SchedulerOutput``)."""

    trees: dict[str, tuple[list[int], np.ndarray]] = field(default_factory=dict)
    reorders: dict[str, list[int]] = field(default_factory=dict)

    def prune(self, manager, request, draft_token_ids, i: int) -> int:
        """Prune request ``i`` of ``draft_token_ids`` (vLLM's ``DraftTokenIds`` with the runner's
        ``tree_parents`` / ``tree_probs`` / ``tree_chains``) in place; returns how many of its
        draft nodes went."""
        req_id = request.request_id
        tokens = list(draft_token_ids.draft_token_ids[i])
        parents = np.asarray(draft_token_ids.tree_parents[req_id], np.int64)
        if len(parents) != len(tokens):
            raise RuntimeError(f"request {req_id}: {len(tokens)} drafts but {len(parents)} tree parents")
        if not tokens:
            self.trees.pop(req_id, None)
            return 0
        if manager._get_constraint_bounds(request, ()).constraint_start != 0:
            kept, new_parents = np.zeros(0, np.int64), np.zeros(0, np.int64)  # reasoning: the grammar not yet in force
        else:
            kept, new_parents = prune_tree(request.structured_output_request.grammar, req_id, tokens, parents)
        pruned = [tokens[k - 1] for k in kept.tolist()]
        if kept.size and kept[-1] != kept.size:  # some node before a kept one went: not a prefix
            self.reorders[req_id] = kept.tolist()
        else:
            self.reorders.pop(req_id, None)
        draft_token_ids.draft_token_ids[i] = pruned
        probs = getattr(draft_token_ids, "tree_probs", None)
        if probs is not None and probs[i] is not None:
            probs[i] = np.asarray(probs[i])[kept - 1]
        chains = getattr(draft_token_ids, "tree_chains", None)
        if chains is not None:
            chains[i] = chain_length(new_parents)
        self.trees[req_id] = (pruned, new_parents)
        return len(tokens) - len(pruned)

    def node_rows(self, request, scheduled: list[int], bitmask) -> np.ndarray:
        """``[m, vocab_size / 32]`` int32 mask rows of the ``m`` scheduled draft nodes of a pruned
        tree (a prefix of its list), from the request's grammar state (the root's)."""
        req_id = request.request_id
        tokens, parents = self.trees[req_id]
        m = len(scheduled)
        if list(scheduled) != tokens[:m]:
            raise RuntimeError(f"request {req_id}: scheduled drafts {list(scheduled)[:8]} are not a prefix of "
                               f"its pruned tree {tokens[:8]}")
        tree_bitmask_rows(request.structured_output_request.grammar, req_id, tokens[:m], parents[:m], bitmask)
        return bitmask[:m].numpy().copy()

    def forget(self, req_id: str) -> None:
        self.trees.pop(req_id, None)
        self.reorders.pop(req_id, None)
