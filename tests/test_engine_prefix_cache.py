"""Prefix caching after tree acceptance (issue 14, item 6), in real vLLM (CPU build, float32).

Accepted tree tokens sit at the wrong KV slots until they are re-run (scheduler.py). vLLM 0.32
registers a block for prefix caching when it schedules the tokens that fill it, capped at the
request's committed tokens (``KVCacheManager.allocate_slots``), i.e. after our rollback of the
previous step: a block holding not-yet-re-run accepted tokens is never registered. A request
that *finishes* on a step that accepted drafts is never scheduled again, so the blocks its last
accepted tokens sit in are never registered either.

The test: one engine, two rounds. Round 1 generates from each prompt with a different
``max_tokens`` (so requests end at assorted points, some on steps that accepted drafts: checked
through the per-request acceptance trace). Round 2, in the same engine, sends each round-1 prompt
+ its output as a new prompt, which hits the blocks round 1 left in the prefix cache (checked
through ``vllm:prefix_cache_hits``). Every round-2 output must equal plain vLLM's for the same
prompt, with plain vLLM run the same way (two rounds in one engine, prefix caching on).

Twice (issue 47): float32 with every other request seeded sampled (trees emit plain vLLM's very
tokens for those), allocator off; and bf16 greedy with the budget allocator on and cutting trees.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_anisotropic.bench.offline import IN_PROCESS
from vllm_anisotropic.integration.vllm.engine.metrics import STATS_ENV, TRACE_ENV

pytestmark = pytest.mark.engine

MAX_TOKENS = [9, 14, 19, 26, 33, 41, 50, 60]
ROUND2_TOKENS = 24
WIDE_GOOSE = {"method": "goose", "bypass": False, "min_branch_score": 0.0, "allocator": "off"}
CUT_COST = 0.002  # seconds a tree row: the allocator keeps the likelier nodes only

TWO_ROUNDS = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm_anisotropic.bench.offline import _counters, _drain_in_process

model, spec, params1, params2, dtype, out = (sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]),
                                             json.loads(sys.argv[4]), sys.argv[5], sys.argv[6])
prompts = json.loads(sys.stdin.read())
llm = LLM(model=model, speculative_config=spec, enforce_eager=True, max_model_len=1024, dtype=dtype,
          block_size=32, enable_prefix_caching=True, seed=0, kv_cache_memory_bytes=64 << 20,
          disable_log_stats=False)
first = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                     [SamplingParams(ignore_eos=True, **kw) for kw in params1], use_tqdm=False)
round1 = [list(o.outputs[0].token_ids) for o in first]
_drain_in_process(llm)  # the step that tells the workers of round 1's last finished requests: stats written
hits_before = _counters(llm).get("vllm:prefix_cache_hits", 0.0)
second = llm.generate([TokensPrompt(prompt_token_ids=p + r) for p, r in zip(prompts, round1)],
                      [SamplingParams(ignore_eos=True, **kw) for kw in params2], use_tqdm=False)
round2 = [list(o.outputs[0].token_ids) for o in second]
_drain_in_process(llm)
hits = _counters(llm).get("vllm:prefix_cache_hits", 0.0) - hits_before
json.dump({"round1": round1, "round2": round2, "round2_prefix_cache_hits": hits}, open(out, "w"))
"""


def _params(sampled: bool, round2: bool = False) -> list[dict]:
    """Each request's sampling: greedy, or (``sampled``) every other request seeded sampled
    (temperature 0.8, top-p 0.95: trees emit plain vLLM's very tokens for it in float32)."""
    params = []
    for i, m in enumerate(MAX_TOKENS):
        kw = {"max_tokens": ROUND2_TOKENS if round2 else m, "temperature": 0.0}
        if sampled and i % 2:
            kw.update(temperature=0.8, top_p=0.95, seed=100 + i + 50 * round2)
        params.append(kw)
    return params


