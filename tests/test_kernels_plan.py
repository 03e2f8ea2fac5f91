"""The tree attention's plan kernels (``kernels/plan.py``): the CPU path rounds (``path_rounds``)
against a plain per-leaf reference on random forests (which paths are kept and what they query,
the rounds they fall in, every slot through a shuffled block table, the rows put back after the
rounds), the CUDA split's ``split_plan`` by example (against ``TreeAttentionPlan.build`` on random
trees: ``tests/test_gpu_paths.py``), the arrays ``TreePlan`` derives from its trees, and the
workers' warm-ups."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_anisotropic.integration.vllm.engine.runner import TreePlan
from vllm_anisotropic.kernels import load
from vllm_anisotropic.tree import DraftTree, FlatTrees


def _random_tree(rng, n) -> DraftTree:
    chainy = rng.random()
    parents = [-1] + [i - 1 if rng.random() < chainy else int(rng.integers(0, i)) for i in range(1, n)]
    return DraftTree(tokens=np.zeros(n, np.int64), parents=parents)


def _reference(trees, chains, first, ctx, rows, table, block_size, num_tokens):
    """Per tree: the kept paths as (nodes root-to-leaf, need), leaf by leaf; then rounds, each a
    slot map over the ``num_tokens`` K/V rows, and the restore's map last."""
    def slot(t, pos):
        return int(table[rows[t], pos // block_size]) * block_size + pos % block_size

    per_tree = []
    for tree, c in zip(trees, chains):
        anc = tree.ancestor_mask[1:, 1:]
        n = anc.shape[0]
        covered = np.zeros(n, bool)
        covered[:c] = True
        paths = []
        for leaf in range(n):
            if anc[:, leaf].sum() != 1:  # attended by a descendant: not a leaf
                continue
            path = np.nonzero(anc[leaf])[0]
            need = int((~covered[path]).sum())
            if need:
                paths.append((path + 1, need))
                covered[path] = True
        per_tree.append(paths)
    out = dict(queried=[], query_start=[], path_lens=[], path_tree=[], round_paths=[], round_queries=[], slots=[],
               reads=0, context=int(sum(ctx)))
    for k in range(max((len(p) for p in per_tree), default=0)):
        out["query_start"].append(0)
        slots = [-1] * num_tokens
        q = 0
        for t, paths in enumerate(per_tree):
            if k >= len(paths):
                continue
            nodes, need = paths[k]
            for d, j in enumerate(nodes):
                slots[first[t] + j - 1] = slot(t, ctx[t] + d)
            out["queried"] += [first[t] + j - 1 for j in nodes[len(nodes) - need:]]
            q += need
            out["query_start"].append(q)
            out["path_lens"].append(ctx[t] + len(nodes))
            out["path_tree"].append(t)
            out["reads"] += int(ctx[t])
        out["round_paths"].append(len(out["path_tree"]))
        out["round_queries"].append(len(out["queried"]))
        out["slots"].append(slots)
    restore = [-1] * num_tokens
    for t, tree in enumerate(trees):
        for j in range(tree.num_nodes - 1):
            restore[first[t] + j] = slot(t, ctx[t] + j)
    out["slots"].append(restore)
    return out


_NO_CAP = 1 << 40  # path_rounds' max_mean: never past it
_NAMES = ("round_paths", "round_queries", "queried", "query_start", "path_lens", "path_tree", "slots", "reads",
          "context")


def _batch(rng, trees):
    """A batch of ``len(trees) + 2`` requests holding the trees in random rows (each query: re-run
    rows, the root, the draft nodes; its KV: a context crossing block edges, then the nodes), a
    shuffled block table: the kernel's inputs and the reference's per-tree view."""
    num = len(trees)
    n = np.array([t.num_nodes - 1 for t in trees], np.int64)
    rows = rng.permutation(num + 2)[:num].astype(np.int64)  # any order (the engine's is ascending)
    q_lens = rng.integers(1, 4, num + 2)
    q_lens[rows] = n + 1 + rng.integers(0, 3, num)
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_lens = rng.integers(1, 90, num + 2).astype(np.int32)
    ctx = rng.integers(1, 80, num).astype(np.int64)
    seq_lens[rows] = ctx + n
    block_size = int(rng.choice([4, 16]))
    blocks = -(-int(seq_lens.max()) // block_size)
    table = rng.permutation((num + 2) * blocks).astype(np.int32).reshape(num + 2, blocks)
    first = query_start_loc[rows + 1] - n
    return query_start_loc, seq_lens, rows, table, block_size, first, ctx


@pytest.mark.parametrize("seed", range(6))
def test_path_rounds_match_the_per_leaf_reference(seed):
    """Random forests (1-9 trees of 1-30 nodes, chain-like to bushy, a chain prefix anywhere up to
    the tree's own) in random rows of a batch, contexts crossing block edges, a shuffled block
    table, K/V rows past the queries: every output equal."""
    rng = np.random.default_rng(seed)
    for _ in range(12):
        num = int(rng.integers(1, 10))
        trees = [_random_tree(rng, int(rng.integers(1, 31))) for _ in range(num)]
        chains = np.array([int(rng.integers(0, t.chain_prefix() + 1)) for t in trees], np.int64)
        query_start_loc, seq_lens, rows, table, block_size, first, ctx = _batch(rng, trees)
        num_tokens = int(query_start_loc[-1]) + int(rng.integers(0, 3))
        flat = FlatTrees.from_trees(trees)
        got = load("plan").path_rounds(flat.parents, flat.offsets, chains, query_start_loc, seq_lens, rows, table,
                                       block_size, num_tokens, _NO_CAP)
        want = _reference(trees, chains, first, ctx, rows, table, block_size, num_tokens)
        for name, value in zip(_NAMES, got):
            assert np.asarray(value).tolist() == want[name], name
        assert got[3].dtype == np.int32 and got[4].dtype == np.int32  # what vLLM's kernel takes


def test_path_rounds_worked_example_and_a_broken_tree():
    """The docstring's example (two chains of two, the first the chain prefix: one round, one path
    querying both of its nodes), a forest of chains (no round), and parents that form no tree (a
    cycle: no leaf) refused."""
    paths = load("plan")
    table = np.arange(4, dtype=np.int32).reshape(1, 4)
    qsl, lens, one = np.array([0, 5], np.int32), np.array([9], np.int32), np.array([0])
    out = dict(zip(_NAMES, paths.path_rounds(np.array([-1, 0, 1, 0, 3]), np.array([0, 5]), np.array([2]), qsl,
                                             lens, one, table, 4, 6, _NO_CAP)))
    # nodes 1..4 at query rows 1..4 and positions 5..8: path (3, 4) written to positions 5, 6
    assert out["round_paths"].tolist() == [1] and out["queried"].tolist() == [3, 4]
    assert out["slots"].tolist() == [[-1, -1, -1, 5, 6, -1], [-1, 5, 6, 7, 8, -1]]
    assert out["path_lens"].tolist() == [7] and out["query_start"].tolist() == [0, 2]
    assert (out["reads"], out["context"]) == (5, 5)
    # a forest of chains (every node in its tree's chain prefix): no path, no round
    chains = paths.path_rounds(np.array([-1, 0, 1, -1, 0]), np.array([0, 3, 5]), np.array([2, 1]),
                               np.array([0, 3, 5], np.int32), np.array([7, 6], np.int32), np.array([0, 1]),
                               np.arange(8, dtype=np.int32).reshape(2, 4), 4, 5, _NO_CAP)
    assert chains[0].size == 0 and chains[2].size == 0 and chains[6].tolist() == [[-1, 5, 6, -1, 21]]
    with pytest.raises(ValueError, match="no root-to-leaf path"):
        paths.path_rounds(np.array([-1, 2, 1]), np.array([0, 3]), np.array([0]), np.array([0, 3], np.int32),
                          np.array([7], np.int32), one, table, 4, 3, _NO_CAP)


def _main_rows_reference(query_start_loc, seq_lens, req_index, off):
    """By masks over the whole query: a row is kept when it lies before its request's end less
    the rows dropped there."""
    qsl = query_start_loc.astype(np.int64)
    drop = np.zeros(seq_lens.shape[0], np.int64)
    drop[req_index] = off
    keep = np.arange(qsl[-1]) < np.repeat(qsl[1:] - drop, np.diff(qsl))
    starts = qsl - np.concatenate([[0], np.cumsum(drop)])
    return np.flatnonzero(keep).tolist(), starts.tolist(), (seq_lens - drop).tolist()


@pytest.mark.parametrize("seed", range(3))
def test_main_rows_match_the_per_request_reference(seed):
    """``main_rows``: random batches whose tree requests drop 0..n rows off their chains (the
    last rows of their queries, the last positions of their KV); the kept rows, the shortened
    query starts and KV lengths, and whether the kept rows are the leading ones."""
    rng = np.random.default_rng(seed)
    for _ in range(30):
        num = int(rng.integers(1, 9))
        trees = [_random_tree(rng, int(rng.integers(1, 12))) for _ in range(num)]
        query_start_loc, seq_lens, rows, _, _, _, _ = _batch(rng, trees)
        off = np.array([int(rng.integers(0, t.num_nodes)) for t in trees], np.int64)
        keep = np.empty(int(query_start_loc[-1]), np.int64)
        starts, lens = np.empty_like(query_start_loc), np.empty_like(seq_lens)
        m, leading = load("plan").main_rows(query_start_loc, seq_lens, rows, off, keep, starts, lens)
        want_rows, want_starts, want_lens = _main_rows_reference(query_start_loc, seq_lens, rows, off)
        assert keep[:m].tolist() == want_rows and starts.tolist() == want_starts and lens.tolist() == want_lens
        assert leading == (want_rows == list(range(m)))
    # the docstring's example
    keep, starts, lens = np.empty(15, np.int64), np.empty(4, np.int32), np.empty(3, np.int32)
    m, leading = load("plan").main_rows(np.array([0, 8, 9, 15], np.int32), np.array([40, 30, 50], np.int32),
                                        np.array([0, 2]), np.array([1, 3]), keep, starts, lens)
    assert keep[:m].tolist() == [*range(7), 8, 9, 10, 11] and not leading
    assert starts.tolist() == [0, 7, 8, 11] and lens.tolist() == [39, 30, 47]
    with pytest.raises(ValueError, match="outside vLLM's metadata"):
        load("plan").main_rows(np.array([0, 8, 9, 15], np.int32), np.array([40, 30, 50], np.int32),
                               np.array([3]), np.array([1]), keep, starts, lens)


def test_path_rounds_refuse_rows_outside_the_arrays_and_skip_bushy_steps():
    """The kernel's writes are not bounds-checked, so what would write outside them is refused: a
    batch row past the metadata, K/V rows fewer than the query's, a block table too narrow for
    the KV length. Past ``max_mean`` context reads per context position (a star of three nodes,
    the first its chain: two paths, 2 reads a position) nothing is built; the reads are returned."""
    paths = load("plan")
    star = (np.array([-1, 0, 0, 0]), np.array([0, 4]), np.array([1]))
    qsl, lens, table = np.array([0, 4], np.int32), np.array([10], np.int32), np.arange(3, dtype=np.int32).reshape(1, 3)
    skip = paths.path_rounds(*star, qsl, lens, np.array([0]), table, 4, 4, 1)
    assert all(a.size == 0 for a in skip[:7]) and skip[6].shape == (0, 4) and (skip[7], skip[8]) == (2 * 7, 7)  # ctx 7
    assert paths.path_rounds(*star, qsl, lens, np.array([0]), table, 4, 4, 2)[6].shape == (3, 4)  # 2 rounds + restore
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    for bad, args in (("outside vLLM's metadata", (qsl, lens, np.array([1]), table, 4, 4)),
                      ("outside vLLM's metadata", (i32(0, 4, 5), lens, np.array([1]), table, 4, 5)),  # past seq_lens
                      ("outside vLLM's metadata", (qsl, i32(10, 10, 10), np.array([1]), table, 4, 4)),  # past starts
                      ("outside the step's arrays", (qsl, lens, np.array([0]), table, 4, 3)),
                      ("outside the step's arrays", (i32(0, 2, 6), i32(5, 10), np.array([1]), table, 4, 5)),
                      ("outside the step's arrays", (qsl, i32(9), np.array([0]), table[:, :2], 4, 4)),  # 3 blocks of 4
                      ("outside the step's arrays", (qsl, i32(2), np.array([0]), table, 4, 4))):  # KV < its 3 nodes
        with pytest.raises(ValueError, match=bad):
            paths.path_rounds(*star, *args, 3)
    # the edges taken: a query of the nodes alone (no root row), a KV of the nodes alone (context
    # 0, as split_plan takes it), a table exactly wide enough, K/V rows exactly the queries
    assert paths.path_rounds(*star, i32(0, 3), lens, np.array([0]), table, 4, 3, 3)[6].shape == (3, 3)
    assert paths.path_rounds(*star, qsl, i32(3), np.array([0]), table[:, :1], 4, 4, 3)[6].shape == (3, 4)
    assert paths.path_rounds(*star, qsl, i32(8), np.array([0]), table[:, :2], 4, 4, 3)[6].shape == (3, 4)


def test_plan_parents_and_masks_of_its_trees():
    """``TreePlan``'s derived arrays against each tree's own: draft nodes and masks; the chain
    prefix computed unless given."""
    rng = np.random.default_rng(7)
    trees = [_random_tree(rng, int(rng.integers(2, 20))) for _ in range(12)]
    plan = TreePlan(list(range(12)), FlatTrees.from_trees(trees))
    assert plan.num_nodes.tolist() == [t.num_nodes - 1 for t in trees]
    assert plan.chain_prefix.tolist() == [t.chain_prefix() for t in trees]
    for tree, mask in zip(trees, plan.masks):
        assert np.array_equal(mask, tree.ancestor_mask[1:, 1:])
    assert TreePlan([0], FlatTrees.from_trees(trees[:1]), chain_prefix=[0]).chain_prefix.tolist() == [0]


def test_split_plan_worked_example_and_refusals():
    """The docstring's example in ``from_buffer``'s layout; a KV length equal to the node count
    taken (context 0, as ``TreeAttentionPlan.build`` takes it), one below it and a tree of 65
    draft nodes refused."""
    split = load("plan").split_plan
    flat = split(np.array([-1, 0, 0, 1]), np.array([0, 4]), np.array([3]), np.array([7]), np.array([40]))
    # req_index [1] | rows [1, 3] | valid | allowed [1, 3, 3] | bits | ctx [1] | cu [2]
    assert flat.tolist() == [3, 4, 5, 6, 1, 1, 1, 1, 0, 0, 0, 1, 0, 1, 0, 1, 1, 2, 5, 37, 0, 3]
    # a context of 0 (``build`` allows it) is not refused
    assert split(np.array([-1, 0]), np.array([0, 2]), np.array([0]), np.array([1]), np.array([1]))[-3] == 0
    with pytest.raises(ValueError, match="shorter than its draft nodes"):
        split(np.array([-1, 0, 0, 1]), np.array([0, 4]), np.array([3]), np.array([7]), np.array([2]))
    with pytest.raises(ValueError, match="at most 64"):
        split(np.array([-1] + [0] * 65), np.array([0, 66]), np.array([0]), np.array([70]), np.array([99]))


def test_the_workers_warm_up_compiles_what_a_step_calls():
    """After ``warm_up_paths`` (the CPU worker's start) a step's path plan and first-call rows, with
    vLLM's int32 query starts, KV lengths and block table, compile nothing more, nor
    ``device_plan`` after ``warm_up_device_plan`` (the GPU worker's): one signature each (a
    fresh process: numba's signatures are its own)."""
    import subprocess
    import sys

    code = """
import numpy as np, torch
from dataclasses import make_dataclass
from types import SimpleNamespace
from vllm_anisotropic.integration.vllm.kernels import attention
from vllm_anisotropic.integration.vllm.engine.runner import TreePlan
from vllm_anisotropic.kernels import load
from vllm_anisotropic.tree import DraftTree, FlatTrees
attention.warm_up_paths()
tree = DraftTree(tokens=np.zeros(5, np.int64), parents=[-1, 0, 1, 0, 3])
impl = attention.TreeCPUAttentionImpl.__new__(attention.TreeCPUAttentionImpl)
impl.num_heads, impl.num_kv_heads, impl.head_size, impl.kv_cache_dtype = 2, 1, 64, "auto"
table = torch.arange(12, dtype=torch.int32).view(3, 4)[1:]  # rows of vLLM's larger table
meta = SimpleNamespace(seq_lens=torch.tensor([20, 30], dtype=torch.int32),
                       query_start_loc=torch.tensor([0, 5, 10], dtype=torch.int32), block_table=table)
plan = TreePlan([0, 1], FlatTrees.from_trees([tree, tree]))
assert impl._path_plan(plan, meta, 16, torch.float32, "vec", 10) is not None
from vllm_anisotropic.integration.vllm.engine.gpu_runner import device_plan, warm_up_device_plan
warm_up_device_plan()
plan = TreePlan([0, 1], FlatTrees.from_trees([tree, tree]), query_end=[5, 10], seq_lens=[20, 30])
device_plan(plan, "cpu")
Meta = make_dataclass("Meta", ["seq_lens", "query_start_loc", "block_table", ("num_actual_tokens", int, 10),
                               ("scheduler_metadata", object, None), ("dynamic_causal", object, None),
                               ("causal", bool, True)])
keep, _ = impl._main_plan(plan, Meta(**vars(meta)), torch.float32, "vec")
assert keep.tolist() == [0, 1, 2, 5, 6, 7]  # nodes 3 and 4 of each tree (off the chain) left out
k = load("plan")
print(len(k.path_rounds.signatures), len(k.main_rows.signatures), len(k.split_plan.signatures))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1 1 1"
