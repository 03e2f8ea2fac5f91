"""``vllm-anisotropic tau``: exact tau (tokens per target forward) of every proposer on real data.

Scope: runs ``bench.harness.TreeDecoder`` (Hugging Face model, tree mask, greedy walk) for each
prompt x method, checks every method's output against plain greedy decoding ("ar", run first as
the reference), writes one JSONL record per prompt x method (full proposer config, environment,
per-step records) and prints a summary table per dataset:

tau        sum over steps of (accepted + 1) / number of steps (micro-average over prompts)
p_s, p_t   acceptance rate of SPINE (context-match) and BRANCH (adjacency) draft tokens:
           accepted / proposed, over all steps (GOOSE arXiv 2604.02047 Sec. 3 / Fig. 5)
synergy    tau_goose / max(tau_pld, tau_tr) (arXiv 2604.02047 Sec. 5.4)
vs iso3    tau_goose / tau_iso3 - 1 (arXiv 2604.02047 Table 1)
ms/step    proposer time per step (propose + observe/harvest), milliseconds

Example::

    vllm-anisotropic tau --model smollm2-135m --dataset humaneval --limit 40 \\
        --max-new-tokens 256 --methods ar,pld,tr,iso3,iso5,goose --out results/tau.jsonl

Adjacency tables are shared across the prompts of one (dataset, method) run (TR's hot start),
and start empty for each dataset.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

__all__ = ["add_parser", "run", "summarize", "complete_prompts", "format_table"]

logger = logging.getLogger(__name__)

DEFAULT_METHODS = "ar,pld,tr,iso3,iso5,goose"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tau", help="exact tau of tree proposers on a Hugging Face model (batch 1, greedy)")
    p.add_argument("--model", default="smollm2-135m", help="registry model name, 'tiny', or an HF directory")
    p.add_argument("--dataset", default="humaneval", help="comma-separated dataset names (vllm_anisotropic.data)")
    p.add_argument("--limit", type=int, default=40, help="prompts per dataset")
    p.add_argument("--offset", type=int, default=0, help="skip this many prompts of each dataset first")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated proposer names (default {DEFAULT_METHODS})")
    p.add_argument("--budget", type=int, default=None, help="node budget B for every tree method (default: config default 60)")
    p.add_argument("--option", action="append", default=[], metavar="METHOD:KEY=JSON",
                   help="extra proposer option, e.g. goose:bypass_signal=\"match_length\" (repeatable)")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:0)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prompt-format", default="chat", help="format_prompt style (chat or raw)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-steps", action="store_true", help="omit per-step records from the JSONL")
    p.add_argument("--out", default="results/tau.jsonl", help="JSONL output (appended)")
    p.add_argument("--summarize", default=None, metavar="JSONL[,JSONL]",
                   help="only print the summary table of existing JSONL files (prompts finished by every method)")
    p.set_defaults(func=run)
    return p


# ---------------------------------------------------------------------- helpers
def environment(device: str, dtype: str) -> dict:
    import numpy
    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001 - environment capture is best effort
        commit = ""
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "device": device,
        "dtype": dtype,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": commit,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


def _resolve_model(name: str) -> Path:
    if name == "tiny":
        from vllm_anisotropic.models import build_tiny_model

        return build_tiny_model()
    if os.path.isdir(name):
        return Path(name)
    from vllm_anisotropic.models import prepare_model

    return prepare_model(name)


def load_prompts(dataset: str, limit: int, offset: int, tokenizer, prompt_format: str) -> list[list[int]]:
    """Token ids of ``limit`` prompts of ``dataset`` (after ``offset``), formatted for the model
    (first user turn; ``data.format_prompt``)."""
    from vllm_anisotropic.data import format_prompt, load_dataset

    items = load_dataset(dataset, limit + offset)[offset:]
    return [tokenizer.encode(format_prompt(it, tokenizer, prompt_format), add_special_tokens=False) for it in items]


def _options(args) -> dict[str, dict]:
    opts: dict[str, dict] = defaultdict(dict)
    for spec in args.option:
        method, _, kv = spec.partition(":")
        key, _, val = kv.partition("=")
        opts[method][key] = json.loads(val)
    return opts


def build_proposers(methods: list[str], budget: int | None, extra: dict[str, dict]):
    from vllm_anisotropic.proposers import PROPOSERS, get_proposer

    props = {}
    for m in methods:
        kw = dict(extra.get(m, {}))
        if budget is not None and "budget" in PROPOSERS[m][1].model_fields:
            kw["budget"] = budget
        props[m] = get_proposer(m, **kw)
    return props


# ---------------------------------------------------------------------- summary
def complete_prompts(records: list[dict]) -> list[dict]:
    """Only the prompts that every method of their dataset finished (a run stopped early
    leaves its last prompt partial), so that all methods average over the same prompts. A
    (dataset, prompt, method) recorded twice (a stopped run's partial prompt redone by the next
    run) counts once: the last record wins."""
    records = list({(r["dataset"], r["prompt_index"], r["method"]): r for r in records}.values())
    methods = defaultdict(set)
    done = defaultdict(set)
    for r in records:
        methods[r["dataset"]].add(r["method"])
        done[(r["dataset"], r["prompt_index"])].add(r["method"])
    return [r for r in records if done[(r["dataset"], r["prompt_index"])] == methods[r["dataset"]]]


def summarize(records: list[dict]) -> dict:
    """Per (dataset, method): tau, p_s, p_t, ratio, ms/step, identical fraction, prompts."""
    acc = defaultdict(lambda: defaultdict(float))
    multi = len({r["dataset"] for r in records}) > 1
    for r in records:
        for a in [acc[(r["dataset"], r["method"])]] + ([acc[("ALL (pooled)", r["method"])]] if multi else []):
            _accumulate(a, r)
    return _finish(acc)


def _accumulate(a: dict, r: dict) -> None:
    s = r["summary"]
    a["steps"] += s["num_steps"]
    a["emitted"] += s["accepted"] + s["num_steps"]
    for k in ("spine_accepted", "spine_proposed", "branch_accepted", "branch_proposed", "bypass_steps"):
        a[k] += s[k]
    a["propose_ms"] += s["propose_ms_per_step"] * s["num_steps"]
    a["tokens"] += s.get("num_tokens", 0)
    a["wall_s"] += s.get("wall_s", 0.0)
    a["prompts"] += 1
    a["identical"] += bool(r.get("identical_to_ar", True))


def _finish(acc: dict) -> dict:
    out = {}
    for key, a in acc.items():
        steps = max(a["steps"], 1)
        p_s = a["spine_accepted"] / a["spine_proposed"] if a["spine_proposed"] else float("nan")
        p_t = a["branch_accepted"] / a["branch_proposed"] if a["branch_proposed"] else float("nan")
        out[key] = {
            "tau": a["emitted"] / steps,
            "p_s": p_s,
            "p_t": p_t,
            "ratio": p_s / p_t if p_t and p_t == p_t and p_t > 0 else float("nan"),
            "bypass_frac": a["bypass_steps"] / steps,
            "propose_ms": a["propose_ms"] / steps,
            "tok_s": a["tokens"] / a["wall_s"] if a["wall_s"] > 0 else float("nan"),
            "prompts": int(a["prompts"]),
            "identical": int(a["identical"]),
        }
    return out


def format_table(summary: dict) -> str:
    lines = []
    datasets = sorted({d for d, _ in summary}, key=lambda d: (d.startswith("ALL"), d))
    for d in datasets:
        rows = {m: v for (dd, m), v in summary.items() if dd == d}
        lines.append(f"dataset {d}")
        lines.append(f"{'method':<26}{'tau':>7}{'p_s':>8}{'p_t':>8}{'p_s/p_t':>9}{'bypass':>8}{'ms/step':>9}{'identical':>11}"
                     f"{'tok/s':>8}{'vs ar':>7}")
        ar_speed = rows.get("ar", {}).get("tok_s")
        for m, v in rows.items():
            lines.append(
                f"{m:<26}{v['tau']:>7.3f}{v['p_s']:>8.3f}{v['p_t']:>8.3f}{v['ratio']:>9.2f}{v['bypass_frac']:>8.2f}"
                f"{v['propose_ms']:>9.2f}{v['identical']:>6d}/{v['prompts']:<4d}{v['tok_s']:>8.1f}"
                f"{v['tok_s'] / ar_speed if ar_speed else float('nan'):>6.2f}x"
            )
        g = rows.get("goose", {}).get("tau")
        base = max([rows[m]["tau"] for m in ("pld", "tr") if m in rows], default=None)
        if g and base:
            lines.append(f"synergy tau_goose / max(tau_pld, tau_tr) = {g / base:.3f}")
        if g and "iso3" in rows:
            lines.append(f"tau_goose / tau_iso3 - 1 = {100 * (g / rows['iso3']['tau'] - 1):+.1f}%")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------- main
def run(args) -> int:
    import torch
    from tqdm import tqdm

    from vllm_anisotropic.bench.harness import TreeDecoder, first_divergence, load_model

    if args.summarize:
        records = []
        for path in args.summarize.split(","):
            with open(path) as fh:
                records.extend(json.loads(line) for line in fh if line.strip())
        sys.stdout.write(format_table(summarize(complete_prompts(records))) + "\n")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    dtype = getattr(torch, args.dtype)
    model_dir = _resolve_model(args.model)
    model, tokenizer = load_model(model_dir, args.device, dtype)
    decoder = TreeDecoder(model, args.device)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    env = environment(args.device, args.dtype)
    extra = _options(args)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    records = []
    datasets = [d.strip() for d in args.dataset.split(",") if d.strip()]
    jobs = {d: load_prompts(d, args.limit, args.offset, tokenizer, args.prompt_format) for d in datasets}
    total = sum(len(p) for p in jobs.values()) * len(methods)
    with out_path.open("a") as fh, tqdm(total=total, desc="tau", unit="run") as bar:
        # prompt-major over datasets, so a run stopped early still covers every dataset
        proposers_of = {d: build_proposers(methods, args.budget, extra) for d in jobs}  # empty tables
        for idx in range(max(len(p) for p in jobs.values())):
            for dataset, prompts in jobs.items():
                if idx >= len(prompts):
                    continue
                prompt, proposers, reference = prompts[idx], proposers_of[dataset], None
                for method in methods:
                    t0 = time.perf_counter()
                    if method == "ar":
                        res = decoder.greedy_decode(prompt, args.max_new_tokens, eos)
                        reference = res.tokens
                    else:
                        res = decoder.generate(prompt, proposers[method].new_request(), args.max_new_tokens, eos)
                    div = first_divergence(reference, res.tokens) if reference is not None else -1
                    identical = reference is None or (div == -1 and len(reference) == len(res.tokens))
                    if not identical:
                        logger.warning("%s prompt %d: output differs from greedy at token %d", method, idx, div)
                    rec = {
                        "dataset": dataset,
                        "prompt_index": args.offset + idx,
                        "method": method,
                        "model": args.model,
                        "model_dir": str(model_dir),
                        "prompt_len": len(prompt),
                        "max_new_tokens": args.max_new_tokens,
                        "config": proposers[method].config.model_dump(mode="json"),
                        "env": env,
                        "summary": res.summary(),
                        "identical_to_ar": identical if reference is not None else None,
                        "first_divergence": div,
                        "elapsed_s": time.perf_counter() - t0,
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    }
                    if not args.no_steps:
                        rec["steps"] = res.step_dicts()
                    fh.write(json.dumps(rec) + "\n")
                    fh.flush()
                    records.append(rec)
                    bar.set_postfix(dataset=dataset, method=method, tau=f"{res.tau:.2f}")
                    bar.update(1)
    table = format_table(summarize(records))
    sys.stdout.write(table + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_anisotropic.bench.tau`` = ``vllm-anisotropic tau``."""
    from vllm_anisotropic.cli import main as cli_main

    return cli_main(["tau", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
