"""K/V slot moves after tree acceptance (``integration/vllm/engine/kv_moves.py``): which rows move, and
the moves themselves in vLLM's real CPU cache layouts (written by vLLM's own
``cpu_attn_reshape_and_cache``) and in FLASH_ATTN's layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from random_trees import random_paths, random_trees
from vllm_anisotropic import kernels
from vllm_anisotropic.integration.vllm.engine.kv_moves import KVMover
from vllm_anisotropic.tree import DraftTree, FlatTrees


def _emit(trees: FlatTrees, paths, node_rows, bonus, width: int = 8):
    """``kernels.emit.emit_rows`` on trees 0..T-1 (batch rows 2t: odd rows have no tree) with
    ``paths`` accepted: ``(rows [2T, width], on_path, src, dst)``."""
    num = np.array([len(p) for p in paths], np.int64)
    accepted = np.full((len(paths), max(1, int(num.max(initial=0)))), -1, np.int64)
    for t, p in enumerate(paths):
        accepted[t, : len(p)] = p
    out = np.full((2 * len(paths), width), 99, np.int32)
    on_path = np.zeros(trees.num_nodes, bool)
    src, dst = np.empty(int(num.sum()), np.int64), np.empty(int(num.sum()), np.int64)
    m = kernels.load("emit").emit_rows(trees.tokens, trees.offsets, np.arange(len(paths)), 2 * np.arange(len(paths)),
                                       accepted, num, np.asarray(bonus, np.int64), np.asarray(node_rows, np.int64),
                                       out, on_path, src, dst)
    return out, on_path, src[:m], dst[:m]


def accepted_moves(paths, node_rows):
    """The moves of the module docstring: path entry j (depth j + 1) at node n_j != j + 1 moves
    query row ``node_rows[t] + n_j - 1`` to ``node_rows[t] + j``."""
    moves = [(r + n - 1, r + j) for p, r in zip(paths, node_rows) for j, n in enumerate(p) if n != j + 1]
    return [s for s, _ in moves], [d for _, d in moves]


def test_emitted_rows_paths_and_moves_worked_example_and_edges():
    chain = DraftTree([5, 6, 7, 8, 9, 4], [-1, 0, 1, 2, 3, 4])
    fork = DraftTree([5, 6, 7, 8], [-1, 0, 0, 2])
    out, on_path, src, dst = _emit(FlatTrees.from_trees([fork, chain]), [[2, 3], [1, 2, 5]], [10, 4], [11, 12])
    assert src.tolist() == [11, 12, 8] and dst.tolist() == [10, 11, 6]  # chain: nodes 1, 2 in place
    assert out[0].tolist() == [7, 8, 11, -1, -1, -1, -1, -1] and out[2].tolist() == [6, 7, 4, 12, -1, -1, -1, -1]
    assert (out[1] == 99).all() and (out[3] == 99).all()  # rows without a tree are not written
    assert np.flatnonzero(on_path).tolist() == [2, 3, 5, 6, 9]
    out, on_path, src, dst = _emit(FlatTrees.from_trees([fork]), [[]], [10], [3], width=3)  # nothing accepted
    assert out[0].tolist() == [3, -1, -1] and not on_path.any() and src.size == 0


def test_emitted_rows_paths_and_moves_follow_their_definitions_on_random_batches():
    rng = np.random.default_rng(0)
    for _ in range(300):
        trees = random_trees(rng)
        paths = random_paths(rng, trees)
        flat = FlatTrees.from_trees(trees)
        node_rows = rng.integers(0, 100, len(trees))
        bonus = rng.integers(0, 50, len(trees))
        out, on_path, src, dst = _emit(flat, paths, node_rows, bonus, width=10)
        for t, (tree, p) in enumerate(zip(trees, paths)):
            want = [int(tree.tokens[n]) for n in p] + [int(bonus[t])]
            assert out[2 * t].tolist() == want + [-1] * (10 - len(want))
        want_path = np.zeros(flat.num_nodes, bool)
        for t, p in enumerate(paths):
            want_path[[int(flat.offsets[t]) + n for n in p]] = True
        assert (on_path == want_path).all()
        assert (src.tolist(), dst.tolist()) == accepted_moves(paths, node_rows.tolist())


def _cpu_layouts():
    from vllm_anisotropic.integration.vllm.kernels.attention import kv_layout

    out = []
    for isa in ("vec", "vec16", "amx"):
        for dtype in (torch.bfloat16, torch.float32):
            try:
                kv_layout(isa, dtype, 32, 64)
                out.append((isa, dtype))
            except Exception:  # noqa: BLE001 - an ISA / dtype this CPU build does not have
                continue
    return out


def _read(cache, isa, slots, num_heads, head_size):
    """K and V of ``slots`` as ``[M, H, head_size]`` each, through the probed layout."""
    from vllm_anisotropic.integration.vllm.kernels.attention import kv_layout

    block_size = cache.shape[2]
    k_off, v_off, _, _ = kv_layout(isa, cache.dtype, block_size, head_size)
    region = cache.view(cache.shape[0], num_heads, -1)
    b, t = slots // block_size, slots % block_size
    k = torch.stack([region[int(bb), :, k_off[int(tt)]] for bb, tt in zip(b, t)])
    v = torch.stack([region[int(bb), :, v_off[int(tt)]] for bb, tt in zip(b, t)])
    return k, v


@pytest.mark.parametrize("isa,dtype", _cpu_layouts())
def test_moves_in_vllm_cpu_layouts(isa, dtype):
    """Slots written by vLLM's own CPU cache writer; the path [2, 3, 5] of a tree whose node 1
    sits at slot 40 (blocks of 32: the tree crosses a block boundary): slots 40, 41, 42 get
    nodes 2, 3, 5's K/V (sources read before destinations: 41 is both), the rest is untouched."""
    from vllm import _custom_ops as ops

    num_blocks, heads, block_size, head_size = 4, 3, 32, 64
    cache = torch.zeros(num_blocks, heads, block_size, 2 * head_size, dtype=dtype)
    kc, vc = cache.view(num_blocks, heads, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.arange(num_blocks * block_size)
    k = torch.randn(slots.numel(), heads, head_size).to(dtype)
    v = torch.randn(slots.numel(), heads, head_size).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    layer = type("Layer", (), {})()
    layer.kv_cache, layer.isa = cache, isa
    shared = type("Layer", (), {})()
    shared.kv_cache, shared.isa = cache, isa  # a second layer on the same tensor: moved once
    mover = KVMover.from_layers([layer, shared])
    assert len(mover.caches) == 1
    src, dst = accepted_moves([[2, 3, 5]], [40])
    mover.move(torch.tensor(src), torch.tensor(dst))
    want_k, want_v = k.clone(), v.clone()
    want_k[[40, 41, 42]] = k[[41, 42, 44]]
    want_v[[40, 41, 42]] = v[[41, 42, 44]]
    got_k, got_v = _read(cache, isa, slots, heads, head_size)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_moves_in_the_flash_attention_layout():
    """FLASH_ATTN's cache as vLLM 0.32 hands it to the backend: K and V of slot s are
    ``kv_cache.transpose(1, 2).split(head_size, -1)`` at ``[s // block, s % block]``."""
    num_blocks, heads, block_size, head_size = 3, 2, 16, 8
    cache = torch.randn(num_blocks, heads, block_size, 2 * head_size)
    before = cache.clone()
    layer = type("Layer", (), {})()
    layer.kv_cache = cache
    KVMover.from_layers([layer]).move(torch.tensor([17, 18, 30]), torch.tensor([16, 17, 18]))

    def kv(c, s):
        key, value = c.transpose(1, 2).split(head_size, dim=-1)
        return key[s // block_size, s % block_size], value[s // block_size, s % block_size]

    for dst, src in ((16, 17), (17, 18), (18, 30)):
        assert all(torch.equal(a, b) for a, b in zip(kv(cache, dst), kv(before, src)))
    untouched = [s for s in range(num_blocks * block_size) if s not in (16, 17, 18)]
    assert all(torch.equal(a, b) for s in untouched for a, b in zip(kv(cache, s), kv(before, s)))


def test_layers_of_different_shapes_each_move_their_own_elements():
    """Layers of one layout share its offsets but not their element indices when their shapes
    differ (3 and 2 kv heads, two block sizes): each cache moves exactly its own slots."""
    shapes = [(3, 3, 16, 16), (3, 2, 16, 16), (2, 3, 32, 16), (3, 3, 16, 16)]
    layers = []
    for shape in shapes:
        layer = type("Layer", (), {})()
        layer.kv_cache = torch.randn(*shape)
        layers.append(layer)
    before = [layer.kv_cache.clone() for layer in layers]
    mover = KVMover.from_layers(layers)
    assert len(mover.caches) == 4 and mover.caches[0][1] is mover.caches[1][1]  # one layout, one offset tensor
    mover.move(torch.tensor([20, 5]), torch.tensor([19, 20]))
    for layer, old in zip(layers, before):
        cache, head_size = layer.kv_cache, layer.kv_cache.shape[-1] // 2
        block_size = cache.shape[2]
        want = old.clone()
        for dst, src in ((19, 20), (20, 5)):
            want[dst // block_size, :, dst % block_size] = old[src // block_size, :, src % block_size]
        assert torch.equal(cache, want)


def test_layers_without_a_cache_are_skipped_and_one_token_moves():
    """Modules without a cache, with a cache of another rank or an empty one hold no slots; a
    single accepted token's move (the common one) is carried out, not skipped as empty."""
    layers = []
    for cache in (None, torch.zeros(4, 8), torch.zeros(0, 2, 16, 8), torch.randn(3, 2, 16, 8)):
        layer = type("Layer", (), {})()
        layer.kv_cache = cache
        layers.append(layer)
    mover = KVMover.from_layers(layers)
    assert len(mover.caches) == 1 and mover.caches[0][0] is layers[-1].kv_cache
    before = layers[-1].kv_cache.clone()
    mover.move(torch.tensor([20]), torch.tensor([17]))
    want = before.clone()
    want[1, :, 1] = before[1, :, 4]
    assert torch.equal(layers[-1].kv_cache, want)


def test_a_cpu_layer_gets_its_probed_layout():
    """A CPU layer (vLLM's ``isa`` on it) of a shape no test probed before: the mover holds the
    layout ``kv_layout`` probes for that ISA, dtype, block and head size."""
    from vllm_anisotropic.integration.vllm.kernels.attention import kv_layout

    layer = type("Layer", (), {})()
    layer.kv_cache, layer.isa = torch.zeros(2, 1, 16, 2 * 48, dtype=torch.bfloat16), "vec"
    (_, k_off, v_off), = KVMover.from_layers([layer]).caches
    want_k, want_v, _, _ = kv_layout("vec", torch.bfloat16, 16, 48)
    assert torch.equal(k_off, want_k) and torch.equal(v_off, want_v)


def _layers(caches: list[torch.Tensor]) -> list:
    """Stand-ins of attention layers holding ``caches`` (``kv_cache`` is all the mover reads)."""
    out = []
    for cache in caches:
        layer = type("Layer", (), {})()
        layer.kv_cache = cache
        out.append(layer)
    return out


def _reference_move(cache: torch.Tensor, src: list[int], dst: list[int]) -> torch.Tensor:
    """The moved cache by the definition: every source's K/V (a slot's ``[heads, 2 * head_size]``
    row of a plain-layout cache) read first, then written to its destination."""
    block_size = cache.shape[2]
    want = cache.clone()
    rows = [cache[s // block_size, :, s % block_size].clone() for s in src]
    for d, row in zip(dst, rows):
        want[d // block_size, :, d % block_size] = row
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_and_device_moves_agree_with_the_definition(dtype):
    """The CPU moves (one compiled call per layout, ``kernels/kv.py``) and the device moves
    (``gather_scatter``: torch gathers and scatters, run here on CPU tensors) both give the
    definition's cache, in every layer of the group and in each dtype's bits: a chain of moves
    where each source is the previous move's destination (16 -> 17 -> 18, read before written,
    in any order of the moves), a move across blocks, a slot onto itself."""
    from vllm_anisotropic.integration.vllm.engine.kv_moves import gather_scatter

    gen = torch.Generator().manual_seed(3)
    shape = (4, 3, 16, 2 * 8)
    src, dst = [16, 17, 40, 9], [17, 18, 3, 9]
    for compiled in (True, False):
        caches = [torch.randn(*shape, generator=gen).to(dtype) for _ in range(3)]
        before = [c.clone() for c in caches]
        mover = KVMover.from_layers(_layers(caches))
        s, d = torch.tensor(src), torch.tensor(dst)
        if compiled:
            mover.move(s, d)
        else:
            gather_scatter(mover.caches, s, d)
        for cache, old in zip(caches, before):
            assert torch.equal(cache.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               _reference_move(old, src, dst).view(torch.int16 if dtype != torch.float32
                                                                   else torch.int32)), (compiled, dtype)


def test_caches_of_two_element_sizes_move_in_their_own_groups():
    """A float32 and a bf16 layer of one shape: two compiled groups (one per element size),
    each cache moved exactly once, each exactly by the definition."""
    caches = [torch.randn(3, 2, 16, 16), torch.randn(3, 2, 16, 16).to(torch.bfloat16), torch.randn(3, 2, 16, 16)]
    before = [c.clone() for c in caches]
    mover = KVMover.from_layers(_layers(caches))
    mover.move(torch.tensor([20, 33]), torch.tensor([19, 20]))
    assert len(mover._host_groups) == 2 and sorted(len(g[0]) for g in mover._host_groups) == [1, 2]
    for cache, old in zip(caches, before):
        assert torch.equal(cache, _reference_move(old, [20, 33], [19, 20]))
    mover.move(torch.tensor([5]), torch.tensor([4]))  # the groups are built once and kept
    assert torch.equal(caches[1], _reference_move(_reference_move(before[1], [20, 33], [19, 20]), [5], [4]))


def test_a_slot_outside_the_caches_is_refused_and_nothing_moves():
    """The compiled moves write without bounds checks: a slot past the smallest cache's last
    (or a negative one) raises before anything is written."""
    caches = [torch.randn(3, 2, 16, 16), torch.randn(2, 2, 16, 16)]  # 48 and 32 slots
    before = [c.clone() for c in caches]
    mover = KVMover.from_layers(_layers(caches))
    for src, dst in (([31, 32], [1, 2]), ([1], [32]), ([-1], [0])):
        with pytest.raises(ValueError, match="outside the caches"):
            mover.move(torch.tensor(src), torch.tensor(dst))
    assert all(torch.equal(a, b) for a, b in zip(caches, before))
    mover.move(torch.tensor([31]), torch.tensor([0]))  # the last slot of the smaller cache
    assert torch.equal(caches[1][0, :, 0], before[1][1, :, 15])


_TRITON_MOVES = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_kv_moves import _reference_move
from vllm_anisotropic.attention.kv_move_triton import layer_offsets, move_slots
gen = torch.Generator().manual_seed(5)
src, dst = [16, 17, 40, 9, 2], [17, 18, 3, 9, 47]
for dtype in (torch.bfloat16, torch.float32):
    # three separate allocations (offsets from the first, one negative at least once), head size 12
    caches = [torch.randn(3, 3, 16, 2 * 12, generator=gen).to(dtype) for _ in range(3)]
    before = [c.clone() for c in caches]
    offsets = layer_offsets(caches)
    move_slots(caches, offsets, torch.tensor(src), torch.tensor(dst))
    for cache, old in zip(caches, before):
        assert torch.equal(cache, _reference_move(old, src, dst)), dtype
    move_slots(caches, offsets, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    for cache, old in zip(caches, before):
        assert torch.equal(cache, _reference_move(old, src, dst)), "an empty move changed a cache"
for bad in ([torch.zeros(3, 3, 16, 24), torch.zeros(3, 3, 8, 24)],
            [torch.zeros(3, 3, 16, 24), torch.zeros(3, 16, 3, 24).transpose(1, 2)]):
    try:
        layer_offsets(bad)
    except ValueError as e:
        print("refused:", e)
    else:
        raise AssertionError("layer_offsets took caches it cannot address")
print("ok")
"""


def test_triton_moves_follow_the_definition_in_the_interpreter():
    """The CUDA path's two Triton launches (``attention/kv_move_triton.py``), run by Triton's
    interpreter on CPU tensors in a fresh process (``TRITON_INTERPRET`` is read at import): in
    three caches of separate allocations addressed from the first one's pointer, bf16 and float32,
    a head size whose run (24) is not a power of two, the definition's cache for a chain of moves
    (16 -> 17 -> 18: a one-launch copy would read 17 after writing it), a move across blocks,
    a slot onto itself; an empty move changes nothing; caches of two shapes and a non-contiguous
    cache are refused by ``layer_offsets``."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _TRITON_MOVES, os.path.dirname(__file__)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
    assert out.stdout.count("refused:") == 2


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_threaded_moves_give_the_definition_for_any_parts(parts):
    """``move_slots_threads`` cuts the caches (5 layers) into ``parts`` contiguous parts, one a
    thread, each with its own buffer: every cache equals the definition's, parts uneven (2, 3),
    one layer a part and more parts than layers (7: empty parts). A chain of moves (16 -> 17 ->
    18: each source the previous destination, read before written), a move across blocks and a
    slot onto itself. A bound off by one skips a layer or moves one twice (the chain then moves
    on: 18 gets 16's K/V). A slot outside the caches raises before any part writes (the caches
    are left as they were); a model of one layer moves too."""
    gen = torch.Generator().manual_seed(parts)
    caches = [torch.randn(4, 3, 16, 2 * 8, generator=gen).to(torch.bfloat16) for _ in range(5)]
    before = [c.clone() for c in caches]
    mover = KVMover.from_layers(_layers(caches))
    mover.move(torch.tensor([0]), torch.tensor([0]))  # builds the groups (slot 0 onto itself)
    (views, k_off, v_off, shape), = mover._host_groups
    src, dst = [16, 17, 40, 9], [17, 18, 3, 9]
    kernels.load("kv").move_slots_threads(views, np.array(src), np.array(dst), k_off, v_off, *shape, parts)
    for cache, old in zip(caches, before):
        assert torch.equal(cache.view(torch.int16), _reference_move(old, src, dst).view(torch.int16))
    moved = [c.clone() for c in caches]
    with pytest.raises(ValueError, match="outside the caches"):  # checked before any part writes
        kernels.load("kv").move_slots_threads(views, np.array([1, 64]), np.array([2, 3]), k_off, v_off, *shape, parts)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(caches, moved))
    one = torch.randn(4, 3, 16, 2 * 8, generator=gen).to(torch.bfloat16)  # a model of one layer moves too
    old = one.clone()
    single = KVMover.from_layers(_layers([one]))
    single.move(torch.tensor([0]), torch.tensor([0]))  # builds its group
    views = single._host_groups[0][0]
    kernels.load("kv").move_slots_threads(views, np.array(src), np.array(dst), k_off, v_off, *shape, parts)
    assert torch.equal(one.view(torch.int16), _reference_move(old, src, dst).view(torch.int16))
