"""The main job: ``vllm-anisotropic demo``.

Runs offline ``LLM.generate`` in real vLLM on a real model over real benchmark prompts, side by
side: plain decoding, then each speculative method. Each engine first generates
``--one-at-a-time`` prompts one request at a time (one ``generate`` call each: where
speculation is meant to pay), then a batch of ``--num-prompts`` other prompts in one call (vLLM
runs them together: where, on a small CPU, the allocator should keep speculation from costing
anything). Each pass is timed apart and prints tokens/s, the
speedup, tau (mean tokens per target forward pass: output tokens / (output tokens - accepted
drafts), from vLLM's spec-decode counters), the tree metrics
(spine / branch acceptance, tree size, bypass rate) and how many outputs are token-identical
to plain greedy decoding. Each run is its own process (see
``integration/vllm/offline.py``), so the numbers are measured in one invocation on one machine.

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
import platform
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"


# Chain methods' draft length when --num-speculative-tokens is not given; tree methods then
# use their budget (GOOSE: B = 60 nodes -> 59 draft tokens).
DEFAULT_CHAIN_TOKENS = 5


def speculative_config_for(method: str, num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """The ``speculative_config`` dict that selects ``method`` in vLLM."""
    from vllm_anisotropic.integration.vllm.proposer import PROMPT_LOOKUP_CLASS

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
    p.add_argument("--dataset", default="humaneval", help="dataset name, or several comma-separated")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per dataset")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--method", default="goose",
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
    p.add_argument("--one-at-a-time", type=int, default=8, metavar="N",
                   help="first, in the same engines, N other prompts per dataset (the next ones) one request at a "
                        "time, timed apart (0: the batch alone)")
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
        from vllm_anisotropic.bench.sweep import cpu_model

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


def build_prompts(model_dir: Path, dataset: str, limit: int, skip: int = 0) -> list[str]:
    """Chat-formatted prompts for ``model_dir``'s tokenizer (``dataset`` may be comma-separated;
    ``limit`` prompts from each, after its first ``skip``)."""
    from transformers import AutoTokenizer

    from vllm_anisotropic.data import format_prompt, load_dataset

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [
        format_prompt(p, tokenizer, "chat") for d in dataset.split(",")
        for p in load_dataset(d.strip(), limit=skip + limit)[skip:]
    ]


def run(args: argparse.Namespace) -> int:
    import tempfile

    from vllm_anisotropic.integration.vllm.metrics import STATS_ENV
    from vllm_anisotropic.integration.vllm.offline import OfflineJob, run_offline_job

    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    for m in methods:
        if m not in DEMO_METHODS:
            raise SystemExit(f"unknown method {m!r}; valid: {', '.join(DEMO_METHODS)}")
    if args.one_at_a_time < 0:
        raise SystemExit(f"--one-at-a-time must be >= 0, got {args.one_at_a_time}")
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
                      llm_kwargs=llm_kwargs)

    logger.info("plain decoding: %s%d prompts x %d tokens (starting vLLM)",
                f"{len(solo_prompts)} prompts one at a time, then " if solo_prompts else "", len(prompts),
                args.max_tokens)
    plain = run_offline_job(base, timeout=None)
    header = f"model {args.model}  dataset {args.dataset}  max_tokens {args.max_tokens}  greedy  {args.dtype} " \
             f"[{dtype_why}]  " \
             f"({platform.machine()} CPU, vLLM CPU build)"
    solo_lines = [f"one request at a time ({len(solo_prompts)} prompts, each engine's first pass):",
                  _rate_line("plain", plain.solo)] if solo_prompts else []
    batch_lines = [f"batch of {len(prompts)} prompts (one generate call{', after that' if solo_prompts else ''}):",
                   _rate_line("plain", plain)]
    lines: list[str] = []  # each method's tree and allocator metrics, printed after the two passes
    all_identical = True
    divergent: list[Divergence] = []
    for method in methods:
        spec_config = speculative_config_for(method, args.num_speculative_tokens)
        logger.info("speculative decoding with %s (starting vLLM)", method)
        with tempfile.TemporaryDirectory() as tmp:
            stats_file = Path(tmp, "tree_stats.json")
            spec = run_offline_job(base.model_copy(update={"speculative_config": spec_config}), timeout=None,
                                   env={STATS_ENV: str(stats_file)})
            tree = json.loads(stats_file.read_text()) if stats_file.exists() else None
            budget_file = Path(f"{stats_file}.budget")
            budget = json.loads(budget_file.read_text()) if budget_file.exists() else None
        identical = sum(a == b for a, b in zip(plain.token_ids, spec.token_ids))
        all_identical &= identical == len(prompts)
        divergent += divergences(method, plain.token_ids, spec.token_ids)
        speedup = spec.tokens_per_second / plain.tokens_per_second
        # output tokens / target passes, a pass emitting 1 + its accepted drafts (vLLM's counters,
        # equal to the drafter's accepted count). Counting the drafter's tree steps instead would
        # miss the steps a request decodes plainly while the allocator's backoff skips its trees.
        tau = spec.spec.tau
        batch_lines.append(_rate_line(method, spec, plain, identical, len(prompts)))
        solo_speedup = solo_identical = None
        if solo_prompts:
            solo_identical = sum(a == b for a, b in zip(plain.solo.token_ids, spec.solo.token_ids))
            all_identical &= solo_identical == len(solo_prompts)
            solo_speedup = spec.solo.tokens_per_second / plain.solo.tokens_per_second
            solo_lines.append(_rate_line(method, spec.solo, plain.solo, solo_identical, len(solo_prompts)))
        lines.append(f"{method}, {'both passes' if solo_prompts else 'the batch'}:")
        if tree and tree.get("verified_trees"):
            lines.append(
                f"          spine acceptance {_rate(tree['accepted_spine_nodes'], tree['spine_nodes'])}  "
                f"branch acceptance {_rate(tree['accepted_branch_nodes'], tree['branch_nodes'])}  "
                f"mean draft nodes {tree['draft_nodes'] / tree['verified_trees']:.1f}  "
                f"bypass {_rate(tree['bypass_steps'], tree['steps'])}  plain steps {_rate(tree['plain_steps'], tree['steps'])}"
            )
        if budget and budget.get("steps"):
            steps = budget["steps"]
            err = budget["cost_abs_rel_err"] / budget["cost_samples"] if budget.get("cost_samples") else float("nan")
            lines.append(
                f"          allocator: kept {budget['tree_rows'] / steps:.1f} of {budget['tree_rows_offered'] / steps:.1f} "
                f"offered draft nodes per step, no drafts in {budget['steps_without_drafts'] / steps:.0%} of steps, "
                f"accepted {budget['realized_accepted']} (predicted {budget['predicted_accepted']:.0f}), "
                f"cost model error {err:.0%}"
            )
            gate = budget.get("gate") or {}
            if gate:
                # per batch size: what the measured gate saw in each arm (tokens/s of decode steps)
                lines.append("          measured gate (tokens/s of decode steps, plain vs trees vs chains): " + ", ".join(
                    f"{r} req {g['plain_rate']:.0f} vs {g['spec_rate']:.0f}"
                    + (f" vs {g['chain_rate']:.0f}" if g.get("chain_steps") else "")
                    + (" (plain)" if max(g["spec_rate"], g.get("chain_rate", 0.0)) < g["plain_rate"] else "")
                    for r, g in sorted(gate.items(), key=lambda kv: int(kv[0])) if g["plain_steps"] and g["spec_steps"])
                    + f"; {budget.get('gate_plain_steps', 0) / steps:.0%} of steps made plain by it, "
                    + f"{budget.get('chain_steps', 0) / steps:.0%} chain steps")
        if args.out:
            record = {
                "model": args.model, "dataset": args.dataset, "num_prompts": len(prompts),
                "max_tokens": args.max_tokens, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                "method": method, "speculative_config": spec_config,
                "plain_tokens_per_s": plain.tokens_per_second, "spec_tokens_per_s": spec.tokens_per_second,
                "speedup": speedup, "tau": tau, "tau_vllm_counters": spec.spec.tau,
                "acceptance_rate": spec.spec.acceptance_rate, "identical": identical, "tree_metrics": tree,
                "budget_metrics": budget,
                "one_at_a_time": None if not solo_prompts else {
                    "num_prompts": len(solo_prompts), "plain_tokens_per_s": plain.solo.tokens_per_second,
                    "spec_tokens_per_s": spec.solo.tokens_per_second, "speedup": solo_speedup,
                    "tau": spec.solo.spec.tau, "identical": solo_identical},
                "machine": platform.machine(),
            }
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
    lines = [header, *solo_lines, *batch_lines, *lines]
    lines.append(f"outputs identical to plain decoding: {'yes' if all_identical else 'NO'}")
    if not all_identical and args.dtype != "float32":
        lines.append(
            f"  ({args.dtype}: vLLM's kernels round differently for different query shapes, so a draft step and a "
            "plain step can pick different tokens where the top two logits are nearly tied; vLLM's own ngram "
            "shows the same. The exactness check is --dtype float32; see docs/engine.md.)"
        )
    if divergent and args.dtype != "float32":
        logger.info("measuring the margins of %d divergences (starting vLLM)", len(divergent))
        probe = base.model_copy(update={
            "prompts": None, "solo_prompts": None, "max_tokens": 1, "logprobs": MARGIN_TOP,
            "prompt_token_ids": [plain.prompt_token_ids[d.prompt] + plain.token_ids[d.prompt][0][: d.position]
                                 for d in divergent],
        })
        lines += margin_report(divergent, run_offline_job(probe, timeout=None).logprobs)
    print("\n".join(lines))
    return 0 if all_identical else 1


def _rate_line(name: str, run, plain=None, identical: int = 0, n: int = 0) -> str:
    """``name  N tokens in S s = R tokens/s``, and for a speculative ``run`` (an ``OfflineResult``
    or its ``solo`` pass) its tau, speedup over ``plain`` and identical outputs."""
    line = (f"  {name:<9} {run.num_output_tokens:6d} tokens in {run.generate_seconds:6.2f} s  "
            f"= {run.tokens_per_second:7.1f} tokens/s")
    if plain is not None:
        line += (f"   tau {run.spec.tau:.2f}  speedup {run.tokens_per_second / plain.tokens_per_second:.2f}x  "
                 f"identical {identical}/{n}")
    return line


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
