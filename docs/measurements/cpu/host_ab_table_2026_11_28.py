"""The tables of docs/measurements/cpu/allocator_measurements.md, "The batched host path": python docs/measurements/cpu/host_ab_table_2026_11_28.py
(the records' date suffix as the argument: 2026_11_28 by default, 2026_11_28b for host_ab_2026_11_28b.sh, 2026_11_29 for host_ab_2026_11_29.sh;
a run of one tree has its "after" file alone: 2026_12_02e, host_final_2026_12_02.sh)"""
import json, os, statistics as st, sys
run = sys.argv[1] if len(sys.argv) > 1 else "2026_11_28"
rows={}
for tag in ["after","before"]:
    path = f"docs/measurements/cpu/host_ab_{tag}_{run}.jsonl"
    for l in (open(path) if os.path.exists(path) else []):
        r=json.loads(l)
        rows.setdefault((r["method"],tag,r["max_num_seqs"]),[]).append(r)
print("| method | tree | requests | runs | tokens/s | wall ms/step | forward ms/step | outside forward ms/step | plugin host ms/step | without the vocabulary pass | decode steps trees / chains / plain |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
for (m,tag,c),rs in sorted(rows.items(), key=lambda kv:(kv[0][2],kv[0][0],kv[0][1])):
    med=lambda k: st.median(x[k] for x in rs)
    kinds=[x.get("decode_steps") or {} for x in rs]
    ks="; ".join(f"{k.get('trees',0)} / {k.get('chains',0)} / {k.get('plain',0)}" for k in kinds if k) or "-"
    print(f"| {m} | {tag} | {c} | {len(rs)} | {st.median(x['tokens']/x['seconds'] for x in rs):.1f} | {med('wall_ms'):.2f} | {med('forward_ms'):.2f} | {med('outside_forward_ms'):.2f} | {med('plugin_host_ms'):.2f} | {st.median(x.get('plugin_host_no_topk_ms', x['plugin_host_ms']) for x in rs):.2f} | {ks} |")
print()
print("phases (ms/step, median over runs), goose-nogate or goose-b8:")
for (m,tag,c),rs in sorted(rows.items(), key=lambda kv:(kv[0][2],kv[0][1])):
    if m not in ("goose-nogate", "goose-b8"): continue
    keys=sorted({k for x in rs for k in x["phases_ms"]}, key=lambda k: -st.median(x["phases_ms"].get(k,0) for x in rs))
    print(f"  {tag:6s} c={c:<3d} " + " ".join(f"{k} {st.median(x['phases_ms'].get(k,0) for x in rs):.2f}" for k in keys if st.median(x['phases_ms'].get(k,0) for x in rs)>=0.01))
