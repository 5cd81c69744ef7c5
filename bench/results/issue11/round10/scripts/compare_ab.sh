#!/bin/bash
export PYTHONPATH=/work/wt RAY_AUTH_MODE=disabled
cd /work/wt
R=bench/results/issue11/round10
i=0
for cfg in serve_config.yaml /tmp/serve_config_nobatch.yaml /tmp/serve_config_nobatch.yaml serve_config.yaml; do
  i=$((i+1)); tag=$([ "$cfg" = serve_config.yaml ] && echo batch || echo nobatch)
  echo "== $i $tag $(date +%T)"
  /tmp/restart.sh $cfg | tail -1
  timeout 600 .venv/bin/python -m bench compare --url http://127.0.0.1:8000 --repeats 3 --out $R/compare_${i}_${tag}.json 2>&1 | tail -12
done
pkill -TERM -f "serve run"; sleep 3; /work/main/.venv/bin/ray stop --force >/dev/null 2>&1
echo done $(date +%T)
