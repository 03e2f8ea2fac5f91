"""Fast vectorised verifiers == slow per-node reference loops, seed for seed; registry."""

import numpy as np
import pytest
import torch

from vllm_anisotropic.tree import DraftTree, pack_trees
from vllm_anisotropic.verifiers import VERIFIERS, TargetSampling, get_verifier
from vllm_anisotropic.verifiers.toy import DraftTable, TableModel, paths_to_tree, sample_iid_paths, topk_tree, tree_rows

V = 6
TARGET = TableModel(V, seed=5)
DRAFT = DraftTable(TARGET, seed=6)


def batch_of_trees(draft_model: bool, rng):
    trees, logits, qs = [], [], []
    for i in range(12):
        prefix = (int(rng.integers(V)),)
        if draft_model:
            k, l1, l2 = int(rng.integers(1, 4)), int(rng.integers(0, 3)), int(rng.integers(0, 3))
            tree = paths_to_tree(sample_iid_paths(DRAFT, prefix, k, l1, l2, rng), prefix[-1], l1)
        else:
            tree = topk_tree(TARGET, prefix, width=int(rng.integers(1, 3)), depth=2, spine=list(rng.integers(0, V, 3)))
        lg, q = tree_rows(tree, prefix, TARGET, DRAFT)
        trees.append(tree)
        logits.append(lg)
        qs.append(q)
    return trees, torch.cat(logits), torch.cat(qs)


SAMPLINGS = [TargetSampling(1.0), TargetSampling(0.6, top_k=3), TargetSampling(1.2, top_p=0.7), TargetSampling(0.0)]


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_fast_equals_reference(name):
    v = get_verifier(name, torch.float64)
    rng = np.random.default_rng(0)
    families = [True] if v.requires_draft_probs else [True, False]
    for draft_model in families:
        trees, logits, q = batch_of_trees(draft_model, rng)
        batch = pack_trees(trees)
        for seed in range(6):
            sampling = [SAMPLINGS[(seed + i) % len(SAMPLINGS)] for i in range(len(trees))]
            fast = v.verify_batch(batch, logits, sampling, torch.Generator().manual_seed(seed), q).to_list()
            ref = v.reference_batch(batch, logits, sampling, torch.Generator().manual_seed(seed), q)
            assert fast == ref


def test_single_tree_api_and_float32():
    tree = DraftTree.from_paths([[1, 2], [3, 4]], root_token=0)
    logits = torch.randn(tree.num_nodes, 8)
    q = torch.softmax(torch.randn(tree.num_nodes, 8), -1)
    for name in VERIFIERS:
        r = get_verifier(name).verify(tree.with_draft_probs(q), logits, TargetSampling(0.8), torch.Generator().manual_seed(0))
        assert 0 <= r.bonus_token < 8
        assert r.accepted == tree.path_to(r.accepted[-1]) if r.accepted else True


def test_registry():
    assert set(VERIFIERS) == {"greedy", "deterministic", "nss", "naive", "naive_tree", "spectr", "specinfer",
                              "khisti", "traversal", "block"}
    with pytest.raises(ValueError, match="valid names.*greedy"):
        get_verifier("nope")


def test_missing_draft_probs_and_merged_trees_raise():
    tree = DraftTree.from_paths([[1, 2], [1, 3]], root_token=0, merge=True)
    logits = torch.randn(tree.num_nodes, 4)
    with pytest.raises(ValueError, match="draft_probs"):
        get_verifier("specinfer").verify(tree, logits)
    q = torch.full((tree.num_nodes, 4), 0.25)
    with pytest.raises(ValueError, match="unmerged"):
        get_verifier("traversal").verify(tree.with_draft_probs(q), logits)


def test_greedy_half_precision_logits():
    """bf16/fp16 target logits (the speed benchmark's storage): the greedy walk's chunked
    float32 argmax equals the argmax of the raw rows: ties (first index), rows whose maximum
    is negative or +-0, infinities and NaN included."""
    from vllm_anisotropic.verifiers.greedy import rows_argmax

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 300, generator=g) * 4
    logits[3, 10] = logits[3, 200] = 50.0  # tie: the first index wins
    logits[5] = -logits[5].abs() - 1  # all negative
    logits[6] = -logits[6].abs()
    logits[6, 7], logits[6, 9] = -0.0, 0.0  # maximum 0, -0 first
    logits[7, 100] = float("inf")
    logits[8, 50] = float("nan")
    rows = torch.tensor([3, 0, 39, 3, 17, 5, 6, 7, 8])
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        x = logits.to(dtype)
        assert rows_argmax(x, rows, chunk_rows=2).tolist() == x[rows].float().argmax(-1).tolist(), dtype
    assert rows_argmax(logits.to(torch.bfloat16), rows)[:2].tolist() == [10, int(logits[0].argmax())]
    rng = np.random.default_rng(1)
    trees, lg, _ = batch_of_trees(False, rng)
    batch = pack_trees(trees)
    v = get_verifier("greedy")
    half = lg.to(torch.bfloat16)
    assert v.verify_batch(batch, half, TargetSampling(0.0)).to_list() == \
        v.reference_batch(batch, half.float(), TargetSampling(0.0))


