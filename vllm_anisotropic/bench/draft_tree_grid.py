"""Expected block efficiency of the draft_tree verifiers over the (K, L1, L2) grid on a real
target / draft pair (arXiv 2602.16994 Sec. 5, Eq. 1-3 and 11; its Table 2 / Table 9 setting).

``python -m vllm_anisotropic.bench.draft_tree_grid --target DIR --draft DIR --temperature 0.7
--prompts 20 --roots 2 --out grid.jsonl`` then ``--summarize grid.jsonl``.

Per root (a prompt's end, then the roots its own continuation reaches) and per trunk length
L1, q drafts one delayed tree of ``K_max`` branches of ``L2_max`` tokens with the engine's own
drafting (``proposers.draft_model.delayed_tree``: the same laws, the same node order); the
target scores all ``L1_max + 1`` trees in one tree forward (transformers, 4D mask). Every
action (K, L1, L2) is a sub-tree of its L1 tree: the trunk and the first K branches (i.i.d.,
so their first K are a K-branch sample) cut at depth L2. So each root gives one sample tree per
action (the paper averages s = 4 per root), and the verification randomness is integrated
out exactly:

* T = 0: greedy trunk and top-K branches, verified by the greedy walk: tokens per target call
  are deterministic given the tree (the engine's greedy path).
* T > 0: E[tau + 1 | tree] of every verifier by ``verifiers.analytic.expected_tokens`` (vector
  operations over the vocabulary). The laws are cut to the tokens where some row of p or q
  exceeds ``--support-eps`` (1e-10): the dropped mass per row is recorded (``dropped``) and
  bounds the error of every value.

The first root is ``--warmup-tokens`` (8) tokens into the answer (plain target decoding, greedy
at T = 0, sampled at T > 0); the continuation that yields the next root is drawn from the
target law too (greedy at T = 0; at T > 0 the NSS walk over the L1 = L1_max tree, which emits
exactly the target's law): each later root is the previous one's next verification step.

Timing for Eq. 11: ``--time`` measures the target's tree forward at each tree size and q's
batched forward at 1..K_max rows once (the paper's "warm-up run"; ``--time-batch-sizes``: also
for b requests, ``time_passes``); ``--summarize`` divides each
action's mean E[tau + 1] by ``T(a) = L1 t_q(1) + L2 t_q(K) + t_p(1 + L1 + K L2)`` (the draft
steps q runs on this implementation: one forward per trunk token, one batched forward of K
per branch depth) for an estimate of tokens per second, reported next to the block efficiency.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections import defaultdict

import numpy as np
import torch

from vllm_anisotropic.bench.harness import load_model, tree_attention_mask
from vllm_anisotropic.bench.machine import cpu_model
from vllm_anisotropic.proposers.draft_kv import DraftKV
from vllm_anisotropic.proposers.draft_model import DelayedShape, DraftLM, delayed_tree
from vllm_anisotropic.selector.features import entropy
from vllm_anisotropic.selector.train import read_records, step_time
from vllm_anisotropic.tree import DraftTree
from vllm_anisotropic.verifiers.analytic import TOPDOWN, expected_tokens, reach_probabilities
from vllm_anisotropic.verifiers.sampling import TargetSampling, target_probs

VERIFIERS = ("traversal", "specinfer", "spectr", "khisti", "naive_tree", "naive", "nss", "block")


def select(tree: DraftTree, keep: np.ndarray) -> DraftTree:
    """The sub-tree on nodes ``keep`` (sorted, ancestors included), parents renumbered."""
    new = np.full(tree.num_nodes, -1, np.int64)
    new[keep] = np.arange(keep.size)
    parents = np.where(tree.parents[keep] >= 0, new[np.maximum(tree.parents[keep], 0)], -1)
    rows = None if tree.draft_probs is None else tree.draft_probs[torch.from_numpy(keep)]
    return DraftTree(tokens=tree.tokens[keep], parents=parents, sources=tree.sources[keep],
                     values=tree.values[keep], draft_probs=rows)


def branch_nodes(l1: int, k_max: int, k: int, l2: int) -> np.ndarray:
    """Nodes of the (k, l1, l2) action inside a (k_max, l1, L2_max) delayed tree (node order:
    root, trunk, then branch nodes depth-major: node 1 + l1 + d k_max + j)."""
    br = [1 + l1 + d * k_max + j for d in range(l2) for j in range(k)]
    return np.asarray(list(range(1 + l1)) + br, np.int64)


def merge(trees: list[DraftTree]) -> tuple[DraftTree, list[np.ndarray]]:
    """One tree holding every tree's non-root nodes under a shared root; each tree's node ids."""
    tokens, parents, ids = [int(trees[0].tokens[0])], [-1], []
    for t in trees:
        off = len(tokens) - 1
        own = np.concatenate([[0], off + np.arange(1, t.num_nodes)])
        ids.append(own)
        tokens += [int(x) for x in t.tokens[1:]]
        parents += [0 if p == 0 else off + int(p) for p in t.parents[1:]]
    return DraftTree(tokens=tokens, parents=parents), ids


class Target:
    """The target over transformers: a KV cache of the context before the root, tree forwards."""

    def __init__(self, path: str, dtype: torch.dtype) -> None:
        from transformers import DynamicCache

        self.model, self.tokenizer = load_model(path, dtype=dtype)
        self.dtype = dtype
        self._cache_type = DynamicCache
        self.cache, self.cache_len = None, 0

    @torch.inference_mode()
    def reset(self, context: list[int]) -> None:
        """Cache every context token but the last (the root)."""
        self.cache = self._cache_type(config=self.model.config)
        self.cache_len = 0
        self.extend(context)

    @torch.inference_mode()
    def extend(self, context: list[int]) -> None:
        new = context[self.cache_len:-1]
        if new:
            self.model(input_ids=torch.tensor([new]), past_key_values=self.cache, use_cache=True, logits_to_keep=1)
            self.cache_len += len(new)

    @torch.inference_mode()
    def decode(self, context: list[int], n: int, temperature: float, generator: torch.Generator) -> list[int]:
        """``context`` plus ``n`` tokens of plain decoding from the target (argmax at T = 0, else a
        draw from softmax(logits / T)); the cache follows."""
        context = list(context)
        for _ in range(n):
            logits = self.model(input_ids=torch.tensor([[context[-1]]]), past_key_values=self.cache,
                                use_cache=True).logits[0, -1].float()
            self.cache_len += 1
            if temperature == 0:
                context.append(int(logits.argmax()))
            else:
                context.append(int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator)))
        return context

    @torch.inference_mode()
    def tree_logits(self, tree: DraftTree) -> torch.Tensor:
        """[num_nodes, vocab] float32 logits after each node's path; the cache is left as it was."""
        n = tree.num_nodes
        out = self.model(input_ids=torch.from_numpy(tree.tokens).view(1, n),
                         attention_mask=tree_attention_mask(tree, self.cache_len, self.dtype, "cpu"),
                         position_ids=torch.from_numpy(tree.positions(self.cache_len)).view(1, n),
                         past_key_values=self.cache, use_cache=True).logits[0].float()
        extra = self.cache.get_seq_length() - self.cache_len
        if extra > 0:
            self.cache.crop(-extra)
        return out


