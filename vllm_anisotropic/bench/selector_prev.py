"""Do the paper's p-side features at the preceding token help the (K, L1, L2) selector?

arXiv 2602.16994 App. E feeds its selector the entropies of p and q at the token before the root
and the divergences KL(p||q), KL(q||p) and ||p - q||_1 there (p at the root itself would need
the target forward the tree is for). The grid records (``bench.draft_tree_grid``) hold the same
statistics at the root, not at the preceding token, and not the context tokens. At T = 0 a
root's context is the prompt plus the target's greedy continuation, so it can be rebuilt:

    python -m vllm_anisotropic.bench.selector_prev reconstruct --records GRID_T0.jsonl.gz \\
        --target DIR --draft DIR --out prev_t0.jsonl            # ~5 min, 120 roots, 2 threads
    python -m vllm_anisotropic.bench.selector_prev compare --records GRID_T0.jsonl.gz --prev prev_t0.jsonl

``reconstruct`` runs the target greedily from each prompt (transformers, float32, as the grid
did), and checks each rebuilt root against its record: the entropies of p and q at the root
must match the recorded ones (1e-3 relative), else it stops. ``compare`` cross-validates the
selector (``selector.train.cross_validate``: five folds by prompt, Traversal, at most 8 drafts)
over several split seeds with the shipped features, with the five preceding-token statistics
added, and with the root's own p statistics added (an upper bound: not available before the
tree is verified), and prints held-out tokens/s over the best static shape.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict

import numpy as np
import torch

from vllm_anisotropic.selector.features import entropy, record_features
from vllm_anisotropic.selector.train import cross_validate, load_examples, read_records

def law_stats(p: torch.Tensor, q: torch.Tensor) -> dict:
    """The grid's five statistics of two [vocab] laws (nats), named for the preceding token."""
    from vllm_anisotropic.bench.draft_tree_grid import _features

    return {f"{name}_prev": value for name, value in _features(p, q, 0).items() if name != "context_len"}


@torch.inference_mode()
def reconstruct(args) -> int:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_anisotropic.data import format_prompt, load_dataset

    roots = [r for r in read_records(args.records) if r.get("kind") == "root"]
    hot = sorted({float(r["temperature"]) for r in roots} - {0.0})
    if hot:
        raise SystemExit(f"{args.records}: roots at temperature {hot}: only T = 0 contexts can be rebuilt "
                         f"(a sampled continuation is not in the record)")
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    by_prompt = defaultdict(list)
    for r in roots:
        by_prompt[(r["dataset"], int(r["prompt"]))].append(r)
    prompts = {}
    for ds in sorted({d for d, _ in by_prompt}):
        for i, item in enumerate(load_dataset(ds, 1 + max(p for d, p in by_prompt if d == ds))):
            prompts[(ds, i)] = tok.encode(format_prompt(item, tok, "chat"), add_special_tokens=False)
    with open(args.out, "w") as out:
        for key in tqdm(sorted(by_prompt), desc="prompts", unit="prompt"):
            context, need = list(prompts[key]), max(int(r["context_len"]) for r in by_prompt[key])
            step = target(input_ids=torch.tensor([context]), use_cache=True, logits_to_keep=1)
            after = {len(context): step.logits[0, -1].float()}  # after[n]: p's logits after n tokens
            while len(context) <= need:
                context.append(int(after[len(context)].argmax()))
                step = target(input_ids=torch.tensor([context[-1:]]), past_key_values=step.past_key_values,
                              use_cache=True)
                after[len(context)] = step.logits[0, -1].float()
            for r in by_prompt[key]:
                n = int(r["context_len"])  # tokens up to and including the root
                q_prev, q_root = draft(input_ids=torch.tensor([context[:n]]), logits_to_keep=2).logits[0].float().softmax(-1)
                got = {"entropy_p": entropy(after[n].softmax(-1)), "entropy_q": entropy(q_root)}
                for name, value in got.items():
                    if abs(value - r["features"][name]) > 1e-3 * max(1.0, abs(r["features"][name])):
                        raise SystemExit(f"{key} root {r['root']}: rebuilt {name} {value:.5f} != recorded "
                                         f"{r['features'][name]:.5f}: the context was not rebuilt")
                row = law_stats(after[n - 1].softmax(-1), q_prev)
                row.update(dataset=key[0], prompt=key[1], root=int(r["root"]), context_len=n)
                out.write(json.dumps(row) + "\n")
    return 0


def compare(args) -> int:
    side = {}
    with open(args.prev) as f:
        for line in f:
            s = json.loads(line)
            side[(s["dataset"], int(s["prompt"]), int(s["root"]))] = s

    def prev(r):
        s = side[(r["dataset"], int(r["prompt"]), int(r["root"]))]
        return [s["entropy_p_prev"], s["entropy_q_prev"], math.log1p(s["kl_pq_prev"]), math.log1p(s["kl_qp_prev"]),
                s["l1_prev"]]

    def root_p(r):
        f = r["features"]
        return [f["entropy_p"], math.log1p(f["kl_pq"]), math.log1p(f["kl_qp"]), f["l1"]]

    sets = {"shipped features": lambda r: [], "+ preceding-token p/q statistics (5)": prev,
            "+ KL, L1 at the preceding token (3)": lambda r: prev(r)[2:],
            "+ p at the root (bound, not available)": root_p}
    seeds = range(args.seeds)
    print(f"held-out selector / best static shape, tokens/s (Traversal, <= {args.max_drafts} drafts, "
          f"5 folds by prompt), split seeds {list(seeds)}:")
    for name, extra in sets.items():
        ex = load_examples(args.records.split(","), max_drafts=args.max_drafts,
                           features=lambda r, b, extra=extra: np.concatenate([record_features(r, b), extra(r)]))
        ratios = [cv["selector"]["tokens_per_s"] / cv["static"]["tokens_per_s"]
                  for cv in (cross_validate(ex, "traversal", seed=s) for s in seeds)]
        print(f"  {name:<40} {' '.join(f'{x:.3f}' for x in ratios)}  mean {np.mean(ratios):.3f} "
              f"(se {np.std(ratios, ddof=1) / math.sqrt(len(ratios)):.3f})", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reconstruct", help="rebuild T = 0 roots, write preceding-token statistics (JSONL)")
    r.add_argument("--records", required=True)
    r.add_argument("--target", required=True)
    r.add_argument("--draft", required=True)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare", help="cross-validate the selector with and without them")
    c.add_argument("--records", required=True, help="grid records (comma-separated)")
    c.add_argument("--prev", required=True, help="the reconstruct step's JSONL")
    c.add_argument("--seeds", type=int, default=5)
    c.add_argument("--max-drafts", type=int, default=8)
    args = ap.parse_args(argv)
    return reconstruct(args) if args.cmd == "reconstruct" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
