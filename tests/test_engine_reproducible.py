"""Reproducible runs inside real vLLM: the ``deterministic`` engine option.

Without it, the allocator's gate and its online cost model follow measured step times, so two
runs of one workload choose different trees (this test with ``deterministic: false``, two runs:
116 and 182 draft tokens), hence different batch shapes: bf16 results follow the batch shape
(for vLLM's own methods too) and unseeded sampled requests' draws follow the number of sampler
calls, so their outputs may differ from run to run. With ``deterministic: true`` every tree
decision depends on the tokens alone: two runs of one bf16 workload (greedy, seeded and unseeded
sampled requests, the allocator on, four requests at a time) give the same tokens and the same
speculative counters. Fails if any decision still reads a clock (the gate, an online refit, a
start-up fit from timed forwards).

The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): with vLLM's
multiprocess engine core the step at which each request joins depends on when its message
arrives, for plain vLLM as much as with trees (measured: two multiprocess runs of this workload
with trees, 6 of 6 unseeded sampled outputs differing from their second token on; greedy and
seeded ones identical).
"""

from __future__ import annotations

import pytest

from vllm_anisotropic.bench.offline import IN_PROCESS, OfflineJob, run_offline_job

pytestmark = pytest.mark.engine

ENGINE = {"enforce_eager": True, "max_model_len": 512, "max_num_seqs": 4, "max_num_batched_tokens": 8192,
          "dtype": "bfloat16", "seed": 0}


def test_deterministic_runs_repeat_exactly(tiny_prompts):
    from vllm_anisotropic.models import build_tiny_model

    model = str(build_tiny_model(block_std=0.1, lm_head_alpha=0.25))
    kinds = [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.95}, {"temperature": 0.7, "seed": 7}]
    per = [{**kinds[i % 3], **({"seed": 100 + i} if "seed" in kinds[i % 3] else {})} for i in range(12)]
    job = OfflineJob(model=model, prompts=tiny_prompts[:12], per_prompt=per, max_tokens=40, llm_kwargs=ENGINE,
                     speculative_config={"method": "goose", "deterministic": True})
    a, b = run_offline_job(job, env=IN_PROCESS), run_offline_job(job, env=IN_PROCESS)
    print(f"run a {a.spec}, run b {b.spec}")
    assert a.spec.num_accepted_tokens > 40  # trees were verified and accepted
    assert (a.spec.num_drafts, a.spec.num_draft_tokens, a.spec.num_accepted_tokens) == \
        (b.spec.num_drafts, b.spec.num_draft_tokens, b.spec.num_accepted_tokens)
    assert a.token_ids == b.token_ids
