"""Shared benchmark helpers: start/stop the real Serve app in-process, an SSE client, statistics."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL_NAME = "SmolLM2-135M-Instruct"


def serve_env(repo: str) -> dict[str, str]:
    """The environment variables `make serve` exports (``make serve-env``), for serving another
    tree or configuration the way `make serve` does."""
    out = subprocess.run(["make", "-s", "--no-print-directory", "-C", repo, "serve-env"], check=True,
                         capture_output=True, text=True).stdout
    env = {}
    for line in out.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.strip("'")
    return env


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpus": os.cpu_count(), "cpu": cpu, "mem_gb": round(mem_gb, 1), "python": platform.python_version(),
            "torch": torch.__version__, "load_avg": os.getloadavg(),
            "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()}


def pct(values: list[float], q: float) -> float:
    """Percentile by linear interpolation (q in 0..100)."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, int(q) - 1))]


class ServeApp:
    """The real application on loopback, started in this process exactly as the tests start it."""

    def __init__(self, args: dict[str, Any], num_cpus: int = 4) -> None:
        from tests.serve_harness import start_app

        self.url, _ = start_app(args, num_cpus=num_cpus)

    def close(self) -> None:
        from tests.serve_harness import stop_app

        stop_app()


@dataclass
class StreamResult:
    ttft: float
    e2e: float
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0
    final: dict[str, Any] | None = None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> StreamResult:
    """POST a streaming completion; time the first content chunk and every later one."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    times: list[float] = []
    final = None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                if chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    ttft = ttft if ttft is not None else now - t0
                    times.append(now)
            else:
                final = chunk
    e2e = time.perf_counter() - t0
    n = final["usage"]["completion_tokens"] if final and final.get("usage") else len(times)
    return StreamResult(ttft=ttft if ttft is not None else e2e, e2e=e2e, token_times=times, num_tokens=n, final=final)
