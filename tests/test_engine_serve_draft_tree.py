"""``vllm serve TARGET --speculative-config '{"method": "draft_tree", "model": DRAFT, ...}'``: the
draft-model tree method through the real console script, HTTP server and ``openai`` client
(tiny target + tiny draft sharing the tokenizer, float32):

* a batched greedy completion is token-identical to plain offline vLLM, and the server's
  ``/metrics`` counts drafts and accepted tokens (the trees ran and were accepted);
* a sampled request (T 0.7, top-p 0.9, Traversal) runs to its length through the same server;
* a misspelled key is refused at start-up with the valid keys named, before vLLM loads a model.

The server runs with ``"allocator": "off"``: with the allocator on, whether it keeps any of the
draft model's trees depends on the start-up cost sweep's timings on the machine (CI, stop 39: it
kept 2 trees in 32 steps, none accepted, where this machine kept 38 with 11 accepted), and this
file tests the HTTP path of the method, not the allocator (tests/test_engine_allocator.py).
"""

from __future__ import annotations

import json
import subprocess
import sysconfig
from pathlib import Path

import pytest

from test_engine_serve import _metric_total
from vllm_anisotropic.bench.offline import IN_PROCESS, OfflineJob, run_offline_job
from vllm_server import http_get, serving, wait_healthy

pytestmark = pytest.mark.engine

MAX_TOKENS = 32
STARTUP_TIMEOUT = 300.0
SCRIPTS = Path(sysconfig.get_path("scripts"))
FLAGS = ["--enforce-eager", "--max-model-len", "512", "--kv-cache-memory-bytes", str(512 << 20), "--dtype", "float32"]
SHAPE = {"trunk": 2, "branches": 2, "branch_length": 2, "verifier": "traversal", "allocator": "off"}


@pytest.fixture(scope="module")
def pair() -> tuple[str, str]:
    from vllm_anisotropic.models import build_tiny_model

    return (str(build_tiny_model(block_std=0.1, lm_head_alpha=0.25)),
            str(build_tiny_model(block_std=0.12, lm_head_alpha=0.25)))


@pytest.fixture(scope="module")
def prompts(tiny_prompts) -> list[str]:
    return tiny_prompts[:2] + tiny_prompts[6:8]


@pytest.fixture(scope="module")
def launched(pair, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve_dtree") / "server.log"
    with serving(pair[0], {"method": "draft_tree", "model": pair[1], **SHAPE}, FLAGS, log_path) as (proc, base):
        yield proc, base, log_path


@pytest.fixture(scope="module")
def plain(launched, pair, prompts):
    """Plain offline vLLM, float32: the greedy reference (runs while the server starts)."""
    return run_offline_job(OfflineJob(model=pair[0], prompts=prompts, max_tokens=MAX_TOKENS,
                                      llm_kwargs={"enforce_eager": True, "max_model_len": 512, "dtype": "float32"}),
                           env=IN_PROCESS)


@pytest.fixture(scope="module")
def client(launched):
    import openai

    proc, base, log_path = launched
    wait_healthy(proc, base, log_path, STARTUP_TIMEOUT)
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=180, max_retries=0)


def test_greedy_completions_identical_to_plain_and_trees_accepted(launched, client, plain, prompts):
    model = client.models.list().data[0].id
    resp = client.completions.create(model=model, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"return_token_ids": True})
    got = [c.token_ids for c in sorted(resp.choices, key=lambda c: c.index)]
    for i, (want, have) in enumerate(zip(plain.token_ids, got)):
        assert list(have) == list(want[0] if isinstance(want[0], list) else want), f"prompt {i}"
    status, text = http_get(f"{launched[1]}/metrics")
    assert status == 200
    drafts = _metric_total(text, "vllm:spec_decode_num_drafts")
    accepted = _metric_total(text, "vllm:spec_decode_num_accepted_tokens")
    print(f"draft_tree over HTTP: {drafts:.0f} trees, {accepted:.0f} accepted tokens")
    assert drafts > 0 and accepted > 0, (drafts, accepted)


def test_sampled_request_runs_to_its_length(client, prompts):
    model = client.models.list().data[0].id
    resp = client.completions.create(model=model, prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0.7,
                                     top_p=0.9, seed=7, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert len(resp.choices[0].token_ids) == MAX_TOKENS


def test_misspelled_key_is_refused_naming_the_valid_ones(pair):
    spec = json.dumps({"method": "draft_tree", "model": pair[1], "trunks": 2})
    proc = subprocess.run([str(SCRIPTS / "vllm"), "serve", pair[0], "--speculative-config", spec, *FLAGS],
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "trunks" in out and "'trunk'" in out, out[-3000:]
