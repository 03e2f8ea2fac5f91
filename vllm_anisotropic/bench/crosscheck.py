"""``vllm-anisotropic crosscheck``: tau inside vLLM vs the exact harness, step by step.

Scope: greedy decoding is deterministic, so the engine path (``speculative_config={"method":
...}`` in real vLLM) and the exact harness (``bench.harness.TreeDecoder`` over the same model
in Hugging Face transformers) must draft the same trees and accept the same number of tokens at
every step. This command runs both on the same token-id prompts and compares, per prompt:

* output tokens (engine vs harness vs plain vLLM);
* the sequence of accepted lengths per verification step (engine: the drafter's per-request
  trace, ``VLLM_ANISOTROPIC_TREE_TRACE=1``; harness: ``DecodeResult.steps``).

Settings that make the two comparable (both sides get them):

* ``shared_table=False``: one adjacency table per request, so concurrent requests in vLLM do
  not feed each other's tables in an order the sequential harness cannot reproduce;
* the harness starts like vLLM (``first_token_from_prefill``: the prefill emits the first token,
  prompt rows are not harvested: vLLM computes only the last prompt row's logits);
* float32 on both sides. Remaining differences are float rounding between vLLM's kernels and
  transformers' (an argmax or a top-K order flips where two logits nearly tie); the command
  reports where the first difference happens instead of assuming none.

tau here = output tokens / target passes (verification steps + the prefill), summed over
prompts. vLLM's counters give ``output tokens / (output tokens - accepted drafts)``, which
overestimates when accepted drafts are cut by ``max_tokens`` or EOS (vLLM counts them as
accepted); both are printed.

Example::

    vllm-anisotropic crosscheck --model smollm2-135m --dataset humaneval,gsm8k --limit 4 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

__all__ = ["add_parser", "run", "compare"]

logger = logging.getLogger(__name__)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("crosscheck", help="tau in vLLM vs the exact harness, step by step (greedy)")
    p.add_argument("--model", default="smollm2-135m", help="registry model name, 'tiny', or an HF directory")
    p.add_argument("--dataset", default="humaneval", help="comma-separated dataset names")
    p.add_argument("--limit", type=int, default=4, help="prompts per dataset")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--method", default="goose", help="vLLM method name (goose, pld, token_recycling, isotropic)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=JSON", help="proposer option (repeatable)")
    p.add_argument("--prompt-format", default="chat", help="format_prompt style (chat or raw)")
    p.add_argument("--block-std", type=float, default=None, help="with --model tiny: build_tiny_model(block_std=...)")
    p.add_argument("--out", default=None, help="write the per-prompt comparison as JSON here")
    p.set_defaults(func=run)
    return p


def compare(engine_traces: list[list[int]], harness_traces: list[list[int]]) -> list[dict]:
    """Per prompt: equal?, first differing step, steps and accepted totals of both sides."""
    rows = []
    for e, h in zip(engine_traces, harness_traces):
        first = next((i for i, (x, y) in enumerate(zip(e, h)) if x != y), -1)
        if first == -1 and len(e) != len(h):
            first = min(len(e), len(h))
        rows.append({"equal": e == h, "first_diff_step": first, "engine_steps": len(e), "harness_steps": len(h),
                     "engine_accepted": sum(e), "harness_accepted": sum(h)})
    return rows


def _tau(traces: list[list[int]], tokens: list[list[int]]) -> float:
    passes = sum(len(t) + 1 for t in traces)  # + the prefill pass of each prompt
    return sum(len(t) for t in tokens) / passes if passes else 0.0


def engine_traces(stats_file: Path, num_prompts: int) -> list[list[int]]:
    """The drafter's per-request accepted lengths, in prompt order (request ids "0", "1", ...)."""
    data = json.loads(stats_file.read_text())
    by_index: dict[int, list[int]] = {}
    for req_id, trace in data.get("requests", {}).items():
        by_index[int(str(req_id).split("-")[0])] = trace
    return [by_index.get(i, []) for i in range(num_prompts)]


LLM_KWARGS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 2048}


def run_engine(model_dir, prompts: list[list[int]], max_tokens: int, method: str, options: dict,
               llm_kwargs: dict | None = None):
    """vLLM with ``speculative_config={"method": method, **options}``: (OfflineResult, traces).

    The budget allocator is pinned off (unless ``options`` says otherwise): the harness verifies
    whole trees, so an engine that cuts them would accept fewer tokens at some steps by design.
    """
    from vllm_anisotropic.integration.vllm.engine.metrics import STATS_ENV, TRACE_ENV
    from vllm_anisotropic.bench.offline import OfflineJob, run_offline_job

    job = OfflineJob(model=str(model_dir), prompt_token_ids=prompts, max_tokens=max_tokens,
                     speculative_config={"method": method, "allocator": "off", **options}, llm_kwargs=llm_kwargs or LLM_KWARGS)
    with tempfile.TemporaryDirectory() as tmp:
        stats_file = Path(tmp, "stats.json")
        result = run_offline_job(job, env={STATS_ENV: str(stats_file), TRACE_ENV: "1"})
        return result, engine_traces(stats_file, len(prompts))


