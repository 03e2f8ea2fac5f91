"""Verifier speed benchmark: ms per batch of 256 trees x 64 nodes x vocab 151,936 (Qwen2.5).

Not a test. ``python -m vllm_anisotropic.bench.verifier_speed [--trees 256] [--chunk 32]``.

Setup (stated in the output): each tree is a root plus 7 i.i.d. paths of 9 draft tokens
(64 nodes); target logits and draft probabilities are stored in bfloat16 (256*64*151936 fp32
would be 10 GB) and converted to float32 row by row inside the verifiers; the batch is
verified in chunks of ``--chunk`` trees (one chunk's tensors are generated once and verified
256/chunk times, so memory stays ~1.5 GB). The first path's tokens get a +8 logit boost in
both target and draft, so walks go deep (a slow case for the top-down verifiers).
Sampling: temperature 1, no top-k/top-p (``--top-p 0.9`` adds vLLM's sort-based nucleus).
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from vllm_anisotropic.tree import DraftTree, NodeSource, pack_trees
from vllm_anisotropic.verifiers import VERIFIERS, TargetSampling, get_verifier

logger = logging.getLogger(__name__)


def make_chunk(num_trees: int, vocab: int, paths: int = 7, depth: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    trees = []
    for _ in range(num_trees):
        toks = torch.randint(0, vocab, (paths, depth), generator=g).tolist()
        tokens, parents = [0], [-1]
        for path in toks:
            par = 0
            for t in path:
                tokens.append(t)
                parents.append(par)
                par = len(tokens) - 1
        src = [NodeSource.ROOT] + [NodeSource.DRAFT] * (len(tokens) - 1)
        trees.append(DraftTree(tokens=tokens, parents=parents, sources=src))
    batch = pack_trees(trees)
    n = batch.num_nodes
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float32)  # [num_nodes, vocab_size]
    first = batch.children[:, 0]
    has = first >= 0
    rows = has.nonzero().squeeze(1)
    logits[rows, batch.tokens[first[rows]]] += 8.0
    draft_logits = logits + 0.5 * torch.randn(n, vocab, generator=g)
    q = torch.softmax(draft_logits, dim=-1).to(torch.bfloat16)  # [num_nodes, vocab_size]
    del draft_logits
    return batch, logits.to(torch.bfloat16), q


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--verifiers", default=",".join(VERIFIERS))
    ap.add_argument("--json", default=None, help="write results as JSON here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    batch, logits, q = make_chunk(args.chunk, args.vocab)
    chunks = args.trees // args.chunk
    sampling = TargetSampling(1.0, top_p=args.top_p)
    results = {}
    print(f"# {args.trees} trees x {batch.num_nodes // args.chunk} nodes x vocab {args.vocab}; bf16 logits/q; "
          f"chunks of {args.chunk}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| verifier | ms / batch | mean accepted |")
    print("|---|---:|---:|")
    for name in args.verifiers.split(","):
        v = get_verifier(name)
        gen = torch.Generator().manual_seed(1)
        t0 = time.perf_counter()
        acc = 0.0
        for _ in range(chunks):
            r = v.verify_batch(batch, logits, sampling, gen, q)
            acc += float(r.num_accepted.float().mean())
        ms = (time.perf_counter() - t0) * 1e3
        results[name] = {"ms_per_batch": ms, "mean_accepted": acc / chunks}
        print(f"| {name} | {ms:.0f} | {acc / chunks:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
