"""draft_tree's drafting time per engine step: q batched over the step's requests
(``DraftTreeProposer.propose_batch``, proposers/draft_batch.py) vs one request at a time
(``DraftTreeState.propose``, what the engine ran before), side by side in one process.

Real q (Qwen2.5-Coder-0.5B-Instruct, float32, transformers with vLLM's CPU GEMM on its linear
layers as in the engine: ``kernels/cpu_gemm.py``; ``--torch-linear``: torch's own), B requests with real
HumanEval / GSM8K prompts (chat-formatted, B = 1, 2, 4, 8), greedy, shapes chain of 4
(1, 4, 0) and the delayed tree (2, 2, 2). Each step the requests accept the first two drafts
plus a bonus token; per step the two paths draft the same trees (checked) from twin
proposers, alternating which runs first. Median ms per step over ``--steps`` steps after one
warm-up step (whose prompts run alone in both paths).

Run: ``.venv/bin/python docs/measurements/cpu/draft_batch_2026_11_29.py [--steps 6]`` (needs
``vllm-anisotropic models prepare qwen2.5-coder-0.5b``).
"""

import argparse
import platform
import time

import numpy as np
import torch

from vllm_anisotropic.bench.tau import load_prompts
from vllm_anisotropic.models import prepare_model
from vllm_anisotropic.proposers import get_proposer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--torch-linear", action="store_true", help="q's linears on torch's own GEMM")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    q = str(prepare_model("qwen2.5-coder-0.5b"))
    tok = AutoTokenizer.from_pretrained(q)
    prompts = load_prompts("humaneval", 4, 0, tok, "chat") + load_prompts("gsm8k", 4, 0, tok, "chat")
    with open("/proc/cpuinfo") as f:
        cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    print(f"CPU: {cpu}; torch threads {torch.get_num_threads()}; python {platform.python_version()}; "
          f"q's linears: {'torch' if args.torch_linear else 'vLLM CPU GEMM'}")
    print("shape | requests | one at a time ms/step | batched ms/step | ratio (spread over steps)")
    for shape in ((1, 4, 0), (2, 2, 2)):
        twins = [get_proposer("draft_tree", model=q, branches=shape[0], trunk=shape[1], branch_length=shape[2],
                              selector="off") for _ in range(2)]
        if not args.torch_linear:
            from vllm_anisotropic.integration.vllm.kernels.cpu_gemm import use_vllm_cpu_gemm

            for p in twins:
                use_vllm_cpu_gemm(p.lm.model)
        for b in [int(x) for x in args.batches.split(",")]:
            batched, single = ([p.new_request() for _ in range(b)] for p in twins)
            width = max(len(p) for p in prompts[:b]) + 8 * (args.steps + 2)
            tokens = np.zeros((b, width), np.int64)
            lengths = np.array([len(p) for p in prompts[:b]], np.int64)
            for i in range(b):
                tokens[i, : lengths[i]] = prompts[i]
            seq_ms, bat_ms = [], []
            for step in range(args.steps + 1):
                order = (0, 1) if step % 2 else (1, 0)
                for which in order:
                    t0 = time.perf_counter()
                    if which == 0:
                        out = twins[0].propose_batch(batched, tokens, np.arange(b), lengths)
                        trees = [out.trees.tree(i) for i in range(b)]
                    else:
                        ref = [s.propose(tokens[i, : lengths[i]]) for i, s in enumerate(single)]
                    ms = (time.perf_counter() - t0) * 1e3
                    if step:
                        (bat_ms if which == 0 else seq_ms).append(ms)
                assert all(x.tokens.tolist() == y.tokens.tolist() for x, y in zip(trees, ref)), step
                for i in range(b):
                    add = trees[i].tokens[1:3].tolist() + [int(trees[i].tokens[-1])]
                    tokens[i, lengths[i] : lengths[i] + len(add)] = add
                    lengths[i] += len(add)
            ratios = np.array(seq_ms) / np.array(bat_ms)
            print(f"{shape} | {b} | {np.median(seq_ms):.0f} | {np.median(bat_ms):.0f} | "
                  f"{np.median(ratios):.2f}x ({ratios.min():.2f}-{ratios.max():.2f})", flush=True)


if __name__ == "__main__":
    main()