def _walk(tree: DraftTree, choose) -> list[int]:
    """Nodes reached from the root when ``choose(node)`` names the token taken after it; the
    emitted tokens are the reached nodes' tokens (root excluded) plus the last choice."""
    kids = tree.children_lists()
    node, path = 0, []
    while True:
        y = choose(node)
        nxt = next((j for j in kids[node] if int(tree.tokens[j]) == y), None)
        if nxt is None:
            return path + [y]
        path.append(int(tree.tokens[nxt]))
        node = nxt


def _features(p_root: torch.Tensor, q_root: torch.Tensor, context_len: int) -> dict:
    """Root statistics (arXiv 2602.16994 App. E scalar features, at the root)."""
    p, q = p_root.double(), q_root.double()
    lp, lq = p.clamp(min=1e-300).log(), q.clamp(min=1e-300).log()
    return {"context_len": context_len, "entropy_p": entropy(p), "entropy_q": entropy(q),
            "kl_pq": float((p * (lp - lq)).sum()), "kl_qp": float((q * (lq - lp)).sum()),
            "l1": float((p - q).abs().sum())}


def root_record(target: Target, draft: DraftLM, context: list[int], temperature: float, k_max: int,
                l1_max: int, l2_max: int, generator: torch.Generator, eps: float) -> tuple[dict, list[int]]:
    """Every action's value at this root, and the tokens the target emits from it."""
    sampling = TargetSampling(temperature=temperature)
    session = draft.new_session()
    t0 = time.perf_counter()
    trees = [delayed_tree(session, context, DelayedShape(k_max, l1, l2_max), sampling, generator)
             for l1 in range(l1_max + 1)]
    t_draft = time.perf_counter() - t0
    union, ids = merge(trees)
    t0 = time.perf_counter()
    logits = target.tree_logits(union)
    t_target = time.perf_counter() - t0
    n = union.num_nodes
    if sampling.greedy:
        p_union = logits.softmax(-1)
    else:
        p_union = target_probs(logits, torch.full((n,), temperature), torch.full((n,), -1), torch.ones(n))
    rec = {"context_len": len(context), "temperature": temperature, "draft_s": t_draft, "target_s": t_target,
           "union_nodes": n, "values": {}}
    t0 = time.perf_counter()
    if sampling.greedy:
        best = logits.argmax(-1)
        for l1, (tree, own) in enumerate(zip(trees, ids)):
            for k in range(1, k_max + 1):
                keep = branch_nodes(l1, k_max, k, l2_max)
                sub, rows = select(tree, keep), own[keep]
                accepted = len(_walk(sub, lambda node: int(best[rows[node]]))) - 1
                for l2 in range(l2_max + 1):
                    if l2 == 0 and k > 1:
                        continue
                    rec["values"][f"{k},{l1},{l2}"] = {"greedy": 1 + min(accepted, l1 + l2)}
        emitted = _walk(trees[-1], lambda node: int(best[ids[-1][node]]))
        rec["features"] = _features(p_union[0], draft_root_q(session, context), len(context))
    else:
        q_rows = torch.cat([t.draft_probs for t in trees])
        support = (p_union > eps).any(0) | (q_rows > eps).any(0)
        support[torch.from_numpy(union.tokens)] = True
        idx = torch.nonzero(support).flatten()
        remap = torch.full((p_union.shape[1],), -1, dtype=torch.long)
        remap[idx] = torch.arange(idx.numel())
        p_small = p_union[:, idx].double()
        rec["support"] = int(idx.numel())
        q_mass = q_rows[:, idx].double().sum(-1)
        q_mass = q_mass[q_rows.sum(-1) > 0]  # leaves have no row
        rec["dropped"] = float(max((1 - p_small.sum(-1)).max(), (1 - q_mass).max()))
        for l1, (tree, own) in enumerate(zip(trees, ids)):
            small = DraftTree(tokens=remap[torch.from_numpy(tree.tokens)].numpy(), parents=tree.parents,
                              draft_probs=tree.draft_probs[:, idx].double())
            p_tree = p_small[torch.from_numpy(own)]
            depth = small.depths
            for k in range(1, k_max + 1):
                keep = branch_nodes(l1, k_max, k, l2_max)
                sub = select(small, keep)
                p_sub, q_sub = p_tree[torch.from_numpy(keep)], sub.draft_probs
                reach = {name: reach_probabilities(name, sub, p_sub, q_sub) for name in TOPDOWN}
                sub_depth = depth[keep]
                for l2 in range(l2_max + 1):
                    if l2 == 0 and k > 1:
                        continue
                    cut = np.flatnonzero(sub_depth <= l1 + l2)
                    vals = {name: float(reach[name][cut].sum()) for name in TOPDOWN}
                    cut_tree = select(sub, cut)
                    vals["traversal"] = expected_tokens("traversal", cut_tree, p_sub[torch.from_numpy(cut)],
                                                        cut_tree.draft_probs)
                    if k == 1:
                        vals["block"] = expected_tokens("block", cut_tree, p_sub[torch.from_numpy(cut)],
                                                        cut_tree.draft_probs)
                    rec["values"][f"{k},{l1},{l2}"] = vals
        emitted = _walk(trees[-1], lambda node: int(torch.multinomial(p_union[ids[-1][node]], 1, generator=generator)))
        rec["features"] = _features(p_union[0], trees[0].draft_probs[0], len(context))  # q at the root
    rec["verify_s"] = time.perf_counter() - t0
    return rec, emitted


