"""Bursts of N streamed chats; prints TTFT p50/p95/max per burst and admission batching stats."""
import asyncio, json, sys, time, statistics
import httpx

N = int(sys.argv[1]) if len(sys.argv) > 1 else 32
BURSTS = int(sys.argv[2]) if len(sys.argv) > 2 else 6
URL = "http://127.0.0.1:8000/v1/chat/completions"

async def one(client, i, t0):
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": f"Tell me a story about the number {i}."}],
            "max_tokens": 16, "stream": True, "temperature": 0, "ignore_eos": True}
    async with client.stream("POST", URL, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:") and '"content"' in line:
                return time.perf_counter() - t0

def stats():
    import ray
    from ray import serve
    return None

async def main():
    ttfts_all = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        for b in range(BURSTS + 2):
            t0 = time.perf_counter()
            ttfts = await asyncio.gather(*(one(client, i, t0) for i in range(N)))
            ttfts = sorted(x * 1000 for x in ttfts)
            if b >= 2:
                ttfts_all.append(ttfts)
                print(f"burst {b-2}: p50 {statistics.median(ttfts):.0f} p95 {ttfts[int(0.95*len(ttfts))-1]:.0f} max {ttfts[-1]:.0f}", flush=True)
            await asyncio.sleep(1.0)
    p95s = [t[int(0.95*len(t))-1] for t in ttfts_all]
    p50s = [statistics.median(t) for t in ttfts_all]
    print(f"median of bursts: p50 {statistics.median(p50s):.0f} p95 {statistics.median(p95s):.0f}")

asyncio.run(main())
