"""The main job: ``vllm-anisotropic demo``.

Runs offline ``LLM.generate`` in real vLLM on a real model over real benchmark prompts, side by
side: plain decoding, then each speculative method, each engine its own process (see
``bench/offline.py``), all in one invocation on one machine. Each engine first
generates ``--one-at-a-time`` prompts one request at a time (where speculation is meant to
pay), then ``--repeats`` times a batch of ``--num-prompts`` other prompts in one call (vLLM runs
them together: where, on a small CPU, the allocator should keep speculation from costing
anything). Each timed pass follows an untimed warm-up of the same requests (``--warmup-tokens``
tokens, under a cache salt of their own, so vLLM has met the pass's shapes and the timed pass
reads neither its prefix cache nor its learned tables); each batch repeat runs under a salt of
its own, so no repeat learns from another.

It prints one table: per method and pass, tokens/s, the speedup over plain on the same prompts
with a 95 % interval (one at a time: a bootstrap over the prompts, each timed alone; the batch:
over the repeats), tau (mean tokens per target forward pass: output tokens / (output tokens -
accepted drafts), from vLLM's spec-decode counters) and how many outputs are token-identical to
plain greedy decoding. ``--details`` adds the tree metrics (spine / branch acceptance, tree size,
bypass rate) and what the allocator kept.

Speculative methods available today (``--method``):
- ``goose`` (default): GOOSE tree speculative decoding through this plugin's front door,
  ``speculative_config={"method": "goose"}`` (tree drafting, tree attention, greedy tree walk;
  see docs/engine.md), paper defaults unless ``--num-speculative-tokens`` caps the tree, with
  the budget allocator on (each step keeps the draft nodes that pay for their verification;
  the demo prints what it kept);
- ``goose-fixed``: the same without the allocator (``"allocator": "off"``): every step
  verifies the whole tree;
- ``pld``: our prompt-lookup proposer plugged in through vLLM's ``custom_class`` method;
- ``ngram``: vLLM's built-in n-gram proposer, for comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any

from vllm_anisotropic.bench.machine import cpu_model

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"


# Chain methods' draft length when --num-speculative-tokens is not given; tree methods then
# use their budget (GOOSE: B = 60 nodes -> 59 draft tokens).
DEFAULT_CHAIN_TOKENS = 5


def speculative_config_for(method: str, num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """The ``speculative_config`` dict that selects ``method`` in vLLM."""
    from vllm_anisotropic.integration.vllm.frontdoor.proposer import PROMPT_LOOKUP_CLASS

    configs = {
        "goose": {"method": "goose"},
        "goose-fixed": {"method": "goose", "allocator": "off"},
        "pld": {"method": "custom_class", "model": PROMPT_LOOKUP_CLASS},
        "ngram": {"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 5},
    }
    if method not in configs:
        raise ValueError(f"unknown method {method!r}; valid: {sorted(configs)}")
    if num_speculative_tokens is None:
        if method.startswith("goose"):
            return dict(configs[method])
        num_speculative_tokens = DEFAULT_CHAIN_TOKENS
    return {**configs[method], "num_speculative_tokens": num_speculative_tokens}


DEMO_METHODS = ("goose", "goose-fixed", "pld", "ngram")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="offline batch job: plain vs speculative decoding in real vLLM on a real model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name or model directory")
    p.add_argument("--dataset", default="mbpp,math500",
                   help="dataset name, or several comma-separated (default: bench's held-out report split, which no "
                        "tunable default was chosen on)")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per dataset in the batch")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--method", default="goose,ngram",
                   help=f"speculative method, or several comma-separated, each run against the same plain run; valid: {', '.join(DEMO_METHODS)}")
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help=f"draft tokens per step (default: the tree budget for goose, {DEFAULT_CHAIN_TOKENS} for chains)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="engine dtype; auto: bfloat16 where the CPU computes it natively (AMX or AVX512-BF16), "
                        "else float32 (emulated bf16 is 2-3x slower than float32)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="vLLM's concurrent-request cap (default: vLLM's)")
    p.add_argument("--one-at-a-time", type=int, default=4, metavar="N",
                   help="first, in the same engines, N other prompts per dataset (the next ones) one request at a "
                        "time, timed apart (0: the batch alone)")
    p.add_argument("--repeats", type=int, default=3, help="batch passes per engine, each timed apart (default 3)")
    p.add_argument("--warmup-tokens", type=int, default=16,
                   help="before each timed pass, the same requests untimed with this many tokens, under a cache salt of "
                        "their own (0: no warm-up)")
    p.add_argument("--details", action="store_true", help="also print each method's tree and allocator metrics")
    p.add_argument("--out", type=Path, default=None, help="append a JSONL record per method here")
    p.set_defaults(func=run)


def resolve_dtype(dtype: str, isa: list[str] | None = None) -> tuple[str, str]:
    """``(dtype, why)`` for ``--dtype``: ``auto`` is bfloat16 on a CPU with native bf16 (the
    ``amx_tile`` or ``avx512_bf16`` flag), else float32, where vLLM's CPU kernels emulate bf16
    (measured 2.3x slower than float32 on an AVX2-only EPYC, issue 46). ``isa``: the flags
    ``sweep.cpu_model`` reports (read from /proc/cpuinfo when None).
    ``resolve_dtype("auto", ["avx512f"])`` -> ``("float32", "auto: no native bf16 (...)")``."""
    if dtype != "auto":
        return dtype, "chosen"
    if isa is None:
        isa = cpu_model().get("cpu_isa", [])
    native = [f for f in ("amx_tile", "avx512_bf16") if f in isa]
    if native:
        return "bfloat16", f"auto: native bf16 ({', '.join(native)})"
    return "float32", "auto: no native bf16 (no amx_tile / avx512_bf16 flag), so float32"


def _resolve_model(name: str) -> Path:
    from vllm_anisotropic.models import model_names, prepare_model

    if Path(name).is_dir():
        return Path(name)
    if name not in model_names():
        raise SystemExit(f"unknown model {name!r}; valid: {model_names()} or a model directory")
    return prepare_model(name)


def build_prompts(model_dir: Path, dataset: str, limit: int, skip: int = 0, context_tokens: int = 0) -> list[str]:
    """Chat-formatted prompts for ``model_dir``'s tokenizer (``dataset`` may be comma-separated;
    ``limit`` prompts from each, after its first ``skip``). ``context_tokens`` > 0: each prompt's
    first user turn is preceded by solved examples of its dataset (``with_context``)."""
    from transformers import AutoTokenizer

    from vllm_anisotropic.data import format_prompt, load_dataset

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for d in dataset.split(","):
        prompts = load_dataset(d.strip(), limit=skip + limit)[skip:]
        if context_tokens > 0:
            prompts = with_context(prompts, load_dataset(d.strip()), skip + limit, context_tokens, tokenizer)
        out += [format_prompt(p, tokenizer, "chat") for p in prompts]
    return out


CONTEXT_HEADER = "Solved examples, for reference:"


def with_context(prompts: list, every: list, used: int, tokens: int, tokenizer) -> list:
    """``prompts`` with a long context and the task after it (a few-shot prompt): each one's text
    preceded by examples of its dataset (problem and reference answer) until the examples hold
    at least ``tokens`` tokens (none longer than half of them). The examples come from the dataset's end (``every``, whose first
    ``used`` the bench asks), each used once, so that no two prompts share a prefix (vLLM's prefix
    cache would take a shared one off the target's prefill, not off a draft model's catch-up)."""
    if prompts and prompts[0].dataset == "humaneval":
        raise ValueError("--context-tokens: humaneval's prompt is code the model continues; "
                         "take mbpp, math500, gsm8k or mtbench")
    pool = list(reversed(every[used:]))
    out = []
    for p in prompts:
        shots, held = [], 0
        while held < tokens:
            if not pool:
                raise ValueError(f"--context-tokens {tokens}: {p.dataset} has too few examples beyond the "
                                 f"{used} the bench asks for {len(prompts)} prompts")
            shot = pool.pop(0)
            text = shot.text + (f"\n{shot.reference}" if shot.reference else "")
            n = len(tokenizer.encode(text, add_special_tokens=False))
            if n > tokens // 2:  # one long example would make the context far longer than asked
                continue
            shots.append(text)
            held += n
        body = "\n\n".join(shots)
        out.append(dataclasses.replace(p, text=f"{CONTEXT_HEADER}\n\n{body}\n\nNow the task:\n{p.text}"))
    return out


def run(args: argparse.Namespace) -> int:
    import tempfile

    from vllm_anisotropic.integration.vllm.engine.metrics import STATS_ENV
    from vllm_anisotropic.bench.offline import OfflineJob, run_offline_job

    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    for m in methods:
        if m not in DEMO_METHODS:
            raise SystemExit(f"unknown method {m!r}; valid: {', '.join(DEMO_METHODS)}")
    for flag, value, low in (("--one-at-a-time", args.one_at_a_time, 0), ("--repeats", args.repeats, 1),
                             ("--warmup-tokens", args.warmup_tokens, 0)):
        if value < low:
            raise SystemExit(f"{flag} must be >= {low}, got {value}")
    model_dir = _resolve_model(args.model)
    prompts = build_prompts(model_dir, args.dataset, args.num_prompts)
    solo_prompts = (build_prompts(model_dir, args.dataset, args.one_at_a_time, skip=args.num_prompts)
                    if args.one_at_a_time else None)
    args.dtype, dtype_why = resolve_dtype(args.dtype)
    logger.info("dtype %s (%s)", args.dtype, dtype_why)
    llm_kwargs = {"dtype": args.dtype}
    if args.max_num_seqs:
        llm_kwargs["max_num_seqs"] = args.max_num_seqs
    base = OfflineJob(model=str(model_dir), prompts=prompts, solo_prompts=solo_prompts, max_tokens=args.max_tokens,
                      llm_kwargs=llm_kwargs, warmup_tokens=min(args.warmup_tokens, args.max_tokens),
                      batch_repeats=args.repeats)

    logger.info("plain decoding (starting vLLM)")
    plain = run_offline_job(base, timeout=None, progress="plain")
    runs: list[MethodRun] = []
    for method in methods:
        spec_config = speculative_config_for(method, args.num_speculative_tokens)
        logger.info("speculative decoding with %s (starting vLLM)", method)
        with tempfile.TemporaryDirectory() as tmp:
            stats_file = Path(tmp, "tree_stats.json")
            spec = run_offline_job(base.model_copy(update={"speculative_config": spec_config}), timeout=None,
                                   env={STATS_ENV: str(stats_file)}, progress=method)
            tree = json.loads(stats_file.read_text()) if stats_file.exists() else None
            budget_file = Path(f"{stats_file}.budget")
            budget = json.loads(budget_file.read_text()) if budget_file.exists() else None
        runs.append(MethodRun(method, spec_config, spec, tree, budget))

    cpu = cpu_model().get("cpu_model") or platform.machine()
    from vllm_anisotropic.data import split_of

    split = split_of(d.strip() for d in args.dataset.split(","))
    header = (f"model {args.model}  dataset {args.dataset} ({split} split)  max_tokens {args.max_tokens}  greedy  {args.dtype} "
              f"[{dtype_why}]\n{cpu}, {os.cpu_count()} cores, vLLM CPU build; each pass after an untimed warm-up of "
              f"{base.warmup_tokens} tokens")
    table = demo_table(plain, runs, solo_prompts is not None)
    lines = [header, "", *table.lines]
    if args.details:
        lines += ["", *[line for r in runs for line in _detail_lines(r)]]
    lines.append(f"outputs identical to plain decoding: {'yes' if table.all_identical else 'NO'}")
    if not table.all_identical and args.dtype != "float32":
        lines.append(
            f"  ({args.dtype}: vLLM's kernels round differently for different query shapes, so a draft step and a "
            "plain step can pick different tokens where the top two logits are nearly tied; vLLM's own ngram "
            "shows the same. The exactness check is --dtype float32; see docs/engine.md.)"
        )
    # first differences of the batch's first repeat and of the one-at-a-time pass, with the prefix
    # plain decoding had at each (prompt + common output), to measure the margin there
    divergent, prefixes = [], []
    for r in runs:
        for d in divergences(r.method, plain.token_ids, r.result.token_ids):
            divergent.append(d)
            prefixes.append(plain.prompt_token_ids[d.prompt] + plain.token_ids[d.prompt][0][: d.position])
        if solo_prompts:
            for d in divergences(f"{r.method} (one at a time)", [[t] for t in plain.solo.token_ids],
                                 [[t] for t in r.result.solo.token_ids]):
                divergent.append(d)
                prefixes.append(plain.solo.prompt_token_ids[d.prompt] + plain.solo.token_ids[d.prompt][: d.position])
    if divergent and args.dtype != "float32":
        logger.info("measuring the margins of %d divergences (starting vLLM)", len(divergent))
        probe = base.model_copy(update={
            "prompts": None, "solo_prompts": None, "max_tokens": 1, "logprobs": MARGIN_TOP, "warmup_tokens": 0,
            "batch_repeats": 1, "prompt_token_ids": prefixes,
        })
        lines += margin_report(divergent, run_offline_job(probe, timeout=None).logprobs)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a", encoding="utf-8") as f:
            for r, row in zip(runs, table.rows):
                f.write(json.dumps({
                    "model": args.model, "dataset": args.dataset, "num_prompts": len(prompts),
                    "one_at_a_time": len(solo_prompts or []), "repeats": args.repeats, "max_tokens": args.max_tokens,
                    "warmup_tokens": base.warmup_tokens, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                    "method": r.method, "speculative_config": r.spec_config, **row,
                    "tree_metrics": r.tree, "budget_metrics": r.budget, "cpu_model": cpu, "machine": platform.machine(),
                }) + "\n")
    print("\n".join(lines))
    return 0 if table.all_identical else 1


@dataclasses.dataclass
class MethodRun:
    """One speculative method's engine run and what its plugin metrics files held."""

    method: str
    spec_config: dict[str, Any]
    result: Any  # OfflineResult
    tree: dict | None
    budget: dict | None


