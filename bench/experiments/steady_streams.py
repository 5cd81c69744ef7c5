#!/usr/bin/env python
"""A steady load of exactly N concurrent chat streams for a while: each client starts its next
request as soon as its last one ends, so the server always holds N streams (for watching how the
stages autoscale at a given concurrency).

    .venv/bin/python bench/experiments/steady_streams.py --url "$(cat /tmp/bench_url)" --streams 32 --seconds 50
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import MODEL_NAME  # noqa: E402
from bench.target import chat_body, stream_chat  # noqa: E402


async def run(url: str, streams: int, seconds: float, max_tokens: int) -> tuple[int, int]:
    done = errors = 0
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=streams + 8)) as c:
        async def client(i: int) -> None:
            nonlocal done, errors
            while time.monotonic() < end:
                rec = await stream_chat(c, chat_body(MODEL_NAME, f"Write an essay about topic {i}:", max_tokens))
                done += 1
                errors += rec.error is not None

        await asyncio.gather(*[client(i) for i in range(streams)])
    return done, errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--seconds", type=float, default=50)
    p.add_argument("--max-tokens", type=int, default=128)
    a = p.parse_args()
    done, errors = asyncio.run(run(a.url, a.streams, a.seconds, a.max_tokens))
    print(f"{done} requests, {errors} errors, {a.streams} streams for {a.seconds:.0f} s")


if __name__ == "__main__":
    main()
