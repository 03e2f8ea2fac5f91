"""The table of chain_alone_ab_2026_12_07.sh: python docs/measurements/cpu/chain_alone_ab_table_2026_12_07.py
Per tree (before 0a6c017, after 523e6da, plain) and concurrency: tokens/s, wall and plugin host ms/step (each run),
the decode steps by the gate's arm, and the chain arm's plugin host ms/step with its largest phases."""
import json

TAGS = ("before", "after", "plain")
PHASES = ("propose", "reply", "prepare", "walk", "harvest")


def steps(r):
    arms = r["by_arm"]
    return " / ".join(str(arms.get(k, {}).get("steps", 0)) for k in ("trees", "chains", "plain"))


def chain_cost(r):
    a = r["by_arm"].get("chains")
    if not a:
        return "-"
    phases = " / ".join("%.2f" % a["phases_ms"].get(p, 0.0) for p in PHASES)
    return "%.2f (%s)" % (a["plugin_host_ms"], phases)


rows = {}
for tag in TAGS:
    for line in open("docs/measurements/cpu/chain_alone_ab_%s_2026_12_07.jsonl" % tag):
        r = json.loads(line)
        rows.setdefault((r["max_num_seqs"], tag), []).append(r)
print("| tree | requests | tokens/s | wall ms/step | plugin host ms/step | decode steps trees / chains / plain "
      "| chain steps: plugin host ms (%s) |" % " / ".join(PHASES))
print("|---|---:|---|---|---|---|---|")
for (c, tag), rs in sorted(rows.items(), key=lambda kv: (kv[0][0], TAGS.index(kv[0][1]))):
    each = lambda f: "; ".join(f(r) for r in rs)  # noqa: E731
    print("| %s | %d | %s | %s | %s | %s | %s |" % (
        tag, c, each(lambda r: "%.1f" % (r["tokens"] / r["seconds"])), each(lambda r: "%.2f" % r["wall_ms"]),
        each(lambda r: "%.3f" % r["plugin_host_ms"]), "-" if tag == "plain" else each(steps),
        "-" if tag == "plain" else each(chain_cost)))
