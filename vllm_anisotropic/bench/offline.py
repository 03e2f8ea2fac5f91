"""Run one offline ``LLM.generate`` job in a fresh process and return what it produced.

Why a separate process: vLLM's CPU engine spawns an EngineCore and worker processes and holds
its KV cache until the interpreter exits; running each configuration (plain decoding, each
speculative method) in its own process gives clean side-by-side measurements and lets tests
start vLLM many times without leaking memory.

Usage (what the demo and the engine tests do)::

    job = OfflineJob(model="/path/model", prompts=["def f(x):"], max_tokens=32,
                     speculative_config={"method": "custom_class", ...})
    result = run_offline_job(job)       # spawns ``python -m ...offline job.json out.json``
    result.token_ids[0], result.tokens_per_second, result.spec.tau
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from vllm_anisotropic.bench.sweep_engine import counters as _counters

# ``run_offline_job(job, env=IN_PROCESS)``: vLLM's engine core in the job's own process instead
# of a child process, and with one rank its worker too (vLLM's in-process executor; with
# ``distributed_executor_backend="mp"`` or tensor parallelism the workers stay processes of their
# own). Most engine tests run so: on 2 cores a job starts and ends in ~12 s instead of ~36-45 s (three
# interpreters each import vLLM, ~9 s apiece), and a 400-request job runs in ~27 s instead of
# ~55-62 s (no inter-process traffic). The production path (frontend, engine core and worker
# processes; the worker's deferred harvest after its reply; the scheduler's output crossing vLLM's
# message queue) is kept by the plugin, GOOSE, fault, request-type and server tests.
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
IN_PROCESS = {IN_PROCESS_ENV: "0"}
# ``llm_kwargs`` that keep a one-rank worker in a process of its own under ``IN_PROCESS``
WORKER_PROCESS = {"distributed_executor_backend": "mp"}

# vLLM's CPU defaults sized for a small machine: an explicit KV cache size (on CPU,
# ``gpu_memory_utilization`` is a fraction of *RAM* per NUMA node and fails on busy hosts).
CPU_LLM_DEFAULTS: dict[str, Any] = {
    "dtype": "bfloat16",
    "kv_cache_memory_bytes": 512 << 20,
}


class OfflineJob(BaseModel):
    """One ``LLM(...).generate(...)`` call, JSON-serialisable."""

    model_config = ConfigDict(extra="forbid")

    model: str
    """Model directory or name passed to ``LLM(model=...)``."""
    prompts: list[str] | None = None
    """Text prompts (already chat-formatted). Exactly one of prompts / prompt_token_ids."""
    prompt_token_ids: list[list[int]] | None = None
    """Token-id prompts."""
    solo_prompts: list[str] | None = None
    """Text prompts generated first, one request at a time (one ``generate`` call each), in the
    same engine before the batch; timed apart (``OfflineResult.solo``)."""
    cache_salts: list[str | None] | None = None
    """Per-prompt vLLM ``cache_salt`` (the tenant of prefix caching and of the adjacency tables)."""
    warmup_tokens: int = Field(0, ge=0)
    """Before each timed pass (the one-at-a-time pass, each batch repeat), the same requests
    untimed with this many output tokens, under the cache salt ``"warmup"``: vLLM meets the
    pass's prompt shapes and batch sizes, the allocator's gate measures them, and the timed
    pass reads neither the warm-up's prefix-cache blocks nor its adjacency table."""
    batch_repeats: int = Field(1, ge=1)
    """The batch generated this many times, timed apart (``OfflineResult.repeats``). With more
    than one, repeat k runs under the cache salt ``f"repeat{k}"`` (k = 0 included): no repeat
    reads another's prefix cache or learned tables, so the repeats are alike."""
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    seed_per_prompt: bool = False
    """With ``seed``: prompt i gets seed ``seed + i`` (independent seeded samples of one prompt)."""
    n: int = Field(1, ge=1)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = Field(None, ge=0)
    """Top logprobs per generated token (``SamplingParams.logprobs``); kept for the first
    completion of each prompt in ``OfflineResult.logprobs`` (also when only ``per_prompt`` asks)."""
    per_prompt: list[dict[str, Any]] | None = None
    """Per-prompt ``SamplingParams`` keyword arguments over the job's (e.g. ``{"logit_bias":
    {"5": 2.0}}``, ``{"temperature": 0.8, "min_p": 0.1, "seed": 3}``), one dict per prompt."""
    speculative_config: dict[str, Any] | None = None
    """Passed verbatim to ``LLM(speculative_config=...)``; None = plain decoding."""
    llm_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra ``LLM`` keyword arguments, applied over ``CPU_LLM_DEFAULTS``."""


class SpecStats(BaseModel):
    """vLLM's speculative-decoding counters for the job (zeros without speculation)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target forward pass, per request.

        Every request-step emits exactly one sampled token plus its accepted drafts, so the
        number of target passes is ``output tokens - accepted drafts``. (Accepted drafts cut off
        by ``max_tokens`` or a stop string make this a slight overestimate.)
        """
        passes = self.num_output_tokens - self.num_accepted_tokens
        return self.num_output_tokens / passes if passes > 0 else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class TimedPass(BaseModel):
    """One timed pass: ``OfflineJob.solo_prompts`` one request at a time, or a batch repeat:
    outputs (first completions), time, counters of that pass."""

    token_ids: list[list[int]]
    """``[num_prompts][num_output_tokens]``."""
    generate_seconds: float
    spec: SpecStats
    prompt_seconds: list[float] = []
    """One request at a time: each prompt's seconds (for per-prompt paired ratios)."""
    prompt_token_ids: list[list[int]] = []
    """One request at a time: the prompts as vLLM tokenized them."""

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c) for c in self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.generate_seconds