def draft_root_q(session, context) -> torch.Tensor:
    return session.root_logits(context).float().softmax(-1)


@torch.inference_mode()
def time_passes(target: Target, draft: DraftLM, context: list[int], k_max: int, l1_max: int, l2_max: int,
                repeats: int = 3, batch_sizes: tuple[int, ...] = (1,), max_drafts: int | None = None) -> dict:
    """Eq. 11's t_p(n) (a tree forward of n nodes) and t_q(m) (q's forward of one token in each
    of m rows, each row after its own copy of the context in q's KV, batched as the engine's
    ``DraftKV`` runs it): median of ``repeats`` rounds over all sizes, seconds. t_p is timed at every tree
    size of the grid (trees of at most ``max_drafts`` drafts) times every one of ``batch_sizes``:
    b requests' trees verified in one forward cost about one forward of b times the nodes (the
    linears dominate; the b contexts' attention is left out). t_q is timed at m = b and b K for
    every b of ``batch_sizes`` and K up to ``k_max`` (``selector.train.step_time``)."""
    target.reset(context)
    sizes = sorted({b * (1 + l1 + k * l2) for k in range(1, k_max + 1) for l1 in range(l1_max + 1)
                    for l2 in range(l2_max + 1) for b in batch_sizes
                    if max_drafts is None or l1 + k * l2 <= max_drafts})
    rows = sorted({b * k for b in batch_sizes for k in range(1, k_max + 1)} | set(batch_sizes))
    kv = DraftKV(draft)  # the engine's rows of q's KV, each a copy of the context's first row
    sessions = [draft.new_session() for _ in range(max(rows))]
    kv.place(sessions, [len(context) + 1] * len(sessions))
    kv.forward(len(sessions), [context] + [[]] * (len(sessions) - 1), [0] * len(sessions),
               [None] * len(sessions), [0] * len(sessions))
    for tensor in kv.keys + kv.values:
        tensor[1:] = tensor[:1]

    def target_pass(n: int) -> float:
        tree = DraftTree(tokens=[context[-1]] * n, parents=[-1] + list(range(n - 1)))
        t0 = time.perf_counter()
        target.tree_logits(tree)
        return time.perf_counter() - t0

    def draft_pass(m: int) -> float:
        t0 = time.perf_counter()
        kv.forward(m, [[int(context[-1])]] * m, [len(context)] * m, [None] * m, [0] * m)  # column len: rewritten each pass
        return time.perf_counter() - t0

    # every size once per round, so that a slow spell of the machine spreads over the sizes
    # instead of landing on one of them
    runs_p: dict[int, list[float]] = defaultdict(list)
    runs_q: dict[int, list[float]] = defaultdict(list)
    for _ in range(repeats):
        for n in sizes:
            runs_p[n].append(target_pass(n))
        for m in rows:
            runs_q[m].append(draft_pass(m))
    t_p = {n: float(np.median(r)) for n, r in runs_p.items()}
    t_q = {m: float(np.median(r)) for m, r in runs_q.items()}
    return {"t_p": t_p, "t_q": t_q, "context_len": len(context), "batch_sizes": list(batch_sizes)}


