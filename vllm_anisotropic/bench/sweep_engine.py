"""The engine process of ``vllm-anisotropic bench``: one method's vLLM engine runs every cell of
its job (``SweepJob``) and appends one record per cell.

``sweep.py`` starts it by file path (``python -c <runpy> this_file job.json out.jsonl``), so the
harness is always this tree's while a ``NAME+src`` engine imports ``vllm_anisotropic`` from the
tree under test: the module needs nothing of the package (standard library, pydantic and vLLM
only), and an older tree, whose bench lacks what this one records, is measured the same way.

Per cell, besides tokens and seconds: vLLM's ``vllm:spec_decode_*`` counters, and, for an engine
with the budget allocator, its decode-step counts from the scheduler's stats file
(``<VLLM_ANISOTROPIC_TREE_STATS>.budget``, written when the batch drains, so exact at a cell's
end): how many steps the measured gate made tree steps, chain steps or plain steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# = integration.vllm.engine.metrics.STATS_ENV (tests/test_bench.py checks); the allocator's
# file is that path + ".budget" (metrics.budget_stats_path)
STATS_ENV = "VLLM_ANISOTROPIC_TREE_STATS"
# the allocator's counters recorded per cell (BudgetMetrics fields; draft_resume_seconds is not in older trees)
BUDGET_FIELDS = ("steps", "steps_without_drafts", "gate_plain_steps", "chain_steps", "chain_drafts", "tree_rows",
                 "draft_resume_seconds", "draft_unrepaid_catchups")
# the measured gate leaves its warm-up at a batch size once each of its arms there has
# GateConfig.min_steps (8) steps (allocator/config.py); its buckets: allocator.gate.bucket with
# GateConfig.exact_buckets (4) (tests/test_bench.py checks both against the package)
GATE_MIN_STEPS = 8
GATE_EXACT_BUCKETS = 4
# most warm-up loops at one concurrency while the gate's bucket there is still warming up
WARMUP_ROUNDS = 4


class SweepJob(BaseModel):
    """What one engine process runs: every (repeat, concurrency) cell of one method."""

    model_config = ConfigDict(extra="forbid")

    model: str
    method: str
    speculative_config: dict[str, Any] | None
    cell_prompts: list[list[str]]
    """Prompts of each cell, in cell order (repeat-major, then concurrency)."""
    cells: list[tuple[int, int]]
    """(repeat, concurrency) of each cell, in order."""
    warmup_prompts: list[str]
    warmup_loop: int | None = Field(default=None, ge=1)
    """Prompts of one warm-up loop (the first ones of ``warmup_prompts``; the next loop at the same
    concurrency takes the next ones); None: all of them."""
    warmup: Literal["each", "largest"] = "each"
    """Warm up at each concurrency of the job up to the warm-up's prompts (``each``: the gate's
    warm-up at those batch sizes done before the cells, as on a server that has run a
    while) or at the largest alone (``largest``: smaller batch sizes start cold)."""
    max_tokens: int = Field(ge=1)
    warmup_tokens: int | None = Field(default=None, ge=1)
    """``max_tokens`` of the warm-up's requests; None: the cells' ``max_tokens``."""
    concurrency: list[int]
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature of the cells (0: greedy); sampled requests are seeded by their index."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Top-p of the sampled cells (1: off)."""
    llm_kwargs: dict[str, Any] = Field(default_factory=dict)
    """``LLM`` keyword arguments (the CPU defaults already merged in by the caller)."""
    record_base: dict[str, Any] = Field(default_factory=dict)
    """Copied into every record (model name, datasets, dtype, environment)."""


def counters(llm, kind: str = "Counter") -> dict[str, float]:
    """vLLM's counters (or another ``kind`` of metric) of the run, summed over label sets."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if type(metric).__name__ == kind:
            out[metric.name] = out.get(metric.name, 0.0) + float(metric.value)
    return out


def spec_counters(llm) -> dict[str, int]:
    """vLLM's ``vllm:spec_decode_*`` counters so far (missing ones read 0)."""
    out: dict[str, int] = defaultdict(int)
    for name, value in counters(llm).items():
        if name.startswith("vllm:spec_decode_"):
            out[name.removeprefix("vllm:spec_decode_")] = int(value)
    return out


