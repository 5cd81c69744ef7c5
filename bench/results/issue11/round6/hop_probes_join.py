"""Join the hop probes of every process (/tmp/r6/probe/*.log) with the client's record: each
event's median time since the Ingress handler started (hop_timeline.txt)."""

import collections
import glob
import json
import statistics

events: dict[str, dict[str, float]] = collections.defaultdict(dict)
for path in glob.glob("/tmp/r6/probe/*.log"):
    for line in open(path):
        rid, name, t = line.split()
        events[rid][name] = float(t)
# Engine ids extend the Ingress id (one per choice): fold them into it.
merged = {}
for rid in (r for r in events if "I0" in events[r]):
    d = dict(events[rid])
    for other, evs in events.items():
        if other != rid and other.startswith(rid):
            for name, t in evs.items():
                d.setdefault(name, t)
    merged[rid] = d
client = json.load(open("/tmp/r6/idle_client.json"))
rows = sorted(merged.values(), key=lambda d: d["I0"])[-len(client):]
rel = collections.defaultdict(list)
for d, c in zip(rows, client, strict=True):
    for name, t in d.items():
        rel[name].append((t - d["I0"]) * 1e3)
    rel["client_send"].append((c["t0"] - d["I0"]) * 1e3)
    rel["client_ttft"].append(c["ttft"] * 1e3)
for name, v in sorted(rel.items(), key=lambda kv: statistics.median(kv[1])):
    print(f"{name:12s} {statistics.median(v):7.2f}  (n={len(v)})")
