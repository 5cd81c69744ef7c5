"""Start and stop the real Serve app in this process, on a free loopback port.

Shared by the test session fixture and the benchmarks so both run exactly the same app.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(args: dict[str, Any], num_cpus: int = 4, timeout_s: float = 300) -> tuple[str, str]:
    """Start Ray and the app built from ``args``; wait for ``/health``. Returns (url, session dir)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    import ray
    from ray import serve

    from graph import build_app

    port = _free_port()
    ctx = ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                   runtime_env={"env_vars": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="lifecycle", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return url, ctx.address_info["session_dir"]
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Serve app did not become healthy in {timeout_s:.0f} s")
        time.sleep(1)


def stop_app() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