class OfflineResult(BaseModel):
    token_ids: list[list[list[int]]]
    """``[num_prompts][n][num_output_tokens]`` generated token ids."""
    texts: list[list[str]]
    finish_reasons: list[list[str | None]]
    startup_seconds: float
    generate_seconds: float
    spec: SpecStats
    counters: dict[str, float] = {}
    """Every ``vllm:*`` counter of the run (e.g. ``vllm:num_preemptions``)."""
    gauges: dict[str, float] = {}
    """Every ``vllm:*`` gauge at the end of the run (e.g. ``vllm:kv_cache_usage_perc``: 0 when
    every KV block went back to the free pool)."""
    pid: int
    kv_cache_blocks: int | None = None
    """KV-cache blocks vLLM made for the target (``cache_config.num_gpu_blocks``)."""
    kv_cache_block_size: int | None = None
    """Tokens per KV-cache block (``cache_config.block_size``; 128 on vLLM's CPU build)."""
    prompt_token_ids: list[list[int]] = []
    """The prompts as vLLM tokenized them."""
    logprobs: list[list[dict[int, float]]] | None = None
    """With ``OfflineJob.logprobs``: ``[num_prompts][num_output_tokens]`` token id -> logprob of
    the first completion's top tokens (the sampled one included)."""
    prompt_logprobs: list[list[dict[int, float]]] | None = None
    """When a request asked ``prompt_logprobs``: ``[num_prompts][num_prompt_tokens - 1]`` token id
    -> logprob (the first prompt position, which has none, dropped; [] for the others)."""
    solo: TimedPass | None = None
    """With ``OfflineJob.solo_prompts``: that pass (``spec`` above counts the batch alone; ``counters`` every pass)."""
    repeats: list[TimedPass] = []
    """Every batch repeat (the first is also ``token_ids`` / ``generate_seconds`` / ``spec``)."""

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c) for req in self.token_ids for c in req)

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.generate_seconds


def _spec_stats(llm, num_output_tokens: int, before: SpecStats | None = None) -> SpecStats:
    """vLLM's spec-decode counters so far, less ``before`` (an earlier reading)."""
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_"):
            counters[metric.name.removeprefix("vllm:spec_decode_")] = getattr(metric, "value", 0)
    before = before or SpecStats()
    return SpecStats(
        num_drafts=int(counters.get("num_drafts", 0)) - before.num_drafts,
        num_draft_tokens=int(counters.get("num_draft_tokens", 0)) - before.num_draft_tokens,
        num_accepted_tokens=int(counters.get("num_accepted_tokens", 0)) - before.num_accepted_tokens,
        num_output_tokens=num_output_tokens,
    )