@dataclasses.dataclass
class DemoTable:
    lines: list[str]
    rows: list[dict[str, Any]]  # per method: the numbers of its table row
    all_identical: bool


def demo_table(plain, runs: list[MethodRun], solo: bool) -> DemoTable:
    """The demo's one table: per method and pass, tokens/s, the speedup over plain with its
    interval, tau and outputs identical to plain's. The one-at-a-time pass: a bootstrap over its
    prompts (each prompt timed alone, paired with plain's); the batch: each repeat's ratio to
    plain's same repeat, their geometric mean and t-interval (``bench.stats``)."""
    from vllm_anisotropic.bench.offline import SpecStats
    from vllm_anisotropic.bench.stats import bootstrap_rate_ratio, format_speedup, ratio_interval

    n_batch, repeats = len(plain.token_ids), len(plain.repeats)
    cols = []
    if solo:
        cols.append(f"one request at a time ({len(plain.solo.token_ids)} prompts, {plain.solo.num_output_tokens} tokens)")
    cols.append(f"batch of {n_batch} prompts ({repeats} repeat{'s' if repeats > 1 else ''}, "
                f"{plain.repeats[0].num_output_tokens} tokens each)")
    head = f"{'':10}" + "".join(f"{c:<50}" for c in cols)
    sub = f"{'method':10}" + f"{'tokens/s':>9}  {'speedup [95% CI]':<22}{'tau':>5}  {'identical':<10}" * len(cols)
    lines = [head.rstrip(), sub.rstrip()]

    def rate(passes) -> float:  # pooled over passes
        return sum(p.num_output_tokens for p in passes) / sum(p.generate_seconds for p in passes)

    plain_cells = ([f"{rate([plain.solo]):9.1f}  {'1.00x':<22}{'':>5}  {'':<10}"] if solo else []) + \
        [f"{rate(plain.repeats):9.1f}  {'1.00x':<22}{'':>5}  {'':<10}"]
    lines.append(f"{'plain':10}" + "".join(plain_cells).rstrip())
    rows, all_identical = [], True
    for r in runs:
        spec, cells, row = r.result, [], {}
        if solo:
            lengths = lambda p: [len(t) for t in p.token_ids]  # noqa: E731
            point, low, high = bootstrap_rate_ratio(lengths(spec.solo), spec.solo.prompt_seconds, lengths(plain.solo),
                                                    plain.solo.prompt_seconds)
            same = sum(a == b for a, b in zip(plain.solo.token_ids, spec.solo.token_ids))
            all_identical &= same == len(plain.solo.token_ids)
            cells.append(f"{rate([spec.solo]):9.1f}  {format_speedup(point, low, high):<22}{spec.solo.spec.tau:5.2f}  "
                         f"{f'{same}/{len(plain.solo.token_ids)}':<10}")
            row["one_at_a_time"] = {"plain_tokens_per_s": rate([plain.solo]), "tokens_per_s": rate([spec.solo]),
                                    "speedup": point, "ci95": [low, high], "tau": spec.solo.spec.tau, "identical": same}
        ratios = [s.tokens_per_second / p.tokens_per_second for s, p in zip(spec.repeats, plain.repeats)]
        point, low, high = ratio_interval(ratios)
        same = sum(a == b for s, p in zip(spec.repeats, plain.repeats) for a, b in zip(p.token_ids, s.token_ids))
        all_identical &= same == n_batch * repeats
        tau = SpecStats(num_output_tokens=sum(s.spec.num_output_tokens for s in spec.repeats),
                        num_accepted_tokens=sum(s.spec.num_accepted_tokens for s in spec.repeats)).tau
        cells.append(f"{rate(spec.repeats):9.1f}  {format_speedup(point, low, high):<22}{tau:5.2f}  "
                     f"{f'{same}/{n_batch * repeats}':<10}")
        row["batch"] = {"plain_tokens_per_s": rate(plain.repeats), "tokens_per_s": rate(spec.repeats),
                        "speedup": point, "ci95": [low, high], "repeat_speedups": ratios, "tau": tau, "identical": same}
        lines.append(f"{r.method:10}" + "".join(cells).rstrip())
        rows.append(row)
    lines.append("speedup: tokens/s over plain's on the same prompts; one at a time, [95% CI] bootstraps the prompts; "
                 "batch, the repeats' geometric mean, t-interval; ~ marks an interval containing 1.00x")
    return DemoTable(lines, rows, all_identical)


