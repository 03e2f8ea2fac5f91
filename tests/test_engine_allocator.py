"""The budget allocator inside real vLLM (CPU build), on the tiny model: default on, lossless,
and driven by its cost model (a steep one means plain decoding, a flat one full trees).

Engine runs (each its own process): plain greedy; GOOSE with the allocator on as shipped (the
start-up sweep + online refit); GOOSE with a steep cost-model file (every query token costs 1 s) and
with a flat one (a step costs 10 ms whatever it verifies), both without online refit.
"""

from __future__ import annotations

import json

import pytest

from vllm_anisotropic.allocator import CostModel
from vllm_anisotropic.bench.sweep import resolve_config
from vllm_anisotropic.integration.vllm.engine.metrics import STATS_ENV
from vllm_anisotropic.bench.offline import CPU_LLM_DEFAULTS, IN_PROCESS, OfflineJob, run_offline_job

pytestmark = pytest.mark.engine

ENGINE_KWARGS = {"enforce_eager": True, "max_model_len": 1024}
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def model_dir():
    from vllm_anisotropic.models import build_tiny_model

    return str(build_tiny_model(block_std=0.1))


@pytest.fixture(scope="module")
def prompts(tiny_prompts):
    return tiny_prompts[:8]


@pytest.fixture(scope="module")
def plain(model_dir, prompts):
    return run_offline_job(OfflineJob(model=model_dir, prompts=prompts, max_tokens=MAX_TOKENS, llm_kwargs=ENGINE_KWARGS),
                           env=IN_PROCESS)


def _run(model_dir, prompts, spec, tmp_path, name):
    stats = tmp_path / f"{name}.json"
    res = run_offline_job(
        OfflineJob(model=model_dir, prompts=prompts, max_tokens=MAX_TOKENS, speculative_config=spec,
                   llm_kwargs=ENGINE_KWARGS),
        env={**IN_PROCESS, STATS_ENV: str(stats)},
    )
    tree = json.loads(stats.read_text())
    budget = json.loads((tmp_path / f"{name}.json.budget").read_text())
    return res, tree, budget


def test_allocator_is_on_by_default_and_lossless(model_dir, prompts, plain, tmp_path):
    res, tree, budget = _run(model_dir, prompts, {"method": "goose"}, tmp_path, "auto")
    assert res.token_ids == plain.token_ids
    assert budget["steps"] > 10 and budget["cost_samples"] > 10, budget
    # the start-up sweep timed the CPU's masked recompute of tree rows (runner.TreeCPUModelRunner.
    # _tree_cost_samples): the first fit already prices tree rows above plain query tokens
    start = budget["cost_model_start"]
    assert start["tree_switch"] + start["tree_switch_per_request"] + start["tree_row"] + start["tree_ctx"] > 0, start
    assert budget["tree_rows"] <= budget["tree_rows_offered"]
    # the realized accepted drafts are the drafter's own count of the steps the allocator cut
    assert budget["realized_accepted"] <= tree["accepted_nodes"]
    # the measured gate is on by default: it saw decode steps in both arms (its warm-up makes
    # every other decision plain) and counted the steps it made plain
    gate = budget["gate"]
    assert sum(g["plain_steps"] for g in gate.values()) > 0 and sum(g["spec_steps"] for g in gate.values()) > 0, gate
    assert 0 < budget["gate_plain_steps"] <= budget["steps_without_drafts"], budget
    # GOOSE drafts chains alone, so the gate also measured chain steps (its warm-up alternates the
    # two speculative kinds) and they verified spine chains, not cut, within allocator_chain_drafts
    assert sum(g["chain_steps"] for g in gate.values()) > 0, gate
    assert budget["chain_steps"] > 0 and budget["chain_drafts"] > 0, budget
    assert budget["chain_drafts"] <= 5 * budget["chain_steps"] * len(prompts), budget


def test_steep_cost_model_means_plain_decoding(model_dir, prompts, plain, tmp_path):
    # bench method goose-never: every query token costs 1 s and a step costs nothing else, so a
    # draft (P(accepted) < 1) can only lower tokens per second, chains included (their rows cost
    # query tokens, not tree rows); online refinement and probes off
    spec = resolve_config("goose-never", tmp_path)
    assert spec["cost_model_online"] is False and spec["allocator_probe_every"] == 0
    res, tree, budget = _run(model_dir, prompts, spec, tmp_path, "steep")
    assert res.token_ids == plain.token_ids
    assert res.spec.num_draft_tokens == 0, res.spec  # vLLM scheduled no draft at all
    assert tree["draft_nodes"] == 0 and tree["verified_trees"] == 0, tree
    assert budget["steps"] > 0 and budget["steps_without_drafts"] == budget["steps"], budget


