import glob, json, statistics, collections
ev = collections.defaultdict(dict)
for f in glob.glob("/tmp/r6/probe/*.log"):
    for line in open(f):
        rid, name, t = line.split()
        ev[rid.split("-")[0] if False else rid][name] = float(t)
# engine ids may carry a suffix: fold by prefix match of ingress ids
ing = [r for r in ev if "I0" in ev[r]]
merged = {}
for r in ing:
    d = dict(ev[r])
    for k, v in ev.items():
        if k != r and k.startswith(r):
            for n, t in v.items(): d.setdefault(n, t)
    merged[r] = d
client = json.load(open("/tmp/r6/idle_client.json"))
order = ["I0","I1","P0","P1","I2","I3","E0","E1","G0","G1","G2","G3","G4","E2","E3","E4","I4","I5","I6"]
rows = sorted(merged.values(), key=lambda d: d["I0"])[-len(client):]
deltas = collections.defaultdict(list)
for d, c in zip(rows, client):
    seq = [n for n in order if n in d]
    for a, b in zip(seq, seq[1:]):
        deltas[f"{a}->{b}"].append((d[b]-d[a])*1e3)
    deltas["client t0->I0"].append((d["I0"]-c["t0"])*1e3)
    deltas["I6 - (t0+ttft)"].append((c["t0"]+c["ttft"]-d["I6"])*1e3 if "I6" in d else 0)
    deltas["total I0->I6"].append((d.get("I6",0)-d["I0"])*1e3)
    deltas["client ttft"].append(c["ttft"]*1e3)
for k, v in deltas.items(): print(f"{k:18s} p50 {statistics.median(v):7.2f}  min {min(v):7.2f} n={len(v)}")
print()
rel = collections.defaultdict(list)
for d in rows:
    for n, t in d.items(): rel[n].append((t - d["I0"]) * 1e3)
for n, v in sorted(rel.items(), key=lambda kv: statistics.median(kv[1])): print(f"{n:4s} {statistics.median(v):7.2f}  (n={len(v)})")