def _json_params(over: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments from JSON: ``logit_bias`` keys back to token ids."""
    over = dict(over)
    if over.get("logit_bias"):
        over["logit_bias"] = {int(k): float(v) for k, v in over["logit_bias"].items()}
    if isinstance(over.get("structured_outputs"), dict):
        from vllm.sampling_params import StructuredOutputsParams

        over["structured_outputs"] = StructuredOutputsParams(**over["structured_outputs"])
    return over


def _salted(prompt, salt):
    """``prompt`` (text or ``TokensPrompt``) with vLLM's ``cache_salt`` (None: unchanged)."""
    if salt is None:
        return prompt
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": salt}
    return {**prompt, "cache_salt": salt}


PROGRESS_FD_ENV = "VLLM_ANISOTROPIC_PROGRESS_FD"
"""A file descriptor the job's process draws its progress bars on (``run_offline_job(progress=)``)."""


class ProgressBars:
    """One tqdm bar per pass on the progress descriptor, labelled ``"<label>: <pass>"``; nothing
    without one. ``bars(items, desc)`` wraps an iterable; ``bars.vllm(desc)`` is the ``use_tqdm``
    argument of ``LLM.generate`` (False: no bar)."""

    def __init__(self, stream=None, label: str = "") -> None:
        self.stream, self.label = stream, label

    @classmethod
    def from_env(cls) -> "ProgressBars":
        fd = os.environ.get(PROGRESS_FD_ENV)
        if not fd:
            return cls()
        stream = os.fdopen(int(fd), "w", buffering=1)
        return cls(stream, os.environ.get(f"{PROGRESS_FD_ENV}_LABEL", ""))

    def _kwargs(self, desc: str) -> dict[str, Any]:
        return {"file": self.stream, "desc": f"{self.label}: {desc}" if self.label else desc, "leave": False,
                "dynamic_ncols": True}

    def __call__(self, items, desc: str):
        if self.stream is None:
            return items
        from tqdm import tqdm

        return tqdm(items, **self._kwargs(desc))

    def vllm(self, desc: str):
        if self.stream is None:
            return False
        from tqdm import tqdm

        def bar(*args, **kwargs):
            # vLLM opens a short "Adding requests" bar, then the "Processed prompts" one: name the second
            adding = str(kwargs.get("desc", "")).startswith("Adding")
            return tqdm(*args, **{**kwargs, **self._kwargs(f"{desc}, adding requests" if adding else desc)})
        return bar


def run_in_this_process(job: OfflineJob) -> OfflineResult:
    """Build the engine, generate, collect outputs and counters. Imports vLLM."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    kwargs = {**CPU_LLM_DEFAULTS, **job.llm_kwargs}
    llm = LLM(
        model=job.model,
        speculative_config=job.speculative_config,
        disable_log_stats=False,
        **kwargs,
    )
    startup = time.perf_counter() - started
    if (job.prompts is None) == (job.prompt_token_ids is None):
        raise ValueError("give exactly one of prompts / prompt_token_ids")
    prompts = (
        job.prompts
        if job.prompts is not None
        else [TokensPrompt(prompt_token_ids=ids) for ids in job.prompt_token_ids]
    )
    if job.cache_salts is not None:
        if len(job.cache_salts) != len(prompts):
            raise ValueError(f"cache_salts needs one entry per prompt: {len(job.cache_salts)} vs {len(prompts)}")
        prompts = [_salted(p, salt) for p, salt in zip(prompts, job.cache_salts)]
    def params_for(seed, over=None):
        kwargs = dict(max_tokens=job.max_tokens, temperature=job.temperature, top_p=job.top_p, seed=seed, n=job.n,
                      stop=job.stop, stop_token_ids=job.stop_token_ids, logprobs=job.logprobs)
        return SamplingParams(**{**kwargs, **(over or {})})

    if job.per_prompt is not None and len(job.per_prompt) != len(prompts):
        raise ValueError(f"per_prompt needs one dict per prompt: {len(job.per_prompt)} vs {len(prompts)}")
    per_seed = job.seed is not None and job.seed_per_prompt
    if job.per_prompt is not None or per_seed:
        overs = job.per_prompt or [{}] * len(prompts)
        params = [params_for(job.seed + i if per_seed else job.seed, _json_params(o)) for i, o in enumerate(overs)]
    else:
        params = params_for(job.seed)
    if job.batch_repeats > 1 and job.cache_salts is not None:
        raise ValueError("batch_repeats > 1 salts each repeat itself: give no cache_salts")
    progress = ProgressBars.from_env()
    warmup = params_for(job.seed, {"max_tokens": job.warmup_tokens}) if job.warmup_tokens else None
    solo = None
    if job.solo_prompts:
        if job.n != 1 or job.seed_per_prompt:
            raise ValueError("solo_prompts needs n = 1 and no seed_per_prompt")
        if warmup:
            for p in progress(job.solo_prompts, "warm-up, one at a time"):
                llm.generate([_salted(p, "warmup")], warmup, use_tqdm=False)
        before = _spec_stats(llm, 0)
        solo_ids, prompt_seconds, solo_prompt_ids = [], [], []
        for p in progress(job.solo_prompts, "one at a time"):
            started = time.perf_counter()
            out = llm.generate([p], params, use_tqdm=False)[0]
            prompt_seconds.append(time.perf_counter() - started)
            solo_ids.append(list(out.outputs[0].token_ids))
            solo_prompt_ids.append(list(out.prompt_token_ids or []))
        solo = TimedPass(token_ids=solo_ids, generate_seconds=sum(prompt_seconds), prompt_seconds=prompt_seconds,
                         prompt_token_ids=solo_prompt_ids, spec=_spec_stats(llm, sum(len(c) for c in solo_ids), before))
    repeats = []
    for k in range(job.batch_repeats):
        if warmup:
            llm.generate([_salted(p, "warmup") for p in prompts], warmup, use_tqdm=progress.vllm("warm-up, batch"))
        batch = prompts if job.batch_repeats == 1 else [_salted(p, f"repeat{k}") for p in prompts]
        before = _spec_stats(llm, 0)
        started = time.perf_counter()
        out = llm.generate(batch, params, use_tqdm=progress.vllm(
            "batch" + (f" {k + 1}/{job.batch_repeats}" if job.batch_repeats > 1 else "")))
        seconds = time.perf_counter() - started
        repeats.append(TimedPass(token_ids=[list(o.outputs[0].token_ids) for o in out], generate_seconds=seconds,
                                 spec=_spec_stats(llm, sum(len(c.token_ids) for o in out for c in o.outputs), before)))
        if k == 0:
            outputs = out
    _drain_in_process(llm)
    token_ids = [[list(c.token_ids) for c in o.outputs] for o in outputs]
    return OfflineResult(
        token_ids=token_ids,
        texts=[[c.text for c in o.outputs] for o in outputs],
        finish_reasons=[[c.finish_reason for c in o.outputs] for o in outputs],
        startup_seconds=startup,
        generate_seconds=repeats[0].generate_seconds,
        spec=repeats[0].spec,
        counters=_counters(llm),
        gauges=_counters(llm, "Gauge"),
        pid=os.getpid(),
        kv_cache_blocks=llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        kv_cache_block_size=llm.llm_engine.vllm_config.cache_config.block_size,
        prompt_token_ids=[list(o.prompt_token_ids or []) for o in outputs],
        logprobs=None if all(o.outputs[0].logprobs is None for o in outputs) else [
            [{int(t): float(lp.logprob) for t, lp in step.items()} for step in (o.outputs[0].logprobs or [])]
            for o in outputs
        ],
        prompt_logprobs=None if all(o.prompt_logprobs is None for o in outputs) else [
            [{int(t): float(lp.logprob) for t, lp in step.items()} for step in (o.prompt_logprobs or [])[1:]]
            for o in outputs
        ],
        solo=solo,
        repeats=repeats,
    )


def _drain_in_process(llm) -> None:
    """With the engine core in this process, run the step that tells the workers of the requests
    that finished last: vLLM's engine loop runs it by itself, ``LLM.generate`` returns before it,
    and only then do the workers drop those requests and write their stats file (the batch
    drained). With vLLM's multiprocess engine core its own loop runs it."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # InprocClient's EngineCore
    for _ in range(4):
        if core is None or not core.scheduler.has_requests():
            return
        core.step_fn()


class OfflineJobFailed(RuntimeError):
    """The job's process exited non-zero; ``returncode`` and the log tail say how."""

    def __init__(self, returncode: int, log_tail: str):
        super().__init__(f"offline vLLM job exited with {returncode}:\n{log_tail}")
        self.returncode = returncode
        self.log_tail = log_tail


def run_offline_job(
    job: OfflineJob,
    timeout: float | None = 900.0,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    progress: str | None = None,
) -> OfflineResult:
    """Run ``job`` in a fresh Python process (vLLM's default multiprocess engine inside, unless
    ``env`` holds ``IN_PROCESS``: then ended as soon as its result is written). Its log goes to
    ``log_path`` (else a temporary file, its tail raised on failure); with ``progress`` (a
    label), one bar per pass on this process's stderr."""
    with tempfile.TemporaryDirectory(prefix="vllm-anisotropic-job-") as tmp:
        job_file, out_file = Path(tmp, "job.json"), Path(tmp, "result.json")
        job_file.write_text(job.model_dump_json())
        log_file = log_path or Path(tmp, "log.txt")
        env = {**os.environ, **(env or {})}
        # the job draws its bars straight on a copy of this process's stderr (its own stderr is the log)
        bars_fd = os.dup(2) if progress is not None else None
        if bars_fd is not None:
            env.update({PROGRESS_FD_ENV: str(bars_fd), f"{PROGRESS_FD_ENV}_LABEL": progress})
        shm_before = _shm_segments()
        try:
            with open(log_file, "wb") as log:
                returncode = _run_until_result(
                    [sys.executable, "-m", __name__, str(job_file), str(out_file)], out_file, log, env, timeout,
                    () if bars_fd is None else (bars_fd,), early=env.get(IN_PROCESS_ENV) == "0")
        finally:
            if bars_fd is not None:
                os.close(bars_fd)
            _remove_orphan_segments(_shm_segments() - shm_before)
        if returncode != 0 or not out_file.exists():
            tail = log_file.read_text(errors="replace")[-6000:]
            raise OfflineJobFailed(returncode, tail)
        return OfflineResult.model_validate_json(out_file.read_text())


def _run_until_result(cmd: list[str], out_file: Path, log, env: dict[str, str], timeout: float | None,
                      pass_fds: tuple[int, ...], early: bool) -> int:
    """Run the job in its own process group, then SIGKILL what is left of the group. ``early``
    (the engine core in the job's process, drained: ``_drain_in_process``): as soon as its result
    file is there (written whole, then renamed), sparing vLLM's graceful shutdown of its worker
    processes (~5 s on 2 cores: a worker-exit wait, then a forced kill). Else once the job has
    exited: a multiprocess engine core may still be running the step that has its workers write
    their stats."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=pass_fds,
                            start_new_session=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            try:
                return proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                if early and out_file.exists():
                    return 0
                if deadline is not None and time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout) from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        _wait_group_gone(proc.pid)


def _wait_group_gone(pgid: int, timeout: float = 10.0) -> None:
    """Wait until no live process of group ``pgid`` is left (the killed engine and worker
    processes are not our children: they unmap their shared memory when they are gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive = True
                break
        if not alive:
            return
        time.sleep(0.05)


_SHM = Path("/dev/shm")


def _shm_segments() -> set[str]:
    """Python's shared-memory segments (vLLM's message queues between its processes). Named
    semaphores (``sem.*``) are left alone: a process that holds one maps it under another name
    (glibc creates it under a temporary name), so nothing here could tell one in use."""
    return {n for n in os.listdir(_SHM) if n.startswith("psm_")} if _SHM.is_dir() else set()


def _remove_orphan_segments(names: set[str]) -> None:
    """Remove the shared-memory segments the killed job created that no live process still maps
    or holds open (a server another test runs may have made some too)."""
    if not names:
        return
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            held.update(line.rsplit("/", 1)[-1] for line in (proc / "maps").read_text().splitlines()
                        if "/dev/shm/" in line)
            held.update(os.readlink(fd).rsplit("/", 1)[-1] for fd in (proc / "fd").iterdir()
                        if os.readlink(fd).startswith("/dev/shm/"))
        except OSError:
            continue
    for name in names - held:
        try:
            (_SHM / name).unlink()
        except OSError:
            pass


def main(argv: list[str]) -> int:
    job_file, out_file = argv
    job = OfflineJob.model_validate_json(Path(job_file).read_text())
    result = run_in_this_process(job)
    partial = Path(f"{out_file}.part")
    partial.write_text(result.model_dump_json())
    partial.rename(out_file)  # whole or absent: the parent ends this process group once it is there
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

