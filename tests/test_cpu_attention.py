"""The CPU tree attention (``integration/vllm/kernels/attention.py``): every KV layout vLLM's CPU kernels
write (probed through vLLM's own ``cpu_attn_reshape_and_cache``) is recognised as a bit
permutation and unpacked (K also as K^T) by one strided copy to exactly what an
element-by-element gather reads; a layout that is not a bit permutation falls back to the
gather; and the tree-row recompute over a paged cache equals masked attention in float64."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_anisotropic.integration.vllm.engine.host_clock import HostClock
from vllm_anisotropic.integration.vllm.kernels.attention import TreeCPUAttentionImpl, _unpack, bit_permutation, kv_layout


def _gathered(blk, off, num_reqs, block_size, head_size):
    """Reference: token t, dim d of each block at ``off[t, d]``; [R, kv_heads, B * block, head]."""
    n, kv_heads, _ = blk.shape
    x = blk[..., off.flatten()].view(n, kv_heads, block_size, head_size).float()
    x = x.reshape(num_reqs, n // num_reqs, kv_heads, block_size, head_size).permute(0, 2, 1, 3, 4)
    return x.reshape(num_reqs, kv_heads, -1, head_size)


def _layouts():
    out = []
    for isa in ("vec", "vec16", "amx"):
        for block_size in (32, 128):
            try:
                out.append((isa, block_size, kv_layout(isa, torch.bfloat16, block_size, 64)))
            except Exception:  # noqa: BLE001 - an ISA this CPU build does not have
                continue
    return out


@pytest.mark.parametrize("isa,block_size,layout", _layouts(), ids=lambda x: str(x) if not isinstance(x, tuple) else "")
def test_every_probed_layout_is_a_bit_permutation_and_unpacks_exactly(isa, block_size, layout):
    k_off, v_off, k_kind, v_kind = layout
    assert isinstance(k_kind, tuple) and isinstance(v_kind, tuple), (isa, k_kind, v_kind)
    torch.manual_seed(0)
    blk = torch.randn(6, 3, 2 * block_size * 64).bfloat16()  # 2 requests x 3 blocks, 3 kv heads
    for off, kind, base in ((k_off, k_kind, 0), (v_off, v_kind, block_size * 64)):
        want = _gathered(blk, off, 2, block_size, 64)
        assert torch.equal(_unpack(blk, off, kind, 2, block_size, 64, base), want)
        assert torch.equal(_unpack(blk, off, "permuted", 2, block_size, 64, base), want)
        want_t = want.transpose(-1, -2)  # K^T for the score matmul
        assert torch.equal(_unpack(blk, off, kind, 2, block_size, 64, base, transpose=True), want_t)
        assert torch.equal(_unpack(blk, off, "permuted", 2, block_size, 64, base, transpose=True), want_t)


def test_bit_permutation_of_known_layouts_and_refusals():
    t = torch.arange(4).view(4, 1)
    d = torch.arange(8).view(1, 8)
    assert bit_permutation(t * 8 + d, 0, 4, 8) == (0, 1, 2, 3, 4)  # plain
    assert bit_permutation(d * 4 + t + 100, 100, 4, 8) == (2, 3, 4, 0, 1)  # transposed, offset base
    shuffled = (t * 8 + d).flatten()[torch.tensor([1, 0] + list(range(2, 32)))].view(4, 8)
    assert bit_permutation(shuffled, 0, 4, 8) is None  # a swap of two elements is no bit permutation
    assert bit_permutation(t * 6 + torch.arange(6).view(1, 6), 0, 4, 6) is None  # head size not 2^k
    # the fallback still unpacks a non-bit permutation exactly
    blk = torch.randn(2, 1, 2 * 32).bfloat16()
    off = torch.cat([shuffled, shuffled + 32])
    assert torch.equal(_unpack(blk, off[:4], "permuted", 1, 4, 8, 0), _gathered(blk, off[:4], 1, 4, 8))


def _impl(num_heads, num_kv_heads, head_size):
    """A ``TreeCPUAttentionImpl`` with only what ``_tree_rows`` reads (no vLLM config needed)."""
    impl = object.__new__(TreeCPUAttentionImpl)
    impl.num_heads, impl.head_size, impl.num_kv_heads = num_heads, head_size, num_kv_heads
    impl.num_queries_per_kv = num_heads // num_kv_heads
    impl.kv_cache_dtype = "auto"
    impl.scale = head_size ** -0.5
    return impl


# request 0: 37 context + tree [-1,0,0,1,2] (4 nodes, chain prefix 1) after 3 re-run tokens;
# request 1: plain (1 row); request 2: 150 context + tree [-1,0,1,1,3,0] (5 nodes, chain prefix 2)
_PARENTS = {0: [-1, 0, 0, 1, 2], 2: [-1, 0, 1, 1, 3, 0]}
_CTX = {0: 37, 1: 20, 2: 150}
_Q_LENS = {0: 3 + 5, 1: 1, 2: 6}  # (re-run tokens +) root + nodes


def _scene(isa, block_size, num_heads, num_kv_heads, dtype, head_size=64, tree_requests=(0, 2)):
    """The three requests above, KV written by vLLM's own cache writer through a shuffled block
    table (every position of every request, the tree nodes' included, as vLLM's KV update
    writes them before attention): ``(kv_cache, keys, values, query, key, value, block_table,
    seq_lens, q_end, trees, plan)``; keys / values per request in float64, ``key`` / ``value``
    each query row's fresh K/V (the last q_len positions of its request). Requests not in
    ``tree_requests`` have no tree (their rows are causal)."""
    from vllm import _custom_ops as ops

    from vllm_anisotropic.integration.vllm.engine.runner import TreePlan
    from vllm_anisotropic.tree import DraftTree, FlatTrees

    torch.manual_seed(1)
    seq_lens = [_CTX[0] + 4, _CTX[1], _CTX[2] + 5]
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = 3 * max_blocks + 2
    perm = torch.randperm(num_blocks)
    block_table = perm[: 3 * max_blocks].view(3, max_blocks).int()
    kv_cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=dtype)
    keys, values = [], []
    for i, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_size).to(dtype)
        v = torch.randn(n, num_kv_heads, head_size).to(dtype)
        pos = torch.arange(n)
        slots = block_table[i, pos // block_size].long() * block_size + pos % block_size
        kc, vc = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, head_size).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        keys.append(k.double())
        values.append(v.double())
    total_q = sum(_Q_LENS.values())
    query = torch.randn(total_q, num_heads * head_size).to(dtype)
    key = torch.cat([k[len(k) - q:] for k, q in zip(keys, _Q_LENS.values())]).to(dtype)
    value = torch.cat([v[len(v) - q:] for v, q in zip(values, _Q_LENS.values())]).to(dtype)
    q_end = torch.tensor(list(_Q_LENS.values())).cumsum(0)
    trees = {i: DraftTree(tokens=np.zeros(len(par), dtype=np.int64), parents=np.array(par), values=np.zeros(len(par)))
             for i, par in _PARENTS.items() if i in tree_requests}
    plan = TreePlan(list(trees), FlatTrees.from_trees(list(trees.values())))
    assert plan.chain_prefix.tolist() == [{0: 1, 2: 2}[i] for i in tree_requests]
    return kv_cache, keys, values, query, key, value, block_table, seq_lens, q_end, trees, plan


def _reference_rows(query, keys, values, seq_lens, q_end, trees, num_heads, num_kv_heads, head_size=64):
    """Float64 attention of every query row: a draft node's row over its context, itself and
    its ancestors; every other row causal. ``{row: [num_heads, head_size]}`` and the rows of
    the nodes off each tree's leading chain."""
    group = num_heads // num_kv_heads
    q = query.double().view(query.shape[0], num_heads, head_size)
    want, off_chain = {}, set()
    start = 0
    for i, end in enumerate(q_end.tolist()):
        length, seq = end - start, seq_lens[i]
        tree = trees.get(i)
        n = 0 if tree is None else tree.num_nodes - 1
        for j in range(length):
            row = start + j
            allowed = torch.zeros(seq, dtype=torch.bool)
            allowed[: seq - length + j + 1] = True  # causal
            node = j - (length - n)  # 0-based draft node, or < 0
            if node >= 0:
                allowed[seq - n :] = torch.from_numpy(np.ascontiguousarray(tree.ancestor_mask[1:, 1:][node]))
                if node >= tree.chain_prefix():
                    off_chain.add(row)
            rows = []
            for h in range(num_heads):
                s = (keys[i][allowed, h // group] @ q[row, h]) * head_size ** -0.5
                rows.append(torch.softmax(s, 0) @ values[i][allowed, h // group])
            want[row] = torch.stack(rows)
        start = end
    return want, off_chain


@pytest.mark.parametrize("isa,block_size,layout", _layouts(), ids=lambda x: str(x) if not isinstance(x, tuple) else "")
@pytest.mark.parametrize("num_heads,num_kv_heads,dtype", [(6, 2, torch.bfloat16), (4, 4, torch.bfloat16), (6, 2, torch.float32)])
@pytest.mark.parametrize("method", ["paths", "recompute"])
def test_tree_rows_match_a_float64_reference(isa, block_size, layout, num_heads, num_kv_heads, dtype, method):
    """Two tree requests (each with a chain prefix, whose rows are left to the kernel; the first
    with 3 re-run tokens before its root) and a plain request between them, KV written by
    vLLM's own cache writer through a shuffled block table: every recomputed row equals masked attention in float64 over (context + self +
    ancestors); rows not recomputed stay untouched. Catches a wrong GQA head grouping, a mask
    off by one position, a K/V layout mix-up and rows written to the wrong place."""
    from vllm_anisotropic.integration.vllm.platform_fixes.amx import cpu_has_amx, request_amx_permission

    if method == "paths" and isa == "amx" and not (cpu_has_amx() and request_amx_permission()):
        pytest.skip("the amx attention kernel needs an AMX CPU (its KV layout is still probed above)")
    if method == "paths" and isa == "amx" and dtype != torch.bfloat16:
        # vLLM picks its amx kernel for bf16 only (cpu_attn._get_attn_isa); given float32 it aborts the process
        pytest.skip("vLLM never runs the amx attention kernel on float32")
    head_size = 64
    kv_cache, keys, values, query, key, value, block_table, seq_lens, q_end, trees, plan = _scene(
        isa, block_size, num_heads, num_kv_heads, dtype)
    total_q = query.shape[0]
    meta = SimpleNamespace(seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                           query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int64), q_end]),
                           block_table=block_table)
    layer = SimpleNamespace(isa=isa)
    output = torch.full((total_q, num_heads * head_size), 7.0)  # float32: the math at full precision
    if method == "paths":
        before = kv_cache.clone()
        impl = _impl(num_heads, num_kv_heads, head_size)
        paths = impl._path_plan(plan, meta, block_size, dtype, isa, key.shape[0])
        impl._tree_rows_paths(layer, query, key, value, kv_cache, paths, output)
        assert torch.equal(kv_cache, before)  # the tree's KV is put back where the next step reads it
    else:
        impl = _impl(num_heads, num_kv_heads, head_size)
        impl._tree_rows(layer, query, kv_cache, impl._gather_plan(plan, meta, block_size), plan, output)

    want, recomputed = _reference_rows(query, keys, values, seq_lens, q_end, trees, num_heads, num_kv_heads)
    out = output.view(total_q, num_heads, head_size)
    # the recompute works in float32; vLLM's kernel returns the model dtype (bf16: 8 bits of
    # mantissa, so half an ulp is 2e-3 of the value), a wrong mask or head errs by ~1e-1
    tol = 4e-3 if (method == "paths" and dtype == torch.bfloat16) else 2e-5
    worst = 0.0
    for row in recomputed:
        worst = max(worst, float((out[row].double() - want[row]).abs().max()))
        torch.testing.assert_close(out[row].double(), want[row], atol=tol, rtol=tol)
    untouched = [r for r in range(total_q) if r not in recomputed]
    if method == "paths" and dtype == torch.bfloat16:
        assert worst > 1e-4  # the kernel's bf16 output rounding: the tolerance is not vacuous
    assert len(recomputed) == 3 + 3
    assert bool((out[untouched] == 7.0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["paths", "recompute"])
@pytest.mark.parametrize("tree_requests", [(0, 2), (2,)], ids=["two-trees", "last-only"])
def test_forward_leaves_the_rows_off_the_chain_out_of_vllms_call_and_gets_every_row_right(
        dtype, method, tree_requests, monkeypatch):
    """The whole layer (``TreeCPUAttentionImpl.forward``, vLLM's metadata type): vLLM's kernel
    is called first for every row but the tree rows off the leading chains (3 + 3; its cost
    grows with each request's query rows), then the tree rows; every row, re-run tokens, roots,
    chains, the plain requests and the tree rows, equals float64 attention under its mask.
    ``last-only``: the one tree request is the batch's last, so the first call reads the leading
    rows in place. Catches rows left in the first call, a wrong kept row, and a KV length or
    query start not shortened with the query (the chain rows would then see the tree nodes
    after them)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    isa, block_size, num_heads, num_kv_heads, head_size = "vec", 32, 6, 2, 64
    if method == "recompute":
        monkeypatch.setenv("VLLM_ANISOTROPIC_TREE_ROWS", "recompute")
    kv_cache, keys, values, query, key, value, block_table, seq_lens, q_end, trees, plan = _scene(
        isa, block_size, num_heads, num_kv_heads, dtype, tree_requests=tree_requests)
    total_q = query.shape[0]
    query_start = torch.cat([torch.zeros(1, dtype=torch.int32), q_end.int()])
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = CPUAttentionMetadata(
        num_actual_tokens=total_q, max_query_len=8, query_start_loc=query_start, max_seq_len=max(seq_lens),
        seq_lens=lens, block_table=block_table, slot_mapping=torch.zeros(total_q, dtype=torch.int64),
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=3, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size, seq_lens=lens,
            dtype=dtype, query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=False, kv_cache_dtype="auto"))
    meta.tree_plan = plan
    plan.clock = HostClock()
    impl = _impl(num_heads, num_kv_heads, head_size)
    impl.attn_type, impl.use_zentorch_sdpa, impl.sinks, impl.alibi_slopes = AttentionType.DECODER, False, None, None
    impl.sliding_window, impl.logits_soft_cap = -1, 0
    calls = []
    kernel = ops.cpu_attention_with_kv_cache

    def spy(**kw):
        calls.append(kw["query"].shape[0])
        return kernel(**kw)

    monkeypatch.setattr(ops, "cpu_attention_with_kv_cache", spy)
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    for _ in range(2):  # two layers of one step: the second reads the plan the first built
        output = torch.full((total_q, num_heads * head_size), 7.0, dtype=dtype)
        impl.forward(layer, query.view(total_q, num_heads, head_size), key, value, kv_cache, meta,
                     output.view(total_q, num_heads, head_size))
    want, off_chain = _reference_rows(query, keys, values, seq_lens, q_end, trees, num_heads, num_kv_heads)
    # paths: one round per path of a request after the first call (both trees have 2 paths)
    per_layer = 1 + (0 if method == "recompute" else 2)
    assert len(off_chain) == 3 * len(tree_requests) and len(calls) == 2 * per_layer
    # host work: the first layer builds the plans (the first call's rows, the paths, and for the
    # recompute its gather), clocked once each; every layer's tree rows are the forward's
    assert plan.clock.calls == {"plan": 2 if method == "paths" else 3, "tree_rows": 2}
    assert calls[0] == calls[per_layer] == total_q - len(off_chain)
    out = output.view(total_q, num_heads, head_size)
    tol = 4e-3 if dtype == torch.bfloat16 else 2e-5
    for row in range(total_q):
        torch.testing.assert_close(out[row].double(), want[row], atol=tol, rtol=tol, msg=f"row {row}")


def test_path_rounds_for_slim_trees_and_the_recompute_for_bushy_ones():
    """``_path_plan``: one path per leaf not covered by the leading chain, rounds = the most
    paths of any request, each path laid out right after its context; a star with more paths
    than ``PATHS_MAX_MEAN`` (as many context re-reads per layer) goes to the recompute instead."""
    from vllm_anisotropic.integration.vllm.kernels.attention import PATHS_MAX_MEAN
    from vllm_anisotropic.integration.vllm.engine.runner import TreePlan
    from vllm_anisotropic.tree import DraftTree, FlatTrees

    def plan_for(parents_list, ctx=50, block_size=16):
        trees = [DraftTree(tokens=np.zeros(len(p), dtype=np.int64), parents=np.array(p), values=np.zeros(len(p)))
                 for p in parents_list]
        n = [t.num_nodes - 1 for t in trees]
        q_lens = [k + 1 for k in n]
        seq = [ctx + k for k in n]
        per = -(-max(seq) // block_size)
        meta = SimpleNamespace(seq_lens=torch.tensor(seq, dtype=torch.int32),
                               query_start_loc=torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32),
                               block_table=torch.arange(len(trees) * per, dtype=torch.int32).view(len(trees), per))
        plan = TreePlan(list(range(len(trees))), FlatTrees.from_trees(trees))
        tokens = int(meta.query_start_loc[-1]) + 2  # K/V rows past the last query's (padding)
        return _impl(6, 2, 64)._path_plan(plan, meta, block_size, torch.float32, "vec", tokens), meta

    # chain 1-2-3 with side branches 4 (under the root) and 5 (under node 1): 2 paths
    (rounds, qrows, restore, _), meta = plan_for([[-1, 0, 1, 2, 0, 1]])
    assert len(rounds) == 2
    first = 6 - 5  # query rows: root at 0, nodes 1..5 at rows 1..5

    def writes(slots):  # {K/V row: slot} of one write
        return {row: int(slots[row]) for row in np.flatnonzero(slots.numpy() >= 0)}

    # round 0: path (4) at position 50; round 1: path (1, 5) at 50, 51, querying node 5 only
    assert writes(rounds[0][0]) == {first + 3: 50} and qrows[rounds[0][1]].tolist() == [first + 3]
    assert writes(rounds[1][0]) == {first + 0: 50, first + 4: 51} and qrows[rounds[1][1]].tolist() == [first + 4]
    assert rounds[0][3].tolist() == [51] and rounds[1][3].tolist() == [52]  # context + path length
    assert rounds[0][0].shape == restore.shape == (8,)  # every K/V row of the layer
    assert writes(restore) == {1: 50, 2: 51, 3: 52, 4: 53, 5: 54}
    # a star's first node is its chain (the kernel's row is right): k + 1 leaves, k paths
    assert plan_for([[-1] + [0] * (PATHS_MAX_MEAN + 2)])[0] is None
    assert len(plan_for([[-1] + [0] * (PATHS_MAX_MEAN + 1)])[0][0]) == PATHS_MAX_MEAN


@pytest.mark.parametrize("kwargs, name", [
    ({"sliding_window": 4096}, "sliding windows"),
    ({"alibi_slopes": [0.5, 0.25]}, "ALiBi"),
    ({"logits_soft_cap": 50.0}, "logit soft-capping"),
    ({"sinks": torch.zeros(2)}, "attention sinks"),
])
def test_tree_attention_refuses_what_it_cannot_do_when_built(tiny_model_dir, kwargs, name):
    """Refused as the model is built (before any request), naming the feature; the plain impl
    with the same arguments builds (the control)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    args = dict(num_heads=2, head_size=16, scale=0.25, num_kv_heads=2, alibi_slopes=None, sliding_window=None,
                kv_cache_dtype="auto")
    config = EngineArgs(model=str(tiny_model_dir), enforce_eager=True, max_model_len=512).create_engine_config()
    with set_current_vllm_config(config):
        CPUAttentionBackendImpl(**{**args, **kwargs})
        with pytest.raises(NotImplementedError, match=name):
            TreeCPUAttentionImpl(**{**args, **kwargs})
        TreeCPUAttentionImpl(**args)