def test_flat_cost_model_keeps_whole_trees(model_dir, prompts, plain, tmp_path):
    flat = tmp_path / "flat.json"
    flat.write_text(CostModel.from_coefficients([0.0], base=0.01).to_json())
    # the allocator alone (the measured gate would make some steps plain)
    spec = {"method": "goose", "cost_model": str(flat), "cost_model_online": False, "allocator_gate": False}
    res, tree, budget = _run(model_dir, prompts, spec, tmp_path, "flat")
    assert res.token_ids == plain.token_ids
    # every node within vLLM's caps that can change the expected tokens is kept: the allocator may
    # leave out only nodes whose calibrated probability is below float resolution next to the
    # step's base tokens (ties go to fewer rows; CI run 15 dropped 1 of 277 such nodes)
    assert budget["steps"] > 0 and budget["given_up_accepted"] < 1e-6, budget
    assert budget["tree_rows"] >= 0.98 * budget["tree_rows_within_caps"] >= 0.9 * 0.98 * budget["tree_rows_offered"], budget
    # vLLM may still trim a kept list at the token budget or max_model_len: nearly all verified
    assert 0.9 * budget["tree_rows"] <= tree["draft_nodes"] <= budget["tree_rows"] and res.spec.tau > 1.5, (tree, res.spec)


# the entry points of the per-step path's compiled kernels (kernels/__init__.py) that a step of
# GOOSE with the allocator calls on the CPU: the workers' proposal, ranking, step rows, attention
# rows and rounds, K/V moves, walk, emit and harvest, the label queue, and the scheduler's cut
_STEP_KERNELS = (
    "goose.proposal_inputs", "goose.spine_trees", "goose.learn_keys", "rank.rank_trees", "plan.step_rows",
    "plan.scheduled_prefixes", "plan.gather_prefix", "plan.main_rows", "plan.path_rounds", "kv.move_slots", "walk.walk_rows", "emit.emit_rows", "emit.harvest_rows",
    "vocab.topk_probs", "table.update", "table.last_writes", "allocate.allocate_batch", "allocate.allocate_one",
    "allocate.offer_budgets", "allocate.cut_accounts", "label.queue_trees", "label.take_labels",
    "fit.nnls_gram",
)
# where the engine has threads (kernels.split): the step's top-k, walk and K/V moves
_THREADS_KERNELS = ("vocab.topk_probs_threads", "walk.walk_rows_threads", "kv.move_slots_threads")

_COMPILES_WHILE_SERVING = """
import importlib, json, sys
from vllm import LLM, SamplingParams
from vllm_anisotropic.kernels import _NAMES  # every kernel module of the package
def signatures():
    out = {}
    for name in _NAMES:
        m = importlib.import_module("vllm_anisotropic.kernels." + name)
        for k, v in vars(m).items():
            if hasattr(v, "signatures") and getattr(getattr(v, "py_func", None), "__module__", None) == m.__name__:
                out[name + "." + k] = len(v.signatures)
    return out
llm = LLM(sys.argv[1], speculative_config={"method": "goose"}, enforce_eager=True, max_model_len=1024, max_num_seqs=8,
          **json.loads(sys.argv[3]))
before = signatures()
llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=48, temperature=0.0))
from vllm_anisotropic.kernels.split import host_threads
print("SIGNATURES", json.dumps({"before": before, "after": signatures(), "threads": host_threads()}))
"""


def test_no_kernel_compiles_while_serving(model_dir, prompts):
    """Every compiled kernel a tree step calls is compiled (or loaded from numba's disk cache)
    while the engine starts (``TreeDrafter.warm_up``, ``BatchBudget.warm_up``, the runner's and
    sampler's warm-ups), for the types the step passes: none gains a signature while requests are
    served. A kernel the warm-ups miss costs the first tree step that calls it ~0.3 s of loading,
    seconds of compiling on a fresh install, with the batch waiting (measured: a first tree step
    of 6.1 s at 16 requests). One in-process engine (scheduler and worker in this process)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, **IN_PROCESS}
    args = [model_dir, json.dumps(prompts), json.dumps(CPU_LLM_DEFAULTS)]  # an explicit KV cache size, bf16
    out = subprocess.run([sys.executable, "-c", _COMPILES_WHILE_SERVING, *args], capture_output=True, text=True,
                         timeout=600, env=env)
    line = [x for x in out.stdout.splitlines() if x.startswith("SIGNATURES ")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    sig = json.loads(line[0].split(" ", 1)[1])
    before, after = sig["before"], sig["after"]
    grew = {k: (before.get(k, 0), n) for k, n in after.items() if n > before.get(k, 0)}
    assert not grew, grew
    unused = [k for k in _STEP_KERNELS + (_THREADS_KERNELS if sig["threads"] > 1 else ()) if not after.get(k)]
    assert not unused, unused  # each has its machine code (from a warm-up): a renamed or dropped kernel fails here
