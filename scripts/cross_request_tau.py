"""Tau of GOOSE with and without the cross-request spine store (docs/goose.md, "Cross-request spine").

One proposer for every prompt (its adjacency table and store shared, as in one engine), the
datasets interleaved prompt by prompt as in a `bench` cell, the exact harness in float32 with the
engine's harvest order; the two variants' outputs are compared token for token.
Usage: .venv/bin/python scripts/cross_request_tau.py BUDGET PROMPTS_PER_DATASET [OFFSET]
(B = 8, 8 prompts: ~3 min on 2 cores).
"""

import sys
import time

import torch

from vllm_anisotropic.bench.harness import TreeDecoder, load_model
from vllm_anisotropic.bench.tau import _resolve_model, load_prompts
from vllm_anisotropic.proposers.config import GooseConfig
from vllm_anisotropic.proposers.goose import GooseProposer


def main() -> None:
    budget, n = int(sys.argv[1]), int(sys.argv[2])
    offset = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    torch.set_num_threads(2)
    model, tok = load_model(_resolve_model("smollm2-135m"), "cpu", torch.float32)
    dec = TreeDecoder(model, "cpu")
    eos = [tok.eos_token_id]
    jobs = {d: load_prompts(d, n, offset, tok, "chat") for d in ["humaneval", "gsm8k", "mtbench"]}
    order = [(d, i) for i in range(n) for d in jobs]  # interleaved like the engine's cells
    outputs = {}
    for store in [False, True]:
        prop = GooseProposer(GooseConfig(budget=budget, cross_request_spine=store), vocab_size=model.config.vocab_size)
        acc, t0 = {}, time.time()
        for d, i in order:
            res = dec.generate(jobs[d][i], prop.new_request(), 128, eos, harvest_lag=True)
            outputs.setdefault((d, i), []).append(res.tokens)
            a = acc.setdefault(d, [0, 0])
            a[0] += len(res.tokens)
            a[1] += res.num_steps
        tokens, steps = sum(a[0] for a in acc.values()), sum(a[1] for a in acc.values())
        print(f"B={budget} store={store}: " + "  ".join(f"{d} tau {a[0] / a[1]:.3f}" for d, a in acc.items())
              + f"  ALL tau {tokens / steps:.3f}  ({time.time() - t0:.0f}s)", flush=True)
    same = sum(v[0] == v[1] for v in outputs.values())
    print(f"outputs identical with and without the store: {same}/{len(outputs)}")


if __name__ == "__main__":
    main()
