"""Per-repeat ratios of a bench's JSONL records (``vllm-anisotropic bench --out``): for each
concurrency, METHOD (default dtree-default) against plain and against the best ``draft_model-k*``
(the one with the highest geometric mean tokens/s over the repeats), each repeat's ratio to the
same repeat's cell, their geometric mean and a 95 % t-interval of the log ratios.

Usage: .venv/bin/python docs/measurements/cpu/dtree_grid_ratios_2026_12_07.py A.jsonl [B.jsonl ...] [--method M]"""
import collections
import json
import math
import statistics
import sys

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}
args = sys.argv[1:]
method = args[args.index("--method") + 1] if "--method" in args else "dtree-default"
rows = [json.loads(line) for path in args if path.endswith(".jsonl") for line in open(path)]
rate = collections.defaultdict(dict)  # (concurrency, method) -> repeat -> tokens/s
for r in rows:
    rate[r["concurrency"], r["method"]][r["repeat"]] = r["tokens_per_s"]


def gmean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def interval(ratios):
    logs = [math.log(x) for x in ratios]
    m = statistics.mean(logs)
    if len(logs) < 2:
        return f"{math.exp(m):.3f}x"
    h = T95[len(logs) - 1] * statistics.stdev(logs) / math.sqrt(len(logs))
    return f"{math.exp(m):.3f}x [{math.exp(m - h):.3f}, {math.exp(m + h):.3f}]"


for c in sorted({k[0] for k in rate}):
    mine = rate.get((c, method))
    if not mine:
        continue
    dms = {m: v for (cc, m), v in rate.items() if cc == c and m.startswith("draft_model")}
    line = [f"c{c}: {method} {gmean(list(mine.values())):.2f} tokens/s"]
    for other in ["plain"] + ([max(dms, key=lambda m: gmean(list(dms[m].values())))] if dms else []):
        ref = rate[c, other]
        reps = sorted(set(mine) & set(ref))
        ratios = [mine[k] / ref[k] for k in reps]
        line.append(f"vs {other} {interval(ratios)} (per repeat {' / '.join(f'{x:.3f}' for x in ratios)})")
    if dms:
        line.append("draft_model: " + ", ".join(f"{m[12:]} {gmean(list(v.values())):.2f}" for m, v in sorted(dms.items())))
    print("; ".join(line))
