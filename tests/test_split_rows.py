"""``kernels.split`` and the ``*_threads`` kernels: a step's vocabulary passes (the harvest's top-k,
the argmax of bf16 rows, the compiled greedy walk) split over threads give what one thread gives,
part by part, and only where threads are safe and pay."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from random_trees import random_trees
from vllm_anisotropic import kernels
from vllm_anisotropic.kernels import split
from vllm_anisotropic.proposers.adjacency import topk_scores
from vllm_anisotropic.tree import PRIORITY_BY_CODE, FlatTrees
from vllm_anisotropic.verifiers.greedy import host_rows_argmax, walk_flat

NO_THREADS = ("one core, or numba's OpenMP / TBB layer does not load here (no libgomp): the passes run the one-thread "
              "kernels, which the other tests check")
# numba alone, not this package (a mutant of kernels.split must not turn the threaded tests into skips)
_LAYER_HERE = """
import numba
numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
from numba.np.ufunc import parallel
parallel._launch_threads()
print("LAYER", numba.threading_layer(), numba.config.NUMBA_NUM_THREADS)
"""


def _threads_here() -> bool:
    """numba's own probe in this environment (its ``NUMBA_*`` variables included, as this process's)."""
    out = subprocess.run([sys.executable, "-c", _LAYER_HERE], capture_output=True, text=True, timeout=300)
    words = out.stdout.split()
    return len(words) == 3 and words[1] in ("omp", "tbb") and int(words[2]) > 1


HAS_THREADS = len(os.sched_getaffinity(0)) > 1 and _threads_here()
THREADS = pytest.mark.skipif(not HAS_THREADS, reason=NO_THREADS)


def _run(code, *args, **env):
    """``code`` in a fresh process (numba's thread state is per process): its stdout."""
    full = {k: v for k, v in os.environ.items() if k not in ("NUMBA_NUM_THREADS", split.HOST_THREADS_ENV)}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                         env={**full, **env})
    return out.stdout + out.stderr[-2000:]


@pytest.fixture
def threads(monkeypatch):
    """``threads(n)``: this process's passes may use n threads from here on."""

    def use(n):
        monkeypatch.setenv(split.HOST_THREADS_ENV, str(n))
        monkeypatch.setattr(split, "_threads", None)
        return split.host_threads()

    return use


def test_a_pass_takes_threads_only_for_two_parts_of_min_part(threads):
    """One thread below two parts of ``min_part`` rows; above, a thread a part up to the cap, and
    numba's thread count for this thread set to it."""
    got = threads(1)
    assert got == 1 and split.row_threads(10_000, 8) == 1
    cap = threads(split.MAX_THREADS)
    assert split.row_threads(15, 8) == 1 and split.row_threads(0, 8) == 1
    if not HAS_THREADS:
        assert cap == 1
        pytest.skip(NO_THREADS)
    import numba

    assert cap == min(len(split._process_cores()), split.MAX_THREADS, numba.config.NUMBA_NUM_THREADS) > 1
    assert numba.threading_layer() in ("omp", "tbb")
    assert split.row_threads(16, 8) == 2 and split.row_threads(23, 8) == 2
    numba.set_num_threads(1)
    assert split.row_threads(10_000, 8) == cap and numba.get_num_threads() == cap


def test_the_default_count_is_the_cores_at_most_max_threads(monkeypatch):
    monkeypatch.delenv(split.HOST_THREADS_ENV, raising=False)
    assert [split._threads_wanted(n) for n in (0, 1, 3, split.MAX_THREADS + 5)] == [1, 1, 3, split.MAX_THREADS]
    monkeypatch.setenv(split.HOST_THREADS_ENV, "12")
    assert split._threads_wanted(2) == 12  # asked for: numba's pool caps it (_launch)


_TORCH_COUNT = """
import numpy as np, torch
torch.set_num_threads(1)
from vllm_anisotropic.kernels import split
from vllm_anisotropic.proposers.adjacency import topk_scores
topk_scores(torch.randn(64, 3000).to(torch.bfloat16), 4, np.arange(64))
print("SPLIT", split.host_threads(), "TORCH", torch.get_num_threads())
"""


@THREADS
def test_starting_numbas_threads_leaves_torchs_thread_count_alone():
    """numba's OpenMP start sets the starting thread's OpenMP count (torch's, whose libgomp
    answers): started on a thread of its own, the engine's thread keeps vLLM's count."""
    assert "SPLIT 2 TORCH 1" in _run(_TORCH_COUNT, VLLM_ANISOTROPIC_HOST_THREADS="2")


