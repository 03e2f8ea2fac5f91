"""The compiled harvest math (``kernels.vocab.topk_probs``) against float64 references: the top-k ids
equal a stable descending sort (lower token id first among equal logits, which bf16 logits make
common), the probabilities a float64 softmax to 2e-6 relative."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_anisotropic.proposers.adjacency import topk_scores


@pytest.mark.parametrize("vocab,k", [(49152, 10), (1000, 10), (300, 7), (17, 17), (256, 3), (257, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_probs_equal_a_float64_softmax(vocab, k, dtype):
    g = torch.Generator().manual_seed(vocab + k)
    logits = (torch.randn(6, vocab, generator=g) * torch.tensor([0.1, 1, 3, 10, 30, 100]).view(-1, 1)).to(dtype)
    logits[5, :] = logits[5, 0]  # one row of ties only
    ids, probs = topk_scores(logits, k)
    x = logits.double().numpy()
    for r in range(x.shape[0]):
        want = np.argsort(-x[r], kind="stable")[:k]
        assert ids[r].tolist() == want.tolist(), r
        p = np.exp(x[r] - x[r].max())
        p /= p.sum()
        # float32 log-sum-exp over up to 49,152 terms: its rounding follows the SIMD width numba
        # compiles for (2.06e-6 seen on an AVX2-only EPYC, under 2e-6 with AVX-512); dropping or
        # doubling one term of 49,152 moves the probabilities by ~2e-5
        np.testing.assert_allclose(probs[r], p[want], rtol=5e-6, atol=1e-30)
    assert ids.dtype == np.int32 and probs.dtype == np.float32


def test_block_bound_keeps_entries_equal_to_it():
    """The k-th largest block maximum is itself an entry: with every block's maximum equal, the
    scan must keep entries equal to the bound (lowest ids first)."""
    x = torch.zeros(1, 1024)
    x[0, ::256] = 5.0  # four blocks, each maximum 5 at its first entry
    ids, _ = topk_scores(x, 4)
    assert ids[0].tolist() == [0, 256, 512, 768]
    ids, _ = topk_scores(x, 6)
    assert ids[0].tolist() == [0, 256, 512, 768, 1, 2]


@pytest.mark.parametrize("vocab", [257, 513, 49153])
def test_topk_sees_the_last_entry_of_a_one_entry_block(vocab):
    """A vocabulary one past a whole number of 256-entry blocks: its last block holds one entry,
    and a top-k that dropped that block would miss a maximum placed there."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(2, vocab, generator=g)
    logits[0, -1] = 50.0  # the maximum, alone in the last block
    logits[1, -1] = logits[1].max() + 1e-3
    ids, probs = topk_scores(logits, 3)
    assert ids[0][0] == vocab - 1 and ids[1][0] == vocab - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_orders_negative_rows_and_signed_zeros_as_values(dtype):
    """Order keys (``kernels.vocab.order_key``) rank as the values: in an all-negative row the
    least negative come first (a key that ignores the sign takes the most negative), -0.0 and
    +0.0 are equal (the lower id first: a key ranking -0 below +0 puts id 10 before id 5), and
    -inf entries (a masked vocabulary) rank last and weigh nothing in the probabilities."""
    g = torch.Generator().manual_seed(11)
    logits = -(torch.rand(2, 700, generator=g) * 20 + 1)
    logits[0, 5], logits[0, 10] = -0.0, 0.0
    logits[1, 600] = -0.5
    logits[1, :300] = -float("inf")
    logits = logits.to(dtype)
    ids, probs = topk_scores(logits, 4)
    x = logits.double().numpy()
    for r in range(2):
        want = np.argsort(-x[r], kind="stable")[:4]
        assert ids[r].tolist() == want.tolist()
        p = np.exp(x[r] - x[r].max())
        np.testing.assert_allclose(probs[r], (p / p.sum())[want], rtol=5e-6)
    assert ids[0][:2].tolist() == [5, 10] and ids[1][0] == 600


def test_block_edges_neither_overlap_nor_drop_an_entry():
    """Blocks are exactly ``BLOCK`` entries: a maximum on the last entry of a full block (index
    255) is its block's maximum (a block one entry short would skip that block and miss it), and
    a maximum on the first entry of the next block (256) is counted once (blocks overlapping by
    one would count it twice among the block maxima, raise the bound to it and skip the
    runner-up)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.rand(2, 1024, generator=g)
    logits[0, 255] = 9.0  # the maximum, last entry of block 0
    logits[0, 700] = 5.0  # block 2's maximum: the bound for k = 1 when block 0 misses index 255
    logits[1, 256] = 9.0  # the maximum, first entry of block 1
    logits[1, 10] = 8.0  # the runner-up, in block 0
    ids, _ = topk_scores(logits, 1)
    assert ids[0].tolist() == [255]
    ids, _ = topk_scores(logits, 2)
    assert ids[1].tolist() == [256, 10]


def test_float32_keys_keep_the_last_bit():
    """float32 rows are ranked on all 32 bits: 1.0 (0x3F800000) and the next float up
    (0x3F800001) differ only in the lowest bit, and the larger wins even from a higher id (a key
    that masked that bit would tie them and take the lower id)."""
    x = torch.full((1, 300), -1.0)
    x[0, 3] = 1.0
    x[0, 7] = float(np.nextafter(np.float32(1.0), np.float32(2.0)))
    ids, _ = topk_scores(x, 2)
    assert ids[0].tolist() == [7, 3]
    from vllm_anisotropic import kernels

    out = np.empty(1, np.int64)
    kernels.load("vocab").argmax_rows(x.numpy(), np.zeros(1, np.int64), out)
    assert out.tolist() == [7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_are_read_in_place_in_the_order_given(dtype):
    """``topk_scores(logits, k, rows)`` (the harvest's rows, read where they lie, no gathered copy)
    equals ``topk_scores(logits[rows], k)`` row for row: rows out of order, repeated, not all
    taken (a kernel reading row i instead of ``rows[i]`` returns rows 0, 1, 2, ...)."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 700, generator=g) * torch.arange(1, 7).view(-1, 1)).to(dtype)
    rows = np.array([4, 0, 4, 2, 5], np.int64)
    ids, probs = topk_scores(logits, 5, rows)
    want_ids, want_probs = topk_scores(logits[torch.from_numpy(rows)], 5)
    assert ids.shape == (5, 5) and ids.tolist() == want_ids.tolist()
    np.testing.assert_array_equal(probs, want_probs)
    assert ids[0].tolist() != ids[1].tolist()  # rows 4 and 0 differ: the test can tell them apart
    empty = topk_scores(logits, 5, np.zeros(0, np.int64))
    assert empty[0].shape == (0, 5) and empty[1].shape == (0, 5)


def test_kth_largest_block_maximum_is_the_sorts():
    """``vocab._kth_largest`` (the top-k's bound) is ``np.sort(values)[-k]`` for every k, with
    repeated values, negative ones and the int32 extremes; a smaller bound would give the same
    top-k more slowly, so only this direct check sees it."""
    from vllm_anisotropic import kernels

    kth = kernels.load("vocab")._kth_largest
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 192):
        for _ in range(20):
            values = rng.integers(-5, 5, n).astype(np.int32) if rng.random() < 0.5 else \
                rng.integers(-2**31, 2**31 - 1, n, dtype=np.int64).astype(np.int32)
            values[rng.integers(0, n)] = np.int32(-2**31)
            for k in range(1, n + 1):
                assert kth(values, k, np.empty(k, np.int32)) == np.sort(values)[n - k], (values, k)
