"""tau inside vLLM equals tau of the exact harness, step by step (greedy is deterministic).

One engine run (real vLLM CPU build, 8 concurrent requests, float32, GOOSE with one adjacency
table per request) on the tiny Llama whose text is not a pure cycle, against the harness
(``bench.harness``, Hugging Face transformers) started the way vLLM starts. Every prompt must
produce the same output tokens and the same accepted length at every verification step; the
drafter's metrics file must agree with vLLM's own spec counters.
"""

from __future__ import annotations

import json

import pytest
import torch

from vllm_anisotropic.bench.crosscheck import compare, run_engine, run_harness
from vllm_anisotropic.bench.harness import load_model
from vllm_anisotropic.integration.vllm.engine.metrics import STATS_ENV, TRACE_ENV
from vllm_anisotropic.bench.offline import IN_PROCESS, OfflineJob, run_offline_job

pytestmark = pytest.mark.engine

MAX_TOKENS = 48
OPTIONS = {"shared_table": False}


@pytest.fixture(scope="module")
def setup(tiny_prompts):
    from vllm_anisotropic.models import build_tiny_model

    model_dir = build_tiny_model(block_std=0.1)
    model, tok = load_model(model_dir, "cpu", torch.float32)
    prompts = [tok.encode(p, add_special_tokens=False) for p in tiny_prompts[:8]]
    return model_dir, model, tok, prompts


def test_engine_and_harness_accept_the_same_tokens_at_every_step(setup):
    model_dir, model, tok, prompts = setup
    result, e_traces = run_engine(model_dir, prompts, MAX_TOKENS, "goose", OPTIONS)
    h_tokens, h_traces = run_harness(model, prompts, MAX_TOKENS, "goose", OPTIONS, [tok.eos_token_id])
    rows = compare(e_traces, h_traces)
    assert all(len(t) > 0 for t in e_traces), e_traces  # every request was traced
    assert sum(sum(t) for t in e_traces) > 0, "no draft was ever accepted: the check would be vacuous"
    assert [r[0] for r in result.token_ids] == h_tokens
    assert all(r["equal"] for r in rows), rows
    # the drafter's counters see what vLLM's counters see
    assert sum(sum(t) for t in e_traces) == result.spec.num_accepted_tokens


def test_metrics_file_counts_sources_consistently(setup, tmp_path):
    model_dir, _, _, prompts = setup
    stats_file = tmp_path / "stats.json"
    job = OfflineJob(model=str(model_dir), prompt_token_ids=prompts[:4], max_tokens=MAX_TOKENS,
                     speculative_config={"method": "goose", "allocator": "off"}, llm_kwargs={"enforce_eager": True, "max_model_len": 1024})
    result = run_offline_job(job, env={**IN_PROCESS, STATS_ENV: str(stats_file), TRACE_ENV: "0"})
    m = json.loads(stats_file.read_text())
    assert m["requests"] == {}  # traces off
    assert m["accepted_nodes"] == result.spec.num_accepted_tokens > 0
    assert m["accepted_nodes"] == m["accepted_spine_nodes"] + m["accepted_branch_nodes"]
    assert m["draft_nodes"] == m["spine_nodes"] + m["branch_nodes"] == result.spec.num_draft_tokens
    assert m["steps"] == m["verified_trees"] + m["plain_steps"]
    assert m["spine_nodes"] > 0 and m["branch_nodes"] > 0
