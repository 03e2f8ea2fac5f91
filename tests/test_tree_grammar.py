"""Grammar-pruned trees and per-node grammar masks (``engine/tree_grammar.py``), on vLLM's real
xgrammar grammar object (``XgrammarGrammar``) over the tiny model's tokenizer.

Which bug each test catches: a walk that backs up too little or too much between siblings (the
masks of later nodes come from the wrong state: they differ from the per-node reference), a
subtree kept under a rejected node, a node checked against the previous *listed* node instead of
its parent (vLLM's chain semantics), a grammar left advanced after the walk (the root state
check), parents not renumbered after pruning, and the worker's reorder not matching the
scheduler's pruned list (``take_step`` raises, or the verified tree differs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_anisotropic.integration.vllm.engine.tree_grammar import (TreeGrammars, prune_tree, tree_bitmask_rows,
                                                                    walk_tree_grammar)
from vllm_anisotropic.tree import DraftTree, FlatTrees, chain_length

REGEX = "(ab|cd|a|b)+x[0-9]{1,3}"


@pytest.fixture(scope="module")
def grammar_factory():
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    from vllm_anisotropic.models import build_tiny_model

    tok = AutoTokenizer.from_pretrained(str(build_tiny_model()))
    vocab = len(tok)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_regex(REGEX)
    ids = {s: tok.encode(s, add_special_tokens=False)[0] for s in ["ab", "cd", "a", "b", "x", "1", "2", "zz"]}
    ids["eos"] = tok.eos_token_id

    def make():
        matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)
        return XgrammarGrammar(vocab_size=vocab, matcher=matcher, ctx=compiled)

    return make, ids, vocab


def _bitmask(vocab: int, n: int) -> torch.Tensor:
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(n, vocab)


def test_prune_drops_rejected_nodes_with_their_subtrees_and_renumbers_parents(grammar_factory):
    make, t, _ = grammar_factory
    g = make()
    assert g.accept_tokens("r", [t["ab"]])  # the request's output so far: "ab"
    # node: 1 cd, 2 zz (rejected), 3 x, 4 ab under zz (goes with it), 5 1 under x, 6 zz under cd
    # (rejected), 7 x under cd, 8 2 under 7, 9 cd under x (rejected: x must be followed by a digit)
    tokens = [t["cd"], t["zz"], t["x"], t["ab"], t["1"], t["zz"], t["x"], t["2"], t["cd"]]
    parents = [0, 0, 0, 2, 3, 1, 1, 7, 3]
    kept, new_parents = prune_tree(g, "r", tokens, parents)
    assert kept.tolist() == [1, 3, 5, 7, 8]
    assert new_parents.tolist() == [0, 0, 2, 1, 4]
    # chain semantics (vLLM's validate_tokens over the list) would have stopped at node 2
    assert g.validate_tokens(tokens) == tokens[:1]
    # the grammar is where it was: "ab" accepted, nothing more
    assert g.validate_tokens([t["x"], t["1"]]) == [t["x"], t["1"]]
    assert g.validate_tokens([t["1"]]) == []


def test_walk_and_masks_equal_a_per_node_reference_on_random_trees(grammar_factory):
    """Every node of 30 random 40-node trees: reachable iff its whole path is valid from the
    request's state, and its mask row equal to the row filled after accepting its path alone."""
    make, t, vocab = grammar_factory
    alphabet = np.array([t[k] for k in ("ab", "cd", "a", "b", "x", "1", "2", "zz", "eos")])
    rng = np.random.default_rng(7)
    g, ref = make(), make()
    for g_ in (g, ref):
        assert g_.accept_tokens("r", [t["a"]])
    seen_valid = seen_pruned = seen_terminated = 0
    for _ in range(30):
        n = 40
        # node j's parent < j: mostly one of the last few nodes (deep paths), else any
        parents = np.array([rng.integers(0, j) if rng.random() < 0.3 else max(0, j - 1 - int(rng.integers(0, 3)))
                            for j in range(1, n + 1)])
        # mostly grammar-friendly tokens, so that trees go deep
        tokens = rng.choice(alphabet, size=n, p=[0.15, 0.15, 0.1, 0.1, 0.15, 0.12, 0.08, 0.05, 0.1])
        # and a path that ends the grammar ("x 1 eos"), with a child after the end (unreachable)
        parents[n - 4:] = [rng.integers(0, n - 4), n - 3, n - 2, n - 1]
        tokens[n - 4:] = [t["x"], t["1"], t["eos"], t["ab"]]
        paths = []
        for j in range(1, n + 1):
            path, k = [], j
            while k:
                path.append(int(tokens[k - 1]))
                k = int(parents[k - 1])
            paths.append(path[::-1])
        expect = np.array([ref.validate_tokens(p) == p for p in paths])
        got = walk_tree_grammar(g, "r", tokens, parents)
        np.testing.assert_array_equal(got, expect)
        kept, new_parents = prune_tree(g, "r", tokens, parents)
        np.testing.assert_array_equal(kept, np.flatnonzero(expect) + 1)
        rows = _bitmask(vocab, max(kept.size, 1))
        tree_bitmask_rows(g, "r", tokens[kept - 1], new_parents, rows)
        want = _bitmask(vocab, max(kept.size, 1))
        for i, k in enumerate(kept.tolist()):
            path = paths[k - 1]
            assert ref.accept_tokens("r", path)
            if ref.is_terminated():
                want[i].fill_(-1)
                seen_terminated += 1
            else:
                ref.fill_bitmask(want, i)
            ref.rollback(len(path))
        assert torch.equal(rows[: kept.size], want[: kept.size])
        seen_valid += int(kept.size)
        seen_pruned += n - int(kept.size)
    # the walk left the grammar where it found it: the same mask at the root
    a, b = _bitmask(vocab, 1), _bitmask(vocab, 1)
    g.fill_bitmask(a, 0)
    ref.fill_bitmask(b, 0)
    assert torch.equal(a, b)
    assert seen_valid > 100 and seen_pruned > 200 and seen_terminated > 0, (seen_valid, seen_pruned, seen_terminated)


