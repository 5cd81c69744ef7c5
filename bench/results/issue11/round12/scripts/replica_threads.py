"""CPU seconds of every thread of the Engine replica over 32-stream bursts, by thread name.

    .venv/bin/python bench/results/issue11/round12/scripts/replica_threads.py --bursts 3
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(ROOT))

from bench.bench_graph import graph_side, prompts  # noqa: E402
from bench.burst_pairs import engine_replica_pid  # noqa: E402
from bench.common import ServeApp  # noqa: E402
from stages.config import EngineSettings  # noqa: E402


def threads(pid: int) -> dict[int, tuple[str, float]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            out[int(tid)] = (name, int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9)
        except OSError:
            continue
    return out


async def main_async(url: str, bursts: int, pid: int) -> None:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        one = graph_side(client, url)
        await one(0, "warm up", 4)
        before = threads(pid)
        for _ in range(bursts):
            await asyncio.gather(*[one(1000 + i, t, 128) for i, t in enumerate(prompts(32))])
        after = threads(pid)
    by_name: collections.Counter[str] = collections.Counter()
    for tid, (name, cpu) in after.items():
        # Python threads carry no OS name of their own here: keep them apart by id.
        by_name[f"{name} ({tid})" if name.startswith("ray::") else name] += cpu - before.get(tid, (name, 0.0))[1]
    for name, cpu in by_name.most_common():
        if cpu > 0.001:
            print(f"{cpu / bursts:8.3f} s/burst  {name}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bursts", type=int, default=3)
    a = p.parse_args()
    settings = EngineSettings(num_threads=1, max_num_seqs=64, max_num_batched_tokens=512)
    app = ServeApp({"engine": settings.model_dump(), "http": {"keepalive_interval_s": 5.0}})
    try:
        asyncio.run(main_async(app.url, a.bursts, engine_replica_pid()))
    finally:
        app.close()


if __name__ == "__main__":
    main()
