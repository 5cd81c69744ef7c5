#!/bin/bash
export PYTHONPATH=/work/main RAY_AUTH_MODE=disabled
cd /work/main
R=bench/results/issue11/round10
i=4
for cfg in /tmp/serve_config_nobatch.yaml serve_config.yaml; do
  i=$((i+1)); tag=$([ "$cfg" = serve_config.yaml ] && echo batch || echo nobatch)
  echo "== $i $tag $(date +%T)"
  /tmp/restart_main.sh $cfg | tail -1
  timeout 600 .venv/bin/python -m bench compare --url http://127.0.0.1:8000 --repeats 3 --out $R/compare_${i}_${tag}.json 2>&1 | tail -6 | grep "^| 32"
done
pkill -TERM -f "serve run"; sleep 3; /work/main/.venv/bin/ray stop --force >/dev/null 2>&1
echo done $(date +%T)
