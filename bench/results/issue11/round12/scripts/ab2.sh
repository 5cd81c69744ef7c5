#!/bin/bash
# Alternate burst_pairs runs with Serve's cached-metrics export every 1 s (m1000) and at its default 100 ms (m100).
cd /work/main
for i in 1 2; do
  for side in m1000 m100; do
    if [ $side = m1000 ]; then export RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000; else unset RAY_SERVE_METRICS_EXPORT_INTERVAL_MS; fi
    timeout 900 .venv/bin/python bench/burst_pairs.py --pairs 6 --out /tmp/r12/bp2_${side}_$i.json > /tmp/r12/bp2_${side}_$i.log 2>&1
    echo "$side $i done $(date +%T)"
  done
done
