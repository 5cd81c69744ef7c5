#!/usr/bin/env python
"""Memory of a running app, per process: RSS and PSS (shared pages split between the processes that
map them, so PSS adds up to what the app really holds) of every process of the local Ray session
(GCS, raylet, dashboard, Serve's controller and proxy, each replica) and of the engine's core
process. Run beside `make serve` (or `serve run serve_config.yaml`) once it is healthy; warm it
first if the figure should include a served request.

    .venv/bin/python bench/experiments/app_memory.py [--warm URL] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.request
from pathlib import Path

import psutil


def label(p: psutil.Process) -> str | None:
    """What the process is in the app, or None when it is not part of it."""
    try:
        name = p.name()
        cmd = " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if "stages.engine.driver.core_process" in cmd:
        return "Engine core process (the model)"
    # The dashboard runs each module in a process forked from its own forkserver.
    m = re.match(r"ray-dashboard-(\w+)", name) or re.match(r"ray-dashboard-(\w+)", cmd)
    if m:
        return f"dashboard module {m.group(1)}"
    if "multiprocessing.forkserver" in cmd and "ray.dashboard" in cmd:
        return "dashboard modules' forkserver"
    m = re.match(r"ray::ServeReplica:\w+:(\w+)", name) or re.search(r"ray::ServeReplica:\w+:(\w+)", cmd)
    if m:
        return f"replica {m.group(1)}"
    # Ray names its actors' and agents' processes ``ray::<Class>`` (truncated in ``name()``).
    for key, what in (("ServeController", "Serve controller"), ("ProxyActor", "Serve proxy"),
                      ("HAProxyManager", "Serve's HAProxy manager"), ("DashboardAgent", "dashboard agent"),
                      ("RuntimeEnvAgent", "runtime env agent")):
        if key in cmd or key in name:
            return what
    for key in ("gcs_server", "raylet", "dashboard.py", "log_monitor", "monitor.py", "runtime_env/agent",
                "dashboard/agent.py", "serve run", "haproxy"):
        if key in cmd:
            return key.replace(".py", "")
    if name.startswith("ray::") or "default_worker.py" in cmd:
        return "idle Ray worker"
    return None


def pss_bytes(p: psutil.Process) -> int:
    try:
        with open(f"/proc/{p.pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", default="", help="send one chat request to this URL first")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds to wait after the request (an idle engine trims its heap after 1 s)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.warm:
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 16,
                           "messages": [{"role": "user", "content": "Say hello."}]}).encode()
        req = urllib.request.Request(a.warm.rstrip("/") + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=120).read()
        time.sleep(a.settle)
    rows = []
    procs = list(psutil.process_iter())
    labels = {p.pid: label(p) for p in procs}
    for p in procs:
        what = labels[p.pid]
        if what is None:
            # Anything else a process of the app started is the app's too.
            try:
                parent = next((a for a in p.parents() if labels.get(a.pid)), None)
                what = None if parent is None else f"other: {p.name()} (child of {labels[parent.pid]})"
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        if what is None:
            continue
        try:
            rows.append({"pid": p.pid, "what": what, "rss_mb": p.memory_info().rss / 2**20,
                         "pss_mb": pss_bytes(p) / 2**20})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    rows.sort(key=lambda r: -r["pss_mb"])
    print("| process | RSS MB | PSS MB |\n|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['rss_mb']:.0f} | {r['pss_mb']:.0f} |")
    rss, pss = sum(r["rss_mb"] for r in rows), sum(r["pss_mb"] for r in rows)
    print(f"| **all {len(rows)} processes** | **{rss:.0f}** | **{pss:.0f}** |")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "rss_mb": rss, "pss_mb": pss}, indent=1))


if __name__ == "__main__":
    main()