def _detail_lines(r: MethodRun) -> list[str]:
    """``--details``: a method's tree and allocator metrics over its whole run (warm-ups included)."""
    tree, budget, lines = r.tree, r.budget, []
    if tree and tree.get("verified_trees"):
        lines.append(
            f"{r.method}: spine acceptance {_rate(tree['accepted_spine_nodes'], tree['spine_nodes'])}  "
            f"branch acceptance {_rate(tree['accepted_branch_nodes'], tree['branch_nodes'])}  "
            f"mean draft nodes {tree['draft_nodes'] / tree['verified_trees']:.1f}  "
            f"bypass {_rate(tree['bypass_steps'], tree['steps'])}  plain steps {_rate(tree['plain_steps'], tree['steps'])}"
        )
    if budget and budget.get("steps"):
        steps = budget["steps"]
        err = budget["cost_abs_rel_err"] / budget["cost_samples"] if budget.get("cost_samples") else float("nan")
        lines.append(
            f"{r.method}: allocator kept {budget['tree_rows'] / steps:.1f} of {budget['tree_rows_offered'] / steps:.1f} "
            f"offered draft nodes per step, no drafts in {budget['steps_without_drafts'] / steps:.0%} of steps, "
            f"accepted {budget['realized_accepted']} (predicted {budget['predicted_accepted']:.0f}), "
            f"cost model error {err:.0%}, {budget.get('gate_plain_steps', 0) / steps:.0%} of steps made plain by the "
            f"gate, {budget.get('chain_steps', 0) / steps:.0%} chain steps"
        )
        gate = budget.get("gate") or {}
        if gate:
            lines.append(f"{r.method}: measured gate (tokens/s of decode steps, plain vs trees vs chains): " + ", ".join(
                f"{n} req {g['plain_rate']:.0f} vs {g['spec_rate']:.0f}"
                + (f" vs {g['chain_rate']:.0f}" if g.get("chain_steps") else "")
                for n, g in sorted(gate.items(), key=lambda kv: int(kv[0])) if g["plain_steps"] and g["spec_steps"]))
    return lines


