"""KV repair by copy (integration/vllm/kv_copy.py) on a real vLLM CPU cache layout: after
``move_kv`` every destination slot holds exactly the source slot's K and V (as written by
vLLM's own cache op), for overlapping moves too, and no other slot changes."""

from __future__ import annotations

import pytest
import torch

from vllm_anisotropic.integration.vllm.kv_copy import move_kv, path_moves


def test_path_moves_skip_in_place_nodes():
    assert path_moves(40, [1, 4, 9]) == [(44, 42), (49, 43)]
    assert path_moves(0, [1, 2, 3]) == []


@pytest.mark.parametrize("isa", ["vec"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_kv_matches_cache_writer(isa, dtype):
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    num_blocks, num_kv_heads, block_size, head_size = 6, 2, 32, 64
    cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, num_kv_heads, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.randperm(num_blocks * block_size)[:80]
    keys = torch.randn(80, num_kv_heads, head_size).to(dtype)
    values = torch.randn(80, num_kv_heads, head_size).to(dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    before = cache.clone()
    # path [2, 3, 6] below a root at index 0: index 1 <- 2, 2 <- 3 (overlapping), 3 <- 6
    moves = path_moves(0, [2, 3, 6])
    src = slots[torch.tensor([s for s, _ in moves])]
    dst = slots[torch.tensor([d for _, d in moves])]
    move_kv([(cache, isa)], src, dst)

    def read(c, slot_list):  # K, V of physical slots, located with the probed layout
        out_k, out_v = [], []
        for s in slot_list.tolist():
            out_k.append(_read_slot(c, s, block_size, head_size, isa, 0))
            out_v.append(_read_slot(c, s, block_size, head_size, isa, 1))
        return torch.stack(out_k), torch.stack(out_v)

    k_src, v_src = read(before, src)
    k_dst, v_dst = read(cache, dst)
    assert torch.equal(k_src, k_dst) and torch.equal(v_src, v_dst)
    assert torch.equal(k_dst, keys[torch.tensor([2, 3, 6])].float())
    # nothing but the destination slots changed
    untouched = [s for s in range(num_blocks * block_size) if s not in set(dst.tolist())]
    for s in untouched[::7]:
        assert torch.equal(_read_slot(cache, s, block_size, head_size, isa, 0), _read_slot(before, s, block_size, head_size, isa, 0))
        assert torch.equal(_read_slot(cache, s, block_size, head_size, isa, 1), _read_slot(before, s, block_size, head_size, isa, 1))


def _read_slot(cache, slot, block_size, head_size, isa, which):
    from vllm_anisotropic.integration.vllm.attention import kv_layout

    k_off, v_off, _, _ = kv_layout(isa, cache.dtype, block_size, head_size)
    off = (k_off if which == 0 else v_off)[slot % block_size]
    flat = cache.view(cache.shape[0], cache.shape[1], -1)
    return flat[slot // block_size][:, off].float()  # [num_kv_heads, head_size]


@pytest.mark.engine
def test_copy_repair_in_vllm_is_greedy_identical(tiny_prompts, tmp_path):
    """GOOSE with wide trees and ``kv_repair="copy"`` in real vLLM (float32): identical to plain
    decoding, with accepted paths off the first chain (so moves really happened)."""
    import json

    from vllm_anisotropic.integration.vllm.metrics import STATS_ENV
    from vllm_anisotropic.integration.vllm.offline import OfflineJob, run_offline_job
    from vllm_anisotropic.models import build_tiny_model

    job = OfflineJob(model=str(build_tiny_model(block_std=0.1)), prompts=tiny_prompts[:8], max_tokens=48,
                     llm_kwargs={"enforce_eager": True, "max_model_len": 1024, "dtype": "float32"})
    plain = run_offline_job(job)
    stats = tmp_path / "stats.json"
    wide_copy = {"method": "goose", "bypass": False, "min_branch_score": 0.0, "kv_repair": "copy"}
    spec = run_offline_job(job.model_copy(update={"speculative_config": wide_copy}), env={STATS_ENV: str(stats)})
    m = json.loads(stats.read_text())
    assert m["accepted_off_chain"] > 0 and m["rerun_tokens"] > 0, m
    assert plain.token_ids == spec.token_ids