def test_bf16_and_float32_rows_argmaxed_as_torch():
    """The CPU walk's argmax (``host_rows_argmax``: bf16 rows by ``kernels.vocab.argmax_rows`` on
    their 16 bits through ``kernels.vocab.order_key``; the kernel on float32 rows too) equals
    torch's ``.float().argmax()``: on every bf16 bit pattern (both zeros, subnormals, infinities,
    NaNs of both signs, the largest finite values; in one block a row and shuffled across 16
    blocks a row), and on rows built to catch a wrong shift (values equal in the low byte), an
    unsigned or sign-flipped key (all-negative rows), zeros of opposite sign ranked apart, a
    maximum in the short last block, in a one-entry last block or second in its block, the later
    of two equal block maxima, a negative NaN ranked low, and a reversed row index."""
    from vllm_anisotropic import kernels
    from vllm_anisotropic.verifiers.greedy import host_rows_argmax

    def check(x: torch.Tensor, rows: np.ndarray) -> None:
        want = x[torch.from_numpy(rows)].float().argmax(-1).tolist()
        assert host_rows_argmax(x, rows).tolist() == want
        out = np.empty(rows.shape[0], np.int64)
        kernels.load("vocab").argmax_rows(np.ascontiguousarray(x.float().numpy()), rows, out)
        assert out.tolist() == want

    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    g = torch.Generator().manual_seed(3)
    check(every.view(torch.bfloat16).reshape(256, 256), np.arange(256)[::-1].copy())
    shuffled = every[torch.randperm(every.numel(), generator=g)].view(torch.bfloat16).reshape(16, 4096)
    check(shuffled, np.arange(16))
    x = (torch.randn(9, 1000, generator=g) * 3).to(torch.bfloat16)  # blocks of 256, 256, 256, 232
    x[1] = -x[1].abs() - 1  # all negative: a key that ignores the sign picks the smallest
    x[2, 900] = 64.0
    x[2, 100] = 64.5  # 64.5 and 64 differ only in the low byte of the float32 word
    x[3, 5] = float("nan")
    x[4] = -x[4].abs() - 1
    x[4, 5], x[4, 10] = -0.0, 0.0  # equal: the first wins (a key ranking -0 below +0 takes 10)
    x[5, 999] = x[5].max() + 1  # alone in the short last block
    x[6, 300] = x[6, 700] = x[6].max() + 1  # two blocks hold the maximum: the first block's index
    x[7] = -float("inf")
    x[7, 600] = -3.0e38
    x[8, 2] = x[8, 500] = float("nan")
    x[8].view(torch.int16)[2] = -64  # 0xFFC0: a NaN with the sign bit set, still the first maximum
    check(x, np.array([3, 2, 1, 0, 8, 7, 6, 5, 4, 2], np.int64))
    y = (torch.randn(2, 513, generator=g) * 3).to(torch.bfloat16)  # blocks of 256, 256 and 1
    y[0, 512] = y[0].max() + 1  # alone in a one-entry last block (a block count rounded down drops it)
    y[1, 257] = y[1].max() + 1  # second entry of its block (a block maximum from its third entry misses it)
    check(y, np.array([0, 1], np.int64))


def test_greedy_host_walk_equals_the_packed_walk():
    """``GreedyVerifier.verify_host`` (the CPU engine's walk) against ``verify_batch`` on random
    trees with many token collisions among siblings (so child priority decides): would catch a
    walk that ignores SPINE-first priority, takes the last matching child, argmaxes the wrong
    row, or mixes up the trees' row offsets."""
    from vllm_anisotropic.tree import NodeSource

    rng = np.random.default_rng(7)
    g = torch.Generator().manual_seed(7)  # the test's own logits, whatever ran before it
    v = get_verifier("greedy")
    vocab = 64
    checked = accepted = 0
    for trial in range(200):
        trees = []
        for _ in range(int(rng.integers(1, 7))):
            n = int(rng.integers(1, 12))
            parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
            sources = [NodeSource.ROOT] + [NodeSource.SPINE if rng.random() < 0.4 else NodeSource.BRANCH
                                           for _ in range(n - 1)]
            trees.append(DraftTree(tokens=rng.integers(0, 4, n), parents=np.array(parents),
                                   sources=np.array(sources, np.int8), values=np.linspace(1.0, 0.1, n)))
        rows = sum(t.num_nodes for t in trees)
        logits = torch.randn(rows, vocab, generator=g)
        logits[:, :4] += 6 * torch.rand(rows, 4, generator=g)  # tokens 0..3 (the draft tokens) usually win
        logits = logits.to(torch.bfloat16 if trial % 2 else torch.float32)
        host = v.verify_host(trees, logits)
        packed = v.verify_batch(pack_trees(trees), logits).to_list()
        for a, b in zip(host, packed):
            assert (a.accepted, a.bonus_token) == (b.accepted, b.bonus_token)
            checked += 1
            accepted += len(a.accepted)
        # the engine's form: the trees' rows where they lie among other rows (``starts``), here
        # after a gap row each and in reverse order; would catch starts ignored or misapplied
        gaps = torch.randn(len(trees), vocab, generator=g).to(logits.dtype)
        parts, starts, at = [], [0] * len(trees), 0
        for k in reversed(range(len(trees))):
            first = sum(t.num_nodes for t in trees[:k])
            parts += [gaps[k : k + 1], logits[first : first + trees[k].num_nodes]]
            starts[k] = at + 1
            at += 1 + trees[k].num_nodes
        placed = v.verify_host(trees, torch.cat(parts), starts)
        assert [(a.accepted, a.bonus_token) for a in placed] == [(a.accepted, a.bonus_token) for a in host]
    assert checked > 500 and accepted > 300, (checked, accepted)  # the walks went deep, not only root bonuses
    with pytest.raises(ValueError, match="logits rows"):
        v.verify_host(trees, logits[:-1])
    with pytest.raises(ValueError, match="run past"):
        v.verify_host(trees, logits, [0] * (len(trees) - 1) + [rows - trees[-1].num_nodes + 1])
