"""Independent rows of a compiled kernel shared out over threads (the CPU harvest's top-k rows,
the greedy walk's trees): ``run(call, n)`` calls ``call(lo, hi)`` on contiguous shares of
``[0, n)``, the first on the calling thread, the others on helper threads. The kernels release
the GIL (``nogil``), so the shares run at once; each row's arithmetic is the one-thread kernel's,
so the results are the same bits.

Threads: torch's intra-op count (the cores vLLM's CPU worker gives its forward, idle while the
host path runs; 1 under tensor parallelism on two cores), each share at least
``SHARED_MIN // 2`` rows, none below ``SHARED_MIN`` rows. Idle helpers block on their queue:
no spinning that would take a core from the next forward (numba's own threading layer, tried
on 2026-12-04 with ``prange``, slowed the forward 17-21 %). The pool is rebuilt in a forked
child (threads do not survive a fork). No numba here (``kernels/__init__.py``: the plugin's
imports must not load it).

Measured on a 2-core AMD EPYC (bf16 rows of 49,152 logits, top-10): 8 rows 152 -> 112 us,
16 rows 304 -> 199 us, 64 rows 1.43 -> 0.74 ms; one row alone would take 20 -> 66 us (the
hand-off), hence the threshold.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

__all__ = ["SHARED_MIN", "Shares", "run", "threads_for"]

SHARED_MIN = 8  # from this many rows on the rows are shared out


def threads_for(n: int) -> int:
    """How many threads share ``n`` rows: torch's intra-op threads, each share at least
    ``SHARED_MIN // 2`` rows; 1 below ``SHARED_MIN``. Example, 2 torch threads: 7 -> 1, 8 -> 2."""
    if n < SHARED_MIN:
        return 1
    import torch

    return max(1, min(torch.get_num_threads(), n // (SHARED_MIN // 2)))


class Shares:
    """A pool of helper threads, grown on demand, rebuilt after a fork."""

    def __init__(self) -> None:
        self.pool: ThreadPoolExecutor | None = None
        self.pid = -1
        self.size = 0

    def run(self, call, n: int) -> None:
        """``call(lo, hi)`` over ``[0, n)`` in ``threads_for(n)`` contiguous shares; returns when
        all are done (an exception of any share is raised here)."""
        k = threads_for(n)
        if k == 1:
            call(0, n)
            return
        if self.pool is None or self.pid != os.getpid() or self.size < k - 1:
            if self.pool is not None and self.pid == os.getpid():
                self.pool.shutdown(wait=False)
            self.pool, self.pid, self.size = ThreadPoolExecutor(k - 1, thread_name_prefix="shares"), os.getpid(), k - 1
        cuts = [n * i // k for i in range(k + 1)]
        helpers = [self.pool.submit(call, cuts[i], cuts[i + 1]) for i in range(1, k)]
        try:
            call(cuts[0], cuts[1])
        finally:
            for share in helpers:
                share.result()


_SHARES = Shares()


def run(call, n: int) -> None:
    """``Shares.run`` on the process's pool."""
    _SHARES.run(call, n)
