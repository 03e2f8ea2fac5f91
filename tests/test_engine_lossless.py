"""GOOSE in real vLLM is lossless under the engine features that cut, pause or fork requests.

One tiny-Llama workload (17 prompts, 96 greedy tokens, float32) on a tight engine:

* a KV cache of ~2,300 tokens for 16 requests that need ~4,000 with their trees -> vLLM
  preempts requests (asserted through ``vllm:num_preemptions``) and re-runs them;
* ``max_num_batched_tokens`` 256 -> a 441-token prompt is prefilled in chunks (and shorter
  ones whenever a step's budget runs out mid-prompt);
* a stop string and a stop token id taken from the middle of plain vLLM's own outputs -> they
  land inside accepted tree paths, and vLLM must cut there exactly as in plain decoding.

Three engine runs: plain without stops (to pick the stops), plain with stops, GOOSE with stops;
the last two must match token for token, with the same finish reasons, and leave every KV block
back in the free pool (``vllm:kv_cache_usage_perc`` 0 at the end). (vLLM allows ``n > 1`` only
when sampling: that is covered in test_engine_sampling.py.)
"""

from __future__ import annotations

import pytest

from vllm_anisotropic.bench.offline import IN_PROCESS, OfflineJob, run_offline_job

pytestmark = pytest.mark.engine

ENGINE = {"enforce_eager": True, "max_model_len": 1024, "dtype": "float32", "kv_cache_memory_bytes": 2_400_000,
          "max_num_batched_tokens": 256}
WIDE_GOOSE = {"method": "goose", "bypass": False, "min_branch_score": 0.0, "allocator": "off"}


@pytest.fixture(scope="module")
def setup(tiny_prompts):
    from vllm_anisotropic.data import load_dataset
    from vllm_anisotropic.models import build_tiny_model

    model = str(build_tiny_model(block_std=0.1))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    # 16 real prompts (26-239 tokens) + one long prompt, which the 256-token step budget must
    # prefill in chunks
    long_prompt = "\n\n".join(tiny_prompts[:4])
    assert len(tok.encode(long_prompt)) > ENGINE["max_num_batched_tokens"]
    prompts = tiny_prompts + [p.text for p in load_dataset("mbpp", limit=4)] + [long_prompt]
    base = OfflineJob(model=model, prompts=prompts, max_tokens=96, llm_kwargs=ENGINE)
    free = run_offline_job(base, env=IN_PROCESS)
    # stops from plain outputs: request 1's text around token 20, request 3's token 30
    stop_text = tok.decode(free.token_ids[1][0][20:22])
    stop_id = free.token_ids[3][0][30]
    return base.model_copy(update={"stop": [stop_text], "stop_token_ids": [stop_id]})


@pytest.fixture(scope="module")
def plain(setup):
    """Plain vLLM with the stops: the reference of both tests."""
    return run_offline_job(setup, env=IN_PROCESS)


def test_stops_preemption_and_chunked_prefill_are_lossless(setup, plain):
    spec = run_offline_job(setup.model_copy(update={"speculative_config": WIDE_GOOSE}), env=IN_PROCESS)
    assert spec.counters.get("vllm:num_preemptions", 0) > 0, spec.counters  # preemption happened
    assert spec.spec.num_accepted_tokens > 0
    reasons = [r for req in plain.finish_reasons for r in req]
    assert reasons.count("stop") >= 2 and "length" in reasons, reasons  # stops really fired
    for i, (a, b) in enumerate(zip(plain.token_ids, spec.token_ids)):
        assert a == b, f"prompt {i}: plain {a} vs goose {b}"
    assert plain.finish_reasons == spec.finish_reasons
    assert plain.texts == spec.texts
    # every KV block back in the free pool once the requests are done (none leaked by a tree
    # step cut short by a stop, a preemption or a rollback)
    assert spec.gauges["vllm:kv_cache_usage_perc"] == plain.gauges["vllm:kv_cache_usage_perc"] == 0.0, \
        (spec.gauges, plain.gauges)


def test_slim_trees_by_path_rounds_are_lossless(setup, plain):
    """Trees of at most 5 draft nodes (budget 6) have at most 5 paths below their leading chain,
    so every step's tree rows take the path rounds through vLLM's kernel
    (attention.TreeCPUAttentionImpl._tree_rows_paths, PATHS_MAX_MEAN 6), under the same
    preemptions, chunked prefills and stops; the wide test above takes the recompute."""
    from vllm_anisotropic.integration.vllm.kernels.attention import PATHS_MAX_MEAN

    budget = 6
    assert budget - 1 <= PATHS_MAX_MEAN
    spec = run_offline_job(setup.model_copy(update={"speculative_config": {**WIDE_GOOSE, "budget": budget}}), env=IN_PROCESS)
    assert spec.counters.get("vllm:num_preemptions", 0) > 0, spec.counters
    assert spec.spec.num_accepted_tokens > 0
    for i, (a, b) in enumerate(zip(plain.token_ids, spec.token_ids)):
        assert a == b, f"prompt {i}: plain {a} vs goose B = {budget} {b}"
    assert plain.finish_reasons == spec.finish_reasons
