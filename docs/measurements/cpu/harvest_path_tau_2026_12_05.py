"""Tau of GOOSE when the harvest reads every verified row (the paper's Alg. 2 line 15, rejected
branches included) against only the rows of the accepted path (the root and the accepted nodes).

Why: at 64 requests the harvest's vocabulary pass is ~7.4 of the plugin's ~11.5 ms of host work a
step (issue 43); it costs ~22 us per row on the EPYC, and a tree of B nodes has B rows but only
1 + (accepted) on its path. This measures what the rejected rows are worth in tau.

Exact harness as ``scripts/cross_request_tau.py`` (SmolLM2-135M-Instruct float32, greedy, one
proposer for all prompts, the datasets interleaved, 128 new tokens, the engine's harvest lag);
outputs are compared token for token (greedy: identical whatever the drafts).
Usage: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/harvest_path_tau_2026_12_05.py BUDGET PROMPTS [OFFSET]
"""

import sys
import time

import numpy as np
import torch

from vllm_anisotropic.bench.harness import TreeDecoder, load_model
from vllm_anisotropic.bench.tau import _resolve_model, load_prompts
from vllm_anisotropic.proposers import adjacency
from vllm_anisotropic.proposers.config import GooseConfig
from vllm_anisotropic.proposers.goose import GooseProposer

_observe_all = adjacency.HarvestingState.observe


def _observe_path(self, tree, accepted, logits, prev_root=None):
    """The root's row and the accepted nodes' rows only, keyed as ``harvest_tree`` keys them."""
    if logits is None:
        return
    keep = np.asarray([0] + list(accepted), np.int64)
    prev = np.empty(tree.num_nodes, np.int64)
    prev[0] = self._prev_root if prev_root is None else prev_root
    prev[1:] = tree.tokens[tree.parents[1:]]
    self.table.harvest(prev[keep], tree.tokens[keep], logits[keep])


def main() -> None:
    budget, n = int(sys.argv[1]), int(sys.argv[2])
    offset = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    torch.set_num_threads(2)
    model, tok = load_model(_resolve_model("smollm2-135m"), "cpu", torch.float32)
    dec = TreeDecoder(model, "cpu")
    eos = [tok.eos_token_id]
    jobs = {d: load_prompts(d, n, offset, tok, "chat") for d in ["humaneval", "gsm8k", "mtbench"]}
    order = [(d, i) for i in range(n) for d in jobs]
    outputs = {}
    for mode, observe in [("all", _observe_all), ("path", _observe_path)]:
        adjacency.HarvestingState.observe = observe
        prop = GooseProposer(GooseConfig(budget=budget), vocab_size=model.config.vocab_size)
        acc, rows, t0 = {}, 0, time.time()
        for d, i in order:
            res = dec.generate(jobs[d][i], prop.new_request(), 128, eos, harvest_lag=True)
            outputs.setdefault((d, i), []).append(res.tokens)
            a = acc.setdefault(d, [0, 0, 0])
            a[0] += len(res.tokens)
            a[1] += res.num_steps
            a[2] += sum(s.tree_size for s in res.steps)
        tokens, steps = sum(a[0] for a in acc.values()), sum(a[1] for a in acc.values())
        nodes = sum(a[2] for a in acc.values())
        print(f"B={budget} harvest={mode}: " + "  ".join(f"{d} tau {a[0] / a[1]:.3f}" for d, a in acc.items())
              + f"  ALL tau {tokens / steps:.3f}  nodes/step {nodes / steps:.2f}  ({time.time() - t0:.0f}s)",
              flush=True)
    adjacency.HarvestingState.observe = _observe_all
    same = sum(v[0] == v[1] for v in outputs.values())
    print(f"outputs identical either way: {same}/{len(outputs)}")


if __name__ == "__main__":
    main()
