"""Where the CPU goes while N streams run through the graph: CPU seconds per process (and per
thread of the engine replica) over one load phase, read from ``/proc`` before and after.

On a small machine the graph's throughput is bounded by CPU, not by the engine alone: the step
thread holds one core, and every other process (Serve's proxy, Ingress, Egress, the engine
replica's own event loop and gRPC threads, Ray's daemons, and the client) shares what is left.
This names each share, per generated token, so a change to the hops can be judged by the CPU it
saves and not only by a noisy throughput ratio.

    .venv/bin/python bench/experiments/cpu_split.py --url http://127.0.0.1:8000 --streams 32 --tokens 128

Linux only (it reads ``/proc``); the client runs in this process and is reported as ``client``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import MODEL_NAME, stream_completion  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(stat_path: str) -> float:
    """utime + stime of one process or thread, in seconds."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _name(pid: str, app: str | None = None) -> str | None:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return None
    if cmd.startswith("ray::ServeReplica:"):
        replica_app, _, deployment = cmd[len("ray::ServeReplica:"):].partition(":")
        if app is not None and replica_app != app:
            return None  # another app's replica (idle while this one is measured)
        return deployment.split()[0]  # Engine, Egress, Ingress, ...
    if cmd.startswith("ray::"):
        return cmd[5:].split(".")[0].split()[0]  # ProxyActor, ServeController, IDLE, ...
    for daemon in ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py"):
        if daemon in cmd:
            return daemon
    return None


def snapshot(app: str | None = None) -> dict[str, float]:
    """CPU seconds so far: per Ray process kind, per engine-replica thread (``Engine/<thread>``),
    and this process (``client``)."""
    out: dict[str, float] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        name = "client" if int(pid) == os.getpid() else _name(pid, app)
        if name is None:
            continue
        try:
            out[name] = out.get(name, 0.0) + _cpu_s(f"/proc/{pid}/stat")
            if name == "Engine":
                for tid in os.listdir(f"/proc/{pid}/task"):
                    comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                    key = f"Engine/{comm}"
                    out[key] = out.get(key, 0.0) + _cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue  # it exited meanwhile
    return out


async def load(url: str, streams: int, tokens: int) -> tuple[int, float]:
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await stream_completion(client, url, {"model": MODEL_NAME, "prompt": "warm up", "max_tokens": 4})
        body = {"model": MODEL_NAME, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        results = await asyncio.gather(*[stream_completion(client, url, {**body, "prompt": f"Write about bees {i}:"})
                                         for i in range(streams)])
        return sum(r.num_tokens for r in results), time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--app", default=None, help="count only this Serve app's replicas (default: all)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    before = snapshot(a.app)
    tokens, wall = asyncio.run(load(a.url, a.streams, a.tokens))
    after = snapshot(a.app)
    used = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) > 0.005}
    total = sum(v for k, v in used.items() if "/" not in k)
    result = {"streams": a.streams, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
              "cpu_s": used, "cpu_s_total": total, "cores_busy": total / wall,
              "cpu_ms_per_token": {k: v * 1e3 / tokens for k, v in used.items()}}
    print(f"{tokens} tokens in {wall:.2f} s ({tokens / wall:.1f} tok/s); {total:.2f} CPU s = "
          f"{total / wall:.2f} cores busy")
    print("| process (thread) | CPU s | cores | ms CPU / token |\n|---|---|---|---|")
    for k, v in sorted(used.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v:.2f} | {v / wall:.2f} | {v * 1e3 / tokens:.2f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
