"""``FlatTrees``, the per-step batch of trees, against the per-tree ``DraftTree`` operations it
replaces on the engine's path: packing (``to_batch`` == ``pack_trees``), cuts, selections,
reorderings, chain prefixes, ancestor bits, the allocator's ranking (``rank_flat`` ==
``rank_trees``) and the greedy walk (``walk_flat`` == ``GreedyVerifier.verify_host``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_anisotropic import kernels
from vllm_anisotropic.allocator import AcceptanceConfig, AcceptanceModel, rank_flat, rank_trees
from vllm_anisotropic.tree import PRIORITY_BY_CODE, DraftTree, FlatTrees, NodeSource, pack_trees
from vllm_anisotropic.verifiers.greedy import GreedyVerifier, walk_flat


def random_tree(rng, n, vocab=50, chainy=0.3, multiplicity=False) -> DraftTree:
    parents = [-1] + [i - 1 if rng.random() < chainy else int(rng.integers(0, i)) for i in range(1, n)]
    sources = [0] + [int(rng.integers(1, 3)) for _ in range(1, n)]
    values = [1.0]
    for i in range(1, n):
        values.append(values[parents[i]] * float(rng.random()))
    mult = [1] + [int(rng.integers(1, 3)) for _ in range(1, n)] if multiplicity else None
    return DraftTree(tokens=rng.integers(0, vocab, n), parents=parents, sources=sources, values=values,
                     multiplicity=mult)


def random_batch(rng, num=None, max_nodes=14, **kw):
    return [random_tree(rng, int(rng.integers(1, max_nodes)), **kw) for _ in range(num or int(rng.integers(1, 7)))]


def test_worked_example_and_round_trip():
    a = DraftTree(tokens=[5, 6, 7], parents=[-1, 0, 0])
    b = DraftTree.chain([], root_token=9)
    flat = FlatTrees.from_trees([a, b])
    assert flat.offsets.tolist() == [0, 3, 4] and flat.tokens.tolist() == [5, 6, 7, 9]
    assert flat.sizes().tolist() == [3, 1] and flat.tree_index().tolist() == [0, 0, 0, 1]
    assert flat.global_parents().tolist() == [-1, 0, 0, -1]
    assert flat.tree(0).tokens.tolist() == [5, 6, 7] and flat.tree(1).num_nodes == 1
    assert FlatTrees.concat([flat.select([1]), flat.select([0])]).tokens.tolist() == [9, 5, 6, 7]
    assert FlatTrees.empty().num_trees == 0
    with pytest.raises(ValueError):
        flat.prefix([0, 1])


@pytest.mark.parametrize("seed", range(20))
def test_array_operations_equal_the_per_tree_ones(seed):
    rng = np.random.default_rng(seed)
    trees = random_batch(rng, multiplicity=seed % 2 == 1)
    flat = FlatTrees.from_trees(trees)
    # packing for the verifiers
    b1, b2 = flat.to_batch(prompt_lens=np.arange(len(trees)) * 7), pack_trees(trees, prompt_lens=np.arange(len(trees)) * 7)
    for name in b2.__dict__:
        x, y = getattr(b1, name), getattr(b2, name)
        assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), name
    # per-tree quantities
    assert flat.chain_prefix().tolist() == [t.chain_prefix() for t in trees]
    assert np.array_equal(flat.ancestor_bits().view(np.int64), np.concatenate([t.ancestor_bits for t in trees]))
    keep = rng.integers(1, 8, len(trees))
    cut = flat.prefix(keep)
    index = rng.integers(0, len(trees), 4)
    picked = flat.select(index)
    for k, t in enumerate(trees):
        want = t.truncate(int(keep[k]))
        got = cut.tree(k)
        assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
        assert got.depths.tolist() == want.depths.tolist() and got.multiplicity.tolist() == want.multiplicity.tolist()
    for k, i in enumerate(index.tolist()):
        assert picked.tree(k).tokens.tolist() == trees[i].tokens.tolist()
    # a reordering that keeps parents first: by (depth, reversed index) inside each tree
    local = np.arange(flat.num_nodes) - np.repeat(flat.offsets[:-1], flat.sizes())
    order = np.lexsort((-local, flat.depths, flat.tree_index()))
    moved = flat.permuted(order)
    for k, t in enumerate(trees):
        a, b = int(flat.offsets[k]), int(flat.offsets[k + 1])
        want = t.reordered(order[a:b] - a)
        assert moved.tree(k).parents.tolist() == want.parents.tolist()
        assert moved.tree(k).tokens.tolist() == want.tokens.tolist()


@pytest.mark.parametrize("seed", range(10))
def test_rank_flat_equals_rank_trees(seed):
    """The compiled ranking equals the per-tree one, also under a calibration whose (alpha,
    beta) differ by source and depth (odd seeds), so every (source, depth) key is read."""
    rng = np.random.default_rng(100 + seed)
    model = AcceptanceModel(AcceptanceConfig())
    if seed % 2:
        alpha, beta = model.parameters()
        model._params = (alpha + rng.normal(0.0, 1.0, alpha.shape), beta * rng.uniform(0.5, 2.0, beta.shape))
    trees = random_batch(rng)
    ranked, probs = rank_trees(trees, model)
    flat, p = rank_flat(FlatTrees.from_trees(trees), model)
    for k, t in enumerate(ranked):
        for name in ("tokens", "parents", "sources", "values", "depths"):  # mixed sources, distinct values
            np.testing.assert_array_equal(getattr(flat.tree(k), name), getattr(t, name), err_msg=name)
        a, b = int(flat.offsets[k]), int(flat.offsets[k + 1])
        np.testing.assert_allclose(p[a + 1 : b], probs[k], rtol=1e-12, atol=1e-15)
    assert np.all(p[flat.offsets[:-1]] == 1.0)
    np.testing.assert_array_equal(flat.chain_prefix(), flat._chain_prefix())  # the kernel's, cached by rank_flat


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_walk_flat_equals_the_per_tree_walk(dtype):
    """A 4-token vocabulary makes ties and duplicate sibling tokens common: the spine-first,
    then index-order priority must agree."""
    rng = np.random.default_rng(7)
    verifier = GreedyVerifier()
    for _ in range(100):
        trees = [random_tree(rng, int(rng.integers(2, 12)), vocab=4) for _ in range(int(rng.integers(1, 6)))]
        flat = FlatTrees.from_trees(trees)
        logits = torch.randn(flat.num_nodes + 3, 4).to(dtype)
        starts = flat.offsets[:-1] + 2  # rows need not start at 0
        accepted, num, bonus = walk_flat(flat, logits, starts)
        for k, res in enumerate(verifier.verify_host(trees, logits, starts.tolist())):
            assert accepted[k, : num[k]].tolist() == res.accepted and int(bonus[k]) == res.bonus_token
    tree = DraftTree(tokens=[9, 5, 5], parents=[-1, 0, 0], sources=[NodeSource.ROOT, NodeSource.BRANCH, NodeSource.SPINE])
    logits = torch.tensor([[0.0] * 5 + [1.0], [0.0] * 6, [0.0] * 6])
    accepted, num, bonus = walk_flat(FlatTrees.from_trees([tree]), logits, np.array([0]))
    assert accepted[0, : num[0]].tolist() == [2]  # the spine child first (GOOSE Algorithm 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [600, 257, 511])
def test_the_compiled_walk_equals_the_walk_depth_by_depth(dtype, vocab):
    """``kernels.walk.walk_rows`` walks every depth in one compiled call (``walk_flat`` takes it
    for bf16 logits); with a ``pick`` ``walk_flat`` walks depth by depth (``descend_flat``). Both
    agree on every path, bonus and the -1 padding, on float32 rows and on bf16 bits, with each row's argmax steered to a child's token half of the time so
    that walks run deep, ties across the argmax's blocks of 256 (the lower index wins) and NaNs
    (the first wins, as in torch). Vocabularies: three blocks; one entry past a block (257: some
    rows' largest entry is that last one); one short of a block (511: every other row starts
    with the largest entry of the logits, the rows between with the smallest, so a scan past a
    row's end would find the next row's)."""
    from vllm_anisotropic.verifiers.greedy import host_rows_argmax

    rng = np.random.default_rng(11)
    for _ in range(40):
        trees = [random_tree(rng, int(rng.integers(1, 14)), vocab=6) for _ in range(int(rng.integers(1, 7)))]
        flat = FlatTrees.from_trees(trees)
        logits = torch.randn(flat.num_nodes + 2, vocab)
        child_of = np.full(flat.num_nodes, -1)
        parents = flat.global_parents()
        child_of[parents[parents >= 0]] = np.flatnonzero(parents >= 0)
        for j in range(flat.num_nodes):
            row = logits[j + 1]
            if child_of[j] >= 0 and rng.random() < 0.5:
                row[int(flat.tokens[child_of[j]])] = 9.0
            elif vocab == 257 and rng.random() < 0.5:
                row[vocab - 1] = 9.0
            if rng.random() < 0.2:  # a tie across blocks: the lower index wins
                top = int(row.argmax())
                row[(top + 256 * int(rng.integers(1, 3))) % vocab] = row[top]
            if rng.random() < 0.1:
                row[int(rng.integers(0, vocab))] = float("nan")
                row[int(rng.integers(0, vocab))] = float("nan")
        if vocab == 511:
            logits[0::2, 0], logits[1::2, 0] = 50.0, -50.0
        logits = logits.to(dtype)
        starts = flat.offsets[:-1] + 1
        want = walk_flat(flat, logits, starts, pick=lambda idx, rows: host_rows_argmax(logits, rows))
        got = [np.full_like(want[0], -1), np.zeros_like(want[1]), np.zeros_like(want[2])]
        x = logits.view(torch.int16).numpy() if dtype == torch.bfloat16 else logits.numpy()
        kernels.load("walk").walk_rows(x, flat.tokens, flat.parents, PRIORITY_BY_CODE[flat.sources].astype(np.int8),
                                       flat.offsets, starts, *got)
        for g, w, default in zip(got, want, walk_flat(flat, logits, starts)):
            assert g.tolist() == w.tolist() == default.tolist()


def test_the_workers_walk_warm_up_compiles_what_a_step_walks():
    """After ``warm_up_walk`` (the CPU worker's start) walks over bf16 logits of a step's shape
    compile nothing more, and float32 logits do not reach the compiled walk: one signature, before
    and after (a fresh process: numba's signatures are its own)."""
    import subprocess
    import sys

    code = """
import numpy as np, torch
from vllm_anisotropic.kernels import load
from vllm_anisotropic.tree import DraftTree, FlatTrees
from vllm_anisotropic.verifiers.greedy import walk_flat, warm_up_walk
warm_up_walk()
before = len(load("walk").walk_rows.signatures)
flat = FlatTrees.from_trees([DraftTree(tokens=[3, 1, 2], parents=[-1, 0, 1])] * 2)
for dtype in (torch.float32, torch.bfloat16):
    walk_flat(flat, torch.randn(9, 300).to(dtype), np.array([0, 4]))
print(before, len(load("walk").walk_rows.signatures))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1"]


def test_one_descent_step_moves_the_matching_trees_stops_the_others_and_counts_the_movers():
    """``kernels.walk.descend_flat``'s contract for one depth step, read directly: a tree whose
    argmax matches a child descends (path, count, cursor) and is counted in the return value; a
    tree without a matching child gets its bonus token and is no longer active (a walk that kept
    it active would argmax its row again every later step); inactive trees are not touched.
    Trees: A = root -> 5 (spine) with y = 5; B = root -> 7 with y = 9; C inactive."""
    from vllm_anisotropic import kernels

    flat = FlatTrees.from_trees([DraftTree.chain([5], root_token=1), DraftTree.chain([7], root_token=2),
                                 DraftTree.chain([3], root_token=4)])
    ranks = np.zeros(flat.num_nodes, np.int8)
    active = np.array([True, True, False])
    y = np.array([5, 9, 3], np.int64)
    cur = np.zeros(3, np.int64)
    accepted = np.full((3, 1), -1, np.int64)
    num_accepted = np.zeros(3, np.int64)
    bonus = np.full(3, -7, np.int64)
    moved = kernels.load("walk").descend_flat(flat.tokens, flat.parents, ranks, flat.offsets, active, y, cur,
                                              accepted, num_accepted, bonus)
    assert moved == 1
    assert active.tolist() == [True, False, False]
    assert accepted[:, 0].tolist() == [1, -1, -1] and num_accepted.tolist() == [1, 0, 0] and cur.tolist() == [1, 0, 0]
    assert bonus.tolist() == [-7, 9, -7]
    y[:] = [8, 0, 0]  # A's node 1 has no child: it stops too, nothing moves
    assert kernels.load("walk").descend_flat(flat.tokens, flat.parents, ranks, flat.offsets, active, y, cur,
                                             accepted, num_accepted, bonus) == 0
    assert not active.any() and bonus.tolist() == [8, 9, -7]
