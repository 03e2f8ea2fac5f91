"""Rows of a vocabulary pass spread over the process's cores (``split_rows``): the harvest's top-k
and the greedy walk's argmax read each logits row on its own, and their compiled kernels release
the GIL (``nogil``), so parts of a step's rows run at once on helper threads.

Why: on a CPU server the forward holds every core of the rank and the plugin's host work after it
holds one; the vocabulary passes are the largest share of that work (a 49,152-token bf16 row:
~18 us of top-k, ~4.5 us of argmax). A hand-off to a sleeping helper costs ~40-60 us (a futex
wake), so the callers give a part ~150 us of work at least (``min_part``).

The cores: vLLM's CPU worker binds its OpenMP threads one to a core, the engine's thread among
them, and a thread inherits its creator's binding; so the helpers take the union of the bindings
of every thread of the process (``/proc/self/task``) when the first split runs (after the first
forward has started the OpenMP threads). ``VLLM_ANISOTROPIC_HOST_THREADS``: the threads a split
may use, the caller's included (default: those cores, at most 8; 1: no helpers).
No numba here (imported by modules that load before vLLM's worker scan, ``kernels/__init__``).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

__all__ = ["HOST_THREADS_ENV", "split_rows", "host_threads"]

logger = logging.getLogger(__name__)

HOST_THREADS_ENV = "VLLM_ANISOTROPIC_HOST_THREADS"
MAX_THREADS = 8

_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor | None, int] | None = None  # (pid, helpers, threads)


def _process_cores() -> set[int]:
    """The union of the CPU bindings of every thread of this process (this thread's on error)."""
    cores: set[int] = set()
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                cores |= os.sched_getaffinity(int(tid))
            except OSError:  # the thread ended
                pass
    except OSError:
        pass
    return cores or set(os.sched_getaffinity(0))


def _threads_wanted(cores: int) -> int:
    raw = os.environ.get(HOST_THREADS_ENV, "").strip()
    if not raw:
        return max(1, min(cores, MAX_THREADS))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{HOST_THREADS_ENV}={raw!r}: expected a whole number >= 1 (1: no helper threads)")
    return value


def host_threads() -> int:
    """The threads a split uses in this process, the caller's included (started on first use)."""
    global _pool
    pool = _pool
    if pool is not None and pool[0] == os.getpid():
        return pool[2]
    with _lock:
        if _pool is None or _pool[0] != os.getpid():  # a forked child starts its own
            cores = _process_cores()
            threads = _threads_wanted(len(cores))
            helpers = None
            if threads > 1:
                helpers = ThreadPoolExecutor(threads - 1, thread_name_prefix="anisotropic-rows",
                                             initializer=_bind, initargs=(frozenset(cores),))
            _pool = (os.getpid(), helpers, threads)
            logger.debug("vocabulary passes: %d thread(s) over cores %s", threads, sorted(cores))
        return _pool[2]


def _bind(cores: frozenset[int]) -> None:
    try:
        os.sched_setaffinity(0, cores)
    except OSError:  # not allowed here: the inherited binding stays
        pass


def split_rows(call: Callable[[int, int], None], n: int, min_part: int) -> None:
    """``call(lo, hi)`` over ``[0, n)`` in contiguous parts of ``min_part`` or more: the first part
    on this thread, the others on helpers (``call`` must release the GIL to gain: a numba
    ``nogil`` kernel writing only its own rows' outputs). A helper's exception is raised here."""
    parts = min(n // min_part, host_threads()) if n >= 2 * min_part else 1
    if parts <= 1:
        call(0, n)
        return
    bounds = [n * i // parts for i in range(parts + 1)]
    helpers = _pool[1]
    futures = [helpers.submit(call, bounds[i], bounds[i + 1]) for i in range(1, parts)]
    try:
        call(bounds[0], bounds[1])
    finally:
        for f in futures:
            f.result()
