"""The measured gate: speculate at a batch size only where speculation has measured faster.

Scope: one guard on top of ``allocate``. The allocator's decision is a prediction (a cost
model times an acceptance model); where either is wrong at some batch size, speculation can
lose to plain decoding step after step without anything noticing. The gate measures the
outcome instead: per batch size R (number of scheduled requests), the realized tokens per
second of *decode steps* in two arms,

    plain:       the workers drafted nothing for the step, no request verified a draft and
                 none re-ran accepted tree tokens
    speculative: the gate let the step draft (whatever the allocator then kept), some request
                 verified drafts, or re-ran tokens accepted the step before

(re-run tokens are speculation's cost, so they count against it; so do the proposing, scoring,
allocating and harvesting of drafts the allocator cut to nothing: a gate that counted such steps
as plain stayed open at eight requests on a 2-core CPU, every step paying ~1.5 ms of drafting
for no draft kept), and lets the allocator keep
drafts at R only while the speculative arm's rate beats the plain arm's by more than
``margin`` (below). Steps with
prompt tokens (prefill chunks, new or resumed requests) belong to neither arm.

    rate(arm, R) = sum_s w_s tokens_s / sum_s w_s seconds_s

with w_s = decay ** (decode steps at R since s), counted over both arms, and each step's
seconds clipped at ``clip`` x the median of the bucket's last ``window`` steps (both arms): a
stall from outside (another process, a page fault storm) can take 50x a step's time, and one
such step among the sixteen of an arm's warm-up would decide the arm (clipped, it moves the
arm's rate by <= 1/8); a step that is genuinely slower (tree rows, re-runs: ~2.5x a plain step
at eight requests, measured) is kept whole. Then the arm the gate
exploits follows the latest ~1 / (1 - decay) steps, and the other arm's old steps fade at the
same pace, so its few recent exploration steps soon outweigh them.

Decisions per bucket of R (``bucket``: exact up to ``exact_buckets``, then powers of two).
Plain decisions come in blocks: every switch from speculation to plain lasts ``block`` steps,
because the engine can measure a plain step apart from speculation only between plain steps
(``GateConfig.block``); speculative decisions are single steps.

1. warm-up, until the plain arm has ``min_steps`` steps: one speculative step, one plain
   block, and again (the allocator alone may never choose plain where it believes speculation
   pays); then until the speculative arm has ``min_steps``: the allocator decides. A bucket
   created below one whose warm-up measured speculation faster (``_open_above``: the tail of a
   batch, as its requests finish) speculates first instead, then measures plain in blocks:
   in a bench of 64 requests the buckets of 1-8 live ~3-6 steps each, and warming up
   plain-first spent them mostly plain where speculation pays most;
2. then exploit the arm with the higher rate (speculation only where it is faster by more than
   ``margin``, 10 %: ties go to plain; ``GateConfig.margin`` says why). A closed gate
   speculates every ``explore_every``-th decision where speculation falls short by
   ``explore_shortfall`` (20 %) or more, and proportionally more often where it is closer (``_explore_period``), so it re-opens soon
   when speculation starts paying (longer context, different text: the speculative rate
   moves with the text); an open one starts a plain block every
   ``explore_plain_every``-th decision (a plain step's rate depends on the batch and context
   sizes, not on the text, so it needs fewer refreshes), and notices at once when the
   speculative rate falls.

Example (block 2, min_steps 2, explore_every 4): decisions 1..4 allow, plain, plain (a block),
allow (warm-up; then the speculative arm's second step); measured plain 100 tokens/s,
speculative 80 -> 5..7 plain, 8 allow (explores), 9..11 plain, 12 allow, ...

A decision here never looks at a step's own samples (only at past steps' times and token
counts), so it cannot bias the verifiers' output law. The cost of the gate where speculation
does pay: the warm-up's plain blocks (once per bucket) and one plain block in
``explore_plain_every`` decisions afterwards (``block`` / ``explore_plain_every`` = 1/32 of
the gain at the defaults).

**Chain steps** (``GateConfig.chains``, for proposers that can draft a chain alone: GOOSE's
context-match spine). The speculative arm splits in two kinds, measured apart: *tree* steps
(the proposer's whole tree, ranked by the acceptance model, cut by the allocator, its rows
harvested) and *chain* steps (each request's spine chain alone, up to ``chain_drafts`` tokens:
no branches, no ranking or labelling, no cut, no harvest; a step then costs what vLLM's
``ngram`` step costs, measured on the AMX Xeon at sixteen requests: 33.6 vs 33.4 ms for 19.5
tokens, against 41.3 ms for a GOOSE tree step). Where the gate speculates it picks the kind:
each kind first gets ``min_steps`` steps (the less measured one goes first, a tie to chains),
then the faster one, trees only when they are faster by more than ``margin`` (ties go to the
cheaper chains), the other explored every ``explore_every``-th speculative decision. The
speculative rate that plain decoding is compared with is the chosen kind's.

This is the gate of docs/allocator.md, section "The measured gate" (its dated runs:
docs/measurements/cpu/allocator_measurements.md); ECHO (arXiv 2604.09603) has no such guard:
its cost model is a fixed profile.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


from .config import GateConfig

__all__ = ["SpeculationGate", "GateArm", "bucket", "PLAIN", "TREE", "CHAIN"]

# a step's kind (the gate's arms; ``decide``): True / False in ``observe`` read as TREE / PLAIN
PLAIN, TREE, CHAIN = 0, 1, 2


def bucket(num_reqs: int, exact_buckets: int) -> int:
    """Batch-size bucket: R itself up to ``exact_buckets``, then the next power of two.

    Example (exact_buckets 8): 1..8 -> 1..8, 9..16 -> 16, 17..32 -> 32, 33 -> 64."""
    r = max(int(num_reqs), 1)
    if r <= exact_buckets:
        return r
    return 1 << (r - 1).bit_length()


@dataclass
class GateArm:
    """One arm in one bucket: steps observed, and decayed sums of tokens and seconds."""

    count: int = 0
    tokens: float = 0.0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def fade(self, decay: float) -> None:
        self.tokens *= decay
        self.seconds *= decay

    def add(self, tokens: float, seconds: float) -> None:
        self.count += 1
        self.tokens += tokens
        self.seconds += seconds


@dataclass
class _Bucket:
    arms: tuple[GateArm, GateArm, GateArm] = field(default_factory=lambda: (GateArm(), GateArm(), GateArm()))  # PLAIN, TREE, CHAIN
    decisions: int = 0
    spec_decisions: int = 0  # decisions that chose a speculative kind (``kind``)
    allow: bool = False  # the latest decision (False first: the warm-up starts speculating)
    plain_left: int = 0  # decisions left in the current plain block
    explored: int = 0  # the decision of a closed gate's last exploring step (or the last open one)
    spec_first: bool = False  # warm up speculating first: a larger batch size measured speculation faster
    recent: deque = field(default_factory=deque)  # seconds of the latest ``window`` steps, both arms


class SpeculationGate:
    """Per-batch-size choice between plain and speculative steps, from measured step rates."""

    def __init__(self, config: GateConfig | None = None) -> None:
        self.config = config or GateConfig()
        c = self.config
        self._explore_plain_every = c.explore_plain_every or c.block * c.explore_every
        self._buckets: dict[int, _Bucket] = {}

    def _bucket(self, num_reqs: int) -> _Bucket:
        key = bucket(num_reqs, self.config.exact_buckets)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(recent=deque(maxlen=self.config.window),
                                             spec_first=self._open_above(key))
        return b

    def _open_above(self, key: int) -> bool:
        """Whether the nearest larger bucket that finished its warm-up measured speculation
        faster than plain decoding (by ``margin``): speculation's gain only grows as the batch
        shrinks (measured on the AMX Xeon: 1.67x at one request to 1.15x at eight), so a new
        smaller bucket (the tail of a batch, as its requests finish) speculates first."""
        for k in sorted(k for k in self._buckets if k > key):
            verdict = self._verdict(*self._compared(self._buckets[k]))
            if verdict is not None:
                return verdict
        return False

    def _compared(self, b: _Bucket) -> tuple[GateArm, GateArm]:
        """The arms the gate compares: plain, and the kind ``kind`` takes."""
        return b.arms[PLAIN], b.arms[self._best_kind(b)]

    def _verdict(self, plain: GateArm, spec: GateArm) -> bool | None:
        """None while either arm has fewer than ``min_steps`` steps (the warm-up); then whether
        speculation is faster than plain by more than ``margin``."""
        c = self.config
        if plain.count < c.min_steps or spec.count < c.min_steps:
            return None
        return spec.rate > plain.rate * (1.0 + c.margin)

    def allows(self, num_reqs: int) -> bool:
        """May the allocator keep drafts in this step of ``num_reqs`` requests? (Counts a decision.)"""
        b = self._bucket(num_reqs)
        b.decisions += 1
        if b.plain_left > 0:  # inside a plain block
            b.plain_left -= 1
            allow = False
        else:
            allow = self._decide(b)
            if not allow and b.allow:  # from speculation to plain: a whole block
                b.plain_left = self.config.block - 1
        b.allow = allow
        return allow

    def decide(self, num_reqs: int) -> int:
        """The kind of the next step of ``num_reqs`` requests: PLAIN, TREE or CHAIN (counts a
        decision). Without ``chains`` the same as ``allows`` (TREE for True)."""
        if not self.allows(num_reqs):
            return PLAIN
        return self.kind(num_reqs) if self.config.chains else TREE

    def kind(self, num_reqs: int) -> int:
        """Which speculative kind a step the gate lets speculate runs (module docstring)."""
        b = self._bucket(num_reqs)
        best = self._best_kind(b)
        if min(b.arms[TREE].count, b.arms[CHAIN].count) < self.config.min_steps:
            return best  # warm-up: the less measured kind
        b.spec_decisions += 1
        other = TREE if best == CHAIN else CHAIN
        return other if b.spec_decisions % self.config.explore_every == 0 else best

    def _best_kind(self, b: _Bucket) -> int:
        """TREE without ``chains``; with them, while either kind has fewer than ``min_steps``
        steps the less measured one (a tie to chains), then trees only when faster than chains by
        more than ``margin``."""
        tree, chain = b.arms[TREE], b.arms[CHAIN]
        if not self.config.chains:
            return TREE
        if min(tree.count, chain.count) < self.config.min_steps:
            return TREE if tree.count < chain.count else CHAIN
        return TREE if tree.rate > chain.rate * (1.0 + self.config.margin) else CHAIN

    def _decide(self, b: _Bucket) -> bool:
        c = self.config
        plain, spec = self._compared(b)
        verdict = self._verdict(plain, spec)
        if verdict is None:
            b.explored = b.decisions  # a closed gate's first exploring step comes a period after the warm-up
            # warm-up: one speculative step, one plain block, ...; then the allocator decides
            # (speculating first in a bucket below one where speculation pays: ``_open_above``)
            if b.spec_first and spec.count < c.min_steps:
                return True
            return not b.allow if plain.count < c.min_steps else True
        if verdict:
            b.explored = b.decisions
            return b.decisions % self._explore_plain_every != 0
        if b.decisions - b.explored >= self._explore_period(plain.rate, spec.rate):
            b.explored = b.decisions
            return True
        return False

    def _explore_period(self, plain_rate: float, spec_rate: float) -> int:
        """Decisions between two exploring steps of a closed gate: ``explore_every`` where the
        speculative arm falls short of opening by ``explore_shortfall`` or more, proportionally
        fewer (down to ``explore_every`` // 8) where it is closer, so an exploring step costs at
        most ~``explore_shortfall`` / ``explore_every`` of a step's tokens either way (besides
        the switch steps of the plain block around it, which no arm counts), and an arm
        that is nearly paying (chain steps as the text starts repeating itself) gets measured
        often enough to open within a cell."""
        c = self.config
        shortfall = 1.0 - spec_rate / (plain_rate * (1.0 + c.margin)) if plain_rate > 0 else 1.0
        period = round(c.explore_every * min(max(shortfall, 0.0) / c.explore_shortfall, 1.0))
        return max(period, max(c.explore_every // 8, 1))

    def token_saving_s(self, num_reqs: int) -> float | None:
        """Seconds one emitted token saves at ``num_reqs`` requests by speculating (the kind
        ``kind`` takes) instead of decoding plainly: 1 / plain rate - 1 / speculative rate where
        the gate is open; where it is closed (its exploring steps) or still warming up, what a
        token would save at the rate that opens it (plain x (1 + ``margin``)), or at the
        speculative rate measured so far if that is higher. So an exploring or warm-up step
        resumes q only for requests that could repay the catch-up if speculation paid at least
        enough to open the gate: exploring stays cheap where speculation cannot pay (long
        prompts, short answers) and still measures it for the requests that can.

        A batch size whose plain arm has no step yet (the tail of a batch reaching a size the
        server has not run: two requests left of four) borrows the nearest measured bucket's
        saving (by ratio of sizes, ties to the smaller), scaled by that bucket's size over this
        one's (a token of a batch of R takes 1 / R of a step: one step's saving spread over fewer
        tokens); without it a cold size let every catch-up through, 1.26 s of q's resumes in a
        34.7-s bench cell at four requests (2026-12-07). None before any bucket's first plain
        step. A draft model's catch-up is worth it for a request only if its remaining tokens
        save more than it costs (``budget.BatchBudget.repay_next``). Counts no decision."""
        key = bucket(num_reqs, self.config.exact_buckets)
        measured = [k for k, b in self._buckets.items() if b.arms[PLAIN].rate > 0]
        if not measured:
            return None
        near = min(measured, key=lambda k: (max(k, key) / min(k, key), k))
        plain, spec = self._compared(self._buckets[near])
        saving = 1.0 / plain.rate - 1.0 / max(spec.rate, plain.rate * (1.0 + self.config.margin))
        return saving * near / key

    def observe(self, num_reqs: int, speculative: bool | int, tokens: int, seconds: float) -> None:
        """One decode step: its requests, arm (PLAIN / TREE / CHAIN; False / True = PLAIN /
        TREE), emitted tokens and wall seconds."""
        if seconds <= 0:
            return
        c = self.config
        b = self._bucket(num_reqs)
        clipped = min(seconds, c.clip * statistics.median(b.recent)) if len(b.recent) >= c.window // 4 else seconds
        b.recent.append(seconds)
        for arm in b.arms:
            arm.fade(c.decay)
        b.arms[int(speculative)].add(tokens, clipped)

    def rates(self) -> dict[int, dict[str, float]]:
        """Per bucket: each arm's rate (tokens/s; 0 before its first step) and steps, and the
        decisions made (``spec_`` is the tree arm; ``chain_`` with ``chains``)."""
        out = {}
        for key, b in sorted(self._buckets.items()):
            out[key] = {"plain_rate": b.arms[PLAIN].rate, "plain_steps": b.arms[PLAIN].count,
                        "spec_rate": b.arms[TREE].rate, "spec_steps": b.arms[TREE].count,
                        "decisions": b.decisions}
            if self.config.chains:
                out[key].update(chain_rate=b.arms[CHAIN].rate, chain_steps=b.arms[CHAIN].count)
        return out
