#!/usr/bin/env bash
# `make serve` start-up, restart and shutdown as a user sees them: seconds from `make serve`
# (installed) to /health 200, whether plain `serve status` works, seconds from a SIGKILL of the
# Engine replica's process until a chat completion succeeds again (and the replica's own log lines
# with their times, to say where those seconds went), and seconds from Ctrl-C (SIGINT to the
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
chat() {
  curl -sf -o /dev/null --max-time 5 http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model":"SmolLM2-135M-Instruct","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
}
chat || echo "chat before the kill FAILED"
engine=$(pgrep -f "ServeReplica:lifecycle:Engine" | head -1)
tk=$(date +%s.%N)
kill -KILL "$engine"
until chat; do sleep 0.2; done
tr=$(date +%s.%N)
echo "engine_sigkill_to_serving_s=$(python3 -c "print(round($tr - $tk, 1))")"
echo "engine_killed_at=$(date -d @"$tk" +%H:%M:%S.%N | cut -c1-12)"
# The new replica's start, step by step (Serve's own log and the engine's), for where the seconds go.
grep -h "Engine" "$session"/logs/serve/controller_*.log 2>/dev/null | tail -6
for f in $(ls -t "$session"/logs/serve/replica_lifecycle_Engine_*.log 2>/dev/null | head -1); do
  grep -hE "loaded|kernel|calibrat|prompt attention|KV|ready|started|core process" "$f" | tail -12
done
t2=$(date +%s.%N)
kill -INT -- -"$pgid"
# A shell that started this script in the background without job control left SIGINT ignored in
# every child: then Ctrl-C cannot be measured, and after 60 s SIGTERM ends the app instead.
waited=0
while pgrep -f "$session" > /dev/null || kill -0 "$pgid" 2>/dev/null; do
  sleep 0.2; waited=$((waited + 1))
  if [ "$waited" -eq 300 ]; then echo "SIGINT ignored (started without job control?): SIGTERM"; kill -TERM -- -"$pgid"; pkill -TERM -f "serve run serve_config.yaml"; fi
done
t3=$(date +%s.%N)
[ "$waited" -lt 300 ] && echo "shutdown_after_ctrl_c_s=$(python3 -c "print(round($t3 - $t2, 1))")"
