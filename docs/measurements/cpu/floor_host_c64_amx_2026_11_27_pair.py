import json,sys,collections
def load(f):
    rows=[json.loads(l) for l in open(f)]
    i=[k for k,r in enumerate(rows) if r.get("mark")=="start"][0]
    return rows[i+1:]
a,b=load(sys.argv[1]),load(sys.argv[2])
print(len(a),len(b))
def tot(rs):
    d=collections.defaultdict(float)
    for r in rs:
        for k,v in r["t"].items(): d[k]+=v
        d["step"]+=r["sec"]*1e3
    return d
A,B=tot(a),tot(b)
n=len(a)
for k in sorted(set(A)|set(B)):
    print(f"{k:40s} {A.get(k,0)/n:8.3f} {B.get(k,0)/n:8.3f} {(B.get(k,0)-A.get(k,0))/n:+7.3f}")
