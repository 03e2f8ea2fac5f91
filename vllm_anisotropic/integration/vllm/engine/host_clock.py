"""The plugin's own host work per step, phase by phase: always on, a ``perf_counter`` pair per phase.

Scope: bookkeeping of seconds only. The drafter (worker) and the batch budget (scheduler) each
own a ``HostClock``; the per-step path adds the seconds of each of its stages to it. Phases are
leaves (no phase contains another), so their sum is the plugin's host work: what tree
speculation adds to vLLM's own per-step host work (``profile-host`` prints both, next to the
model forward). Not counted: vLLM's own code the plugin calls (``super()`` of an override, its
sampler for the bonus rows) and the tree rows' attention, which is compute inside the forward.

Worker phases: ``propose`` (drafting the next step's trees: eligibility, proposer, ranking,
labelling), ``prepare`` (cutting the scheduled trees, node positions, the attention plan's
inputs), ``plan`` (the attention plan's index arrays, built by the first layer), ``walk`` (the
verification of the step's trees, emitted tokens), ``kv`` (K/V slot moves of accepted nodes),
``harvest`` (metrics, the copy of the verified rows, and after the reply the adjacency-table
updates and the spine EMA), ``topk`` (the harvest's pass over the vocabulary: top-k and
log-sum-exp of every verified row; device work where the logits live on a GPU), ``label``
(the acceptance model's labels and refits, after the reply), ``finish`` (finished requests'
tokens into the cross-request store, after the reply), ``reply`` (the extras the step's output
carries: probabilities, chain lengths), ``states`` (request drops, tenants).
Scheduler phases: ``cut`` (the gate and the allocator), ``scheduled`` (the step's composition),
``on_output`` (cost model, gate, metrics), ``update`` (drafts applied from the output).
Both: ``stats`` (the stats files, written at most once a second, and the summary log line; the
worker's after the reply): a cost per second, ~0.3-0.7 ms a write, so per step it shrinks as
steps get shorter.

Cost of the clock itself: ~0.1 us per phase (two ``perf_counter`` calls and a dict update).
"""

from __future__ import annotations

import functools
import time

__all__ = ["HostClock", "timed"]


class HostClock:
    """Seconds and calls per phase (see module docstring)."""

    __slots__ = ("seconds", "calls")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        self.calls[phase] = self.calls.get(phase, 0) + 1

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


def timed(phase: str):
    """Method decorator: the call's wall seconds go to ``self.host_clock`` under ``phase``.

    ``@timed("cut") def cut(self, running): ...`` adds each call's duration to
    ``self.host_clock.seconds["cut"]``."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                self.host_clock.add(phase, time.perf_counter() - t0)

        return inner

    return wrap
