"""Tensor parallelism: GOOSE trees under ``tensor_parallel_size=2`` in real vLLM (CPU build).

Each rank runs its own drafter and must draft the very same tree every step (vLLM schedules
rank 0's draft list on every rank; each rank computes the tree attention of its own heads from
its own tree). Greedy: the tree walk is deterministic given the all-gathered logits. Sampling:
the verifier's uniforms come from a generator seeded alike on every rank (``sampler.py``); a
rank that accepted a different path would draft a different next tree, and ``take_step`` would
raise (the job would fail).

vLLM's CPU backend binds each TP rank's threads to a NUMA node and refuses two ranks on a
one-node machine; ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` binds rank 0 to core 0 and rank 1 to
core 1 instead (2-core machines included).
"""

from __future__ import annotations

import json

import pytest

from vllm_anisotropic.integration.vllm.engine.metrics import STATS_ENV
from vllm_anisotropic.bench.offline import OfflineJob, run_offline_job

pytestmark = pytest.mark.engine

TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
TP2 = {"enforce_eager": True, "max_model_len": 1024, "dtype": "float32", "tensor_parallel_size": 2,
       "distributed_executor_backend": "mp"}
WIDE_GOOSE = {"method": "goose", "bypass": False, "min_branch_score": 0.0, "allocator": "off"}


@pytest.fixture(scope="module")
def job(tiny_prompts):
    from vllm_anisotropic.models import build_tiny_model

    return OfflineJob(model=str(build_tiny_model(block_std=0.1)), prompts=tiny_prompts[:6], max_tokens=32, llm_kwargs=TP2)


def test_tp2_greedy_trees_identical_to_tp2_plain(job, tmp_path):
    plain = run_offline_job(job, env=TP_ENV)
    stats = tmp_path / "stats.json"
    spec = run_offline_job(job.model_copy(update={"speculative_config": WIDE_GOOSE}), env={**TP_ENV, STATS_ENV: str(stats)})
    m = json.loads(stats.read_text())
    assert m["branching_trees"] > 0 and m["accepted_branch_nodes"] > 0, m  # real trees, not chains
    assert spec.spec.num_accepted_tokens > 0
    assert plain.token_ids == spec.token_ids


def test_tp2_sampled_trees_keep_ranks_in_step(job):
    sampled = job.model_copy(update={"temperature": 0.8, "speculative_config": WIDE_GOOSE})
    spec = run_offline_job(sampled, env=TP_ENV)
    assert spec.spec.num_accepted_tokens > 0
    assert all(len(r[0]) == 32 for r in spec.token_ids)
