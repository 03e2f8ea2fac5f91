"""Contained faults inside real vLLM (``integration/vllm/engine/faults.py``).

One engine run (real vLLM CPU build, tiny Llama, float32) with a fault injected in each stage of
the tree path (``VLLM_ANISOTROPIC_INJECT_FAULT``): the drafter's proposal, the allocator's hooks
in the scheduler, the tree verification and the deferred harvest, each once, in different waves
of requests (``max_num_seqs`` 3, 12 requests). Every request must finish with exactly plain
vLLM's tokens -- the greedy ones and the seeded sampled ones alike (the verify fault's fallback
samples the root row with the request's generator restored, so a seeded request's output is
still plain vLLM's) --, each fault counted once by stage, requests that lost their trees
counted, and the waves after the faults still accepting drafts. Fails if any stage's exception
escapes (the engine dies and the job fails), if a fallback emits a different token (e.g. the
bonus row's instead of the root's, or a second draw from a seeded request's generator), or if
the faulting requests keep their trees.
"""

from __future__ import annotations

import json

import pytest

from vllm_anisotropic.bench.offline import IN_PROCESS, WORKER_PROCESS, OfflineJob, run_offline_job
from vllm_anisotropic.integration.vllm.engine.faults import INJECT_ENV, parse_injection
from vllm_anisotropic.integration.vllm.engine.metrics import STATS_ENV

pytestmark = pytest.mark.engine

ENGINE = {"enforce_eager": True, "max_model_len": 512, "max_num_seqs": 3, "max_num_batched_tokens": 8192,
          "dtype": "float32"}
# allocator on (its hooks are a stage), gate off (so that trees run whatever this machine's speed)
CONFIG = {"method": "goose", "budget": 8, "allocator_gate": False}
# the call of each stage that fails, spread over the four waves of three requests
FAULTS = "propose@8,verify@30,harvest@55,allocator@110,grammar@6"


def test_parse_injection_names_the_valid_stages():
    assert parse_injection("verify@5, propose") == {"verify": 5, "propose": 1}
    assert parse_injection(None) == {}
    with pytest.raises(ValueError, match="valid stages: propose, allocator, verify, harvest, grammar"):
        parse_injection("sampler@2")
    for bad in ("verify@0", "verify@x"):
        with pytest.raises(ValueError, match="count >= 1"):
            parse_injection(bad)
    # a rank qualifier: that tensor-parallel rank's worker only
    spec = "propose@3:rank1, verify@2, harvest:rank0"
    assert parse_injection(spec, rank=0) == {"verify": 2, "harvest": 1}
    assert parse_injection(spec, rank=1) == {"propose": 3, "verify": 2}
    assert parse_injection(spec, rank=2) == {"verify": 2}
    with pytest.raises(ValueError, match="runs in the scheduler.*worker stages: propose, verify, harvest"):
        parse_injection("allocator@2:rank1")
    for bad in ("verify@2:1", "verify:rankx", "verify@2:rank"):
        with pytest.raises(ValueError, match="a tensor-parallel rank, e.g. verify"):
            parse_injection(bad)


def test_inject_fails_the_nth_call_of_each_stage_of_this_rank_once(monkeypatch):
    from vllm_anisotropic.integration.vllm.engine import faults

    monkeypatch.setenv(INJECT_ENV, "verify@2:rank1,propose")
    monkeypatch.setattr(faults, "_pending", None)
    monkeypatch.setattr(faults, "tp_rank", lambda: 1)
    faults.inject("verify")
    faults.inject("harvest")
    with pytest.raises(faults.InjectedFault, match="fault injected in stage 'verify'"):
        faults.inject("verify")
    faults.inject("verify")  # each once
    with pytest.raises(faults.InjectedFault, match="stage 'propose'"):
        faults.inject("propose")
    faults.inject("propose")
    assert faults._pending == {}
    monkeypatch.setattr(faults, "_pending", None)
    monkeypatch.setattr(faults, "tp_rank", lambda: 0)  # rank 0: only the unqualified fault
    for _ in range(3):
        faults.inject("verify")
    assert faults._pending == {"propose": 1}
    monkeypatch.setattr(faults, "_pending", None)
    monkeypatch.setenv(INJECT_ENV, "verify@2")
    monkeypatch.setattr(faults, "tp_rank", lambda: 1 / 0)  # no rank qualifier: the rank is not asked
    faults.inject("verify")
    assert faults._pending == {"verify": 1}
    monkeypatch.setattr(faults, "_pending", None)
    monkeypatch.delenv(INJECT_ENV)
    faults.inject("verify")
    assert faults._pending == {}


def _agree_on_rank(rank: int, path: str, flags: list, out) -> None:
    import os

    import numpy as np
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import get_tp_group, init_distributed_environment, initialize_model_parallel

    from vllm_anisotropic.integration.vllm.engine.faults import agree, tp_group

    os.environ.setdefault("VLLM_DIST_IDENT", f"agree-{os.getppid()}")
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"file://{path}",
                                     local_rank=rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=2)
    assert tp_group() is get_tp_group()
    out.put((rank, agree(np.asarray(flags, bool), tp_group()).tolist()))


def test_agree_is_an_or_of_every_ranks_flags(tmp_path):
    """``faults.agree`` on vLLM's real tensor-parallel group of two processes (its CPU
    communicator, as in a TP = 2 engine): each rank gets the element-wise OR of both ranks'
    flags."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    flags = {0: [True, False, False, False], 1: [False, False, True, False]}
    procs = [ctx.Process(target=_agree_on_rank, args=(r, str(tmp_path / "rendezvous"), flags[r], out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == {0: [True, False, True, False], 1: [True, False, True, False]}


def test_a_fault_in_each_stage_is_contained(tiny_prompts, tmp_path):
    from vllm_anisotropic.models import build_tiny_model

    model = str(build_tiny_model(block_std=0.1, lm_head_alpha=0.25))
    # every other request seeded sampled (temperature 0.8, top-p 0.95), the others greedy
    per = [{"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": 300 + i}
           for i in range(12)]
    # two structured outputs (wave 2, sampled; wave 4, greedy): their grammar-pruning is a stage
    for i in (3, 10):
        per[i] = {**per[i], "structured_outputs": {"regex": r"((cat|dog) (runs|sleeps)\. ){2,8}"}}
    job = OfflineJob(model=model, prompts=tiny_prompts[:12], per_prompt=per, max_tokens=40, llm_kwargs=ENGINE)
    plain = run_offline_job(job, env=IN_PROCESS)
    stats = tmp_path / "tree.json"
    # the worker in a process of its own (the production executor): its deferred harvest runs
    # after its reply there, where a harvest fault must be contained too
    spec = run_offline_job(job.model_copy(update={"speculative_config": CONFIG,
                                                  "llm_kwargs": {**ENGINE, **WORKER_PROCESS}}),
                           env={**IN_PROCESS, INJECT_ENV: FAULTS, STATS_ENV: str(stats)})
    tree = json.loads(stats.read_text())
    print(f"spec {spec.spec}; faults {tree['faults']}, requests without trees after a fault {tree['disabled_requests']}")
    differ = [i for i, (a, b) in enumerate(zip(plain.token_ids, spec.token_ids)) if a != b]
    assert not differ, differ
    assert tree["faults"] == {"propose": 1, "verify": 1, "harvest": 1, "allocator": 1, "grammar": 1}
    assert tree["disabled_requests"] >= 5  # at least one request per fault lost its trees
    assert spec.spec.num_accepted_tokens > 40  # trees ran (before, between and after the faults)
