#!/usr/bin/env bash
# Install a C++ compiler (Debian's g++) where none is found: the engine builds its CPU kernels with it
# on first use (stages/engine/runner/kernels). Run by `make setup` (so by `make serve`, `make test` and
# .ci/run). Needs root or password-less sudo and apt; without them it says so, and the engine runs
# torch's kernels instead (slower; the kernel tests skip).
set -uo pipefail
if command -v "${CXX:-g++}" >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1; then exit 0; fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "no C++ compiler and no apt-get: the engine will use torch's kernels" >&2; exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
export DEBIAN_FRONTEND=noninteractive
if $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends g++; then
  echo "installed $(g++ --version | head -1)"
else
  echo "could not install g++ with apt-get: the engine will use torch's kernels" >&2
fi
exit 0