def run_harness(model, prompts: list[list[int]], max_tokens: int, method: str, options: dict, eos):
    """The exact harness started the way vLLM starts, learning in the engine's order (a step's
    harvest after the next proposal): (tokens, traces) per prompt."""
    from vllm_anisotropic.bench.harness import TreeDecoder
    from vllm_anisotropic.integration.vllm.frontdoor.config import TreeSpecConfig
    from vllm_anisotropic.proposers import get_proposer

    cfg = TreeSpecConfig.build(method, options)
    proposer = get_proposer(cfg.proposer_name, **cfg.proposer_options)
    decoder = TreeDecoder(model)
    tokens, traces = [], []
    for ids in prompts:
        res = decoder.generate(ids, proposer.new_request(), max_tokens, eos, harvest_prefill=False,
                               first_token_from_prefill=True, harvest_lag=True)
        tokens.append(res.tokens)
        traces.append([s.accepted for s in res.steps])
    return tokens, traces


def run(args) -> int:
    import torch

    from vllm_anisotropic.bench.harness import load_model
    from vllm_anisotropic.bench.tau import _resolve_model, load_prompts
    from vllm_anisotropic.integration.vllm.frontdoor.config import TreeSpecConfig
    from vllm_anisotropic.bench.offline import OfflineJob, run_offline_job

    options = {"shared_table": False}
    for spec in args.option:
        key, _, val = spec.partition("=")
        options[key] = json.loads(val)
    TreeSpecConfig.build(args.method, options)  # fail fast on a bad method / option
    if args.model == "tiny" and args.block_std is not None:
        from vllm_anisotropic.models import build_tiny_model

        model_dir = build_tiny_model(block_std=args.block_std)
    else:
        model_dir = _resolve_model(args.model)
    model, tokenizer = load_model(model_dir, "cpu", torch.float32)
    prompts = []
    for d in args.dataset.split(","):
        prompts += load_prompts(d.strip(), args.limit, 0, tokenizer, args.prompt_format)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    logger.info("plain vLLM (%d prompts)", len(prompts))
    plain = run_offline_job(OfflineJob(model=str(model_dir), prompt_token_ids=prompts, max_tokens=args.max_tokens,
                                       llm_kwargs=LLM_KWARGS))
    logger.info("vLLM with speculative_config method %s", args.method)
    spec, e_traces = run_engine(model_dir, prompts, args.max_tokens, args.method, options)
    logger.info("exact harness (transformers, float32)")
    h_tokens, h_traces = run_harness(model, prompts, args.max_tokens, args.method, options, eos)

    rows = compare(e_traces, h_traces)
    e_tokens = [r[0] for r in spec.token_ids]
    p_tokens = [r[0] for r in plain.token_ids]
    for i, row in enumerate(rows):
        row["engine_equals_plain"] = e_tokens[i] == p_tokens[i]
        row["harness_equals_plain"] = h_tokens[i] == p_tokens[i]
        print(f"prompt {i:3d}  steps engine {row['engine_steps']:4d} harness {row['harness_steps']:4d}  "
              f"accepted {row['engine_accepted']:4d} / {row['harness_accepted']:4d}  "
              f"trace equal {'yes' if row['equal'] else 'no (step %d)' % row['first_diff_step']}  "
              f"engine==plain {row['engine_equals_plain']}  harness==plain {row['harness_equals_plain']}")
    n = len(rows)
    summary = {
        "prompts": n,
        "traces_equal": sum(r["equal"] for r in rows),
        "engine_equals_plain": sum(r["engine_equals_plain"] for r in rows),
        "harness_equals_plain": sum(r["harness_equals_plain"] for r in rows),
        "tau_engine_trace": _tau(e_traces, e_tokens),
        "tau_harness": _tau(h_traces, h_tokens),
        "tau_engine_vllm_counters": spec.spec.tau,
        "tokens_per_s_plain": plain.tokens_per_second,
        "tokens_per_s_spec": spec.tokens_per_second,
    }
    print(f"method {args.method}  prompts {n}  identical per-step accepted lengths {summary['traces_equal']}/{n}")
    print(f"tau engine {summary['tau_engine_trace']:.3f} (vLLM counters {spec.spec.tau:.3f})  "
          f"harness {summary['tau_harness']:.3f}")
    print(f"outputs identical to plain vLLM: engine {summary['engine_equals_plain']}/{n}  "
          f"harness {summary['harness_equals_plain']}/{n}")
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "prompts": rows, "options": options}, indent=1))
    return 0 if summary["traces_equal"] == n else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_anisotropic.bench.crosscheck`` = ``vllm-anisotropic crosscheck``."""
    from vllm_anisotropic.cli import main as cli_main

    return cli_main(["crosscheck", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
