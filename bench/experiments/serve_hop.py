#!/usr/bin/env python
"""What one Serve handle call costs on this machine, idle and back to back, with nothing of ours in it.

Two bare deployments in a private Ray: ``Caller`` times, in its own process, ``await
callee.ping.remote(i)`` (a unary round trip: request and reply, two messages) and the first item of
``callee.gen.remote(1)`` (a streaming call), with a pause between calls of each ``--gaps`` value. A
pause lets every process of the path fall asleep, as between the requests of an idle server; the
cost of waking them is part of each message then. The app's idle TTFT crosses eight such messages
(proxy → Ingress; Ingress's body pull from the proxy and its reply; Preprocess there and back;
Ingress → Egress → Engine; the first token back through Egress; Ingress → proxy).

    .venv/bin/python bench/experiments/serve_hop.py                       # the transport `make serve` uses
    RAY_SERVE_THROUGHPUT_OPTIMIZED=0 .venv/bin/python bench/experiments/serve_hop.py   # Ray's actor transport
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["RAY_ADDRESS"] = "local"  # a private Ray: never join a cluster someone else started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=100, help="timed calls per gap and kind")
    p.add_argument("--gaps", default="0,0.002,0.02", help="pauses between calls, seconds")
    a = p.parse_args()
    gaps = [float(g) for g in a.gaps.split(",")]

    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class Callee:
        async def ping(self, x: int) -> int:
            return x

        async def gen(self, n: int) -> Any:
            for i in range(n):
                yield i

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    class Caller:
        async def __init__(self, callee: Any) -> None:  # async: a handle needs the replica's loop
            self.callee = callee
            self.stream = callee.options(stream=True)

        async def run(self, calls: int, gap: float) -> dict[str, float]:
            unary, first = [], []
            for i in range(calls):
                t0 = time.perf_counter()
                await self.callee.ping.remote(i)
                unary.append(time.perf_counter() - t0)
                await asyncio.sleep(gap)
            for _ in range(calls):
                t0 = time.perf_counter()
                async for _ in self.stream.gen.remote(1):
                    first.append(time.perf_counter() - t0)
                await asyncio.sleep(gap)
            return {"unary_ms": 1e3 * statistics.median(unary), "first_item_ms": 1e3 * statistics.median(first)}

    handle = serve.run(Caller.bind(Callee.bind()), name="hop", route_prefix=None)

    async def drive() -> None:
        await handle.run.remote(20, 0.0)  # warm-up: routers, connections
        transport = "gRPC" if os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1" else "Ray actor calls"
        print(f"Serve handle calls ({transport}), medians of {a.calls}:")
        for gap in gaps:
            r = await handle.run.remote(a.calls, gap)
            print(f"  {gap * 1e3:5.0f} ms between calls: unary round trip {r['unary_ms']:.2f} ms, "
                  f"first streamed item {r['first_item_ms']:.2f} ms", flush=True)

    try:
        asyncio.run(drive())
    finally:
        ray.shutdown()  # takes Serve with it (serve.shutdown() wants the handles' event loop)


if __name__ == "__main__":
    main()
