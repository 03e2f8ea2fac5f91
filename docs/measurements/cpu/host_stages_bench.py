"""The worker's per-step tree path on fixed inputs, for an A/B of two source trees (no engine, no
forward: warm caches, so these times are lower bounds of the in-engine ones).

One step for R requests over a 49,152-token vocabulary: TreeDrafter.propose_trees (GOOSE over
contexts with repeats, a table filled by 50 random harvests, the acceptance model on), take_step
of every drafted tree, the greedy walk (verifiers.greedy.walk_flat) over bf16 logits whose
argmax follows the tree's first two draft tokens, observe_step and the deferred learning, and
the allocator's allocate() on the proposal's probabilities (after propose_trees, timed; the step
then schedules the first --max-drafts drafts of every tree). Median microseconds per stage over
--steps steps (the same inputs every step).

    PYTHONPATH=/tmp/before python docs/measurements/cpu/host_stages_bench.py --requests 1,8
    PYTHONPATH=.           python docs/measurements/cpu/host_stages_bench.py --requests 1,8
"""
import argparse
import json
import time
from types import SimpleNamespace

import numpy as np
import torch

from vllm_anisotropic.allocator.allocate import allocate
from vllm_anisotropic.allocator.cost import CostModel
from vllm_anisotropic.integration.vllm.engine.drafter import TreeDrafter
from vllm_anisotropic.integration.vllm.frontdoor.config import TreeSpecConfig
from vllm_anisotropic.proposers.adjacency import TopKRows
from vllm_anisotropic.verifiers.greedy import walk_flat

V = 49152
COST = CostModel.from_coefficients([0, 2, 4, 8, 16, 32, 64, 128], base=0.00728, per_request=0.0,
                                   slopes=[0, 0, 0.00028, 0.000317, 0.000237, 0.00028, 0.000239, 0.000235],
                                   tree_switch=0.0017, tree_row=4.7e-05, tree_ctx=8.76e-07, spec_switch=0.0017)


def drafter_and_contexts(num: int):
    """A GOOSE drafter (no backoff) with a table filled by 50 random harvests, and ``num``
    contexts with repeats: ``(drafter, rng, tokens [num, 4096], lengths [num], req_ids)``."""
    spec = TreeSpecConfig.build("goose", {})
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(method="goose", num_speculative_tokens=59),
                          additional_config={"vllm_anisotropic": spec.to_additional_config()},
                          model_config=SimpleNamespace(get_vocab_size=lambda: V, max_model_len=4096))
    d = TreeDrafter(cfg)
    d.max_backoff = 0  # every request drafts every step (no zero-cut backoff): the same work each step
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, 2000, (64, 10)).astype(np.int32)
        scores = np.sort(rng.random((64, 10)).astype(np.float32), axis=1)[:, ::-1].copy() * 0.5
        d.proposer.table.harvest(rng.integers(0, 2000, 64), rng.integers(0, 2000, 64), TopKRows(ids, scores, V))
    base = rng.integers(0, 2000, 200)
    tokens = np.zeros((num, 4096), np.int32)
    lengths = []
    for r in range(num):
        ctx = np.concatenate([base, rng.integers(0, 2000, 200), base[: 150 + r]])
        tokens[r, : len(ctx)] = ctx
        lengths.append(len(ctx))
    return d, rng, tokens, np.array(lengths), [f"r{i}" for i in range(num)]


def bench(num: int, steps: int, cut_max: int, flush_mb: int = 0) -> dict:
    d, rng, tokens, lengths, req_ids = drafter_and_contexts(num)
    nodes = []
    # --flush-mb: what a CPU forward does to the caches between the host stages (it streams the
    # model's weights: SmolLM2-135M's 270 MB in bf16), imitated by a read of that many MB
    flush = [0.0, np.ones(flush_mb << 18, np.float32)] if flush_mb else None
    times = {k: [] for k in ("propose", "take_step", "walk", "observe", "learn", "allocate", "total")}
    for it in range(steps + 5):
        t = [time.perf_counter()]
        drafts = d.propose_trees(req_ids, [True] * num, [[1]] * num, lengths, tokens)
        t.append(time.perf_counter())
        probs = [np.zeros(0) if p is None else p for p in d.pending_probs(req_ids)]  # None: backing off
        allocate(probs, COST, ctx_lens=lengths.astype(float), num_reqs=num, fixed_query_tokens=num,
                        token_budget=2048, max_per_request=cut_max, headroom=[1000] * num, base_tokens=num)
        t.append(time.perf_counter())
        # scheduled: the first --max-drafts drafts of every tree (the cuts above price the proposal;
        # they would keep none for these random tables)
        step = d.take_step(req_ids, {r: x[:cut_max] for r, x in zip(req_ids, drafts)})
        nodes.append(step.trees.num_nodes / num)
        t.append(time.perf_counter())
        trees = step.trees
        if flush:  # where the engine runs the forward (which then writes the logits): a read of flush_mb MB
            flush[0] += float(np.add.reduce(flush[1]))
        logits = torch.zeros(trees.num_nodes, V, dtype=torch.bfloat16)
        starts = trees.offsets[:-1]
        for k in range(trees.num_trees):  # the target agrees with the first two draft tokens
            a, b = int(trees.offsets[k]), int(trees.offsets[k + 1])
            logits[a, int(trees.tokens[a + 1]) if b - a > 1 else 0] = 1.0
            if b - a > 2 and trees.parents[a + 2] == 1:
                logits[a + 1, int(trees.tokens[a + 2])] = 1.0
        t.append(time.perf_counter())  # (building the logits and the flush are not timed)
        acc, n_acc, _bonus = walk_flat(trees, logits, starts)
        t.append(time.perf_counter())
        d.observe_step(step, acc, n_acc, starts, logits)
        t.append(time.perf_counter())
        d.run_deferred()
        t.append(time.perf_counter())
        if it >= 5:
            for key, (i, j) in zip(("propose", "allocate", "take_step", "walk", "observe", "learn"),
                                   ((0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7))):
                times[key].append(t[j] - t[i])
            times["total"].append(t[7] - t[0] - (t[4] - t[3]))
    return {"nodes_per_tree": round(float(np.mean(nodes)), 1), **{k: round(float(np.median(v)) * 1e6, 1) for k, v in times.items()}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--flush-mb", type=int, default=0, help="read this many MB between take_step and the walk, "
                    "where the engine's forward runs (0: warm caches)")
    ap.add_argument("--max-drafts", type=int, default=8, help="the allocator's per-request cap (a GOOSE tree's "
                    "kept drafts in the engine's tree steps are a few)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for num in (int(x) for x in args.requests.split(",")):
        print(json.dumps({"requests": num, "flush_mb": args.flush_mb, "us": bench(num, args.steps, args.max_drafts,
                                                                              args.flush_mb)}))
