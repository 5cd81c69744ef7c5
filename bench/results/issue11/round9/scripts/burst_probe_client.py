import asyncio, json, sys, time
sys.path.insert(0, "/work/main")
import httpx
from bench.common import MODEL_NAME
from bench.target import chat_body, stream_chat
TOPICS = ["rivers", "volcanoes", "bridges", "bees", "libraries", "glaciers", "trains", "forests"]
async def burst(client, n, tag):
    t0 = time.monotonic()
    recs = await asyncio.gather(*[stream_chat(client, chat_body(MODEL_NAME, f"Write a detailed essay about {TOPICS[i % 8]} number {i} (burst {tag}):", 16)) for i in range(n)])
    return t0, [r.ttft for r in recs], [r.server_timing for r in recs]
async def main():
    n = int(sys.argv[1]); bursts = int(sys.argv[2])
    out = []
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url="http://127.0.0.1:8000", timeout=600, limits=limits) as client:
        await burst(client, 4, -1)
        for b in range(bursts):
            await asyncio.sleep(2.0)
            t0, ttfts, st = await burst(client, n, b)
            out.append({"t0": t0, "ttfts": ttfts, "st": st})
    json.dump(out, open("/tmp/burst_client.json", "w"))
asyncio.run(main())