def test_masks_refuse_an_unpruned_tree(grammar_factory):
    make, t, vocab = grammar_factory
    g = make()
    with pytest.raises(RuntimeError, match=rf"node 2 \(token {t['zz']}\) is not reachable"):
        tree_bitmask_rows(g, "r", [t["ab"], t["zz"]], [0, 1], _bitmask(vocab, 2))


def test_chain_length():
    assert chain_length([0, 1, 0, 3]) == 2
    assert chain_length([0, 1, 2]) == 3
    assert chain_length([]) == 0
    assert chain_length([0, 0]) == 1


class _Request:
    def __init__(self, grammar) -> None:
        self.request_id = "r"
        self.structured_output_request = type("S", (), {"grammar": grammar})()


class _Manager:
    """The one manager method the pruning calls: a request whose grammar is in force."""

    @staticmethod
    def _get_constraint_bounds(request, spec_tokens):
        from vllm.v1.structured_output import _CONSTRAINED_FROM_START

        return _CONSTRAINED_FROM_START


def test_scheduler_prune_and_worker_reorder_agree(grammar_factory):
    """The scheduler prunes a drafted tree (its drafts, probabilities, leading chain) and the
    worker, told the kept nodes, verifies exactly the tree the scheduler scheduled."""
    from vllm.v1.outputs import DraftTokenIds

    from vllm_anisotropic.integration.vllm.engine.drafter import _kept_first, _Proposal

    make, t, vocab = grammar_factory
    g = make()
    # root "ab"; drafts: 1 zz (rejected), 2 cd, 3 ab under zz, 4 x under cd, 5 1 under x
    tokens = [t["ab"], t["zz"], t["cd"], t["ab"], t["x"], t["1"]]
    parents = [-1, 0, 0, 1, 2, 4]
    flat = FlatTrees.from_trees([DraftTree(np.array(tokens), np.array(parents))])
    probs = np.array([1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    drafts = DraftTokenIds(["r"], [tokens[1:]])
    drafts.tree_parents = {"r": parents[1:]}
    drafts.tree_probs = [probs[1:]]
    drafts.tree_chains = [1]
    grammars = TreeGrammars()
    assert grammars.prune(_Manager(), _Request(g), drafts, 0) == 2
    assert drafts.draft_token_ids[0] == [t["cd"], t["x"], t["1"]]
    np.testing.assert_array_equal(drafts.tree_probs[0], [0.8, 0.6, 0.5])
    assert drafts.tree_chains[0] == 3  # cd -> x -> 1 is a chain now
    assert grammars.reorders == {"r": [2, 4, 5]}
    proposal = _Proposal(flat, probs, np.array([-1]), np.zeros(1, np.int8), False)
    mine, k = _kept_first(proposal, 0, grammars.reorders["r"])
    tree = mine.trees.tree(k)
    assert tree.tokens[:4].tolist() == [t["ab"], t["cd"], t["x"], t["1"]]
    assert tree.parents[:4].tolist() == [-1, 0, 1, 2]
    np.testing.assert_array_equal(mine.probs[:4], [1.0, 0.8, 0.6, 0.5])
    # the masks of the scheduled prefix (the allocator kept two nodes)
    rows = grammars.node_rows(_Request(g), drafts.draft_token_ids[0][:2], _bitmask(vocab, 4))
    want = _bitmask(vocab, 2)
    tree_bitmask_rows(g, "r", drafts.draft_token_ids[0][:2], grammars.trees["r"][1][:2], want)
    assert rows.shape == (2, want.shape[1]) and np.array_equal(rows, want.numpy())
    with pytest.raises(RuntimeError, match="not a prefix"):
        grammars.node_rows(_Request(g), [t["x"]], _bitmask(vocab, 4))
    # kept nodes that are the tree's first ones: the worker's list needs no reorder
    drafts = DraftTokenIds(["r"], [[t["cd"], t["x"], t["zz"]]])
    drafts.tree_parents = {"r": [0, 1, 0]}
    grammars.reorders = {}
    assert grammars.prune(_Manager(), _Request(g), drafts, 0) == 1
    assert drafts.draft_token_ids[0] == [t["cd"], t["x"]] and grammars.reorders == {}
    # a grammar not yet in force (a reasoning model still thinking): every draft dropped
    class Thinking:
        @staticmethod
        def _get_constraint_bounds(request, spec_tokens):
            return type("Bounds", (), {"constraint_start": 1})()

    drafts = DraftTokenIds(["r"], [[t["cd"], t["x"]]])
    drafts.tree_parents = {"r": [0, 1]}
    drafts.tree_probs, drafts.tree_chains = [np.array([0.9, 0.8])], [2]
    assert grammars.prune(Thinking(), _Request(g), drafts, 0) == 2
    assert drafts.draft_token_ids[0] == [] and drafts.tree_probs[0].size == 0 and drafts.tree_chains[0] == 0
