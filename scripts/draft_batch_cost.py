"""draft_tree's drafting time per engine step on a device: q batched over the step's requests
(``DraftTreeProposer.propose_batch``) against one request at a time (``DraftTreeState.propose``),
side by side in one process (issue 45, item 5: q on the worker's device).

q: a directory (``--q``), or by default a random-weight model of Qwen2.5-Coder-0.5B-Instruct's
shape (24 layers, hidden 896, 14 query / 2 KV heads, vocabulary 151,936; a drafting step's cost
depends on the shape, not on the weights), written once to ``--work``. B requests (``--batches``)
with random contexts of ``--context`` tokens, greedy, shapes the chain of 4 (1, 4, 0) and the
delayed tree (2, 2, 2); each step every request accepts its first two drafts plus a bonus token.

Two checks before any timing, in float32 on the device (bf16 rounding can flip a near-tie of a
random model's flat logits between a batched and a single GEMM): the batched step's trees equal
the one-at-a-time trees, token for token, over 3 steps at B = 4; and q's weights and KV are on
the device (``--device``) while the laws come back to the host. Then per (shape, B) the median
ms per step of each path over ``--steps`` steps after one warm-up step (the device synchronized
around each), the two paths alternating which runs first. Output: a table on stdout and JSON
lines in ``--out``::

    python scripts/draft_batch_cost.py --device cuda --dtype bfloat16 --out /tmp/draft_batch_gpu.jsonl
    .venv/bin/python scripts/draft_batch_cost.py --device cpu --batches 1,2 --steps 2 --context 64   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import torch

from vllm_anisotropic.proposers import DraftTreeProposer, proposer_config

QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                tie_word_embeddings=True, rms_norm_eps=1e-6)
SHAPES = ((1, 4, 0), (2, 2, 2))


def random_q(work: str) -> str:
    """A random-weight Qwen2 of Qwen2.5-Coder-0.5B's shape saved in ``work`` (once)."""
    path = os.path.join(work, "qwen05b_shape")
    if not os.path.isfile(os.path.join(path, "config.json")):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**QWEN_05B)).save_pretrained(path)
    return path


def twins(q: str, shape, device: str, dtype: torch.dtype) -> list[DraftTreeProposer]:
    config = proposer_config("draft_tree", model=q, branches=shape[0], trunk=shape[1], branch_length=shape[2],
                             selector="off")
    return [DraftTreeProposer(config, device=device, dtype=dtype) for _ in range(2)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(pair, batch: int, steps: int, context: int, device: str, check: bool, seed: int = 0):
    """``steps`` + 1 drafting steps of both paths (the first a warm-up); per step the ms of each."""
    rng = np.random.default_rng(seed)
    vocab = pair[0].lm.vocab_size
    batched, single = ([p.new_request() for _ in range(batch)] for p in pair)
    tokens = np.zeros((batch, context + 8 * (steps + 2)), np.int64)
    tokens[:, :context] = rng.integers(100, vocab, (batch, context))
    lengths = np.full(batch, context, np.int64)
    times = {"batched": [], "single": []}
    for step in range(steps + 1):
        for which in (("batched", "single") if step % 2 else ("single", "batched")):
            sync(device)
            t0 = time.perf_counter()
            if which == "batched":
                out = pair[0].propose_batch(batched, tokens, np.arange(batch), lengths)
                trees = [out.trees.tree(i) for i in range(batch)]
            else:
                ref = [s.propose(tokens[i, : lengths[i]]) for i, s in enumerate(single)]
            sync(device)
            if step:
                times[which].append((time.perf_counter() - t0) * 1e3)
        if check:
            for i in range(batch):
                assert trees[i].tokens.tolist() == ref[i].tokens.tolist(), (step, i, trees[i].tokens, ref[i].tokens)
        for i in range(batch):
            add = trees[i].tokens[1:3].tolist() + [int(rng.integers(100, vocab))]
            tokens[i, lengths[i] : lengths[i] + len(add)] = add
            lengths[i] += len(add)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--q", default=None, help="the draft model's directory (default: a random Qwen2.5-0.5B shape)")
    ap.add_argument("--work", default="/tmp/draft_batch_cost")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    os.makedirs(args.work, exist_ok=True)
    q = args.q or random_q(args.work)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
    print(f"# device {args.device} ({name}); torch {torch.__version__}; q {q}; context {args.context}; "
          f"{args.dtype}; torch threads {torch.get_num_threads()}", flush=True)

    pair = twins(q, (2, 2, 2), args.device, torch.float32)
    weight = next(pair[0].lm.model.parameters())
    assert weight.device.type == torch.device(args.device).type, weight.device
    run(pair, 4, 3, min(args.context, 128), args.device, check=True)
    cache = pair[0].new_request().session
    logits = cache.root_logits(list(range(100, 120)))  # token ids any vocabulary has
    assert cache.cache.layers[0].keys.device.type == torch.device(args.device).type
    assert logits.device.type == "cpu" and logits.dtype == torch.float32, (logits.device, logits.dtype)
    print("check: batched trees == one-at-a-time trees (float32, B = 4, 3 steps); q's weights and KV on "
          f"{weight.device}, the logits on the host", flush=True)
    del pair, cache

    out = open(args.out, "w") if args.out else None
    print("shape | requests | one at a time ms/step | batched ms/step | ratio (spread over steps)")
    for shape in SHAPES:
        pair = twins(q, shape, args.device, dtype)
        for batch in [int(b) for b in args.batches.split(",")]:
            times = run(pair, batch, args.steps, args.context, args.device, check=False, seed=batch)
            seq, bat = np.array(times["single"]), np.array(times["batched"])
            ratios = seq / bat
            print(f"{shape} | {batch} | {np.median(seq):.1f} | {np.median(bat):.1f} | "
                  f"{np.median(ratios):.2f}x ({ratios.min():.2f}-{ratios.max():.2f})", flush=True)
            if out:
                out.write(json.dumps({"shape": shape, "requests": batch, "single_ms": seq.tolist(),
                                      "batched_ms": bat.tolist(), "device": args.device, "device_name": name,
                                      "dtype": args.dtype, "context": args.context}) + "\n")
        del pair
    if out:
        out.close()


if __name__ == "__main__":
    main()
