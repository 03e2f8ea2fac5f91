"""Summary of a profile-host A/B (two --json files, A before, B after): per run tokens/s, the
plugin's host work and the cut a step, over all steps and the tree steps; means and ranges."""
import json, sys, statistics as S
a, b = sys.argv[1], sys.argv[2]
def load(p): return [json.loads(l) for l in open(p)]
A, B = load(a), load(b)
def arm(r, name, key): return r["by_arm"].get(name, {}).get(key)
print("side  tokens/s  host ms/step  cut ms/step  trees-arm host  trees-arm cut")
for side, rows in (("A", A), ("B", B)):
    for r in rows:
        t = r["by_arm"]["trees"]
        print(side, f"{r['tokens']/r['seconds']:7.1f}", f"{r['plugin_host_ms']:8.3f}", f"{r['phases_ms']['cut']:8.3f}",
              f"{t.get('plugin_host_ms'):8.3f}", f"{t.get('phases_ms',{}).get('cut',float('nan')):8.3f}")
for key in ("plugin_host_ms",):
    ma, mb = S.mean(r[key] for r in A), S.mean(r[key] for r in B)
    print(key, f"A {ma:.3f} B {mb:.3f} diff {mb-ma:+.3f}")
ca, cb = [r["phases_ms"]["cut"] for r in A], [r["phases_ms"]["cut"] for r in B]
print("cut", f"A {S.mean(ca):.3f} ({min(ca):.3f}..{max(ca):.3f}) B {S.mean(cb):.3f} ({min(cb):.3f}..{max(cb):.3f})")
ta, tb = [r["by_arm"]["trees"]["phases_ms"]["cut"] for r in A], [r["by_arm"]["trees"]["phases_ms"]["cut"] for r in B]
print("trees-arm cut", f"A {S.mean(ta):.3f} ({min(ta):.3f}..{max(ta):.3f}) B {S.mean(tb):.3f} ({min(tb):.3f}..{max(tb):.3f})")
