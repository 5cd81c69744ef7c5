"""Shared fixtures. The real Serve app starts once per test session (it takes ~20-40 s here)."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.otlp_receiver import OTLPReceiver
from tests.serve_harness import start_app, stop_app

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


@pytest.fixture(scope="session")
def serve_app() -> Iterator[ServeApp]:
    otlp = OTLPReceiver()
    request_log = os.path.join(tempfile.mkdtemp(prefix="lifecycle-test-"), "requests.jsonl")
    args = {**TEST_ARGS, "tracing": {**TEST_ARGS["tracing"], "otlp_endpoint": otlp.endpoint},
            "http": {**TEST_ARGS["http"], "request_log_file": request_log}}
    url, session_dir = start_app(args)
    try:
        yield ServeApp(url=url, otlp=otlp, args=args, session_dir=session_dir, request_log=request_log)
    finally:
        stop_app()
        otlp.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that use the real Serve app get the ``serve`` marker (``-m "not serve"`` skips them)."""
    for item in items:
        if "serve_app" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.serve)