_STARTS = """
import os, sys
from numba.np.ufunc import parallel
from vllm_anisotropic.kernels import split
print("ROWS", split.row_threads(int(sys.argv[1]), 8), "STARTED", parallel._is_initialized)
"""


@THREADS
def test_numba_threads_start_only_for_a_pass_that_splits():
    """A small pass, or one thread asked for, never starts numba's threads (nor its layer)."""
    assert "ROWS 1 STARTED False" in _run(_STARTS, "15", VLLM_ANISOTROPIC_HOST_THREADS="2")
    assert "ROWS 1 STARTED False" in _run(_STARTS, "100", VLLM_ANISOTROPIC_HOST_THREADS="1")
    assert "ROWS 2 STARTED True" in _run(_STARTS, "100", VLLM_ANISOTROPIC_HOST_THREADS="2")


_LAYER = """
from vllm_anisotropic.kernels import split
print("THREADS", split.host_threads())
"""


@THREADS
def test_numbas_own_variables_choose_the_layer_and_only_omp_or_tbb_take_threads():
    """``NUMBA_THREADING_LAYER(_PRIORITY)`` set by the operator are kept: ``workqueue`` (its
    threads woken through a queue gained nothing in vLLM) runs one thread, a layer that does not
    load runs one thread with a warning, OpenMP first takes two."""
    assert "THREADS 1" in _run(_LAYER, NUMBA_THREADING_LAYER_PRIORITY="workqueue omp tbb", VLLM_ANISOTROPIC_HOST_THREADS="2")
    assert "THREADS 1" in _run(_LAYER, NUMBA_THREADING_LAYER="workqueue", VLLM_ANISOTROPIC_HOST_THREADS="2")
    out = _run(_LAYER, NUMBA_THREADING_LAYER="nonesuch", VLLM_ANISOTROPIC_HOST_THREADS="2")
    assert "THREADS 1" in out and "did not load" in out
    assert "THREADS 2" in _run(_LAYER, VLLM_ANISOTROPIC_HOST_THREADS="2")
    assert "THREADS 1" in _run(_LAYER, NUMBA_NUM_THREADS="1", VLLM_ANISOTROPIC_HOST_THREADS="2")  # numba's pool caps


@pytest.mark.parametrize("raw", ["0", "-2", "two"])
def test_a_bad_thread_count_names_the_value_and_the_valid_ones(threads, raw):
    with pytest.raises(ValueError, match=f"{split.HOST_THREADS_ENV}='{raw}'.*>= 1"):
        threads(raw)


def _steered(rng, dtype, num_trees=40, vocab=1000):
    """``num_trees`` trees, bf16/float32 logits whose rows' argmax is a child's token 70 % of the
    time (walks run deep), and the trees' row starts."""
    trees = [t for _ in range(num_trees) for t in random_trees(rng, chain=0.7, sources=True, vocab=6)][:num_trees]
    flat = FlatTrees.from_trees(trees)
    logits = torch.randn(flat.num_nodes + 5, vocab, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
    parents = flat.global_parents()
    for j in np.flatnonzero(parents >= 0):
        if rng.random() < 0.7:
            logits[parents[j] + 3, int(flat.tokens[j])] = 9.0
    return flat, logits.to(dtype), flat.offsets[:-1] + 3


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 40, 41])
def test_the_threads_kernels_equal_the_one_thread_ones_for_any_parts(parts):
    """``topk_probs_threads``, ``argmax_rows_threads`` and ``walk_rows_threads`` cut the rows (the
    trees) into ``parts`` contiguous parts: every output equals the one-thread kernel's, parts
    uneven, one row or tree a part, and more parts than rows (empty parts). A bound off by one
    leaves a row unwritten or written twice; a part reading its neighbour's rows differs."""
    rng = np.random.default_rng(parts)
    flat, logits, starts = _steered(rng, torch.bfloat16)
    x = logits.view(torch.int16).numpy()
    rows = rng.integers(0, x.shape[0], 40)
    vocab, walk = kernels.load("vocab"), kernels.load("walk")
    want = [np.full((40, 5), -1, np.int32), np.full((40, 5), -1.0, np.float32), np.full(40, -1, np.int64)]
    got = [a.copy() for a in want]
    vocab.topk_probs(x, rows, 5, want[0], want[1])
    vocab.topk_probs_threads(x, rows, 5, got[0], got[1], parts)
    vocab.argmax_rows(x, rows, want[2])
    vocab.argmax_rows_threads(x, rows, got[2], parts)
    ranks = PRIORITY_BY_CODE[flat.sources].astype(np.int8)
    n = flat.num_trees
    walked = []
    for fn, extra in ((walk.walk_rows, ()), (walk.walk_rows_threads, (parts,))):
        out = [np.full((n, 16), -1, np.int64), np.full(n, -1, np.int64), np.full(n, -1, np.int64)]
        fn(x, flat.tokens, flat.parents, ranks, flat.offsets, starts, *out, *extra)
        walked.append(out)
    for a, b in zip(want + walked[0], got + walked[1]):
        assert a.tolist() == b.tolist()
    assert (want[0] >= 0).all() and (want[2] >= 0).all() and (walked[0][2] >= 0).all()
    assert walked[0][1].max() >= 3  # some walk went three deep


