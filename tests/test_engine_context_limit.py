"""Requests near ``max_model_len`` in a batch with others, in real vLLM (CPU build), float32.

vLLM 0.32 skips the drafter for the *whole batch* when any request is within
``num_speculative_tokens`` of ``max_model_len`` (``GPUModelRunner._input_fits_in_drafter``:
its drafters run a forward of that many tokens) and then hands the scheduler
``num_speculative_tokens`` zero drafts for every request. With GOOSE (59 drafts) and
``max_model_len`` 256 that is every step once one request reaches 197 tokens: the soak test
(``test_engine_soak.py``) saw ~2,000 zero drafts a step, throughput collapse, and greedy
outputs different from plain vLLM. The tree runner overrides the check (its drafter sizes each
tree to its own request's room), so vLLM's zero-draft path never runs.

What this test would catch: the override removed or bypassed (zero drafts scheduled: vLLM's
draft counter exceeds the nodes of verified trees, and the trees stop while the long request
runs), and any loss of greedy identity next to a request at the limit.
"""

from __future__ import annotations

import json

import pytest

from vllm_anisotropic.integration.vllm.engine.metrics import STATS_ENV
from vllm_anisotropic.bench.offline import IN_PROCESS, OfflineJob, run_offline_job

pytestmark = pytest.mark.engine

MAX_MODEL_LEN = 256
MAX_TOKENS = 40
# Trees every step whatever this machine's speed: with the allocator on, its cost model may price
# every node above its worth next to two 216-token contexts (CI run of 3992587: 58 of 58 steps
# plain, no tree to test the override with). The allocator has its own tests.
GOOSE = {"method": "goose", "allocator": "off"}
ENGINE_KWARGS = {"enforce_eager": True, "max_model_len": MAX_MODEL_LEN, "dtype": "float32"}


@pytest.fixture(scope="module")
def model_dir():
    from vllm_anisotropic.models import build_tiny_model

    return str(build_tiny_model())


@pytest.fixture(scope="module")
def prompt_ids(model_dir, tiny_prompts):
    """Six short prompts and two that end exactly at ``max_model_len`` after MAX_TOKENS tokens
    (so for most of the batch's life some request is within 59 tokens of the limit)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok(t)["input_ids"] for t in tiny_prompts]
    long = [t for p in ids for t in p]
    short = [p[:48] for p in ids[:6]]
    return short[:3] + [long[: MAX_MODEL_LEN - MAX_TOKENS], long[100 : 100 + MAX_MODEL_LEN - MAX_TOKENS]] + short[3:]


def _job(model_dir, prompt_ids, spec=None):
    return OfflineJob(model=model_dir, prompt_token_ids=prompt_ids, max_tokens=MAX_TOKENS, speculative_config=spec,
                      llm_kwargs={**ENGINE_KWARGS, "max_num_seqs": len(prompt_ids)})


def test_greedy_next_to_requests_at_the_context_limit(model_dir, prompt_ids, tmp_path):
    plain = run_offline_job(_job(model_dir, prompt_ids), env=IN_PROCESS)
    stats = tmp_path / "tree.json"
    res = run_offline_job(_job(model_dir, prompt_ids, GOOSE), env={**IN_PROCESS, STATS_ENV: str(stats)})
    tree = json.loads(stats.read_text())
    assert [len(t[0]) for t in plain.token_ids][3:5] == [MAX_TOKENS, MAX_TOKENS]  # they reach the limit
    assert res.token_ids == plain.token_ids
    # every draft vLLM scheduled was a node of a verified tree (no zero drafts of vLLM's own)
    assert res.spec.num_draft_tokens == tree["draft_nodes"] > 0, (res.spec, tree)
    assert tree["accepted_nodes"] == res.spec.num_accepted_tokens, (res.spec, tree)
