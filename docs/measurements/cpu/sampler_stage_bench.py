"""``TreeRejectionSampler.forward`` on fixed inputs, for an A/B of two source trees (no engine:
warm caches, so these times are lower bounds of the in-engine ones).

R greedy requests, each a 6-node tree (a spine chain of 3 and two branches), bf16 logits over a
49,152-token vocabulary whose argmax accepts node 1 and then the branch node 5 (off the leading
chain: one K/V move a request). vLLM's real ``Sampler`` / ``RejectionSampler`` /
``SpecDecodeMetadata`` / ``SamplingMetadata``; the runner and drafter are the recording stand-ins
of ``tests/test_tree_sampler.py`` (their ``move_kv`` and ``observe_step`` only record). Prints the
median microseconds a step of the plugin's ``walk`` + ``kv`` phases (the host clock's, vLLM's
bonus sampler excluded) over 300 steps after 20 warm-up steps; one thread.

    REPO=/tmp/before PYTHONPATH=/tmp/before python docs/measurements/cpu/sampler_stage_bench.py
    REPO=$PWD        PYTHONPATH=$PWD        python docs/measurements/cpu/sampler_stage_bench.py
"""
import json
import os
import sys
import time

sys.path.insert(0, os.environ.get("REPO", "."))  # the tree whose tests/ stand-ins to use
import numpy as np, torch
from tests.test_tree_sampler import _Runner, _sampler, _metadata, _sampling
from vllm_anisotropic.integration.vllm.engine.drafter import StepTrees
from vllm_anisotropic.tree import DraftTree, FlatTrees, NodeSource
torch.set_num_threads(1)
V = 49152
S, B, R0 = NodeSource.SPINE, NodeSource.BRANCH, NodeSource.ROOT

def case(num, rng):
    trees = []
    for r in range(num):
        toks = rng.integers(0, V, 6).tolist()
        trees.append(DraftTree(toks, [-1, 0, 1, 2, 0, 1], [R0, S, S, S, B, B]))
    drafts = [list(map(int, t.tokens[1:])) for t in trees]
    n = num
    step = StepTrees([f"r{i}" for i in range(n)], np.arange(n, dtype=np.int64), FlatTrees.from_trees(trees),
                     np.full(n, -1, np.int64), np.ones(n, np.int8), np.zeros(n, bool))
    step.node_rows = np.arange(n, dtype=np.int64) * 6 + 1
    step.root_positions = np.full(n, 100, np.int64)
    logits = torch.randn(6 * n, V).to(torch.bfloat16)
    for r, t in enumerate(trees):  # accept node 1, then the branch 5 (off chain): one move
        logits[6 * r, t.tokens[1]] = 10
        logits[6 * r + 1, t.tokens[5]] = 10
    return step, drafts, logits

def run(num, steps):
    rng = np.random.default_rng(0)
    step, drafts, logits = case(num, rng)
    md = _metadata(drafts)
    sm = _sampling(batch=num)
    runner = _Runner(None, seeds={f"r{i}": None for i in range(num)}, outputs=[[1]] * num)
    s = _sampler(runner)
    ts = []
    for it in range(steps + 20):
        runner._step = step
        runner.host_clock = type(runner.host_clock)()
        s(md, None, logits, sm)
        if it >= 20:
            ts.append((runner.host_clock.seconds.get("walk", 0) + runner.host_clock.seconds.get("kv", 0)) * 1e6)
    return {"requests": num, "walk_kv_us_median": round(float(np.median(ts)), 1), "p10": round(float(np.percentile(ts, 10)), 1)}

if __name__ == "__main__":
    for n in (1, 8, 64):
        print(json.dumps(run(n, 300)))
