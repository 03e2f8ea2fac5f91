"""``kernels.split.split_rows``: a step's vocabulary passes (the harvest's top-k, the greedy walk's
argmax and compiled walk) spread over helper threads give what one thread gives, part by part."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from random_trees import random_trees
from vllm_anisotropic.kernels import split
from vllm_anisotropic.proposers.adjacency import topk_scores
from vllm_anisotropic.tree import FlatTrees
from vllm_anisotropic.verifiers.greedy import host_rows_argmax, walk_flat


@pytest.fixture
def threads(monkeypatch):
    """``threads(n)``: the process's splits use n threads from here on (a fresh pool)."""
    pools = []

    def use(n):
        monkeypatch.setenv(split.HOST_THREADS_ENV, str(n))
        monkeypatch.setattr(split, "_pool", None)
        assert split.host_threads() == n
        pools.append(split._pool[1])

    yield use
    for pool in pools:
        if pool is not None:
            pool.shutdown()


def _parts(n, min_part):
    seen = []
    lock = threading.Lock()

    def call(lo, hi):
        with lock:
            seen.append((lo, hi, threading.get_ident()))

    split.split_rows(call, n, min_part)
    return sorted(seen)


def test_parts_are_contiguous_hold_min_part_rows_and_the_first_runs_on_the_caller(threads):
    threads(3)
    me = threading.get_ident()
    assert [p[:2] for p in _parts(100, 8)] == [(0, 33), (33, 66), (66, 100)]  # 3 threads
    assert [p[:2] for p in _parts(16, 8)] == [(0, 8), (8, 16)]  # two parts of min_part
    assert [p[:2] for p in _parts(15, 8)] == [(0, 15)]  # one part short of two: no helper
    assert [p[:2] for p in _parts(23, 8)] == [(0, 11), (11, 23)]
    assert [p[:2] for p in _parts(0, 8)] == [(0, 0)]
    parts = _parts(100, 8)
    assert parts[0][2] == me and {p[2] for p in parts[1:]}.isdisjoint({me})
    threads(1)
    assert [p[:2] for p in _parts(100, 8)] == [(0, 100)]


def test_a_helpers_exception_is_raised_to_the_caller_after_every_part_ends(threads):
    threads(2)
    ended = []

    def call(lo, hi):
        if lo:
            raise RuntimeError(f"part {lo}")
        ended.append(hi)

    with pytest.raises(RuntimeError, match="part 10"):
        split.split_rows(call, 20, 10)
    assert ended == [10]


@pytest.mark.parametrize("raw", ["0", "-2", "two"])
def test_a_bad_thread_count_names_the_value_and_the_valid_ones(monkeypatch, raw):
    monkeypatch.setenv(split.HOST_THREADS_ENV, raw)
    monkeypatch.setattr(split, "_pool", None)
    with pytest.raises(ValueError, match=f"{split.HOST_THREADS_ENV}='{raw}'.*>= 1"):
        split.host_threads()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_split_vocabulary_passes_equal_one_threads(threads, dtype):
    """The harvest's top-k over rows in any order with repeats, the argmax of bf16 rows and the
    compiled greedy walk of 40 trees (bf16: each tree's rows steered so walks run deep): every
    output the same with 1 and with 3 threads (a part's output slice off by a row, a walk part
    reading its neighbour's offsets or rows would differ)."""
    rng = np.random.default_rng(3)
    logits = torch.randn(300, 1000).to(dtype)
    rows = rng.integers(0, 300, 200)
    trees = [t for _ in range(40) for t in random_trees(rng, chain=0.7, sources=True, vocab=6)][:40]
    flat = FlatTrees.from_trees(trees)
    starts = flat.offsets[:-1] + 3
    parents = flat.global_parents()
    for j in np.flatnonzero(parents >= 0):
        if rng.random() < 0.7:
            logits[parents[j] + 3, int(flat.tokens[j])] = 9.0
    out = {}
    for n in (1, 3):
        threads(n)
        out[n] = (*topk_scores(logits, 10, rows), host_rows_argmax(logits, rows), *walk_flat(flat, logits, starts))
    for a, b in zip(out[1], out[3]):
        assert a.tolist() == b.tolist()
    assert out[1][2].tolist() == logits[rows].float().argmax(-1).tolist()
    assert out[1][4].max() >= 3  # some walk went three deep


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to bind a thread to one")
def test_helpers_run_on_the_cores_of_every_thread_of_the_process():
    """vLLM's CPU worker binds the engine's thread to one core and its OpenMP threads to the
    others: helpers started from the bound thread take the union (a fresh process)."""
    code = """
import os, threading
from vllm_anisotropic.kernels import split
cores = os.sched_getaffinity(0)
first = min(cores)
gate = threading.Event()
other = threading.Thread(target=gate.wait)  # an unbound thread, as OpenMP's on the other cores
other.start()
os.sched_setaffinity(0, {first})  # this thread only
seen = []
split.split_rows(lambda lo, hi: seen.append((lo, sorted(os.sched_getaffinity(0)))), 40, 10)
gate.set()
print(sorted(seen) == [(0, [first])] + [(lo, sorted(cores)) for lo in sorted(s[0] for s in seen)[1:]],
      len(seen) == min(4, len(cores)))
"""
    env = dict(os.environ)
    env.pop(split.HOST_THREADS_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr
