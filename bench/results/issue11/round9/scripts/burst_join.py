import collections, glob, json, statistics
events = collections.defaultdict(dict)
for path in glob.glob("/tmp/r6/probe/*.log"):
    for line in open(path):
        rid, name, t = line.split()
        events[rid].setdefault(name, float(t))
merged = {}
for rid in (r for r in events if "I0" in events[r]):
    d = dict(events[rid])
    for other, evs in events.items():
        if other != rid and other.startswith(rid):
            for name, t in evs.items():
                d.setdefault(name, t)
    merged[rid] = d
client = json.load(open("/tmp/burst_client.json"))
rows = sorted(merged.values(), key=lambda d: d["I0"])
def pct(v, q):
    v = sorted(v); return v[min(len(v)-1, int(round(q/100*(len(v)-1))))]
rel = collections.defaultdict(lambda: collections.defaultdict(list))
for b in client:
    t0 = b["t0"]; n = len(b["ttfts"])
    mine = [d for d in rows if t0 <= d["I0"] <= t0 + 5][:n]
    for d in mine:
        for name, t in d.items():
            rel[name]["all"].append((t - t0) * 1e3)
    for t in b["ttfts"]:
        rel["client_ttft"]["all"].append(t * 1e3)
print(f"{'event':10s} {'min':>7s} {'p5':>7s} {'p50':>7s} {'p95':>7s} {'max':>7s}  n")
for name, v in sorted(rel.items(), key=lambda kv: statistics.median(kv[1]["all"])):
    a = v["all"]
    print(f"{name:10s} {min(a):7.1f} {pct(a,5):7.1f} {pct(a,50):7.1f} {pct(a,95):7.1f} {max(a):7.1f}  {len(a)}")