def _budget_stats() -> dict:
    path = os.environ.get(STATS_ENV)
    try:
        with open(f"{path}.budget", encoding="utf-8") as f:
            data = json.load(f)
    except (TypeError, OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def budget_counters() -> dict[str, float]:
    """The allocator's counters so far (``BUDGET_FIELDS``), from its stats file; {} without one
    (no tree method, or the allocator off)."""
    data = _budget_stats()
    return {k: data.get(k, 0) for k in BUDGET_FIELDS} if data else {}


def gate_rates() -> dict:
    """The measured gate's state so far, per batch-size bucket (``SpeculationGate.rates``: each
    arm's rate and steps, the decisions), from the allocator's stats file; {} without one. A
    cell records it as it stands at the cell's end (since the engine started, not the cell's
    share): why a gate stayed closed or open is read from it."""
    return _budget_stats().get("gate") or {}


def step_kinds(budget: dict[str, int]) -> dict[str, int]:
    """Decode steps by the measured gate's decision: ``plain`` (the gate kept drafting off),
    ``chains`` (chain steps), ``trees`` (the rest: the allocator cut a drafted tree, to nothing
    at times); {} without the allocator's counters."""
    if not budget.get("steps"):
        return {}
    plain, chains = budget["gate_plain_steps"], budget["chain_steps"]
    return {"trees": budget["steps"] - plain - chains, "chains": chains, "plain": plain}


def closed_loop(engine, prompts: list[str], params, concurrency: int, tag: str) -> tuple[list[list[int]], float]:
    """Generate every prompt with at most ``concurrency`` requests in flight; (outputs, seconds).
    Sampled ``params`` get a seed per prompt (its index), the same for every method."""
    outputs: list[list[int] | None] = [None] * len(prompts)
    next_prompt, in_flight = 0, 0
    started = time.perf_counter()
    while next_prompt < len(prompts) or in_flight:
        while next_prompt < len(prompts) and in_flight < concurrency:
            own = params
            if params is not None and params.temperature > 0:
                own = params.clone()
                own.seed = next_prompt
            engine.add_request(f"{tag}-{next_prompt}", prompts[next_prompt], own)
            next_prompt += 1
            in_flight += 1
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id.rsplit("-", 1)[1])] = list(out.outputs[0].token_ids)
                in_flight -= 1
    return outputs, time.perf_counter() - started


def gate_bucket(num_reqs: int) -> int:
    """The measured gate's batch-size bucket of ``num_reqs`` requests (``allocator.gate.bucket``
    at the default ``exact_buckets``): the key of its state in the stats file."""
    r = max(int(num_reqs), 1)
    return r if r <= GATE_EXACT_BUCKETS else 1 << (r - 1).bit_length()


def gate_warming(num_reqs: int) -> bool:
    """Whether the measured gate at ``num_reqs`` requests is still in its warm-up: an arm there
    (plain, tree, chain where the gate has chains) with fewer than ``GATE_MIN_STEPS`` steps, by
    the stats file (current once a batch drains). False without a gate: no stats file (plain
    decoding, vLLM's own methods) or one without ``gate`` (the allocator or its gate off)."""
    gate = gate_rates()
    if not gate:
        return False
    b = gate.get(str(gate_bucket(num_reqs)), {})
    arms = [b[k] for k in ("plain_steps", "spec_steps", "chain_steps") if k in b]
    return not arms or min(arms) < GATE_MIN_STEPS