@THREADS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_callers_split_and_give_what_one_thread_gives(threads, dtype):
    """``topk_scores``, ``host_rows_argmax`` and ``walk_flat`` with threads (200 rows, 40 trees:
    every pass splits) equal themselves on one thread and torch's argmax."""
    rng = np.random.default_rng(3)
    flat, logits, starts = _steered(rng, dtype)
    rows = rng.integers(0, logits.shape[0], 200)
    out = {}
    for n in (1, 2):
        assert threads(n) == n
        out[n] = (*topk_scores(logits, 10, rows), host_rows_argmax(logits, rows), *walk_flat(flat, logits, starts))
    for a, b in zip(out[1], out[2]):
        assert a.tolist() == b.tolist()
    assert out[1][2].tolist() == logits[rows].float().argmax(-1).tolist()


_FORKED = """
import os, sys, numpy as np, torch
from vllm_anisotropic import kernels
from vllm_anisotropic.kernels import split
from vllm_anisotropic.proposers.adjacency import topk_scores
logits = torch.randn(64, 3000).to(torch.bfloat16)
rows = np.arange(64)
want = topk_scores(logits, 4, rows)  # one thread (VLLM_ANISOTROPIC_HOST_THREADS=1)
ids, probs = np.empty((64, 4), np.int32), np.empty((64, 4), np.float32)
if sys.argv[1] == "direct":  # numba's threads started without kernels.split (as by anyone's parallel kernel)
    kernels.load("vocab").topk_probs_threads(logits.view(torch.int16).numpy(), rows, 4, ids, probs, 2)
elif sys.argv[1] == "split":
    os.environ[split.HOST_THREADS_ENV] = "2"; split._threads = None
    assert split.row_threads(64, 8) == 2
    topk_scores(logits, 4, rows)
else:  # torch's OpenMP threads only
    a = torch.randn(256, 256); a @ a
pid = os.fork()
if pid == 0:  # OpenMP's threads do not survive a fork (a hang, or numba aborts): one thread here
    os.environ[split.HOST_THREADS_ENV] = "2"  # the cache is the parent's (another pid)
    ok = split.host_threads() == 1
    ok = ok and all((a == b).all() for a, b in zip(topk_scores(logits, 4, rows), want))
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
os.environ[split.HOST_THREADS_ENV] = "2"; split._threads = None
print("CHILD", status, "PARENT", split.host_threads())
"""