def summarize(path: str, out=sys.stdout) -> dict:
    """Mean E[tau + 1] per (verifier, action) over the roots, per dataset and temperature; the
    best action per verifier by block efficiency and by Eq. 11 tokens per second."""
    recs = read_records(path)
    timing = next((r for r in recs if r.get("kind") == "timing"), None)
    roots = [r for r in recs if r.get("kind") == "root"]
    table = {}
    for temp in sorted({r["temperature"] for r in roots}):
        rs = [r for r in roots if r["temperature"] == temp]
        sums: dict = defaultdict(lambda: defaultdict(list))
        for r in rs:
            for action, vals in r["values"].items():
                for name, v in vals.items():
                    sums[name][action].append(v)
        counts = ", ".join(f"{d} {sum(r['dataset'] == d for r in rs)}" for d in sorted({r["dataset"] for r in rs}))
        print(f"\n## T = {temp}: {len(rs)} roots ({counts})", file=out)
        print("| verifier | best E[tau+1] (K, L1, L2) | E at (2,2,2) | best est. tok/s (K, L1, L2): E, T(a) |", file=out)
        print("|---|---|---:|---|", file=out)
        table[temp] = {}
        for name, per in sums.items():
            means = {a: float(np.mean(v)) for a, v in per.items()}
            best = max(means, key=means.get)
            row = {"best_be": (best, means[best]), "at_222": means.get("2,2,2")}
            cell_tps = ""
            if timing:
                tps = {a: e / _eq11(a, timing) for a, e in means.items()}
                bt = max(tps, key=tps.get)
                row["best_tps"] = (bt, means[bt], _eq11(bt, timing), tps[bt])
                row["tps"] = tps
                cell_tps = f"({bt}): {means[bt]:.2f}, {1e3 * _eq11(bt, timing):.0f} ms -> {tps[bt]:.2f} tok/s"
            row["means"] = means
            table[temp][name] = row
            at = f"{row['at_222']:.3f}" if row["at_222"] is not None else "-"
            print(f"| {name} | {means[best]:.3f} ({best}) | {at} | {cell_tps} |", file=out)
        for name in ("greedy", "traversal", "specinfer"):
            if name in sums:
                print(_matrix(name, {a: float(np.mean(v)) for a, v in sums[name].items()}), file=out)
        shapes = ["1,4,0", "1,8,0", "4,0,2", "4,2,2", "2,2,2", "4,0,4", "4,4,4", "4,8,8"]
        if len(sums) > 1:
            print("\n| verifier | " + " | ".join(f"({s})" for s in shapes) + " |", file=out)
            print("|---|" + "---:|" * len(shapes), file=out)
            for name, per in sums.items():
                cells = [f"{np.mean(per[s]):.3f}" if s in per else "-" for s in shapes]
                print(f"| {name} | " + " | ".join(cells) + " |", file=out)
    return table


