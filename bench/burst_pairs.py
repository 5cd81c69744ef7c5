#!/usr/bin/env python
"""The graph against the same engine in-process at N streams, burst by burst, with the engine's
step thread accounted on both sides.

``bench_graph.py`` alternates whole suites (idle, 1 stream, N streams) round by round; on a noisy
2-core machine its three N-stream bursts can differ by 25% on the *same* side. Here only the
N-stream burst runs, in pairs (in-process then graph, the order flipping every pair), so each
ratio compares bursts a few seconds apart; the median of the per-pair ratios is the figure.

For every burst the step thread's own counters are read from ``/proc`` (in this process for the
in-process engine, in the Engine replica's process for the graph): time on a CPU, time waiting on
the run queue, voluntary and involuntary context switches. That splits a slower graph into "the
step thread computed longer" and "the step thread was off the CPU".

    .venv/bin/python bench/burst_pairs.py --pairs 8 --out bench/results/burst_pairs.json
    .venv/bin/python bench/burst_pairs.py --pairs 6 --worker-nice 15   # + the graph with Ray's threads reniced
    .venv/bin/python bench/burst_pairs.py --pairs 6 --pin              # + the step thread alone on a CPU
    .venv/bin/python bench/burst_pairs.py --pairs 8 --core-process     # the graph's step loop in its own process
    .venv/bin/python bench/burst_pairs.py --pairs 6 --local-core       # + the step loop in a child of this process, no Serve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_graph import graph_side, inproc_side, prompts  # noqa: E402
from bench.common import ServeApp, machine  # noqa: E402
from stages.config import EngineSettings  # noqa: E402
from stages.model_info import EMBEDDED_MODEL, load_tokenizer  # noqa: E402

#: The graph again with every Ray worker thread but the step thread at ``--worker-nice``.
NICE_SIDE = "graph_workers_reniced"
#: The graph again with the step thread alone on the last CPU and everything else on the others.
PIN_SIDE = "graph_step_thread_pinned"
#: The same engine as in-process, its step loop in a core process of this one: the graph's child
#: without the graph (is a slower graph the child itself, or the stages beside it?).
LOCAL_CORE_SIDE = "local_core_process"


def thread_counters(pid: int, tid: int) -> dict[str, float]:
    """On-CPU and run-queue seconds and context switches of one thread, from ``/proc``."""
    run_ns, wait_ns, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines()
                  if ":\t" in line)
    return {"on_cpu_s": int(run_ns) / 1e9, "runqueue_s": int(wait_ns) / 1e9,
            "voluntary": float(status["voluntary_ctxt_switches"]),
            "involuntary": float(status["nonvoluntary_ctxt_switches"])}


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU nanoseconds so far of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = float(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except OSError:
            continue
    return out


def renice_ray_workers(nice: int, keep: int) -> list[tuple[int, int]]:
    """Give every thread of every Ray worker process (``ray::…``) below ``nice`` that nice value,
    except the thread ``keep`` (the engine's step thread); returns ``[(tid, old nice)]`` to undo.

    Why: Ray starts a worker's Python threads at nice 15 but its C++ threads (gRPC pollers,
    event engines, the core worker's io) stay at 0, the step thread's own priority."""
    changed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if not Path(f"/proc/{entry}/cmdline").read_bytes().startswith(b"ray::"):
                continue
            tids = [int(t) for t in os.listdir(f"/proc/{entry}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                old = os.getpriority(os.PRIO_PROCESS, tid)
                if tid != keep and old < nice:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
                    changed.append((tid, old))
            except OSError:
                continue
    return changed


def restore_nice(changed: list[tuple[int, int]]) -> None:
    for tid, old in changed:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, old)
        except OSError:
            pass  # the thread is gone


def pin_machine(keep: int) -> list[tuple[int, set[int]]]:
    """Give the thread ``keep`` (the engine's step thread) the last CPU to itself: every other
    thread of every process that may move goes to the other CPUs. Returns ``[(tid, old affinity)]``
    to undo. Why: the step thread computes ~12% longer beside the stages (round 6) with the same
    profile; if sharing a core's caches and its time slices with them is the cause, this removes it."""
    cpus = sorted(os.sched_getaffinity(0))
    step_cpu, others = {cpus[-1]}, set(cpus[:-1])
    changed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{entry}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                old = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, step_cpu if tid == keep else others)
                changed.append((tid, old))
            except OSError:
                continue  # gone, or a kernel thread bound to its CPU
    return changed


def unpin(changed: list[tuple[int, set[int]]]) -> None:
    for tid, old in changed:
        try:
            os.sched_setaffinity(tid, old)
        except OSError:
            pass  # the thread is gone


def engine_replica_pid() -> int:
    """The process of the local Engine replica's step loop (one engine replica: this app's): the
    replica's own, or its engine core process (``engine.core_process``)."""
    replica = None
    commands = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                commands[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
    for pid, cmd in commands.items():
        if b"ServeReplica:lifecycle:Engine" in cmd:
            replica = pid
    if replica is None:
        raise SystemExit("no Engine replica process found")
    for pid, cmd in commands.items():
        if b"stages.engine.driver.core_process" in cmd:
            try:
                if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == replica:
                    return pid
            except (OSError, ValueError):
                continue
    return replica


async def burst(one: Any, streams: int, tokens: int, pid: int, tid: int) -> dict[str, float]:
    texts = prompts(streams)
    before = thread_counters(pid, tid)
    threads_before = thread_cpu(pid)
    t0 = time.perf_counter()
    results = await asyncio.gather(*[one(1000 + i, texts[i], tokens) for i in range(streams)])
    wall = time.perf_counter() - t0
    after = thread_counters(pid, tid)
    threads_after = thread_cpu(pid)
    total = sum(r["n"] for r in results)
    assert total == streams * tokens, total
    # Every other thread of the engine's process: in the replica its event loop and Ray's threads
    # (what can hold the GIL the step thread waits for); in-process the benchmark's own loop and client.
    rest = sum(ns - threads_before.get(t, 0.0) for t, ns in threads_after.items() if t != tid) / 1e9
    return {"wall_s": wall, "tok_s": total / wall, **{k: after[k] - before[k] for k in after},
            "process_rest_cpu_s": rest}


async def run(a: argparse.Namespace, settings: EngineSettings, url: str) -> dict[str, list[dict[str, float]]]:
    engine, inproc = await inproc_side(settings, load_tokenizer(EMBEDDED_MODEL))
    engines = [engine]
    sides: dict[str, list[dict[str, float]]] = {"in_process": [], "graph": []}
    try:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
            graph = graph_side(client, url)
            await inproc(0, "warm up", 4)
            # The replica's step thread: the one that gains the most CPU time over a short burst
            # (its main thread has more in all, from loading the model).
            pid = engine_replica_pid()
            before = thread_cpu(pid)
            await asyncio.gather(*[graph(i, text, 16) for i, text in enumerate(prompts(a.streams))])
            after = thread_cpu(pid)
            step_tid = max(after, key=lambda t: after[t] - before.get(t, 0.0))
            where = {"in_process": (inproc, os.getpid(), engine.driver.thread.native_id),
                     "graph": (graph, pid, step_tid)}
            names = ["in_process", "graph"]
            if a.worker_nice is not None:
                names.append(NICE_SIDE)
                sides[NICE_SIDE] = []
                where[NICE_SIDE] = where["graph"]
            if a.pin:
                names.append(PIN_SIDE)
                sides[PIN_SIDE] = []
                where[PIN_SIDE] = where["graph"]
            if a.local_core:
                local, local_one = await local_core_side(settings, load_tokenizer(EMBEDDED_MODEL))
                engines.append(local)
                await local_one(0, "warm up", 4)
                core_pid = local.driver.pid
                assert core_pid is not None
                before = thread_cpu(core_pid)
                await asyncio.gather(*[local_one(i, text, 16) for i, text in enumerate(prompts(a.streams))])
                after = thread_cpu(core_pid)
                local_tid = max(after, key=lambda t: after[t] - before.get(t, 0.0))
                names.append(LOCAL_CORE_SIDE)
                sides[LOCAL_CORE_SIDE] = []
                where[LOCAL_CORE_SIDE] = (local_one, core_pid, local_tid)
            for i in range(a.pairs):
                order = names[i % len(names):] + names[:i % len(names)]  # each side leads in turn
                for side in order:
                    one, p, t = where[side]
                    changed = renice_ray_workers(a.worker_nice, keep=t) if side == NICE_SIDE else []
                    pinned = pin_machine(keep=t) if side == PIN_SIDE else []
                    try:
                        res = await burst(one, a.streams, a.tokens, p, t)
                    finally:
                        restore_nice(changed)
                        unpin(pinned)
                    res["threads_reniced"] = float(len(changed))
                    res["threads_pinned"] = float(len(pinned))
                    sides[side].append(res)
                    print(f"pair {i} {side}: " + json.dumps({k: round(v, 2) for k, v in res.items()}), flush=True)
    finally:
        for e in engines:
            e.shutdown()
    return sides


async def local_core_side(settings: EngineSettings, tok: Any) -> tuple[Any, Any]:
    """The in-process side's engine with its step loop in a core process (``engine.core_process``)
    of this process: the graph's child, with no Serve around it."""
    from bench.bench_graph import inproc_one
    from stages.engine.driver.async_engine import AsyncEngine
    from stages.engine.driver.core_process import ChildProcessDriver
    from stages.engine.driver.messages import LoopSpec

    engine = AsyncEngine(ChildProcessDriver(LoopSpec(EMBEDDED_MODEL, settings)))
    loop = asyncio.get_running_loop()
    await asyncio.to_thread(engine.start, loop)

    def one(i: int, text: str, mt: int) -> Any:
        return inproc_one(engine, f"c{i}-{time.monotonic_ns()}", tok(text)["input_ids"], mt)

    return engine, one


def summary(sides: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    ratios = [g["tok_s"] / p["tok_s"] for p, g in zip(sides["in_process"], sides["graph"], strict=True)]
    med = {side: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for side, runs in sides.items()}
    for m in med.values():
        m["on_cpu_share_of_wall"] = m["on_cpu_s"] / m["wall_s"]
    out: dict[str, Any] = {"graph_over_in_process_per_pair": [round(r, 3) for r in ratios],
                           "graph_over_in_process_median": statistics.median(ratios),
                           "step_thread_cpu_graph_over_in_process": med["graph"]["on_cpu_s"] / med["in_process"]["on_cpu_s"]}
    for extra in (NICE_SIDE, PIN_SIDE, LOCAL_CORE_SIDE):
        if extra not in sides:
            continue
        ratio = [g["tok_s"] / p["tok_s"] for p, g in zip(sides["in_process"], sides[extra], strict=True)]
        out[f"{extra}_over_in_process_per_pair"] = [round(r, 3) for r in ratio]
        out[f"{extra}_over_in_process_median"] = statistics.median(ratio)
        out[f"step_thread_cpu_{extra}_over_in_process"] = med[extra]["on_cpu_s"] / med["in_process"]["on_cpu_s"]
    return {**out, "medians": med}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="engine torch threads, both sides")
    p.add_argument("--worker-nice", type=int, default=None,
                   help="also run the graph with every Ray worker thread but the engine's step thread at this "
                        "nice value (e.g. 15, what Ray gives a worker's Python threads), undone after each burst")
    p.add_argument("--pin", action="store_true",
                   help="also run the graph with the engine's step thread alone on the last CPU and every other "
                        "thread on the machine on the others, undone after each burst")
    p.add_argument("--core-process", action="store_true",
                   help="the graph's engine runs its step loop in a child process (engine.core_process: true)")
    p.add_argument("--local-core", action="store_true",
                   help="also run the in-process engine with its step loop in a core process of this one "
                        "(no Serve): the graph's child without the stages beside it")
    p.add_argument("--out", default="bench/results/burst_pairs.json")
    a = p.parse_args()
    env = machine()
    print("machine:", env, flush=True)
    settings = EngineSettings(num_threads=a.threads, max_num_seqs=64, max_num_batched_tokens=512)
    graph_engine = {**settings.model_dump(), "core_process": a.core_process}
    app = ServeApp({"engine": graph_engine, "http": {"keepalive_interval_s": 5.0}})
    try:
        sides = asyncio.run(run(a, settings, app.url))
    finally:
        app.close()
    out = {"args": vars(a), "machine": env, **summary(sides), "runs": sides}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k not in ("runs", "machine", "args")}, indent=1))


if __name__ == "__main__":
    main()