@THREADS
@pytest.mark.parametrize("how", ["direct", "split", "torch"])
def test_a_fork_child_runs_one_thread(how):
    """Its parent ran numba's threads (without ``kernels.split``, or through it), or only torch's."""
    env = {**os.environ, split.HOST_THREADS_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", _FORKED, how], capture_output=True, text=True, env=env, timeout=300)
    assert "CHILD 0 PARENT 2" in out.stdout, (out.stdout, out.stderr[-2000:])


_BOUND = """
import os, threading
from vllm_anisotropic.kernels import split
cores = os.sched_getaffinity(0)
gate = threading.Event()
other = threading.Thread(target=gate.wait, daemon=True)  # unbound, as vLLM's OpenMP threads on the other cores
other.start()
os.sched_setaffinity(0, {min(cores)})  # this thread only, as OpenMP binds a CPU worker's at torch's load
import numba  # imported on the bound thread: numba's own default pool is one thread
from numba.np.ufunc import parallel
assert parallel.NUM_THREADS == 1
want = min(len(cores), split.MAX_THREADS)
print(sorted(split._process_cores()) == sorted(cores), split.host_threads() == want,
      parallel.NUM_THREADS == numba.config.NUMBA_NUM_THREADS == max(len(cores), os.cpu_count()),
      split.row_threads(64, 8) == want and numba.get_num_threads() == want)  # numba's own check takes it
gate.set()
"""


@THREADS
def test_threads_count_the_cores_of_every_thread_of_the_process():
    """vLLM's CPU worker binds the engine's thread to one core and its OpenMP threads to the
    others: the count is the union's, and the first pass gives numba's pool a thread per CPU
    (numba imported on the bound thread sized it one; a fresh process), which numba's
    ``set_num_threads`` then takes (its bound is fixed at numba's import)."""
    env = {k: v for k, v in os.environ.items() if k not in (split.HOST_THREADS_ENV, "NUMBA_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", _BOUND], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.split() == ["True", "True", "True", "True"], out.stderr[-2000:]


_NGRAM = """
import os, sys, torch
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # vLLM's CPU worker: its thread on one core
torch.set_num_threads(1)  # and torch's OpenMP threads to match
assert torch.get_num_threads() == 1  # torch's count applied on this thread (as the model's load does in the worker)
if sys.argv[1] == "plugin":
    from vllm_anisotropic.integration.vllm.frontdoor.plugin import register
    register()
import numpy as np, numba
from numba.typed import List
from vllm.v1.spec_decode.ngram_proposer import batch_propose_numba
original = numba.get_num_threads()  # NgramProposer.propose, on the engine's thread
numba.set_num_threads(1)
batch_propose_numba(List([0]), np.array([8], np.int32), np.arange(16, dtype=np.int32).reshape(1, 16) % 3, 1, 3, 64, 2,
                    np.zeros((1, 2), np.int32), np.zeros(1, np.int32))
numba.set_num_threads(original)
print("TORCH_THREADS", torch.get_num_threads())
"""


@THREADS
@pytest.mark.parametrize("how", ["plugin", "vllm-alone"])
def test_vllms_ngram_kernel_leaves_torch_one_thread_on_a_one_core_worker(how):
    """vLLM's ``ngram`` proposer starts numba's threads on the engine's thread, and numba's OpenMP
    start sets that thread's OpenMP count (torch's) to numba's pool size. With the plugin loaded,
    that pool must still be numba's own (one thread on a one-core worker): a pool sized for the
    machine at the plugin's load (3d35a61) gave torch two threads on one core, and vLLM's ``ngram``
    ran at 0.5 tokens/s instead of 43 in a multiprocess engine."""
    env = {k: v for k, v in os.environ.items() if k not in (split.HOST_THREADS_ENV, "NUMBA_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", _NGRAM, how], capture_output=True, text=True, env=env, timeout=300)
    assert "TORCH_THREADS 1" in out.stdout, (out.stdout, out.stderr[-2000:])


@THREADS
def test_kv_moves_take_threads_from_two_parts_of_move_part(threads, monkeypatch):
    """``KVMover.move`` on the CPU: the threaded kernel, with a thread a part, where the moved
    elements (moves x heads x 2 head_size x layers) make two parts of ``MOVE_PART``; below, the
    one-thread kernel; both give the definition's caches."""
    from test_kv_moves import _layers, _reference_move
    from vllm_anisotropic.integration.vllm.engine.kv_moves import MOVE_PART, KVMover

    kv = kernels.load("kv")
    calls = []
    for name in ("move_slots", "move_slots_threads"):
        real = getattr(kv, name)
        monkeypatch.setattr(kv, name, lambda *a, _real=real, _name=name: (calls.append((_name, a[8:])), _real(*a)))
    assert threads(2) == 2
    caches = [torch.randn(64, 2, 16, 2 * 16).to(torch.bfloat16) for _ in range(4)]
    before = [c.clone() for c in caches]
    mover = KVMover.from_layers(_layers(caches))
    per_move = 2 * 2 * 16 * len(caches)  # elements a move copies over every layer
    small = 2 * MOVE_PART // per_move - 1  # one move short of two parts
    for m in (small, small + 1):
        calls.clear()
        src, dst = list(range(100, 100 + m)), list(range(300, 300 + m))
        mover.move(torch.tensor(src), torch.tensor(dst))
        assert calls == ([("move_slots", ())] if m == small else [("move_slots_threads", (2,))]), (m, calls)
        for cache, old in zip(caches, before):
            assert torch.equal(cache.view(torch.int16), _reference_move(old, src, dst).view(torch.int16))
        before = [c.clone() for c in caches]
