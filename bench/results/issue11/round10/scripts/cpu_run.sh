#!/bin/bash
# per-thread CPU of the Ingress, Egress, Engine replicas over one run of the burst client
P=$(for s in Ingress Egress Engine; do pgrep -f "ServeReplica:lifecycle:$s" | head -1; done | paste -sd,)
cd /work/wt && /work/main/.venv/bin/python /work/main/bench/results/issue11/round9/scripts/thread_cpu.py $P /work/main/.venv/bin/python /tmp/burst_stats.py 32 8 2>&1 | grep -v "^burst"
for s in Ingress Egress Engine; do echo "$s $(pgrep -f "ServeReplica:lifecycle:$s" | head -1)"; done | paste -sd' '
