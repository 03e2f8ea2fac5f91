"""Block efficiency of every draft-model verifier on i.i.d. trees (arXiv 2602.16994 Sec. 4, Table 2).

``python -m vllm_anisotropic.bench.verifier_ordering [--out table.md]`` writes a markdown table
of E[tau + 1] (mean emitted tokens per verification) for K in 1..4 i.i.d. paths of length
L in 1..8, on synthetic p/q tables (``verifiers.toy``, V = 32) whose divergence grows with
depth (draft = (1 - lam_d) target + lam_d noise, lam_d = 0.2 + 0.1 d). Each cell averages the
same ``--trees`` sampled trees (common random trees across verifiers) verified by the fast
implementations at temperature 1. Expected (arXiv 2602.16994): Traversal on top, NSS at the bottom.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from vllm_anisotropic.tree import pack_trees
from vllm_anisotropic.verifiers import TargetSampling, get_verifier
from vllm_anisotropic.verifiers.toy import DraftTable, TableModel, paths_to_tree, sample_iid_paths, tree_rows

NAMES = ["traversal", "block", "specinfer", "spectr", "khisti", "naive_tree", "naive", "nss"]


def cell(k: int, length: int, trees: int, seed: int, target, draft) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    ts, lg, qs = [], [], []
    for _ in range(trees):
        prefix = (int(rng.integers(target.vocab_size)),)
        tree = paths_to_tree(sample_iid_paths(draft, prefix, k, 0, length, rng), prefix[-1], 0)
        a, b = tree_rows(tree, prefix, target, draft)
        ts.append(tree)
        lg.append(a)
        qs.append(b)
    batch, logits, q = pack_trees(ts), torch.cat(lg), torch.cat(qs)
    out = {}
    for name in NAMES:
        r = get_verifier(name, torch.float64).verify_batch(
            batch, logits, TargetSampling(1.0), torch.Generator().manual_seed(seed), q
        )
        out[name] = float((r.num_accepted + 1).double().mean())
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", type=int, default=400)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    target = TableModel(32, seed=0, sharpness=2.0)
    draft = DraftTable(target, seed=1, lam0=0.2, slope=0.1)
    lines = ["| K | L | " + " | ".join(NAMES) + " |", "|---|---|" + "---:|" * len(NAMES)]
    total = dict.fromkeys(NAMES, 0.0)
    n = 0
    for k in range(1, 5):
        for length in range(1, 9):
            c = cell(k, length, args.trees, seed=100 * k + length, target=target, draft=draft)
            best = max(c.values())
            lines.append(f"| {k} | {length} | " + " | ".join(
                (f"**{c[m]:.3f}**" if c[m] == best else f"{c[m]:.3f}") for m in NAMES) + " |")
            for m in NAMES:
                total[m] += c[m]
            n += 1
    lines.append("| mean | | " + " | ".join(f"{total[m] / n:.3f}" for m in NAMES) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
