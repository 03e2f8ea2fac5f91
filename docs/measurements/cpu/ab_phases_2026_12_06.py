"""Phase by phase, two sides of a profile-host A/B (``--json`` records of alternated runs): the
median and range of each phase's ms a step over each side's runs, over every step and over the
allocator's tree steps; ``--drop-slow F``: leave out runs below F x the side's best tokens/s
(the machine's slow mode), named in the output.

Usage: .venv/bin/python docs/measurements/cpu/ab_phases_2026_12_06.py A.jsonl B.jsonl [--drop-slow 0.85]"""
import json
import statistics
import sys

args = sys.argv[1:]
drop = float(args[args.index("--drop-slow") + 1]) if "--drop-slow" in args else 0.0
paths = [a for a in args if a.endswith(".jsonl")]
sides = []
for path in paths:
    runs = [json.loads(line) for line in open(path)]
    best = max(r["tokens"] / r["seconds"] for r in runs)
    kept = [r for r in runs if r["tokens"] / r["seconds"] >= drop * best]
    for r in runs:
        if r not in kept:
            print(f"# {path}: a run at {r['tokens'] / r['seconds']:.1f} tokens/s left out (best {best:.1f})")
    sides.append(kept)


def col(runs, get):
    xs = sorted(get(r) for r in runs)
    return f"{statistics.median(xs):.3f} ({xs[0]:.3f}..{xs[-1]:.3f})"


phases = list(sides[0][0]["phases_ms"])
print(f"# runs: {', '.join(f'{p} {len(s)}' for p, s in zip(paths, sides))}; ms a step, median (min..max)")
for scope, get in (("every step", lambda r: r), ("tree steps", lambda r: r["by_arm"].get("trees", {}))):
    print(f"## {scope}")
    print(f"{'phase':12s} " + " ".join(f"{p.split('/')[-1]:>28s}" for p in paths))
    for ph in phases + ["plugin_host_ms", "plugin_host_no_topk_ms"]:
        cells = []
        for runs in sides:
            if ph.startswith("plugin"):
                cells.append(col(runs, lambda r: get(r).get(ph, float("nan"))))
            else:
                cells.append(col(runs, lambda r: get(r).get("phases_ms", {}).get(ph, 0.0)))
        print(f"{ph:12s} " + " ".join(f"{c:>28s}" for c in cells))
print("tokens/s " + " ".join(col(runs, lambda r: r["tokens"] / r["seconds"]) for runs in sides))
