#!/bin/bash
# Alternate burst_pairs runs: the sink change applied (new) and reverted (old).
# /tmp/r12/sink.patch was `git diff stages/` of 44b8ae4 (git show 44b8ae4 -- stages/).
cd /work/main
for i in 1 2; do
  for side in new old; do
    if [ $side = old ]; then git apply -R /tmp/r12/sink.patch; fi
    timeout 900 .venv/bin/python bench/burst_pairs.py --pairs 6 --out /tmp/r12/bp_${side}_$i.json > /tmp/r12/bp_${side}_$i.log 2>&1
    if [ $side = old ]; then git apply /tmp/r12/sink.patch; fi
    echo "$side $i done $(date +%T)"
  done
done
