"""py-spy on the Engine replica during 32-stream bursts (active samples only): which of its threads other than the step
thread use CPU, and on what (each thread's samples by function, idle samples dropped).

    .venv/bin/python bench/results/issue11/round12/scripts/replica_profile.py --seconds 25 --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(ROOT))

from bench.bench_graph import graph_side, prompts  # noqa: E402
from bench.burst_pairs import engine_replica_pid  # noqa: E402
from bench.common import ServeApp  # noqa: E402
from stages.config import EngineSettings  # noqa: E402


async def bursts(url: str, until: float) -> int:
    n = 0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        one = graph_side(client, url)
        await one(0, "warm up", 4)
        while time.monotonic() < until:
            await asyncio.gather(*[one(1000 + i, t, 128) for i, t in enumerate(prompts(32))])
            n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=25)
    p.add_argument("--out", default="/tmp/replica_profile")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = EngineSettings(num_threads=1, max_num_seqs=64, max_num_batched_tokens=512)
    app = ServeApp({"engine": settings.model_dump(), "http": {"keepalive_interval_s": 5.0}})
    try:
        pid = engine_replica_pid()
        # Start the bursts first, profile once they run.
        loop = asyncio.new_event_loop()
        task = loop.create_task(bursts(app.url, time.monotonic() + a.seconds + 15))
        loop.run_until_complete(asyncio.sleep(8))
        spy = subprocess.Popen([str(ROOT / ".venv/bin/py-spy"), "record", "-p", str(pid), "-r", "250", "-d",
                                str(int(a.seconds)), "--threads", "--format", "raw", "-o",
                                str(out / "engine_replica.raw")])
        print("bursts:", loop.run_until_complete(task))
        spy.wait()
    finally:
        app.close()


if __name__ == "__main__":
    main()