def _two_rounds(model_dir, prompts, spec, tmp_path, name, env=None, sampled=False, dtype="float32"):
    out = tmp_path / f"{name}.json"
    log = tmp_path / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-c", TWO_ROUNDS, model_dir, json.dumps(spec), json.dumps(_params(sampled)),
             json.dumps(_params(sampled, round2=True)), dtype, str(out)],
            input=json.dumps(prompts), text=True, stdout=f, stderr=subprocess.STDOUT, timeout=900,
            env={**__import__("os").environ, **(env or {})},
        )
    assert proc.returncode == 0 and out.exists(), log.read_text(errors="replace")[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def setup(tiny_prompts):
    from transformers import AutoTokenizer

    from vllm_anisotropic.models import build_tiny_model

    model = str(build_tiny_model(block_std=0.1))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.encode(p) for p in tiny_prompts[: len(MAX_TOKENS)]]
    return model, prompts


def test_blocks_cached_after_tree_acceptance_serve_a_later_request_exactly(setup, tmp_path):
    """Greedy and seeded sampled requests (every other one) in both rounds, float32."""
    model, prompts = setup
    plain = _two_rounds(model, prompts, None, tmp_path, "plain", sampled=True, env=IN_PROCESS)
    stats = tmp_path / "tree_stats.json"
    goose = _two_rounds(model, prompts, WIDE_GOOSE, tmp_path, "goose", sampled=True,
                        env={**IN_PROCESS, STATS_ENV: str(stats), TRACE_ENV: "1"})
    assert goose["round1"] == plain["round1"]
    # the second round really read blocks the first round cached (prompt + output blocks)
    assert goose["round2_prefix_cache_hits"] > sum(len(p) for p in prompts) // 2, goose["round2_prefix_cache_hits"]
    # some round-1 requests ended on a step that accepted drafts (the case under test)
    trace = json.loads(stats.read_text())["requests"]
    ended_in_acceptance = [r for r, steps in trace.items() if steps and steps[-1] > 0]
    assert ended_in_acceptance, trace
    for i, (a, b) in enumerate(zip(plain["round2"], goose["round2"])):
        assert a == b, f"prompt {i}: plain {a} vs goose {b}"


def test_prefix_cache_with_the_allocator_cutting_trees_in_bf16(setup, tmp_path):
    """The same two rounds in bfloat16, greedy, with the budget allocator on and cutting: a fixed
    cost model (``deterministic``: no wall-clock decision) under which it keeps some draft nodes
    and drops others, so accepted paths end at cut trees. bf16 outputs of this tiny model do not
    change with the batch shape (its greedy margins are wide), so plain vLLM's bf16 run is the
    reference token for token."""
    from vllm_anisotropic.allocator import CostModel

    model, prompts = setup
    cost = tmp_path / "cost.json"
    cost.write_text(CostModel.from_coefficients([0.0], base=0.01, tree_row=CUT_COST).to_json())
    spec = {"method": "goose", "bypass": False, "min_branch_score": 0.0, "cost_model": str(cost), "deterministic": True}
    plain = _two_rounds(model, prompts, None, tmp_path, "plain", dtype="bfloat16", env=IN_PROCESS)
    stats = tmp_path / "tree_stats.json"
    goose = _two_rounds(model, prompts, spec, tmp_path, "goose", dtype="bfloat16",
                        env={**IN_PROCESS, STATS_ENV: str(stats), TRACE_ENV: "1"})
    budget = json.loads((tmp_path / "tree_stats.json.budget").read_text())
    print(f"allocator: {budget['tree_rows']} of {budget['tree_rows_offered']} offered nodes kept; "
          f"round-2 prefix cache hits {goose['round2_prefix_cache_hits']}")
    assert 0 < budget["tree_rows"] < 0.8 * budget["tree_rows_offered"], budget  # it cut, and kept some
    assert goose["round2_prefix_cache_hits"] > sum(len(p) for p in prompts) // 2
    trace = json.loads(stats.read_text())["requests"]
    assert [r for r, steps in trace.items() if steps and steps[-1] > 0], trace
    assert goose["round1"] == plain["round1"]
    for i, (a, b) in enumerate(zip(plain["round2"], goose["round2"])):
        assert a == b, f"prompt {i}: plain {a} vs goose {b}"
