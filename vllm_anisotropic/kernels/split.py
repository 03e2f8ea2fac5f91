"""How many threads a step's vocabulary pass runs on (``row_threads``): the harvest's top-k and the
greedy walk's argmax read each logits row on its own, so their ``*_threads`` kernels split the
rows (the walk: the trees) into contiguous parts, one a thread, over numba's threading layer; the
K/V slot moves split the layers the same way (``kernels.kv.move_slots_threads``).

Why: on a CPU server the forward holds every core of the rank and the plugin's host work after it
ran on one; the vocabulary passes are the largest share of that work (a 49,152-token bf16 row:
~18 us of top-k, ~4.5 us of argmax). A part gets the callers' ``min_part`` at least: 2 rows of
top-k (two rows split: 35 -> 20 us alone), 32 rows of argmax, 8 walked trees (parts of 4 trees
made the walk at 8 requests ~7 % slower in the engine); K/V moves (``kv_moves.MOVE_PART``)
from 8,192 elements.

The layer: OpenMP first (measured: a part starts at once right after torch's forward; numba's
``workqueue`` threads, woken through a queue, and Python threads gained nothing in vLLM's engine,
where torch's OpenMP threads still spin). OpenMP's threads do not survive a ``fork``: a child of a
process whose torch had run OpenMP threads hung at its first threaded pass, and numba aborts a
child of one whose numba had; so a child forked after this package loaded (``kernels/__init__``
imports this module) runs the one-thread kernels (vLLM's CPU platform spawns its engine and
workers). The cores: vLLM's CPU worker binds its OpenMP threads one to a core, and a thread
inherits its creator's binding, so the count is that of the union of the bindings of every thread
of the process (``/proc/self/task``), read at the first pass. numba sizes its pool from the
importing thread's binding (one core in a CPU worker), so the first pass sizes it (``_size_pool``)
before it starts the threads, and only then: numba's OpenMP start sets the OpenMP thread count of
the thread that starts it to the pool's size, and vLLM's own numba kernels (the ``ngram``
proposer) start it on the engine's thread. A pool sized for the whole process before that (as
``NUMBA_NUM_THREADS`` in every process, 3d35a61 and before) gave torch's forward two OpenMP
threads on its one core: vLLM's ``ngram`` ran at 0.5 tokens/s instead of 43 in a multiprocess
engine. ``VLLM_ANISOTROPIC_HOST_THREADS``: the threads a pass may use (default: those cores, at
most 8; 1: one thread). numba is imported here only when a pass asks (``kernels/__init__``).
"""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["HOST_THREADS_ENV", "MAX_THREADS", "host_threads", "row_threads", "run_rows"]

logger = logging.getLogger(__name__)

HOST_THREADS_ENV = "VLLM_ANISOTROPIC_HOST_THREADS"
MAX_THREADS = 8
_LAYERS = ("omp", "tbb")  # layers that start a part without a queue's wake-up

_threads: tuple[int, int] | None = None  # (pid, threads) of this process
_forked = False  # this process is a fork child: one thread


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def _size_pool() -> None:
    """numba's pool to a thread per CPU of the machine (a pass asks for its own count,
    ``row_threads``, and OpenMP starts threads as passes ask for them) if its threads have not
    started (no one ran a threaded kernel yet in this process) and ``NUMBA_NUM_THREADS`` is unset
    (a value the user set is kept). numba reads the count at its import into three places, each
    set here: its config (reloaded from the variable, which later reloads then agree with; its
    check passes, no thread yet), the threading module's copy that its start reads, and the bound
    ``set_num_threads`` checks (a closure; a numba whose check has another shape keeps its pool,
    and the passes one thread). The variable stays set: a process this one spawns inherits it."""
    import numba
    from numba.np.ufunc import parallel

    threads = max(len(os.sched_getaffinity(0)), os.cpu_count() or 1)
    check = parallel.snt_check
    cells = dict(zip(check.__code__.co_freevars, check.__closure__ or ()))
    with parallel._backend_init_thread_lock:  # no pool starts between the check and the sizing
        if (parallel._is_initialized or "NUMBA_NUM_THREADS" in os.environ or threads <= parallel.NUM_THREADS
                or set(cells) != {"NUMBA_NUM_THREADS", "msg"}):
            return
        os.environ["NUMBA_NUM_THREADS"] = str(threads)
        numba.config.reload_config()
        parallel.NUM_THREADS = numba.config.NUMBA_NUM_THREADS
        cells["NUMBA_NUM_THREADS"].cell_contents = parallel.NUM_THREADS
        cells["msg"].cell_contents = f"The number of threads must be between 1 and {parallel.NUM_THREADS}"


