import json, sys, statistics as st
from collections import defaultdict
for fn in sys.argv[1:]:
    rows=[json.loads(l) for l in open(fn)]
    i=[k for k,r in enumerate(rows) if r.get('mark')=='start']
    rows=[r for r in rows[(i[0]+1 if i else 0):] if 'mark' not in r and r['R']==16 and not r['new']]
    g=defaultdict(list)
    for r in rows:
        b = 0 if r['ndraft']==0 else (1 if r['ndraft']<20 else (2 if r['ndraft']<40 else 3))
        g[b].append(r)
    print(fn)
    keys=sorted({k for r in rows for k in r['t']})
    hdr=f"{'bucket':28s}"+"".join(f"{b:>9d}" for b in sorted(g))
    print(hdr)
    print(f"{'n':28s}"+"".join(f"{len(g[b]):9d}" for b in sorted(g)))
    print(f"{'ndraft':28s}"+"".join(f"{st.mean(r['ndraft'] for r in g[b]):9.1f}" for b in sorted(g)))
    print(f"{'tok':28s}"+"".join(f"{st.mean(r['tok'] for r in g[b]):9.1f}" for b in sorted(g)))
    print(f"{'sec ms':28s}"+"".join(f"{st.mean(r['sec'] for r in g[b])*1e3:9.2f}" for b in sorted(g)))
    for k in keys:
        print(f"{k:28s}"+"".join(f"{st.mean(r['t'].get(k,0) for r in g[b]):9.2f}" for b in sorted(g)))