def warm_up(engine, job: SweepJob, params) -> list[int]:
    """Run the warm-up's prompts (``params``: ``warmup_params``) at the largest concurrency of
    ``job``, then (``job.warmup`` "each") at each other one in increasing order:
    the engine's first steps, and the measured gate's warm-up at those batch sizes. The largest
    goes first so that the engine's cold first steps (q's first forwards, the acceptance model
    before any label) land in its bucket, not in one request's, whose gate they closed for ~80
    steps in a run (2026-12-07). A concurrency above the number of warm-up prompts (8) runs as
    that number: larger batch sizes start cold. With ``each``, a concurrency's loop runs again on
    the next ``warmup_loop`` prompts (up to ``WARMUP_ROUNDS`` loops) while the gate there is
    still in its warm-up: one loop of two requests left it mid-way there (3 plain and 2 tree steps
    of 8 each; its plain blocks then fell into the cells, 7 of ~40 decode steps, 2026-12-07), a
    cost a server pays once per batch size. Returns the concurrency of each loop run."""
    size = job.warmup_loop or len(job.warmup_prompts)
    if job.warmup == "largest":
        run = [max(job.concurrency)]
    else:
        sizes = sorted({min(c, size) for c in job.concurrency})
        run = sizes[-1:] + sizes[:-1]
    loops = []
    for conc in run:
        for k in range(WARMUP_ROUNDS if job.warmup == "each" else 1):
            prompts = job.warmup_prompts[k * size : (k + 1) * size]  # other prompts each loop
            if not prompts:
                break
            closed_loop(engine, prompts, params, conc, f"warm{conc}-{k}")
            loops.append(conc)
            if not gate_warming(conc):
                break
    return loops


def warmup_params(job: SweepJob, sampling_params):
    """The warm-up requests' ``sampling_params`` (vLLM's class): the cells' law, as many tokens as
    theirs unless ``job.warmup_tokens`` says: the measured gate reads its arms' first rates off
    them, and shorter requests weigh a draft model's prompt catch-up (a cost once per request)
    more than the cells do."""
    return sampling_params(max_tokens=job.warmup_tokens or job.max_tokens, temperature=job.temperature,
                           top_p=job.top_p)


def run_job(job: SweepJob, out_file: Path) -> None:
    """Start vLLM once for ``job.method`` and append one record per cell to ``out_file``."""
    from vllm import LLM, SamplingParams

    if len(job.cell_prompts) != len(job.cells):
        raise ValueError(f"{len(job.cells)} cells but {len(job.cell_prompts)} prompt sets")
    started = time.perf_counter()
    llm = LLM(model=job.model, speculative_config=job.speculative_config, disable_log_stats=False,
              max_num_seqs=max(job.concurrency), **job.llm_kwargs)
    startup = time.perf_counter() - started
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=job.max_tokens, temperature=job.temperature, top_p=job.top_p)
    warmup_loops = warm_up(engine, job, warmup_params(job, SamplingParams))
    for i, ((repeat, conc), prompts) in enumerate(zip(job.cells, job.cell_prompts)):
        before, budget_before = spec_counters(llm), budget_counters()
        outputs, seconds = closed_loop(engine, prompts, params, conc, f"r{repeat}c{conc}")
        after, budget_after = spec_counters(llm), budget_counters()
        tokens = sum(len(o) for o in outputs)
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        budget = {k: v - budget_before.get(k, 0) for k, v in budget_after.items()}
        record = {
            **job.record_base, "method": job.method, "speculative_config": job.speculative_config,
            "concurrency": conc, "repeat": repeat, "temperature": job.temperature, "top_p": job.top_p, "num_prompts": len(prompts), "max_tokens": job.max_tokens,
            "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tau": tokens / (tokens - accepted) if tokens > accepted else 1.0,
            "num_drafts": after["num_drafts"] - before["num_drafts"],
            "draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
            "accepted_tokens": accepted, "startup_seconds": startup, "warmup_loops": warmup_loops,
            "output_sha1": [hashlib.sha1(json.dumps(o).encode()).hexdigest()[:12] for o in outputs],
            **({"budget": budget, "decode_steps": step_kinds(budget)} if budget.get("steps") else {}),
            **({"gate": gate} if (gate := gate_rates()) else {}),
        }
        with open(out_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        kinds = record.get("decode_steps")
        print(f"[{job.method} {i + 1}/{len(job.cells)}] concurrency {conc} repeat {repeat}: {tokens} tokens in "
              f"{seconds:.2f} s = {tokens / seconds:.1f} tokens/s, tau {record['tau']:.2f}"
              + (f", decode steps {kinds}" if kinds else ""), file=sys.stderr, flush=True)


# started by path: ``python -c RUN_BY_PATH <this file> job.json out.jsonl`` (sys.path[0] is the
# working directory, as with ``-m``, not this file's folder)
RUN_BY_PATH = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def main(argv: list[str]) -> int:
    job_file, out_file = argv
    run_job(SweepJob.model_validate_json(Path(job_file).read_text()), Path(out_file))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
