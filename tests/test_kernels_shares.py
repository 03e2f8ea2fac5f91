"""``kernels/shares.py``: independent rows of a compiled kernel shared out over helper threads
(the CPU harvest's top-k rows, the greedy walk's trees). The shares must cover every row once,
raise a helper's exception in the caller, and leave every row's result the bits of that row
computed alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tests.test_flat_trees import random_tree
from vllm_anisotropic.kernels import shares
from vllm_anisotropic.proposers.adjacency import topk_scores
from vllm_anisotropic.tree import FlatTrees
from vllm_anisotropic.verifiers.greedy import GreedyVerifier, walk_flat


@pytest.fixture
def three_threads():
    """torch's intra-op threads at 3 (what ``threads_for`` reads), restored after the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


def test_threads_for_counts_torch_threads_and_share_sizes(three_threads):
    assert [shares.threads_for(n) for n in (0, 1, shares.SHARED_MIN - 1)] == [1, 1, 1]
    assert shares.threads_for(shares.SHARED_MIN) == 2  # shares of at least SHARED_MIN // 2 rows
    assert shares.threads_for(11) == 2 and shares.threads_for(12) == 3 and shares.threads_for(1000) == 3
    torch.set_num_threads(1)
    assert shares.threads_for(1000) == 1


def test_shares_cover_every_row_once_and_raise_a_helper_exception(three_threads):
    pool, seen = shares.Shares(), []
    pool.run(lambda lo, hi: seen.append((lo, hi, threading.current_thread().name)), 31)
    assert sorted((lo, hi) for lo, hi, _ in seen) == [(0, 10), (10, 20), (20, 31)]
    names = [name for _, _, name in seen]
    assert sum(name.startswith("shares") for name in names) == 2  # the first share on the caller's thread

    def fail_late(lo, hi):
        if lo > 0:
            raise ValueError("share")

    with pytest.raises(ValueError, match="share"):
        pool.run(fail_late, 31)
    pool.run(lambda lo, hi: None, 31)  # the pool still serves after a failed share


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_harvest_rows_shared_over_threads_equal_one_row_at_a_time(dtype, three_threads):
    """A share cut that skipped, doubled or shifted rows leaves rows of ``np.empty`` or another
    row's top-k: row counts around the cuts, rows out of order and repeated."""
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(40, 3000, generator=g) * 4).to(dtype)
    for n in (shares.SHARED_MIN - 1, shares.SHARED_MIN, 13, 37):
        rows = np.random.default_rng(n).integers(0, 40, n)
        ids, probs = topk_scores(logits, 6, rows)
        for i, r in enumerate(rows.tolist()):
            one_ids, one_probs = topk_scores(logits[r : r + 1], 6)
            assert ids[i].tolist() == one_ids[0].tolist(), (n, i)
            np.testing.assert_array_equal(probs[i], one_probs[0])


def test_greedy_walk_of_trees_shared_over_threads_equals_the_per_tree_walk(three_threads):
    """``walk_flat`` on bf16 logits shares the trees out from ``SHARED_MIN`` trees on: every
    tree's path and bonus are its own walk's (a share handed another share's offsets or rows
    walks the wrong rows)."""
    rng = np.random.default_rng(5)
    verifier = GreedyVerifier()
    for num in (shares.SHARED_MIN, 13, 30):
        trees = [random_tree(rng, int(rng.integers(2, 12)), vocab=4) for _ in range(num)]
        flat = FlatTrees.from_trees(trees)
        logits = torch.randn(flat.num_nodes + 3, 4).to(torch.bfloat16)
        starts = flat.offsets[:-1] + 2
        accepted, got, bonus = walk_flat(flat, logits, starts)
        for k, res in enumerate(verifier.verify_host(trees, logits, starts.tolist())):
            assert accepted[k, : got[k]].tolist() == res.accepted and int(bonus[k]) == res.bonus_token, (num, k)
        assert got.sum() > 0  # some paths accepted: the test sees where each walk went
