#!/usr/bin/env bash
# `make serve` start-up and shutdown as a user sees them: seconds from `make serve` (installed) to
# /health 200, whether plain `serve status` works, and seconds from Ctrl-C (SIGINT to the
# foreground process group) until every process of that Ray session has exited. Run from the
# repository root with nothing listening on :8000.
set -uo pipefail
set -m  # job control: the background job gets its own process group, like a terminal's foreground job
t0=$(date +%s.%N)
make serve > /tmp/make_serve.log 2>&1 &
pgid=$!
until curl -sf -o /dev/null http://127.0.0.1:8000/health; do
  sleep 0.5
  if ! kill -0 "$pgid" 2>/dev/null; then echo "make serve exited early"; tail -20 /tmp/make_serve.log; exit 1; fi
done
t1=$(date +%s.%N)
echo "healthy_after_s=$(python3 -c "print(round($t1 - $t0, 1))")"
env -u RAY_AUTH_MODE .venv/bin/serve status > /tmp/serve_status.txt 2>&1 && echo "serve_status=ok" || echo "serve_status=FAILED"
grep -c "RUNNING\|HEALTHY" /tmp/serve_status.txt | sed 's/^/serve_status_healthy_lines=/'
session=$(readlink -f /tmp/ray/session_latest)
t2=$(date +%s.%N)
kill -INT -- -"$pgid"
while pgrep -f "$session" > /dev/null || kill -0 "$pgid" 2>/dev/null; do sleep 0.2; done
t3=$(date +%s.%N)
echo "shutdown_after_ctrl_c_s=$(python3 -c "print(round($t3 - $t2, 1))")"
