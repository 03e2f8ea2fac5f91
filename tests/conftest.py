"""Shared fixtures. Engine tests start real vLLM (CPU build) in separate processes.

The suite runs on two pytest-xdist workers, a test file each at a time (``-n 2 --dist loadfile
--no-loadscope-reorder``, the README's test command): a job of the engine tests keeps one core
busy, importing vLLM or running its engine bound to one core, so one worker left the other core
mostly idle. Each worker binds its engines to a core of its own, and the longest files start
first so that both workers end together.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# the longest files (their order: longest first, seconds on a 2-core AVX2 EPYC); the rest follow
# in the usual order
LONGEST_FIRST = (
    "test_engine_draft_tree.py",   # ~600: eight verifiers' law tests
    "test_engine_sampling.py",     # ~550
    "test_vllm033.py",             # ~350: engine tests again on vLLM 0.33
    "test_engine_plugin.py",       # ~300: multiprocess starts
    "test_engine_tp.py",
    "test_bench.py",
    "test_engine_allocator.py",
)


def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1" on an xdist worker
    if worker:
        cores = sorted(os.sched_getaffinity(0))
        # each worker's engines on a core of its own (vLLM's default binds every engine to the
        # first core); tests that set their own binding (tensor parallelism) override it
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[int(worker[2:]) % len(cores)]))
        # one thread per worker in this process too (torch's default, a thread per core, would
        # make the two workers' OpenMP threads wait on each other)
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """A deterministic tiny random-weight Llama with the real SmolLM2 tokenizer."""
    from vllm_anisotropic.models import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
def tiny_prompts() -> list[str]:
    """Real HumanEval and GSM8K prompt texts (raw: the tiny model is a random-weight model, chat formatting adds nothing)."""
    from vllm_anisotropic.data import load_dataset

    return [p.text for p in load_dataset("humaneval", limit=6)] + [
        p.text for p in load_dataset("gsm8k", limit=6)
    ]
