import asyncio, sys, time
sys.path.insert(0, "/work/main")
import httpx
from bench.common import MODEL_NAME
from bench.target import chat_body, stream_chat
async def worker(client, i, n):
    for j in range(n):
        r = await stream_chat(client, chat_body(MODEL_NAME, f"Write a detailed essay about topic {i} {j}:", int(sys.argv[3]) if len(sys.argv) > 3 else 16))
        assert not r.error, r.error
async def main():
    c = int(sys.argv[1]); n = int(sys.argv[2])
    async with httpx.AsyncClient(base_url="http://127.0.0.1:8000", timeout=600, limits=httpx.Limits(max_connections=c+4)) as client:
        t = time.time()
        await asyncio.gather(*[worker(client, i, n) for i in range(c)])
        print(f"{c*n} requests in {time.time()-t:.1f}s")
asyncio.run(main())
