#!/usr/bin/env bash
# One prepared check for a machine with a CUDA GPU, in under 10 minutes: the parity test on CUDA,
# FlexAttention paged decode and CUDA-graph replay against SDPA (tokens, then step times), the
# engine benchmark (parts a and d, float32 on CUDA), the graph benchmark (--quick), every figure
# printed and the JSON kept under $OUT (default bench/results/gpu). Not part of `make test`.
#
#   bash bench/gpu_check.sh            # after `make setup` (a CUDA build of torch in .venv)
#
# Each step has its own timeout so one hang cannot eat the budget; a failing step is reported and
# the next one still runs. Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT="${OUT:-bench/results/gpu}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0 RAY_SERVE_THROUGHPUT_OPTIMIZED=1

if ! "$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch (torch %s); nothing to check" % torch.__version__)
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {p.name}, {p.total_memory / 2**30:.0f} GiB")
PYEOF
then exit 1; fi
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv || true

failed=0
step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo; echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  if timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; then :; fi
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0))s"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

# 1. Token parity with transformers, engine on CUDA in float32 (the reference stays on CPU).
step parity 240 env LIFECYCLE_TEST_DEVICE=cuda "$PY" -m pytest -q -x tests/test_engine_parity.py \
  -k "one_at_a_time or chunked_prefill or logits_close"
# 1b. FlexAttention over the block tables and decode steps replayed from captured CUDA graphs
#     (attention=flex, decode_graphs=cuda: the CUDA defaults), tokens against the SDPA path.
step flex_graphs 150 env LIFECYCLE_TEST_DEVICE=cuda "$PY" -m pytest -q -x tests/test_flex_attention.py
# 1c. Decode step time: sdpa vs flex vs flex + CUDA graphs at 1, 8 and 32 sequences.
step decode_graphs 120 "$PY" bench/bench_decode_graphs.py --device cuda --rounds 2 --out "$OUT/decode_graphs.json"
# 2. Engine core vs transformers on the same device: batch-1 decode and the step-time table.
step engine 180 "$PY" bench/bench_engine.py --device cuda --parts a,d --weights float32 --quick \
  --out "$OUT/engine.json"
# 3. The graph over HTTP vs in-process, quick run (the app picks its own loopback port).
step graph 150 "$PY" bench/bench_graph.py --quick

echo; echo "gpu_check: $failed step(s) failed; logs and JSON in $OUT"
exit "$failed"
