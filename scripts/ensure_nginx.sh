#!/usr/bin/env bash
# Install Debian's nginx where it is missing: `python -m bench proxy` and tests/unit/bench/test_cli.py start
# it on loopback with their own config (no system service is used). Run by `make test` (and so by
# .ci/run). Needs root or password-less sudo and apt; without them it says so and the nginx tests skip.
set -uo pipefail
if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then exit 0; fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "nginx is missing and there is no apt-get: the nginx tests will skip" >&2; exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
export DEBIAN_FRONTEND=noninteractive
if $SUDO apt-get update -qq && { $SUDO apt-get install -y -qq --no-install-recommends nginx-light \
     || $SUDO apt-get install -y -qq --no-install-recommends nginx; }; then
  echo "installed $(/usr/sbin/nginx -v 2>&1)"
else
  echo "could not install nginx with apt-get: the nginx tests will skip" >&2
fi
exit 0
