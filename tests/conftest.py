"""Shared fixtures. The real Serve app starts once per test session (it takes ~20-40 s here)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.otlp_receiver import OTLPReceiver

MODEL_NAME = "SmolLM2-135M-Instruct"

#: App configuration used by the integration tests: small limits so 413/429/heartbeats are
#: reachable quickly, tracing on to a real OTLP receiver.
TEST_ARGS: dict[str, Any] = {
    "model": "embedded:smollm2-135m-instruct",
    "engine": {"max_num_seqs": 8, "max_waiting_requests": 8, "max_num_batched_tokens": 256,
               "kv_cache_memory_gb": 0.5},
    "http": {"max_body_bytes": 65536, "keepalive_interval_s": 0.5},
    "tracing": {"enabled": True, "sampling_ratio": 1.0},
}


@dataclass
class ServeApp:
    url: str
    otlp: OTLPReceiver
    args: dict[str, Any]
    #: Ray's session directory.
    session_dir: str = ""
    #: The Ingress's per-request JSON-lines log (``http.request_log_file``).
    request_log: str = ""

    def engine_stats(self) -> dict[str, Any]:
        """The engine's own stats, straight from its replica.

        With ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` a handle's router runs on the caller's event loop
        (``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP`` defaults to 0), so a blocking ``.result()`` from
        plain test code fails with "No event loop running". The call therefore runs on one private
        event loop thread, where the handle is created once and reused.
        """
        return asyncio.run_coroutine_threadsafe(_engine_stats(), _handle_loop()).result(timeout=10)


_LOOP: asyncio.AbstractEventLoop | None = None
_ENGINE_HANDLE: Any = None


def _handle_loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
        threading.Thread(target=_LOOP.run_forever, name="serve-handle-loop", daemon=True).start()
    return _LOOP


async def _engine_stats() -> dict[str, Any]:
    global _ENGINE_HANDLE
    from ray import serve

    if _ENGINE_HANDLE is None:
        _ENGINE_HANDLE = serve.get_deployment_handle("Engine", app_name="lifecycle")
    return await _ENGINE_HANDLE.stats.remote()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_app() -> Iterator[ServeApp]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    import ray
    from ray import serve

    from graph import build_app

    otlp = OTLPReceiver()
    import tempfile

    request_log = os.path.join(tempfile.mkdtemp(prefix="lifecycle-test-"), "requests.jsonl")
    args = {**TEST_ARGS, "tracing": {**TEST_ARGS["tracing"], "otlp_endpoint": otlp.endpoint},
            "http": {**TEST_ARGS["http"], "request_log_file": request_log}}
    port = _free_port()
    ctx = ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="lifecycle", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the Serve app did not become healthy in 300 s")
        time.sleep(1)
    try:
        yield ServeApp(url=url, otlp=otlp, args=args, session_dir=ctx.address_info["session_dir"],
                       request_log=request_log)
    finally:
        serve.shutdown()
        ray.shutdown()
        otlp.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that use the real Serve app get the ``serve`` marker (``-m "not serve"`` skips them)."""
    for item in items:
        if "serve_app" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.serve)
