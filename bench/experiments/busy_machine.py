#!/usr/bin/env python
"""How the graph's per-token time behaves when the machine is busy, and what cheap priority changes
do to it. Beside a running app, 0, 1 or 2 CPU-bound neighbours (``while True: pass`` at nice 0,
standing for whatever else the machine runs) and, per condition, one of these priority variants:

- ``default``: as the app runs (the engine's step thread at nice 0, Ray's workers at 15);
- ``engine-5``: every thread of the Engine core process at nice -5 (``engine.step_thread_nice: -5``,
  which needs CAP_SYS_NICE);
- ``stages0``: the CPU stages (Ingress, Egress, Preprocess, the Engine actor, the Directory, Serve's
  proxy, HAProxy) at nice 0 instead of Ray's 15;
- ``stages5``: the CPU stages at nice 5;
- ``both``: ``engine-5`` and ``stages0`` together.

Each condition serves ``--requests`` chats of ``--max-tokens`` tokens at 1 and at 8 streams; the
conditions rotate each round. ``--in-process`` instead times the engine's decode step alone
(``decode_steps.py``) under the same neighbours; run it with the app stopped.

    make serve &
    .venv/bin/python bench/experiments/busy_machine.py --url http://127.0.0.1:8000 --out DIR
    .venv/bin/python bench/experiments/busy_machine.py --in-process --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.cmd_client import run_batch, summarize  # noqa: E402
from bench.target import probe  # noqa: E402

STAGES = ("ServeReplica:", "ProxyActor")


def _threads(match: object) -> list[int]:
    """Thread ids of every process ``match(cmdline, name)`` selects."""
    tids = []
    for p in psutil.process_iter():
        try:
            if match(" ".join(p.cmdline()), p.name()):
                tids += [t.id for t in p.threads()]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return tids


def engine_threads() -> list[int]:
    return _threads(lambda cmd, name: "stages.engine.driver.core_process" in cmd)


def stage_threads() -> list[int]:
    return _threads(lambda cmd, name: any(k in name or k in cmd for k in STAGES) or name == "haproxy")


@contextlib.contextmanager
def reniced(tids: list[int], value: int) -> Iterator[None]:
    """Set each thread's nice to ``value``; put back what each had."""
    before = {}
    for tid in tids:
        with contextlib.suppress(OSError):
            before[tid] = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, value)
    try:
        yield
    finally:
        for tid, nice in before.items():
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, nice)


@contextlib.contextmanager
def neighbours(n: int) -> Iterator[None]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def variant(name: str) -> contextlib.AbstractContextManager[None]:
    if name == "engine-5":
        return reniced(engine_threads(), -5)
    if name in ("stages0", "stages5"):
        return reniced(stage_threads(), int(name[-1]))
    if name == "both":
        stack = contextlib.ExitStack()
        stack.enter_context(reniced(engine_threads(), -5))
        stack.enter_context(reniced(stage_threads(), 0))
        return stack
    return contextlib.nullcontext()


async def graph(a: argparse.Namespace) -> list[dict]:
    target = await probe(a.url)
    await run_batch(target, 1, 1, 16, 4)  # warm-up
    conditions = [(n, v) for n in a.neighbours for v in a.variants]
    rows = []
    for rnd in range(a.rounds):
        shift = rnd % len(conditions)
        for n, v in conditions[shift:] + conditions[:shift]:
            with neighbours(n), variant(v):
                for streams in a.streams:
                    load = os.getloadavg()[0]
                    recs, wall = await run_batch(target, streams, a.requests * streams, a.prompt_tokens,
                                                 a.max_tokens)
                    s = summarize(recs, wall)
                    row = {"round": rnd, "neighbours": n, "variant": v, "streams": streams, "load": load, **s}
                    rows.append(row)
                    print(f"round {rnd} neighbours {n} {v:9s} streams {streams}: TPOT p50 "
                          f"{s['tpot_p50_ms']:.1f} ms, gap p50/p95 {s['gap_p50_ms']:.1f}/{s['gap_p95_ms']:.1f} "
                          f"ms, {s['output_tok_s']:.1f} tok/s, load {load:.2f}", flush=True)
    return rows


def in_process(a: argparse.Namespace, out: Path) -> list[dict]:
    rows = []
    for rnd in range(a.rounds):
        for n in (a.neighbours if rnd % 2 == 0 else a.neighbours[::-1]):
            path = out / f"decode_steps_n{n}_r{rnd}.json"
            with neighbours(n):
                subprocess.run([sys.executable, str(ROOT / "bench/experiments/decode_steps.py"),
                                "--streams", ",".join(map(str, a.streams)), "--threads", "1", "--steps", "32",
                                "--repeats", "3", "--json", str(path)], check=True, cwd=ROOT)
            rows.append({"round": rnd, "neighbours": n, "result": json.loads(path.read_text())})
    return rows


def table(rows: list[dict]) -> str:
    keys = sorted({(r["neighbours"], r["variant"], r["streams"]) for r in rows})
    lines = ["| neighbours | variant | streams | TPOT p50 (ms) | event gap p50 / p95 (ms) | tok/s | runs |",
             "|---|---|---|---|---|---|---|"]
    for n, v, s in keys:
        sel = [r for r in rows if (r["neighbours"], r["variant"], r["streams"]) == (n, v, s)]

        def med(k: str, sel: list[dict] = sel) -> float:
            return statistics.median(r[k] for r in sel)

        lines.append(f"| {n} | {v} | {s} | {med('tpot_p50_ms'):.1f} | {med('gap_p50_ms'):.1f} / "
                     f"{med('gap_p95_ms'):.1f} | {med('output_tok_s'):.1f} | {len(sel)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", required=True)
    ap.add_argument("--in-process", action="store_true")
    ap.add_argument("--neighbours", default="0,1,2")
    ap.add_argument("--variants", default="default,engine-5,stages0")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=2, help="requests per stream slot")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    a.neighbours = [int(x) for x in a.neighbours.split(",")]
    a.variants = a.variants.split(",")
    a.streams = [int(x) for x in a.streams.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.in_process:
        rows = in_process(a, out)
        (out / "in_process.json").write_text(json.dumps(rows, indent=1))
        return
    rows = asyncio.run(graph(a))
    (out / "graph.json").write_text(json.dumps(rows, indent=1))
    (out / "graph.md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
