"""Read Prometheus text from ``/metrics``: this server's ``lifecycle:*`` names, vLLM's ``vllm:*`` and
llama.cpp's ``llamacpp:*`` where they mean the same thing."""

from __future__ import annotations

import re
from typing import Any

import httpx

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")

#: Our name → the same quantity on other servers (first match wins).
ALIASES: dict[str, list[str]] = {
    "num_requests_running": ["lifecycle:num_requests_running", "vllm:num_requests_running",
                             "llamacpp:requests_processing"],
    "num_requests_waiting": ["lifecycle:num_requests_waiting", "vllm:num_requests_waiting",
                             "llamacpp:requests_deferred"],
    "kv_cache_usage_perc": ["lifecycle:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                            "llamacpp:kv_cache_usage_ratio"],
    "generation_tokens": ["lifecycle:generation_tokens_total", "lifecycle:generation_tokens",
                          "vllm:generation_tokens_total", "llamacpp:tokens_predicted_total"],
    "tokens_after_client_gone": ["lifecycle:tokens_after_client_gone_total", "lifecycle:tokens_after_client_gone"],
}


def parse(text: str) -> dict[str, float]:
    """Sum each metric name over its label sets (one engine replica or many)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        except ValueError:
            continue
    return out


def pick(metrics: dict[str, float], key: str) -> float | None:
    for name in ALIASES.get(key, [key]):
        if name in metrics:
            return metrics[name]
    return None


async def scrape(client: httpx.AsyncClient) -> dict[str, Any]:
    r = await client.get("/metrics", timeout=10)
    r.raise_for_status()
    m = parse(r.text)
    return {k: pick(m, k) for k in ALIASES}
