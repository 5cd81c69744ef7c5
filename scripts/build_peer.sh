#!/usr/bin/env bash
# Build llama.cpp's llama-server (the peer for `python -m bench compare`) from the llama-cpp-python
# sdist on PyPI, which vendors llama.cpp. Opt-in (`make peer`): about 30 minutes on 2 cores.
# Output: $PEER_DIR/llama-server (default ~/.cache/lifecycle-serve/peer). PEER_ISA=avx2 builds
# llama-server-avx2 instead, restricted to AVX2 (to compare AVX2 paths on an AVX-512 machine).
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PEER_DIR="${PEER_DIR:-$HOME/.cache/lifecycle-serve/peer}"
PY="${PY:-python3}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$PEER_DIR"
ISA="${PEER_ISA:-native}"
if [ "$ISA" = native ]; then
  NAME=llama-server; ISA_FLAGS=(-DGGML_NATIVE=ON)
  if [ "$(uname -m)" = x86_64 ]; then
    # ggml's AMX matmul faults (ldtilecfg: SIGSEGV) on VMs that list AMX but do not enable its tile
    # state, as the Xeon VMs here do: build without it (torch's oneDNN checks and runs AMX there).
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    ISA_FLAGS+=("-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX")
  fi
elif [ "$ISA" = avx2 ]; then
  NAME=llama-server-avx2
  ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
             -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF
             -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF)
else
  echo "PEER_ISA must be native or avx2" >&2; exit 2
fi
if [ -x "$PEER_DIR/$NAME" ]; then echo "peer already built: $PEER_DIR/$NAME"; exit 0; fi
if ! command -v cmake >/dev/null 2>&1 || ! command -v c++ >/dev/null 2>&1; then
  echo "installing cmake and g++ with apt-get" >&2
  SUDO=""; if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq cmake g++ make
fi
work="$PEER_DIR/src"
mkdir -p "$work"
if [ ! -d "$work/llama_cpp_python-$VERSION" ]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$VERSION"
  tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
fi
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
build="$work/build-$ISA"
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF "${ISA_FLAGS[@]}" \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$build" --target llama-server -j "$JOBS"
cp "$build/bin/llama-server" "$PEER_DIR/$NAME"
echo "built $PEER_DIR/$NAME"
