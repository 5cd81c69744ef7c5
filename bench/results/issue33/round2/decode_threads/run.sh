#!/usr/bin/env bash
# decode_threads 0 vs 2 through the graph: 1 and 8 streams, and the steps-by-threads counter.
set -m
cd "$(git rev-parse --show-toplevel)"  # swaps serve_config.yaml for the run, restores it at the end
cp serve_config.yaml /tmp/orig_config.yaml
out=bench/results/issue33/round2/decode_threads
mkdir -p $out
for side in off on off on; do
  if [ $side = on ]; then cp $out/serve_config_decode_threads.yaml serve_config.yaml; else cp /tmp/orig_config.yaml serve_config.yaml; fi
  make serve > /tmp/dt_serve.log 2>&1 &
  pg=$!
  until curl -sf -o /dev/null http://127.0.0.1:8000/health; do sleep 0.5; done
  echo "== $side load $(cut -d' ' -f1-3 /proc/loadavg)"
  for c in 1 8; do
    .venv/bin/python -m bench client --concurrency $c --requests $((c*4)) --repeats 2 --max-tokens 128 --no-progress --out $out/${side}_c$c 2>&1 | grep -i "tok/s\|tpot\|gap" | head -4
  done
  curl -s http://127.0.0.1:8000/metrics | grep "engine_steps_by_threads_total{"
  kill -INT -- -$pg; wait $pg
  sleep 3
done
cp /tmp/orig_config.yaml serve_config.yaml