def _eq11(action: str, timing: dict) -> float:
    return step_time(tuple(int(x) for x in action.split(",")), timing)


def _matrix(name: str, means: dict, ks=(1, 2, 4), l1s=(0, 1, 2, 4, 8), l2s=(0, 1, 2, 4, 8)) -> str:
    """E[tau + 1] of ``name``: rows (K, L1), columns L2."""
    lines = [f"\n{name}: E[tau + 1] by (K, L1) and L2", "| K, L1 | " + " | ".join(f"L2 = {x}" for x in l2s) + " |",
             "|---|" + "---:|" * len(l2s)]
    for k, l1 in itertools.product(ks, l1s):
        cells = [f"{means[f'{1 if l2 == 0 else k},{l1},{l2}']:.3f}" if f"{1 if l2 == 0 else k},{l1},{l2}" in means
                 else "-" for l2 in l2s]
        lines.append(f"| {k}, {l1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--datasets", default="humaneval,gsm8k,mtbench")
    ap.add_argument("--prompts", type=int, default=20, help="prompts per dataset")
    ap.add_argument("--roots", type=int, default=2, help="roots per prompt (consecutive verification steps)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--warmup-tokens", type=int, default=8,
                    help="plain target tokens decoded after the prompt before the first root")
    ap.add_argument("--k-max", type=int, default=4)
    ap.add_argument("--l1-max", type=int, default=8)
    ap.add_argument("--l2-max", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--support-eps", type=float, default=1e-10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", action="store_true", help="also record Eq. 11's pass times (first prompt)")
    ap.add_argument("--time-only", action="store_true", help="record Eq. 11's pass times and no roots")
    ap.add_argument("--time-batch-sizes", default="1",
                    help="comma-separated batch sizes b: t_p is also timed at b times every tree size and t_q at "
                         "b and b K rows (the selector's batch-size labels, selector.train)")
    ap.add_argument("--time-repeats", type=int, default=3, help="runs per timed forward (their median is recorded)")
    ap.add_argument("--time-max-drafts", type=int, default=None,
                    help="time only trees of at most this many drafts (with large --time-batch-sizes)")
    ap.add_argument("--linears", default="torch", choices=["torch", "vllm"],
                    help="the target's and q's linear layers on torch's GEMM, or on vLLM's CPU GEMM as the "
                         "engine runs them (integration/vllm/kernels/cpu_gemm.py; the CPU platform only; with "
                         "--time-only q's decoder also as the engine runs it, kernels/cpu_draft.py)")
    ap.add_argument("--draft-quantization", default="auto", choices=["auto", "none", "int8"],
                    help="with --linears vllm: q's linear layers as draft_tree's draft_quantization runs them "
                         "(auto: int8 on a CPU with VNNI, as the engine's default; written into the timing record)")
    ap.add_argument("--out", help="JSONL, appended")
    ap.add_argument("--summarize", metavar="JSONL", help="print the tables of a finished run (.jsonl or .jsonl.gz) and exit")
    args = ap.parse_args(argv)
    if args.summarize:
        summarize(args.summarize)
        return
    if not (args.target and args.draft and args.out):
        ap.error("--target, --draft and --out are required (or --summarize)")
    from tqdm import tqdm

    from vllm_anisotropic.data import format_prompt, load_dataset

    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    target = Target(args.target, dtype)
    draft = DraftLM(args.draft, dtype=dtype)
    if args.linears == "vllm":
        from vllm.platforms import current_platform

        from vllm_anisotropic.integration.vllm.kernels.cpu_draft import use_vllm_cpu_layers
        from vllm_anisotropic.integration.vllm.kernels.cpu_gemm import resolve_quantization, use_vllm_cpu_gemm

        quantization = resolve_quantization(args.draft_quantization, current_platform.is_cpu())
        if args.time_only:  # q's forwards as the engine runs them (the roots' sessions need transformers' layers)
            use_vllm_cpu_layers(draft, quantization)
        if not (use_vllm_cpu_gemm(target.model) and use_vllm_cpu_gemm(draft.model, quantization)):
            ap.error("--linears vllm: vLLM's platform is not the CPU")
    else:
        quantization = "none"
    gen = torch.Generator().manual_seed(args.seed)
    jobs = []
    for ds in args.datasets.split(","):
        for i, item in enumerate(load_dataset(ds, args.prompts)):
            text = format_prompt(item, target.tokenizer, "chat")
            jobs.append((ds, i, target.tokenizer.encode(text, add_special_tokens=False)))
    with open(args.out, "a") as f:
        if args.time or args.time_only:
            rec = {"kind": "timing", "dtype": args.dtype, "linears": args.linears, "draft_quantization": quantization,
                   "cpu": cpu_model(),
                   "threads": torch.get_num_threads(),
                   **time_passes(target, draft, jobs[0][2], args.k_max, args.l1_max, args.l2_max,
                                 batch_sizes=tuple(int(b) for b in args.time_batch_sizes.split(",")),
                                 max_drafts=args.time_max_drafts, repeats=args.time_repeats)}
            f.write(json.dumps(rec) + "\n")
            f.flush()
        if args.time_only:
            return
        for ds, i, context in tqdm(jobs, desc=f"roots at T={args.temperature}", unit="prompt"):
            context = list(context)
            target.reset(context)
            context = target.decode(context, args.warmup_tokens, args.temperature, gen)
            for r in range(args.roots):
                rec, emitted = root_record(target, draft, context, args.temperature, args.k_max, args.l1_max,
                                           args.l2_max, gen, args.support_eps)
                rec.update(kind="root", dataset=ds, prompt=i, root=r, dtype=args.dtype)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                context = context + emitted
                target.extend(context)


if __name__ == "__main__":
    main()