def _process_cores() -> set[int]:
    """The union of the CPU bindings of every thread of this process (this thread's on error)."""
    cores: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            cores |= os.sched_getaffinity(int(tid))
        except (OSError, ValueError):  # the thread ended
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
        raise ValueError(f"{HOST_THREADS_ENV}={raw!r}: expected a whole number >= 1 (1: one thread)")
    return value


def _launch(threads: int) -> int:
    """Start numba's threading layer (OpenMP first, unless numba's own variables choose): the
    threads a pass may use, 1 where no layer that starts a part at once loads."""
    import numba
    from numba.np.ufunc import parallel

    _size_pool()  # first: numba's config reload resets the priority below
    if not (os.environ.get("NUMBA_THREADING_LAYER") or os.environ.get("NUMBA_THREADING_LAYER_PRIORITY")):
        numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
    failed: list[BaseException] = []

    def start() -> None:
        try:
            parallel._launch_threads()
        except Exception as e:  # no layer loads here (numba raises ValueError)
            failed.append(e)

    # on a thread of its own: numba's OpenMP start sets the OpenMP thread count of the thread that
    # starts it (torch's too, its libgomp answering), and the engine's thread runs the forward
    starter = threading.Thread(target=start, name="vllm-anisotropic-numba-start")
    starter.start()
    starter.join()
    if failed:
        logger.warning("vllm-anisotropic: numba's threading layer did not load (%s); vocabulary passes and K/V "
                       "moves on one thread", failed[0])
        return 1
    layer = numba.threading_layer()
    if layer not in _LAYERS:
        logger.info("vllm-anisotropic: numba's threading layer is %r; vocabulary passes and K/V moves on one thread",
                    layer)
        return 1
    return max(1, min(threads, parallel.NUM_THREADS))  # the pool numba started: ours, or an earlier starter's


def host_threads() -> int:
    """The threads a pass may use in this process (numba's layer started on the first ask)."""
    global _threads
    pid = os.getpid()
    if _threads is None or _threads[0] != pid:
        threads = _threads_wanted(len(_process_cores()))
        if _forked:
            threads = 1  # OpenMP's threads do not survive a fork (module docstring)
        elif threads > 1:
            threads = _launch(threads)
        _threads = (pid, threads)
        logger.debug("vllm-anisotropic: vocabulary passes and K/V moves on %d thread(s)", threads)
    return _threads[1]


def row_threads(n: int, min_part: int) -> int:
    """Threads for a pass over ``n`` rows (or trees, or layers), each part ``min_part`` or more: 1 means the
    one-thread kernel; above, numba's thread count for this thread is set to it for the
    ``*_threads`` kernel the caller runs next."""
    if n < 2 * min_part:
        return 1
    threads = min(n // min_part, host_threads())
    if threads > 1:
        import numba

        numba.set_num_threads(threads)
    return threads


def run_rows(one, threaded, n: int, min_part: int, *args) -> None:
    """``one(*args)``, or ``threaded(*args, threads)`` where a pass over ``n`` rows (or trees)
    takes threads (``row_threads``)."""
    threads = row_threads(n, min_part)
    if threads == 1:
        one(*args)
    else:
        threaded(*args, threads)
