"""The CUDA path's host-side pieces, on CPU: the sync-free greedy walk, the batched positions
scatter and top-k harvest, the device attention plan, and the CUDA config forcing.

What each would catch: a dense walk that diverges from the visited-rows walk (wrong child
priority, an inactive tree that keeps descending, accepted ids written to the wrong column); a
positions scatter that uses the wrong root row or depth; a batched harvest that attributes rows
to the wrong request; a config that leaves FULL CUDA graphs or another attention backend on.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_anisotropic.attention.random_batch import random_tree
from vllm_anisotropic.proposers.adjacency import AdjacencyTable, TopKRows
from vllm_anisotropic.tree import DraftTree, FlatTrees, NodeSource, pack_trees
from vllm_anisotropic.verifiers import get_verifier


def _random_trees(rng, vocab, count):
    trees = []
    for _ in range(count):
        t = random_tree(rng, int(rng.integers(1, 40)))
        src = np.where(rng.random(t.num_nodes) < 0.5, NodeSource.SPINE, NodeSource.BRANCH).astype(np.int8)
        src[0] = NodeSource.ROOT
        # few distinct tokens: sibling collisions and long accepted paths both happen
        trees.append(DraftTree(tokens=rng.integers(0, vocab, t.num_nodes), parents=t.parents, sources=src))
    return trees


def test_dense_greedy_walk_equals_the_visited_rows_walk():
    rng = np.random.default_rng(0)
    verifier = get_verifier("greedy")
    checked = accepted_total = 0
    for trial in range(40):
        vocab = 6
        trees = _random_trees(rng, vocab, int(rng.integers(1, 9)))
        batch = pack_trees(trees)
        # logits that favour tree tokens, so walks go deep
        logits = torch.randn(batch.num_nodes, vocab, generator=torch.Generator().manual_seed(trial)) * 3
        sparse = verifier._verify_batch_sparse(batch, logits).to_list()
        dense = verifier._verify_batch_dense(batch, logits).to_list()
        for a, b in zip(sparse, dense):
            assert a.accepted == b.accepted and a.bonus_token == b.bonus_token
            accepted_total += len(a.accepted)
            checked += 1
    assert checked > 100 and accepted_total > 50  # the walks were not all trivial


def test_dense_walk_is_chosen_on_cuda_logits_only():
    verifier = get_verifier("greedy")
    assert verifier.dense is None  # decided by the logits' device
    calls = []
    verifier._verify_batch_dense = lambda *a: calls.append("dense")
    verifier._verify_batch_sparse = lambda *a: calls.append("sparse")
    verifier._verify_batch(None, torch.zeros(1, 2), None, None, None)
    assert calls == ["sparse"]


def test_scatter_tree_positions_worked_example():
    """The CPU path (numpy, in place) and the device path (torch ops, run here on CPU tensors)."""
    from vllm_anisotropic.integration.vllm.engine.runner import scatter_device_positions, scatter_tree_positions

    for scatter in (scatter_tree_positions, scatter_device_positions):
        positions = torch.tensor([9, 10, 11, 12, 13, 20, 21, 22], dtype=torch.int64)
        # request A: rows 2..4 under root row 1 with depths [1, 1, 2]; request B: rows 6..7 under row 5
        scatter(positions, np.array([[2, 3, 4, 6, 7], [1, 1, 1, 5, 5], [1, 1, 2, 1, 2]]))
        assert positions.tolist() == [9, 10, 11, 11, 12, 20, 21, 22], scatter


def test_device_plan_from_the_runner_plan():
    from vllm_anisotropic.integration.vllm.engine.gpu_runner import device_plan
    from vllm_anisotropic.integration.vllm.engine.runner import TreePlan

    tree = DraftTree(tokens=[0] * 4, parents=[-1, 0, 0, 1])
    plan = TreePlan(req_index=[2], trees=FlatTrees.from_trees([tree]), query_end=[17], seq_lens=[40])
    dp = device_plan(plan, "cpu")
    assert dp.req_index.tolist() == [2] and dp.packed_rows.tolist() == [14, 15, 16]
    assert dp.context_lens.tolist() == [37] and dp.ancestor_bits.tolist() == [[1, 2, 5]]


def test_batched_topk_harvest_equals_per_request_harvest():
    g = torch.Generator().manual_seed(3)
    rng = np.random.default_rng(3)
    trees = _random_trees(rng, 50, 4)
    logits = [torch.randn(t.num_nodes, 50, generator=g) for t in trees]
    alone = [AdjacencyTable(50, top_k=4) for _ in trees]
    batched = [AdjacencyTable(50, top_k=4) for _ in trees]
    for table, tree, lg in zip(alone, trees, logits):
        table.harvest_tree(tree, 7, lg)
    top = TopKRows.of(torch.cat(logits), 6)  # a larger k than the tables keep is fine
    offset = 0
    for table, tree in zip(batched, trees):
        table.harvest_tree(tree, 7, top[offset : offset + tree.num_nodes])
        offset += tree.num_nodes
    for a, b in zip(alone, batched):
        assert np.array_equal(a.unigram_ids, b.unigram_ids) and np.allclose(a.unigram_scores, b.unigram_scores)
        assert np.array_equal(a.bigram_keys, b.bigram_keys)
        assert np.array_equal(a.bigram_ids, b.bigram_ids) and np.allclose(a.bigram_scores, b.bigram_scores)
    with pytest.raises(ValueError, match="top-2"):
        AdjacencyTable(50, top_k=4).harvest_tree(trees[0], 7, TopKRows.of(logits[0], 2))


# ---------------------------------------------------------------------- CUDA config forcing
def _configs(mode=None, backend=None, mla=False, dcp=1, dbo=False):
    from vllm.config import CompilationConfig
    from vllm.config.attention import AttentionConfig

    comp = CompilationConfig() if mode is None else CompilationConfig(cudagraph_mode=mode)
    attn = AttentionConfig() if backend is None else AttentionConfig(backend=backend)
    par = SimpleNamespace(decode_context_parallel_size=dcp, enable_dbo=dbo)
    return comp, attn, par, SimpleNamespace(use_mla=mla)


def test_gpu_defaults_are_flash_attn_and_piecewise():
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_anisotropic.integration.vllm.frontdoor.patches import force_gpu_settings

    comp, attn, par, model = _configs()
    assert force_gpu_settings(comp, attn, par, model) == []
    assert comp.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert attn.backend == AttentionBackendEnum.FLASH_ATTN
    comp, attn, par, model = _configs(mode="NONE", backend="FLASH_ATTN")
    assert force_gpu_settings(comp, attn, par, model) == [] and comp.cudagraph_mode == CUDAGraphMode.NONE


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(mode="FULL"), "cudagraph_mode FULL"),
        (dict(mode="FULL_AND_PIECEWISE"), "FULL_AND_PIECEWISE"),
        (dict(mode="FULL_DECODE_ONLY"), "FULL_DECODE_ONLY"),
        (dict(backend="FLASHINFER"), "FLASHINFER"),
        (dict(backend="TRITON_ATTN"), "TRITON_ATTN"),
        (dict(mla=True), "MLA"),
        (dict(dcp=2), "decode context parallelism"),
        (dict(dbo=True), "dual-batch overlap"),
    ],
)
def test_gpu_refusals_name_the_setting(kwargs, needle):
    from vllm_anisotropic.integration.vllm.frontdoor.patches import force_gpu_settings

    problems = force_gpu_settings(*_configs(**kwargs))
    assert len(problems) == 1 and needle in problems[0], problems


def test_device_plan_from_the_kernel_equals_the_plan_from_masks():
    """``device_plan`` (the runner's: one ``split_plan`` call for the step) against
    ``TreeAttentionPlan.build`` of the same trees' masks: random trees of 2-40 nodes, 64 draft
    nodes (the last bit of a 64-bit row), and a tree above that taking ``build`` itself."""
    from vllm_anisotropic.attention.tree_attention import TreeAttentionPlan
    from vllm_anisotropic.integration.vllm.engine.gpu_runner import device_plan
    from vllm_anisotropic.integration.vllm.engine.runner import TreePlan

    rng = np.random.default_rng(11)
    for sizes in ([2], [40, 3, 17], [9] * 8, [65, 2], [70, 5]):
        trees = [random_tree(rng, n) for n in sizes]
        num = [t.num_nodes - 1 for t in trees]
        ends = np.cumsum([n + 1 + int(rng.integers(0, 3)) for n in num]).tolist()
        seq = [n + int(rng.integers(1, 300)) for n in num]
        plan = TreePlan(list(range(1, 2 * len(trees), 2)), FlatTrees.from_trees(trees), query_end=ends, seq_lens=seq)
        want = TreeAttentionPlan.build(plan.req_index, [t.ancestor_mask[1:, 1:] for t in trees], ends, seq)
        got = device_plan(plan, "cpu")
        for name in ("req_index", "node_rows", "node_valid", "allowed", "ancestor_bits", "context_lens", "cu_nodes"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (sizes, name)
        assert got.max_context == want.max_context
