"""Train and evaluate the (K, L1, L2) selector on ``bench.draft_tree_grid`` records.

Labels (arXiv 2602.16994 Sec. 6): for each root c and action a of the grid, the record holds the
exact E[tau + 1 | c, a] of every verifier (``verifiers.analytic``; the greedy walk's at T = 0),
and the file's timing record the measured pass times, from which Eq. 11 gives the step's time
``step_time(a)``. The policy pi(a | c) (``policy.SelectorNet``) is trained, full batch, to
minimize the paper's Eq. 5, ``-log(TPS_pi(c) / TPS_base(c))`` with Eq. 4's
``TPS_pi(c) = sum_a pi(a|c) E(c, a) / sum_a pi(a|c) T(a)``; the baseline is the best static
action of the training roots (the paper's regression penalty is left out). At run time the
selector takes the argmax.

Evaluation is on held-out prompts: the roots are split by prompt (dataset, prompt index) into
folds; each fold's roots are scored by a selector trained on the other folds, against the best
static action of those other folds (under the same verifier, and under Traversal). A score is
tokens per second over the held-out roots, sum E / sum T (every root one step); with batch
sizes above one, also as whole engine steps of b held-out rows (``step_scores``: per-request
choices, the selector's one shape per step, the best static and the best shape of each step,
priced by ``batch_step_time``). Then a last selector is trained on every root and saved.

Example::

    vllm-anisotropic selector train --records t0.jsonl.gz,t07.jsonl.gz --verifier traversal --out sel/
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vllm_anisotropic.selector.features import FEATURES, record_features
from vllm_anisotropic.selector.policy import SelectorNet, ShapeSelector, action_grid

__all__ = ["Examples", "load_examples", "read_records", "step_time", "batch_step_time", "fit", "evaluate",
           "cross_validate", "step_scores", "add_parser"]

logger = logging.getLogger(__name__)

VERIFIERS = ("traversal", "specinfer", "spectr", "khisti", "naive_tree", "naive", "nss", "block")


def step_time(action: tuple[int, int, int], timing: dict, batch_size: int = 1) -> float:
    """Eq. 11 with pass times measured at one context length, for one of the b = ``batch_size``
    requests drafting the same shape in a step: ``(L1 t_q(b) + L2 t_q(b K)) / b + t_p(b (1 + L1 + K L2)) / b``
    seconds. q runs batched over the step's requests as the engine runs it
    (``proposers/draft_batch.py``: one forward of b rows per trunk depth, one of b K rows per branch
    depth) and the b trees are verified in one target forward (``timing``: a ``draft_tree_grid
    --time`` record, t_q and t_p by rows / tokens; keys may be strings, as JSON stores them). At
    b = 1 this is the paper's ``L1 t_q(1) + L2 t_q(K) + t_p(1 + L1 + K L2)``. Raises ValueError if
    the record lacks a forward the action needs."""
    k, l1, l2 = action
    t_p = {int(n): float(v) for n, v in timing["t_p"].items()}
    t_q = {int(n): float(v) for n, v in timing["t_q"].items()}
    b = batch_size
    n = b * (1 + l1 + k * l2)
    hint = (f"(action {action} at batch size {b}); time it with `draft_tree_grid --time-only --time-batch-sizes {b}`, "
            f"or leave that batch size out")
    if n not in t_p:
        raise ValueError(f"the timing record has no target forward of {n} tokens {hint}")
    rows = [m for m, count in ((b, l1), (b * k, l2)) if count]
    if missing := [m for m in rows if m not in t_q]:
        raise ValueError(f"the timing record has no draft forward of {missing[0]} rows {hint}")
    drafting = (l1 * t_q[b] if l1 else 0.0) + (l2 * t_q[b * k] if l2 else 0.0)
    return (drafting + t_p[n]) / b


def _at(table: dict, n: int) -> float:
    """``table[n]`` of a timing record's t_q / t_p (keys may be strings); a count it lacks is
    interpolated linearly between the nearest measured ones (the end values beyond them)."""
    xs = sorted(int(k) for k in table)
    return float(np.interp(n, xs, [float(table[str(x)] if str(x) in table else table[x]) for x in xs]))


def batch_step_time(actions: list[tuple[int, int, int]], timing: dict) -> float:
    """Seconds of one engine step in which request r drafts ``actions[r]`` (a ``draft_tree_grid
    --time`` record's pass times, ``_at``), counted as ``proposers/draft_batch.py`` runs it: one q
    forward of the drafting rows (the catch-up, ending at the roots); per trunk depth d one forward
    of the rows whose tree has a node below trunk node d + 1; per branch depth d one of the K lanes
    of every request whose branches go past depth d + 1; and one target forward of every tree's
    nodes (a plain request's root included). The step pays max L1 and max L2 forwards of q whatever
    the other shapes are. For b requests of one shape this is ``b step_time(a, timing, b)`` up to
    Eq. 11's count of q's forwards (L1 + L2 there; here 1 + L1 + L2 - 1, a chain's last trunk node
    and the branches' last depth running none)."""
    drafting = [(k, l1, l2) for k, l1, l2 in actions if l1 + k * l2 > 0]
    if not drafting:
        return _at(timing["t_p"], len(actions))
    q = _at(timing["t_q"], len(drafting))
    for d in range(max(l1 for _, l1, _ in drafting)):
        rows = sum(1 for k, l1, l2 in drafting if l1 > d and d + 1 < l1 + k * l2)
        q += _at(timing["t_q"], rows) if rows else 0.0
    for d in range(max(l2 for _, _, l2 in drafting)):
        rows = sum(k for k, _, l2 in drafting if d < l2 - 1)
        q += _at(timing["t_q"], rows) if rows else 0.0
    return q + _at(timing["t_p"], sum(1 + l1 + k * l2 for k, l1, l2 in actions))


@dataclass
class Examples:
    """One row per (root, batch size): features [n, F], E[tau + 1] per verifier [n, A], Eq. 11
    time [n, A] (each root under its own file's timing, or the one given), the prompt it came
    from and the batch size."""

    features: np.ndarray
    values: dict[str, np.ndarray]
    time: np.ndarray
    groups: np.ndarray  # "dataset/prompt"
    actions: list[tuple[int, int, int]]
    batch: np.ndarray | None = None  # [n] batch size of the row
    timings: list[dict] = dataclasses.field(default_factory=list)  # the timing records the times came from
    timing_of: np.ndarray | None = None  # [n] index into ``timings`` of the row's

    def __len__(self) -> int:
        return len(self.groups)


def read_records(path: str | Path) -> list[dict]:
    """The JSON lines of a ``draft_tree_grid`` record file (``.jsonl`` or ``.jsonl.gz``)."""
    raw = Path(path).read_bytes()
    text = gzip.decompress(raw).decode() if str(path).endswith(".gz") else raw.decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_examples(paths: list[str], verifiers=VERIFIERS, max_drafts: int | None = None,
                  features=record_features, batch_sizes: tuple[int, ...] = (1,), timing: dict | None = None) -> Examples:
    """Every root record of ``paths`` once per batch size b of ``batch_sizes``, its feature
    vector by ``features(record, b)`` and its times by ``step_time(action, timing, b)``, with
    ``timing`` (a ``draft_tree_grid --time`` record) or else its file's timing record. A T = 0
    root's value under any verifier is its greedy walk's (every verifier reduces to it);
    ``block`` only has K = 1 actions, so its missing values are 0 (never chosen). Raises
    ValueError for a file without a timing record when ``timing`` is None."""
    actions = action_grid(max_drafts)
    feats, times, groups, batch, timings, timing_of = [], [], [], [], [], []
    values: dict[str, list] = {v: [] for v in verifiers}
    for path in paths:
        recs = read_records(path)
        file_timing = timing or next((r for r in recs if r.get("kind") == "timing"), None)
        if file_timing is None:
            raise ValueError(f"{path}: no timing record (run `python -m vllm_anisotropic.bench.draft_tree_grid` "
                             f"with --time, or --time-only and append its record)")
        t = {b: np.array([step_time(a, file_timing, b) for a in actions]) for b in batch_sizes}
        timings.append(file_timing)
        for r in (r for r in recs if r.get("kind") == "root"):
            row = [[r["values"].get(f"{k},{l1},{l2}", {}).get("greedy" if float(r["temperature"]) == 0.0 else v, 0.0)
                    for k, l1, l2 in actions] for v in verifiers]
            for b in batch_sizes:
                feats.append(features(r, b))
                times.append(t[b])
                groups.append(f"{r['dataset']}/{r['prompt']}")
                batch.append(b)
                timing_of.append(len(timings) - 1)
                for v, vals in zip(verifiers, row):
                    values[v].append(vals)
    if not groups:
        raise ValueError(f"no root records in {paths}")
    return Examples(np.array(feats), {v: np.array(x) for v, x in values.items()}, np.array(times),
                    np.array(groups), actions, np.array(batch), timings, np.array(timing_of))


def _loss(logits: torch.Tensor, e: torch.Tensor, t: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Eq. 5 averaged over roots: -log(TPS_pi / TPS_base), Eq. 4's TPS_pi."""
    pi = logits.softmax(-1)
    return -((pi * e).sum(-1) / (pi * t).sum(-1) / base).log().mean()


def best_static(e: np.ndarray, t: np.ndarray) -> int:
    """The action with the most tokens per second over these roots (sum E / sum T)."""
    return int(np.argmax(e.sum(0) / t.sum(0)))


def fit(ex: Examples, rows: np.ndarray, verifier: str, seed: int = 0, epochs: int = 300, lr: float = 1e-3,
        weight_decay: float = 1e-2, progress: bool = False) -> ShapeSelector:
    """A selector trained on ``ex``'s ``rows`` (deterministic for a seed on one machine)."""
    torch.manual_seed(seed)
    x = ex.features[rows]
    mean, std = x.mean(0), x.std(0)
    std = np.where(std > 1e-9, std, 1.0)  # a constant feature (one temperature) stays 0
    e = torch.as_tensor(ex.values[verifier][rows], dtype=torch.float64)
    t = torch.as_tensor(ex.time[rows], dtype=torch.float64)
    base_action = best_static(e.numpy(), t.numpy())
    base = e[:, base_action] / t[:, base_action]
    xs = torch.as_tensor((x - mean) / std, dtype=torch.float32)
    net = SelectorNet(x.shape[1], len(ex.actions))
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    steps = range(epochs)
    if progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc=f"selector ({verifier}, {len(rows)} roots)", unit="epoch")
    for _ in steps:
        opt.zero_grad()
        loss = _loss(net(xs).double(), e, t, base)
        loss.backward()
        opt.step()
    return ShapeSelector(net=net.eval(), mean=mean, std=std, actions=list(ex.actions), verifier=verifier,
                         meta={"training": {"roots": int(len(rows)), "prompts": int(len(set(ex.groups[rows]))),
                                            "seed": seed, "epochs": epochs, "lr": lr, "weight_decay": weight_decay,
                                            "baseline_action": list(ex.actions[base_action]),
                                            "final_loss": float(loss.detach())}})


def evaluate(chosen: np.ndarray, e: np.ndarray, t: np.ndarray) -> dict:
    """Scores of per-root action indices ``chosen`` on roots' values ``e`` and times ``t``."""
    ee, tt = e[np.arange(len(chosen)), chosen], t[np.arange(len(chosen)), chosen]
    return {"block_efficiency": float(ee.mean()), "step_s": float(tt.mean()), "tokens_per_s": float(ee.sum() / tt.sum())}


def cross_validate(ex: Examples, verifier: str, folds: int = 5, seed: int = 0, **fit_kwargs) -> dict:
    """Held-out comparison (module docstring): the selector, the best static action of the
    training folds under ``verifier``, and the same under Traversal. With several batch sizes
    in ``ex``, also per batch size: the best static action of the training rows of that batch
    size (a shape tuned by hand for each concurrency), and a selector trained without the batch
    size (its feature held at 0)."""
    prompts = np.array(sorted(set(ex.groups)))
    order = np.random.default_rng(seed).permutation(len(prompts))
    fold_of = {p: i % folds for i, p in zip(range(len(prompts)), prompts[order])}
    fold = np.array([fold_of[g] for g in ex.groups])
    batch = ex.batch if ex.batch is not None else np.ones(len(ex), np.int64)
    sizes = sorted(set(batch.tolist()))
    names = ["selector", "static", "static_traversal"] + (["static_per_batch", "selector_without_batch"]
                                                          if len(sizes) > 1 else [])
    picks = {name: np.zeros(len(ex), np.int64) for name in names}
    blind = None
    if len(sizes) > 1:
        col = FEATURES.index("log_batch_size")
        blind = dataclasses.replace(ex, features=ex.features.copy())
        blind.features[:, col] = 0.0
    statics = []
    log_pi = np.zeros((len(ex), len(ex.actions)))
    for f in range(folds):
        train, test = np.flatnonzero(fold != f), np.flatnonzero(fold == f)
        if test.size == 0:
            continue
        sel = fit(ex, train, verifier, seed=seed, **fit_kwargs)
        logits = sel.logits(ex.features[test])  # choose_index's argmax, and the step rule's log-policies
        picks["selector"][test] = logits.argmax(-1).numpy()
        log_pi[test] = logits.log_softmax(-1).numpy()
        picks["static"][test] = best_static(ex.values[verifier][train], ex.time[train])
        picks["static_traversal"][test] = best_static(ex.values["traversal"][train], ex.time[train])
        statics.append(ex.actions[picks["static"][test[0]]])
        if blind is not None:
            picks["selector_without_batch"][test] = fit(blind, train, verifier, seed=seed, **fit_kwargs).choose_index(
                blind.features[test])
            for b in sizes:
                tr, te = train[batch[train] == b], test[batch[test] == b]
                picks["static_per_batch"][te] = best_static(ex.values[verifier][tr], ex.time[tr])

    def scores(rows: np.ndarray) -> dict:
        out = {name: evaluate(p[rows], ex.values["traversal" if name == "static_traversal" else verifier][rows],
                              ex.time[rows]) for name, p in picks.items()}
        oracle = (ex.values[verifier][rows] / ex.time[rows]).argmax(1)
        out["oracle_per_root"] = evaluate(oracle, ex.values[verifier][rows], ex.time[rows])
        return out

    out = scores(np.arange(len(ex)))
    if len(sizes) > 1:
        out["by_batch_size"] = {}
        for b in sizes:
            rows = np.flatnonzero(batch == b)
            out["by_batch_size"][str(b)] = {**scores(rows), "selector_actions": _counts(ex, picks["selector"][rows]),
                                            "static_per_batch_actions": _counts(ex, picks["static_per_batch"][rows])}
            if b > 1 and ex.timings:
                out["by_batch_size"][str(b)]["steps"] = step_scores(ex, rows, b, verifier, picks["selector"], log_pi,
                                                                    picks["static_per_batch"], seed)
    out["static_actions"] = [list(a) for a in statics]
    out["selector_actions"] = _counts(ex, picks["selector"])
    out["folds"], out["roots"], out["prompts"] = folds, len(ex), len(prompts)
    return out


def step_scores(ex: Examples, rows: np.ndarray, b: int, verifier: str, chosen: np.ndarray, log_pi: np.ndarray,
                static: np.ndarray, seed: int = 0) -> dict:
    """Scores of whole engine steps: ``rows`` (held-out rows of batch size ``b``) shuffled into
    steps of ``b`` requests, each step priced by ``batch_step_time``. Policies: ``selector`` (each
    request its own choice ``chosen[r]``, the step paying the deepest), ``selector_step`` (one shape
    for the step, ``ShapeSelector.choose_shapes``'s rule on the rows' log-policies ``log_pi``),
    ``static_per_batch`` (the step's first request's ``static[r]`` for all: folds' statics may
    differ) and ``oracle_step`` (the one shape with the most tokens per second for the step, known
    only afterwards)."""
    order = np.random.default_rng(seed).permutation(rows)
    steps = [order[i : i + b] for i in range(0, len(order) - b + 1, b)]
    e, timing_of = ex.values[verifier], ex.timing_of
    totals = {name: [0.0, 0.0] for name in ("selector", "selector_step", "static_per_batch", "oracle_step")}
    uniform_time: dict = {}

    def uniform(a: int, t: int) -> float:
        if (a, t) not in uniform_time:
            uniform_time[(a, t)] = batch_step_time([ex.actions[a]] * b, ex.timings[t])
        return uniform_time[(a, t)]

    for step in steps:
        t = int(timing_of[step[0]])
        joint = int(log_pi[step].sum(0).argmax())
        best = max(range(len(ex.actions)), key=lambda a: e[step, a].sum() / uniform(a, t))
        for name, picks in (("selector", chosen[step]), ("selector_step", [joint] * b),
                            ("static_per_batch", [static[step[0]]] * b), ("oracle_step", [best] * b)):
            totals[name][0] += float(e[step, picks].sum())
            totals[name][1] += batch_step_time([ex.actions[a] for a in picks], ex.timings[t])
    return {name: {"block_efficiency": v / (len(steps) * b), "step_s": s_ / len(steps), "tokens_per_s": v / s_}
            for name, (v, s_) in totals.items()} | {"steps": len(steps)}


def _counts(ex: Examples, chosen: np.ndarray) -> dict:
    return {f"{k},{l1},{l2}": int(c) for (k, l1, l2), c in zip(
        ex.actions, np.bincount(chosen, minlength=len(ex.actions))) if c}


def format_report(verifier: str, cv: dict) -> str:
    """Tables of ``cross_validate``'s scores. With several batch sizes, one table per batch size
    (a batch size is its own workload: rows of different batch sizes share no clock, so their
    pooled tokens/s means nothing), against the best static shape of that batch size."""
    lines = [f"held-out ({cv['folds']} folds by prompt, {cv['roots']} rows of {cv['prompts']} prompts), "
             f"verifier {verifier}:"]
    by_batch = cv.get("by_batch_size", {})
    parts = [(f"batch size {b}", s) for b, s in by_batch.items()] or [("all rows", cv)]
    for title, part in parts:
        ref_name = "static_per_batch" if by_batch else "static"
        lines += [f"{title}:", f"| policy | block efficiency | step (ms) | tokens/s | vs {ref_name} |",
                  "|---|---:|---:|---:|---:|"]
        ref = part[ref_name]["tokens_per_s"]
        for name in ("selector", "selector_without_batch", "static", "static_per_batch", "static_traversal",
                     "oracle_per_root"):
            if name not in part:
                continue
            s = part[name]
            lines.append(f"| {name} | {s['block_efficiency']:.3f} | {1e3 * s['step_s']:.0f} | {s['tokens_per_s']:.3f} | "
                         f"{s['tokens_per_s'] / ref:.3f}x |")
        if "steps" in part:
            st = part["steps"]
            lines += [f"as {st['steps']} engine steps of {title.split()[-1]} requests (batch_step_time):",
                      "| policy | block efficiency | step (ms) | tokens/s | vs static_per_batch |", "|---|---:|---:|---:|---:|"]
            for name in ("selector", "selector_step", "static_per_batch", "oracle_step"):
                s = st[name]
                lines.append(f"| {name} | {s['block_efficiency']:.3f} | {1e3 * s['step_s']:.0f} | {s['tokens_per_s']:.3f} | "
                             f"{s['tokens_per_s'] / st['static_per_batch']['tokens_per_s']:.3f}x |")
        if "static_per_batch_actions" in part:
            lines.append(f"selector's choices: {part['selector_actions']}; best static of this batch size: "
                         f"{part['static_per_batch_actions']}")
    if by_batch:
        for name in ("selector", "selector_without_batch"):
            ratios = [part[name]["tokens_per_s"] / part["static_per_batch"]["tokens_per_s"] for part in by_batch.values()]
            lines.append(f"{name} vs the best static shape of each batch size, geometric mean over batch sizes "
                         f"{', '.join(by_batch)}: {float(np.exp(np.mean(np.log(ratios)))):.3f}x")
    lines.append(f"best static per fold (pooled rows): {cv['static_actions']}; selector's choices: {cv['selector_actions']}")
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("selector", help="train the learned (K, L1, L2) selector of draft_tree")
    sub = p.add_subparsers(dest="selector_command", required=True)
    t = sub.add_parser("train", help="train on draft_tree_grid records, report held-out folds, save")
    t.add_argument("--records", required=True, help="comma-separated draft_tree_grid JSONL(.gz) files")
    t.add_argument("--verifier", default="traversal", choices=VERIFIERS, help="verifier of sampled requests")
    t.add_argument("--out", required=True, help="output directory (selector.json + selector.safetensors)")
    t.add_argument("--folds", type=int, default=5, help="held-out folds by prompt (0: no evaluation)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--epochs", type=int, default=300)
    t.add_argument("--max-drafts", type=int, default=8,
                   help="only actions with at most this many drafts (vLLM's num_speculative_tokens; 0: the whole grid)")
    t.add_argument("--batch-sizes", default="1",
                   help="comma-separated batch sizes: every root is a training row at each (the log_batch_size "
                        "feature; Eq. 11 for one of b requests, selector.train.step_time)")
    t.add_argument("--timing", default=None,
                   help="a draft_tree_grid --time-only JSONL whose timing record replaces the record files' (it "
                        "must hold the target forwards of every batch size, --time-batch-sizes)")
    t.add_argument("--max-batch-size", type=int, default=None,
                   help="draft only in engine steps of at most this many requests, drafting or not (stored in the file; from runs "
                        "in vLLM where wider batches lost: what the labels leave out, docs/selector.md); default: no bound")
    t.add_argument("--target", default=None, help="name of the target model, stored in the file")
    t.add_argument("--draft", default=None, help="name of the draft model, stored in the file")
    t.set_defaults(func=run_train)
    return p


def _pair(target: str | None, draft: str | None) -> dict:
    """Names and fingerprints (``shipped.model_fingerprint``: what ``"selector": "auto"`` matches)
    of the pair; a model name of the registry or a checkpoint directory."""
    from vllm_anisotropic.models.prepare import model_path
    from vllm_anisotropic.selector.shipped import model_fingerprint

    pair: dict = {"target": target, "draft": draft}
    for role, name in (("target", target), ("draft", draft)):
        if name is None:
            continue
        directory = Path(name) if Path(name).is_dir() else model_path(name)
        try:
            pair[f"{role}_fingerprint"] = model_fingerprint(directory)
        except ValueError as e:
            logger.warning("%s %s: no fingerprint (%s); 'auto' will not pick this selector", role, name, e)
    return pair


def run_train(args) -> int:
    paths = [s for s in args.records.split(",") if s]
    timing = None
    if args.timing:
        timing = next((r for r in read_records(args.timing) if r.get("kind") == "timing"), None)
        if timing is None:
            raise SystemExit(f"--timing {args.timing}: no timing record in it")
    try:
        batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    except ValueError:
        raise SystemExit(f"--batch-sizes must be comma-separated integers >= 1, got {args.batch_sizes!r}") from None
    if not batch_sizes or min(batch_sizes) < 1:
        raise SystemExit(f"--batch-sizes must be comma-separated integers >= 1, got {args.batch_sizes!r}")
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise SystemExit(f"--max-batch-size must be an integer >= 1, got {args.max_batch_size}")
    try:
        ex = load_examples(paths, max_drafts=args.max_drafts or None, batch_sizes=batch_sizes, timing=timing)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    report = None
    if args.folds > 1:
        report = cross_validate(ex, args.verifier, folds=args.folds, seed=args.seed, epochs=args.epochs)
        print(format_report(args.verifier, report))
    sel = fit(ex, np.arange(len(ex)), args.verifier, seed=args.seed, epochs=args.epochs, progress=True)
    # what q ran in when its pass times were measured (shipped.py picks a pair's selector by it)
    quantizations = {t.get("draft_quantization", "none") for t in ex.timings}
    sel.meta.update({"pair": _pair(args.target, args.draft), "records": [Path(p).name for p in paths],
                     "draft_quantization": quantizations.pop() if len(quantizations) == 1 else "mixed",
                     "batch_sizes": list(batch_sizes), "timing": Path(args.timing).name if args.timing else None,
                     "held_out": report, **({"max_batch_size": args.max_batch_size} if args.max_batch_size else {})})
    out = sel.save(args.out)
    print(f"saved {out} ({len(ex.actions)} actions, {len(ex)} roots)")
    return 0
