"""``vllm-anisotropic profile-host``: where a speculative step's host time goes, in real vLLM.

Runs one offline batch with vLLM's engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and prints, per engine step:

* the wall time, the model forward (``_model_forward`` of vLLM's runner, timed here) and
  everything else, of which the LM head (``compute_logits``: every sampled row, so every verified
  tree row; compute, on a CPU a GEMM that grows with the rows), for any method (plain decoding,
  vLLM's ngram, ours);
* the plugin's own host work phase by phase, from the clocks the per-step path keeps
  (``integration/vllm/engine/host_clock.py``: ``propose``, ``prepare``, ``plan``, ``walk``, ``kv``,
  ``harvest``, ``reply``, ``states`` in the worker; ``cut``, ``scheduled``, ``on_output``,
  ``update`` in the scheduler), their sum, and the tree rows' attention (compute inside the
  forward, listed apart); for vLLM's ngram, its ``propose``;
* with the budget allocator on, the decode steps by what it made of them: trees, the measured
  gate's chain steps, plain (no draft kept);
* the same numbers per arm (``step_arm``): steps with prompt tokens, then the measured gate's
  plain, tree and chain steps and its switch steps; without the allocator, ``plain`` and
  ``drafts`` decode steps. A gate-plain step's plugin host work is what speculation costs a batch
  size where the gate keeps it off.

By default the batch also runs under ``cProfile`` (which slows Python code more than the torch
kernels it calls: the shares are upper bounds) and prints its top functions;
``--no-profile`` gives the honest step times. ``--json`` writes the numbers.

Example::

    vllm-anisotropic profile-host --method goose-nogate --max-num-seqs 8 --no-profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import tempfile
import time
from pathlib import Path

from vllm_anisotropic.bench.machine import cpu_model

# (label, file suffix, function name): cumulative time of these frames, per step
PHASES = (
    ("propose (drafter)", "integration/vllm/engine/drafter.py", "propose_trees"),
    ("allocator cut", "integration/vllm/engine/budget.py", "cut"),
    ("allocator step bookkeeping", "integration/vllm/engine/budget.py", "on_output"),
    ("prepare inputs (tree part + vLLM)", "integration/vllm/engine/runner.py", "_prepare_inputs"),
    ("attention metadata", "integration/vllm/engine/runner.py", "_build_attention_metadata"),
    ("tree walk (sampler)", "integration/vllm/engine/sampler.py", "forward"),
    ("metrics (drafter)", "integration/vllm/engine/drafter.py", "observe_step"),
    ("harvest after the reply (drafter)", "integration/vllm/engine/drafter.py", "run_deferred"),
    ("plain-step harvest", "integration/vllm/engine/sampler.py", "harvest_plain"),
    ("tree attention incl. vLLM's (all layers)", "integration/vllm/kernels/attention.py", "forward"),
    ("tree rows attention (all layers)", "integration/vllm/kernels/attention.py", "tree_rows"),
    ("scheduler.schedule", "integration/vllm/engine/scheduler.py", "schedule"),
    ("scheduler.update_from_output", "integration/vllm/engine/scheduler.py", "update_from_output"),
    ("draft model: delayed trees (draft_tree)", "proposers/draft_model.py", "delayed_tree"),
    ("draft model: q forwards (draft_tree)", "proposers/draft_model.py", "forward"),
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile-host", help="cProfile one offline batch in real vLLM: host time per step by phase",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dataset", default="humaneval", help="one dataset, or several comma-separated")
    p.add_argument("--num-prompts", type=int, default=8,
                   help="prompts from each dataset (2 datasets x 8 = 16 prompts)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--method", default="goose", help="a bench method name (vllm-anisotropic bench --help)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--draft", default=None, help="draft model of the draft_model-kN / dtree-K.L1.L2 methods")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the requests' temperature (0: greedy; above, sampled trees take the sampling verifier)")
    p.add_argument("--top-p", type=float, default=1.0, help="the requests' top-p (with --temperature above 0)")
    p.add_argument("--seed", type=int, default=None, help="each request's sampling seed (default: unseeded)")
    p.add_argument("--no-profile", action="store_true", help="time the batch without cProfile")
    p.add_argument("--top", type=int, default=25, help="also print the top N functions by own time")
    p.add_argument("--dump", type=Path, default=None, help="also write the raw cProfile stats here (pstats format)")
    p.add_argument("--json", type=Path, default=None, help="append the per-step numbers to this JSONL file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from vllm_anisotropic.bench.demo import _resolve_model, build_prompts
    from vllm_anisotropic.bench.sweep import IOMP, METHODS, method_llm_kwargs, modifiers, resolve_config, valid_method
    from vllm_anisotropic.bench.offline import CPU_LLM_DEFAULTS

    if not valid_method(args.method) or IOMP in modifiers(args.method):
        raise SystemExit(f"unknown method {args.method!r}; valid: {', '.join(METHODS)}, each also as NAME+sync "
                         f"(NAME{IOMP} needs its own process: use bench)")
    model_dir = _resolve_model(args.model)
    prompts = build_prompts(model_dir, args.dataset, args.num_prompts)
    spec_dir = tempfile.mkdtemp(prefix="vllm-anisotropic-profile-")
    draft = str(_resolve_model(args.draft)) if args.draft else None
    extra = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    llm = LLM(model=str(model_dir), speculative_config=resolve_config(args.method, Path(spec_dir), draft),
              max_num_seqs=args.max_num_seqs,
              **{**CPU_LLM_DEFAULTS, "dtype": args.dtype, **extra, **method_llm_kwargs(args.method)})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
    probe = StepProbe(llm)
    prof = None if args.no_profile else cProfile.Profile()
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if prof:
        prof.disable()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    law = f" T={args.temperature:g} top_p={args.top_p:g}" if args.temperature > 0 else ""
    print(f"{args.method}{law} max_num_seqs {args.max_num_seqs}: {tokens} tokens in {seconds:.2f} s"
          f"{' (under cProfile)' if prof else ''} = {tokens / seconds:.1f} tokens/s")
    report = probe.report(seconds)
    print(format_report(report))
    if args.json:
        record = {"method": args.method, "max_num_seqs": args.max_num_seqs, "num_prompts": len(prompts),
                  "max_tokens": args.max_tokens, "dtype": args.dtype, "profiled": prof is not None,
                  "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed,
                  "tokens": tokens, "seconds": seconds, "cpu": cpu_model().get("cpu_model") or platform.processor(), **report}
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    if prof is None:
        return 0
    stats = pstats.Stats(prof)
    if args.dump:
        stats.dump_stats(str(args.dump))

    def cumulative(suffix: str, func: str) -> tuple[float, int]:
        """Largest cumulative time (outermost frame) among matching functions, and its calls."""
        hits = [(v[3], v[1]) for (file, _, name), v in stats.stats.items() if file.endswith(suffix) and name == func]
        return max(hits) if hits else (0.0, 0)

    step_s, n = cumulative("vllm/v1/worker/gpu_model_runner.py", "execute_model")
    n = max(n, 1)
    total_s = cumulative("vllm/v1/engine/core.py", "step")[0] or seconds
    # the target's forward: the outermost model ``forward`` vLLM runs (llama.py, qwen2.py, ...)
    forward_s = max((v[3] for (file, _, name), v in stats.stats.items()
                     if "vllm/model_executor/models/" in file and name == "forward"), default=0.0)
    print(f"cProfile: {n} model steps: {seconds / n * 1e3:.1f} ms/step wall, model forward {forward_s / n * 1e3:.1f} ms/step, "
          f"everything else (host) {(total_s - forward_s) / n * 1e3:.1f} ms/step = {(total_s - forward_s) / total_s:.1%}")
    print(f"{'phase':<42} {'ms/step':>8} {'share':>6}")
    for label, suffix, func in PHASES:
        total = cumulative(suffix, func)[0]
        print(f"{label:<42} {total / n * 1e3:8.2f} {total / seconds:6.1%}")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
    print(buf.getvalue())
    return 0


# the measured gate's arms (allocator.gate PLAIN / TREE / CHAIN; None: no arm) as ``by_arm`` names them
ARM_NAMES = {0: "plain", 1: "trees", 2: "chains", None: "switch"}


def step_arm(scheduler_output, budget=None) -> str:
    """The arm of a scheduled step: ``prompt`` for a step with prompt tokens (a new request, a
    prefill chunk); else with the plugin's allocator its measured gate's
    (``BatchBudget.on_scheduled``: ``plain``, ``trees``, ``chains``, or ``switch`` for the two
    steps around a change of arm that no arm counts: the plain step that drafts for the next, the
    one that re-runs what a speculative step accepted), without it ``plain`` (no request verifies
    drafts) or ``drafts``."""
    num = scheduler_output.num_scheduled_tokens
    spec = scheduler_output.scheduled_spec_decode_tokens
    if budget is not None:  # its own test (on_scheduled): a request past its prompt re-runs tokens, not prompts
        decoding = getattr(budget, "_decoding", {})
        if scheduler_output.scheduled_new_reqs or not all(rid in decoding for rid in num):
            return "prompt"
        step = getattr(budget, "_step", None)
        return ARM_NAMES.get(step[-1] if step else None, "switch")
    if scheduler_output.scheduled_new_reqs or any(n > 1 + len(spec.get(rid, ())) for rid, n in num.items()):
        return "prompt"
    return "drafts" if any(spec.values()) else "plain"


# the plugin's host phases (host_clock.py), worker then scheduler, in per-step order
HOST_PHASES = ("states", "propose", "reply", "cut", "scheduled", "prepare", "plan", "walk", "kv", "harvest",
               "topk", "label", "finish", "on_output", "update", "stats")


class StepProbe:
    """Per-step numbers of an in-process engine: steps, model-forward seconds (a timer around the
    runner's ``_model_forward``), the plugin's host clocks (reset now) and vLLM's own proposer's
    seconds (``drafter.propose``, methods like ngram)."""

    def __init__(self, llm) -> None:
        core = llm.llm_engine.engine_core.engine_core
        self.runner = core.model_executor.driver_worker.worker.model_runner
        self.scheduler = core.scheduler
        self.forward_s = 0.0
        self.steps = 0
        self.vllm_propose_s = 0.0
        runner = self.runner
        forward = runner._model_forward

        def timed_forward(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.forward_s += time.perf_counter() - t0
                self.steps += 1

        runner._model_forward = timed_forward
        # the LM head over the sampled rows (every verified tree row): compute outside the forward
        self.logits_s = 0.0
        model = runner.model
        compute_logits = model.compute_logits

        def timed_logits(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return compute_logits(*args, **kwargs)
            finally:
                self.logits_s += time.perf_counter() - t0

        model.compute_logits = timed_logits
        drafter = getattr(runner, "drafter", None)
        if drafter is not None and not hasattr(drafter, "host_clock") and hasattr(drafter, "propose"):
            propose = drafter.propose

            def timed_propose(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return propose(*args, **kwargs)
                finally:
                    self.vllm_propose_s += time.perf_counter() - t0

            drafter.propose = timed_propose
        for clock in self.clocks():
            clock.reset()
        self.empty_chain_steps = 0
        budget = getattr(self.scheduler, "budget", None)
        if budget is not None and hasattr(budget, "_chain_step"):
            chain_step = budget._chain_step

            def counted_chain_step(*args, **kwargs):
                before = budget.metrics.steps_without_drafts
                out = chain_step(*args, **kwargs)
                self.empty_chain_steps += budget.metrics.steps_without_drafts - before
                return out

            budget._chain_step = counted_chain_step
        self._kinds0 = self.step_kinds()
        # per gate arm: each step's host clocks, forward and wall seconds, from the start of one
        # ``schedule`` call to the start of the next (``by_arm``)
        self.arms: dict[str, dict] = {}
        self._open = None
        self.tokens = 0  # tokens the steps emitted (sampled), for each arm's rate
        schedule = self.scheduler.schedule

        def schedule_by_arm(*args, **kwargs):
            snap = self._snapshot()
            self._close_step(snap)
            out = schedule(*args, **kwargs)
            self._open = (step_arm(out, budget), snap)
            return out

        self.scheduler.schedule = schedule_by_arm
        update = self.scheduler.update_from_output

        def counted_update(scheduler_output, model_runner_output, *args, **kwargs):
            self.tokens += sum(len(t) for t in (getattr(model_runner_output, "sampled_token_ids", None) or ()))
            return update(scheduler_output, model_runner_output, *args, **kwargs)

        self.scheduler.update_from_output = counted_update

    def step_kinds(self) -> dict[str, int]:
        """Decode steps so far by what the allocator made of them (its ``BudgetMetrics``): ``trees``
        (the allocator kept some draft), ``chains`` (a chain step of the measured gate with some
        draft) and ``plain`` (no draft kept: the gate's plain steps, empty cuts, empty chain
        steps); empty without a budget allocator."""
        budget = getattr(self.scheduler, "budget", None)
        m = getattr(budget, "metrics", None)
        if m is None:
            return {}
        plain = m.steps_without_drafts
        chains = getattr(m, "chain_steps", 0) - self.empty_chain_steps
        return {"trees": m.steps - chains - plain, "chains": chains, "plain": plain}

    def _phases(self) -> dict[str, float]:
        """Seconds so far per host phase, summed over the plugin's clocks."""
        phases: dict[str, float] = {}
        for clock in self.clocks():
            for k, v in clock.seconds.items():
                phases[k] = phases.get(k, 0.0) + v
        return phases

    def _snapshot(self) -> tuple:
        return self._phases(), self.forward_s, self.logits_s, self.steps, self.tokens, time.perf_counter()

    def _close_step(self, snap: tuple) -> None:
        """Adds the open step (``schedule`` to ``snap``) to its arm's sums; a ``schedule`` call
        that ran no forward (an idle engine) counts nowhere."""
        if self._open is None:
            return
        arm, (phases0, forward0, logits0, steps0, tokens0, t0) = self._open
        self._open = None
        phases, forward, logits, steps, tokens, t = snap
        if steps == steps0:
            return
        a = self.arms.setdefault(arm, {"steps": 0, "tokens": 0, "forward_s": 0.0, "logits_s": 0.0, "wall_s": 0.0,
                                       "phases_s": {}})
        a["steps"] += steps - steps0
        a["tokens"] += tokens - tokens0
        a["forward_s"] += forward - forward0
        a["logits_s"] += logits - logits0
        a["wall_s"] += t - t0
        for k, v in phases.items():
            a["phases_s"][k] = a["phases_s"].get(k, 0.0) + v - phases0.get(k, 0.0)

    def by_arm(self) -> dict[str, dict]:
        """Per arm (``step_arm``): steps, emitted tokens and their rate over the arm's wall time,
        wall / forward / LM head / plugin host ms a step and the host phases; a step runs from its
        ``schedule`` call to the next one (its cut, forward, verification, harvest, the
        scheduler's update with the step's tokens, and the proposals for the step after it)."""
        self._close_step(self._snapshot())
        out = {}
        for arm, a in sorted(self.arms.items()):
            n = a["steps"]
            host = sum(a["phases_s"].get(k, 0.0) for k in HOST_PHASES)
            out[arm] = {"steps": n, "tokens": a["tokens"],
                        "tokens_per_s": a["tokens"] / a["wall_s"] if a["wall_s"] > 0 else 0.0,
                        "wall_ms": a["wall_s"] / n * 1e3, "forward_ms": a["forward_s"] / n * 1e3,
                        "logits_ms": a["logits_s"] / n * 1e3, "plugin_host_ms": host / n * 1e3,
                        "plugin_host_no_topk_ms": (host - a["phases_s"].get("topk", 0.0)) / n * 1e3,
                        "phases_ms": {k: a["phases_s"][k] / n * 1e3 for k in HOST_PHASES
                                      if a["phases_s"].get(k, 0.0) > 0}}
        return out

    def clocks(self) -> list:
        out = []
        drafter = getattr(self.runner, "drafter", None)
        if drafter is not None and hasattr(drafter, "host_clock"):
            out.append(drafter.host_clock)
        budget = getattr(self.scheduler, "budget", None)
        if budget is not None:
            out.append(budget.host_clock)
        return out

    def report(self, seconds: float) -> dict:
        n = max(self.steps, 1)
        phases = self._phases()
        host = sum(phases.get(k, 0.0) for k in HOST_PHASES)
        tree_rows = phases.get("tree_rows", 0.0)
        kinds = {k: v - self._kinds0.get(k, 0) for k, v in self.step_kinds().items()}
        return {
            "steps": self.steps,
            "wall_ms": seconds / n * 1e3,
            "forward_ms": self.forward_s / n * 1e3,
            "outside_forward_ms": (seconds - self.forward_s) / n * 1e3,
            "logits_ms": self.logits_s / n * 1e3,
            "plugin_host_ms": host / n * 1e3,
            # what stays on the host where the logits live on a GPU: without the vocabulary pass
            "plugin_host_no_topk_ms": (host - phases.get("topk", 0.0)) / n * 1e3,
            "tree_rows_ms": tree_rows / n * 1e3,
            "vllm_propose_ms": self.vllm_propose_s / n * 1e3,
            "phases_ms": {k: phases[k] / n * 1e3 for k in HOST_PHASES if k in phases},
            "decode_steps": kinds,
            "by_arm": self.by_arm(),
        }


def format_report(r: dict) -> str:
    lines = [f"{r['steps']} model steps: {r['wall_ms']:.2f} ms/step wall, model forward {r['forward_ms']:.2f} "
             f"(of which tree rows' attention {r['tree_rows_ms']:.2f}), outside the forward "
             f"{r['outside_forward_ms']:.2f} ms/step (of which the LM head {r.get('logits_ms', 0.0):.2f})",
             f"plugin's own host work {r['plugin_host_ms']:.3f} ms/step "
             f"({r['plugin_host_no_topk_ms']:.3f} without the harvest's vocabulary pass)"
             + (f"; vLLM's proposer {r['vllm_propose_ms']:.3f} ms/step" if r["vllm_propose_ms"] else "")]
    for k, v in r["phases_ms"].items():
        lines.append(f"  {k:<10} {v:8.3f} ms/step")
    kinds = r.get("decode_steps") or {}
    if sum(kinds.values()):
        total = sum(kinds.values())
        lines.append("decode steps: " + ", ".join(f"{k} {v} ({v / total:.0%})" for k, v in kinds.items()))
    for arm, a in (r.get("by_arm") or {}).items():
        top = sorted(a["phases_ms"].items(), key=lambda kv: -kv[1])[:4]
        lines.append(f"  {arm:<7} {a['steps']:5d} steps, {a.get('tokens_per_s', 0.0):6.1f} tokens/s: "
                     f"wall {a['wall_ms']:.2f} ms/step, forward {a['forward_ms']:.2f}, "
                     f"LM head {a['logits_ms']:.2f}, plugin host {a['plugin_host_ms']:.3f} "
                     f"({a['plugin_host_no_topk_ms']:.3f} without the top-k)"
                     + (": " + ", ".join(f"{k} {v:.3f}" for k, v in top) if top else ""))
    return "\n".join(lines)