MARGIN_TOP = 5  # top logprobs read at each first differing position


@dataclasses.dataclass(frozen=True)
class Divergence:
    """A speculative output that differs from plain decoding's: where first, and which tokens."""

    method: str
    prompt: int
    position: int  # index of the first differing output token
    plain_token: int
    spec_token: int


def divergences(method: str, plain: list[list[list[int]]], spec: list[list[list[int]]]) -> list[Divergence]:
    """The first difference of each prompt's first completion where both sides have a token.
    ``plain [[[1, 2, 3]]], spec [[[1, 5, 3]]] -> [Divergence(method, 0, 1, 2, 5)]``."""
    out = []
    for i, (a, b) in enumerate(zip(plain, spec)):
        a, b = a[0], b[0]
        d = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if d is not None:
            out.append(Divergence(method, i, d, int(a[d]), int(b[d])))
    return out


def margin_report(divergent: list[Divergence], logprobs: list[list[dict[int, float]]]) -> list[str]:
    """Lines saying, for every divergence, how far apart plain decoding's token and the
    speculative one were in the target's own distribution at that position (recomputed by a
    plain prefill of prompt + common prefix): a near-tie (rounding) or not (a bug)."""
    gaps, lines = [], []
    for d, lp in zip(divergent, logprobs):
        top = lp[0] if lp else {}
        ranked = sorted(top, key=top.get, reverse=True)
        rank = ranked.index(d.spec_token) + 1 if d.spec_token in top else None
        gap = top[d.plain_token] - top[d.spec_token] if rank and d.plain_token in top else None
        gaps.append(gap)
        lines.append(
            f"    {d.method} prompt {d.prompt}: first difference at output token {d.position}, plain {d.plain_token} "
            f"vs {d.spec_token} (rank {rank or f'>{MARGIN_TOP}'} in the recomputed distribution, logprob gap "
            f"{'n/a' if gap is None else f'{gap:.3f}'})"
        )
    known = sorted(abs(g) for g in gaps if g is not None)
    head = (f"divergences: {len(divergent)} outputs; the speculative token is among the recomputed top 2 in "
            f"{sum(1 for line in lines if '(rank 1 ' in line or '(rank 2 ' in line)}/{len(divergent)}")
    if known:
        head += f", |logprob gap| median {known[len(known) // 2]:.3f} max {known[-1]:.3f} nats"
    return [head + " (near-ties: bf16 rounding, not a bug; a large gap would be)"] + lines



def _rate(x: int, n: int) -> str:
    return f"{x / n:.3f}" if n else "n/a"
