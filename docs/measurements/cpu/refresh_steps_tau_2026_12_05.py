"""Tau of GOOSE with ``refresh_steps`` (a row whose table entries were written in the table's
last W harvests is not harvested) against W = 0 (every verified row rewrites its entries, the
papers' rule).

Why: the harvest's vocabulary pass is the largest phase of the plugin's host work at 8 and 64
requests (issue 43). In the engine (goose-b8, bf16) 11-19 % of the rows a step keeps were
written in the previous step, 24-35 % in the previous 4 and 40-53 % in the previous 16 (8 / 64
requests). This measures what those rewrites are worth in tau.

Exact harness as ``harvest_path_tau_2026_12_05.py`` (SmolLM2-135M-Instruct float32, greedy, one
proposer for all prompts, the datasets interleaved, 128 new tokens, the engine's harvest lag);
outputs are compared token for token (greedy: identical whatever the drafts).
Usage: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/refresh_steps_tau_2026_12_05.py BUDGET PROMPTS OFFSET W[,W...]
"""

import sys
import time

import torch

from vllm_anisotropic.bench.harness import TreeDecoder, load_model
from vllm_anisotropic.bench.tau import _resolve_model, load_prompts
from vllm_anisotropic.proposers.config import GooseConfig
from vllm_anisotropic.proposers.goose import GooseProposer


def main() -> None:
    budget, n, offset = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    windows = [int(w) for w in sys.argv[4].split(",")]
    torch.set_num_threads(2)
    model, tok = load_model(_resolve_model("smollm2-135m"), "cpu", torch.float32)
    dec = TreeDecoder(model, "cpu")
    eos = [tok.eos_token_id]
    jobs = {d: load_prompts(d, n, offset, tok, "chat") for d in ["humaneval", "gsm8k", "mtbench"]}
    order = [(d, i) for i in range(n) for d in jobs]
    outputs = {}
    for window in windows:
        prop = GooseProposer(GooseConfig(budget=budget, refresh_steps=window), vocab_size=model.config.vocab_size)
        acc, t0 = {}, time.time()
        for d, i in order:
            res = dec.generate(jobs[d][i], prop.new_request(), 128, eos, harvest_lag=True)
            outputs.setdefault((d, i), []).append(res.tokens)
            a = acc.setdefault(d, [0, 0])
            a[0] += len(res.tokens)
            a[1] += res.num_steps
        tokens, steps = sum(a[0] for a in acc.values()), sum(a[1] for a in acc.values())
        table = prop.tables.default
        print(f"B={budget} offset={offset} refresh_steps={window}: "
              + "  ".join(f"{d} tau {a[0] / a[1]:.3f}" for d, a in acc.items())
              + f"  ALL tau {tokens / steps:.3f}  rows written {table.num_harvested} skipped {table.num_skipped}"
              + f"  ({time.time() - t0:.0f}s)", flush=True)
    same = sum(all(o == v[0] for o in v) for v in outputs.values())
    print(f"outputs identical across windows: {same}/{len(outputs)}")


if __name__ == "__main__":
    main()
