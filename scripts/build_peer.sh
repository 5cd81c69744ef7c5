#!/usr/bin/env bash
# Build llama.cpp's llama-server (the peer for `python -m bench compare`) from the llama-cpp-python
# sdist on PyPI, which vendors llama.cpp. Opt-in (`make peer`): about 30 minutes on 2 cores.
# Output: $PEER_DIR/llama-server (default ~/.cache/lifecycle-serve/peer).
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PEER_DIR="${PEER_DIR:-$HOME/.cache/lifecycle-serve/peer}"
PY="${PY:-python3}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$PEER_DIR"
if [ -x "$PEER_DIR/llama-server" ]; then echo "peer already built: $PEER_DIR/llama-server"; exit 0; fi
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
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$work/build" --target llama-server -j "$JOBS"
cp "$work/build/bin/llama-server" "$PEER_DIR/llama-server"
echo "built $PEER_DIR/llama-server"
