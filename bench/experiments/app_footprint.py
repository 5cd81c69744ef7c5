#!/usr/bin/env python
"""What the whole app takes from the machine, counted by the kernel: `make serve` runs in a memory
cgroup of its own (v1 or v2; needs root), and after one request and a settle the script reads the
cgroup's charge beside the per-process RSS and PSS sums of `app_memory.py`.

Why a cgroup: every physical page is charged once, to the group whose process first touched it, so
its total is neither the summed RSS (which counts a shared page once per process that maps it: the
dashboard's forked modules, torch's and Ray's libraries) nor an estimate. It is also how a
Kubernetes pod's memory is judged: the working set is the charge less the inactive file cache,
the figure a pod's limit and eviction go by. Page caches are dropped first, so that the app's own
file pages (libraries, the GGUF) are faulted in, and charged, by the app.

    .venv/bin/python bench/experiments/app_footprint.py [--rounds 3] [--settle 5] [--fill-kv] [--json OUT]

`--fill-kv` then sends distinct long prompts until every block of the KV pool has been written
once: the pool is mapped lazily and the block manager hands out never-used blocks before it evicts
cached ones, so that is where a long-running server ends up.

Run from the repository root with nothing on :8000 and nothing else running.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import yaml

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]
from app_memory import label, pss_bytes  # noqa: E402

from bench.target import filler, nonce  # noqa: E402

URL = "http://127.0.0.1:8000"
MB = 2**20


class MemoryCgroup:
    """A fresh memory cgroup under this process's own (v2 unified, else v1's memory hierarchy)."""

    def __init__(self, name: str) -> None:
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if v2.exists() and "memory" in v2.read_text().split():
            self.v2, root = True, Path("/sys/fs/cgroup")
            own = next(line.split(":", 2)[2] for line in open("/proc/self/cgroup") if line.startswith("0::"))
        else:
            self.v2, root = False, Path("/sys/fs/cgroup/memory")
            own = next(line.split(":", 2)[2] for line in open("/proc/self/cgroup")
                       if line.split(":")[1] == "memory")
        self.path = root / own.strip().lstrip("/") / name
        self.path.mkdir()

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def stat(self) -> dict[str, int]:
        return {k: int(v) for k, v in (line.split() for line in (self.path / "memory.stat").read_text().splitlines())}

    def usage(self) -> int:
        return int((self.path / ("memory.current" if self.v2 else "memory.usage_in_bytes")).read_text())

    def figures(self) -> dict[str, float]:
        s, usage = self.stat(), self.usage()
        if self.v2:
            anon, shmem, inactive_file = s["anon"], s["shmem"], s["inactive_file"]
        else:
            anon, shmem, inactive_file = s["total_rss"], s["total_shmem"], s["total_inactive_file"]
        return {"charged_mb": usage / MB, "working_set_mb": (usage - inactive_file) / MB,
                "anon_mb": anon / MB, "shmem_mb": shmem / MB}

    def remove(self) -> None:
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def app_processes() -> list[dict[str, float | str]]:
    """Each process of the app (as `app_memory.py` names them) with its RSS and PSS in MB."""
    procs = list(psutil.process_iter())
    labels = {p.pid: label(p) for p in procs}
    rows = []
    for p in procs:
        try:
            what = labels[p.pid] or next((f"other: {p.name()}" for a in p.parents() if labels.get(a.pid)), None)
            if what:
                rows.append({"what": what, "rss_mb": p.memory_info().rss / MB, "pss_mb": pss_bytes(p) / MB})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sorted(rows, key=lambda r: -r["pss_mb"])


def chat() -> None:
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 16,
                       "messages": [{"role": "user", "content": "Say hello."}]}).encode()
    req = urllib.request.Request(URL + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=120).read()


def fill_kv(block_size: int, words: int = 3000) -> int:
    """Distinct prompts (a nonce first, so no block is shared) until 1.1x the pool's tokens went in."""
    text = urllib.request.urlopen(URL + "/metrics", timeout=10).read().decode()
    blocks = next(float(line.split()[-1]) for line in text.splitlines()
                  if re.match(r"^(\w+:)?num_kv_blocks[ {]", line))
    sent = 0
    while sent < 1.1 * blocks * block_size:
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 1,
                           "messages": [{"role": "user", "content": filler(words, nonce())}]}).encode()
        req = urllib.request.Request(URL + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        sent += json.loads(urllib.request.urlopen(req, timeout=300).read())["usage"]["prompt_tokens"]
    return sent


def healthy() -> bool:
    try:
        return urllib.request.urlopen(URL + "/health", timeout=2).status == 200
    except OSError:
        return False


def one_round(i: int, settle: float, fill: bool) -> dict[str, float]:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3")
    avail0 = psutil.virtual_memory().available
    cg = MemoryCgroup(f"lifecycle-footprint-{os.getpid()}-{i}")
    log = open(f"/tmp/app_footprint_{i}.log", "w")
    # The cgroup is joined before exec, so every process the app starts is born inside it.
    app = subprocess.Popen(["make", "serve"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                           preexec_fn=lambda: cg.add(os.getpid()))
    try:
        t0 = time.monotonic()
        while not healthy():
            if app.poll() is not None or time.monotonic() - t0 > 300:
                raise SystemExit(f"make serve did not become healthy: see /tmp/app_footprint_{i}.log")
            time.sleep(0.5)
        chat()
        filled = fill_kv(int(yaml.safe_load(open("serve_config.yaml"))["applications"][0]["args"]["engine"]
                             .get("block_size", 16))) if fill else 0
        time.sleep(settle)
        procs = app_processes()
        rss, pss = sum(r["rss_mb"] for r in procs), sum(r["pss_mb"] for r in procs)
        row = {"processes": len(procs), "kv_tokens_written": filled, "rss_sum_mb": rss, "pss_sum_mb": pss, **cg.figures(),
               "mem_available_drop_mb": (avail0 - psutil.virtual_memory().available) / MB,
               "per_process": procs}
    finally:
        os.killpg(app.pid, signal.SIGINT)
        try:
            app.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(app.pid, signal.SIGKILL)
            app.wait()
        deadline = time.monotonic() + 60
        while (cg.path / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        cg.remove()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=5.0,
                    help="seconds after the request (an idle engine trims its heap after 1 s)")
    ap.add_argument("--fill-kv", action="store_true", help="write every KV block once before measuring")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    load0 = os.getloadavg()
    rows = [one_round(i, a.settle, a.fill_kv) for i in range(a.rounds)]
    keys = [k for k in rows[0] if k != "per_process"]
    print("| round | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1))
    for i, r in enumerate(rows):
        print(f"| {i} | " + " | ".join(f"{r[k]:.0f}" for k in keys) + " |")
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    print("| median | " + " | ".join(f"{med[k]:.0f}" for k in keys) + " |")
    print(f"load average at start {load0[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
    print("\nThe last round, per process:\n| process | RSS MB | PSS MB |\n|---|---|---|")
    for r in rows[-1]["per_process"]:
        print(f"| {r['what']} | {r['rss_mb']:.0f} | {r['pss_mb']:.0f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"rounds": rows, "median": med, "load": [load0, os.getloadavg()]},
                                           indent=1))


if __name__ == "__main__":
    main()
