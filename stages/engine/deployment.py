"""The Engine deployment: a thin Ray Serve adapter around :class:`AsyncEngine`.

One replica per GPU (CPU fallback). The step loop runs on its own thread inside the replica;
``generate`` streams a request's coalesced outputs. Cancelling the stream (the caller went away, or
Egress found a stop string) runs ``AsyncEngine.generate``'s ``finally``, which aborts the request
by id so its blocks are free at the next step. The engine emits its spans (queue wait, prefill,
decode) after the fact from the request's own timestamps, so tracing adds no work to a step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from stages.config import EngineSettings
from stages.engine.async_engine import AsyncEngine
from stages.engine.engine import LLMEngine
from stages.errors import EngineUnavailableError
from stages.protocol import EngineOutput, EngineRequest

logger = logging.getLogger("lifecycle.engine")


@serve.deployment(name="Engine", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 1},
                  health_check_period_s=5, health_check_timeout_s=30)
class EngineDeployment:
    """Owns the model; everything else reaches it through this handle."""

    def __init__(self, model: str, engine: dict[str, Any] | None = None,
                 tracing: dict[str, Any] | None = None) -> None:
        from stages.engine.tracing import EngineTracer
        from stages.telemetry import configure_logging, configure_tracing

        configure_logging()
        configure_tracing(tracing, component="engine")
        self.settings = EngineSettings(**(engine or {}))
        self.engine = LLMEngine.from_config(self.settings.to_engine_config(model))
        self.tracer = EngineTracer()
        self.engine.on_finish = self.tracer.on_finish
        self.async_engine = AsyncEngine(self.engine, max_waiting=self.settings.max_waiting_requests)
        logger.info("engine ready: %s, max_model_len=%d, %d KV blocks of %d tokens",
                    model, self.engine.max_model_len, self.engine.block_manager.num_blocks,
                    self.engine.config.block_size)

    def _ensure_started(self) -> None:
        # Started lazily so the step thread delivers outputs to the loop Serve runs our calls on.
        if self.async_engine._thread is None:
            self.async_engine.start(asyncio.get_running_loop())
        if self.async_engine.dead is not None:
            raise EngineUnavailableError("the engine step loop has died; the replica will restart")

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream the outputs of one request (first token at once, then coalesced)."""
        self._ensure_started()
        async for out in self.async_engine.generate(request):
            yield out

    async def abort(self, request_id: str) -> None:
        """Abort by id (no-op if unknown or finished); blocks are free at the next step."""
        self._ensure_started()
        self.async_engine.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        """Gauges and counters for ``/metrics`` and tests."""
        self._ensure_started()
        return {**self.async_engine.stats().to_dict(), **self.async_engine.cancellation_stats(),
                **self.tracer.counters()}

    async def info(self) -> dict[str, Any]:
        self._ensure_started()
        return {"max_model_len": self.engine.max_model_len, "alive": self.async_engine.is_alive}

    def check_health(self) -> None:
        """Serve restarts the replica when this raises."""
        if self.async_engine.dead is not None:
            raise RuntimeError(f"engine step loop died: {self.async_engine.dead!r}")
