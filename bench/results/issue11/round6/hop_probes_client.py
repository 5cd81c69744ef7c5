"""Client of the hop-probe diagnostic (hop_probes.patch applied, app URL in /tmp/r6/url): 20 idle
streamed completions, 50 ms apart, after 3 warm-ups; writes /tmp/r6/idle_client.json."""

import asyncio
import json
import sys
import time

sys.path.insert(0, ".")
import httpx  # noqa: E402

from bench.bench_graph import graph_side, prompts  # noqa: E402


async def main() -> None:
    url = open("/tmp/r6/url").read().strip()
    async with httpx.AsyncClient(timeout=600) as client:
        g = graph_side(client, url)
        for _ in range(3):
            await g(0, "warm up", 4)
        out = []
        for i, t in enumerate(prompts(20)):
            t0 = time.monotonic()
            r = await g(i, t, 8)
            out.append({"t0": t0, "ttft": r["ttft"], "timing": r["timing"]})
            await asyncio.sleep(0.05)
        json.dump(out, open("/tmp/r6/idle_client.json", "w"))


asyncio.run(main())
