"""The Engine deployment: a thin Ray Serve adapter around :class:`AsyncEngine`.

One replica per GPU (CPU fallback). The step loop runs in a child process of the replica
(``engine.core_process``) or on a thread of it. Requests arrive and leave through the transport's
producer side (:mod:`stages.transport.producer`): ``submit`` admits a batch of requests in one call
and answers with each one's acceptance; each step's outputs go straight from the step delivery to
the consumer's mailbox, which ``attach`` streams (one item per step for all of an Egress replica's
requests here). ``abort`` ends requests by id (cancel by id, a stop string in one of several
choices, a caller that gave up): they finish at the next step with ``finish_reason="abort"`` and
their blocks are free. A request whose Egress replica died is aborted by the producer's consumer
watch, since a killed caller cancels nothing. The engine emits its spans (queue wait, prefill,
decode) after the fact from the request's own timestamps, so tracing adds no work to a step.

The replica publishes its state twice: to the router through ``record_routing_stats`` (where to
send the next request), and to the app's Directory every ``report_interval_s`` (``/health`` and
``/metrics`` for every engine replica, and the context length Preprocess must enforce).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from stages.autoscaling import most_replicas
from stages.config import EngineSettings, TracingSettings
from stages.directory.client import directory_client
from stages.engine.core.errors import EngineDeadError
from stages.engine.driver.async_engine import AsyncEngine
from stages.engine.driver.interface import build_driver
from stages.engine.driver.messages import LoopSpec
from stages.engine.driver.priority import step_thread_nice
from stages.routing.router import engine_router_config
from stages.transport.channel import merge_channel_items
from stages.transport.liveness import own_replica_id
from stages.transport.messages import (
    AbortRequest,
    Admission,
    AdmissionBatch,
    ChannelAttach,
    ChannelBatch,
    EngineOutput,
    EngineReport,
    EngineRequest,
)
from stages.transport.producer import Job, Producer

logger = logging.getLogger("lifecycle.engine")


# Serve learns of a dead replica only from a failed health check, so the period bounds how long a
# killed engine goes unreplaced: each check is one cheap call a second.
@serve.deployment(name="Engine", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 1},
                  health_check_period_s=1, health_check_timeout_s=30,
                  request_router_config=engine_router_config())
class EngineDeployment:
    """Owns the model; everything else reaches it through its handle."""

    async def __init__(self, model: str, engine: EngineSettings | None = None,
                       tracing: TracingSettings | None = None, directory: Any = None) -> None:
        """``engine`` and ``tracing`` are the app config's sections as validated (defaults when omitted)."""
        from stages.telemetry import configure_logging, configure_tracing

        configure_logging()
        configure_tracing(tracing, component="engine")
        self.settings = engine if engine is not None else EngineSettings()
        directory = directory_client(directory)
        replicas = most_replicas(serve.get_replica_context()._deployment_config)
        nice = step_thread_nice(self.settings.step_thread_nice, replicas)
        if nice != self.settings.step_thread_nice:
            logger.info("step thread left at the workers' priority: this deployment may run %d engine replicas", replicas)
            self.settings = self.settings.model_copy(update={"step_thread_nice": nice})
        self.replica = own_replica_id()
        # device=auto resolves where the model loads: with a core process, this process never imports torch.
        spec = LoopSpec(model, self.settings, replica=self.replica, tracing=tracing)
        self.async_engine = AsyncEngine(build_driver(spec, child_process=self.settings.core_process),
                                        stall_timeout_s=self.settings.stall_timeout_s)
        # A child process loads the model meanwhile; this loop stays free. Outputs are delivered
        # on the loop Serve runs our calls on.
        await asyncio.to_thread(self.async_engine.start, asyncio.get_running_loop())
        #: Requests in and outputs out (stages.transport.producer); aborts by id go to the engine, so
        #: an aborted request still ends its stream with ``finish_reason="abort"``.
        self.transport = Producer(self.replica, merge=merge_channel_items, directory=directory)
        self.transport.set_end(self._abort_ids)
        self._seq = itertools.count()
        self._last_ttft = 0.0
        self.directory = directory
        self._reporter = asyncio.create_task(self._report_loop()) if directory is not None else None
        logger.info("engine %s ready: %s, max_model_len=%d, %d KV blocks of %d tokens%s", self.replica,
                    model, self.async_engine.max_model_len, self.async_engine.num_blocks, self.settings.block_size,
                    f", step loop in process {self.async_engine.driver.pid}")

    def _check_alive(self) -> None:
        problem = self.async_engine.health_problem()
        if problem is not None:
            raise EngineDeadError(problem + "; the replica will be replaced")

    async def submit(self, batch: AdmissionBatch) -> list[Admission]:
        """Admit every request of ``batch``; answer with each one's acceptance item (its first,
        empty outputs naming this replica) or its refusal (a full queue: 429, retried elsewhere)."""
        return await self.transport.submit(batch, self._job)

    def _job(self, request: EngineRequest) -> Job:
        consumer = request.consumer
        return Job(request.choice_ids()[0], consumer, self._run(request, consumer), wrap=list)

    async def _run(self, request: EngineRequest, consumer: str) -> AsyncIterator[list[EngineOutput]]:
        """The request's acceptance; every later output goes from the step delivery to the
        consumer's mailbox. Closing it early aborts every unfinished choice."""
        self._check_alive()
        sink = functools.partial(self.transport.push, consumer)
        async for outs in self.async_engine.generate(request, sink=sink):
            yield outs

    async def attach(self, request: ChannelAttach) -> AsyncIterator[ChannelBatch]:
        """The channel of ``request.consumer`` on this replica (routed here by name): one item per
        engine step for all its requests; ends a moment after the last of them ends."""
        async for batch in self.transport.attach(request.consumer):
            yield batch

    async def abort(self, request: AbortRequest) -> None:
        """Abort by engine request id (no-op if unknown or finished); blocks are free at the next
        step. An abort naming another replica (draining) is forwarded to the directory, where that
        replica takes it with its next report."""
        await self.transport.abort(request)

    def _abort_ids(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.async_engine.abort(rid)

    def _abort_forwarded(self, request_ids: list[str]) -> None:
        self._abort_ids(request_ids)
        if request_ids:
            logger.info("aborted %d request(s) forwarded by the directory", len(request_ids))

    def _report(self) -> EngineReport:
        return EngineReport(replica=self.replica, node_id=ray.get_runtime_context().get_node_id(),
                            max_model_len=self.async_engine.max_model_len,
                            healthy=self.async_engine.health_problem() is None,
                            stats={**self.async_engine.snapshot(), **self.async_engine.loop_counters(),
                                   **self.transport.stats()},
                            report_interval_s=self.settings.report_interval_s)

    async def stats(self) -> dict[str, Any]:
        """This replica's gauges and counters (tests; ``/metrics`` reads every replica's report)."""
        return {**self._report().stats, "replica": self.replica}

    async def info(self) -> dict[str, Any]:
        return {"max_model_len": self.async_engine.max_model_len, "alive": self.async_engine.is_alive,
                "replica": self.replica}

    def record_routing_stats(self) -> dict[str, Any]:
        """What :class:`stages.routing.router.EngineRouter` ranks replicas by (Serve calls this):
        the scheduler's state and a summary of the prefix cache."""
        return {**self.async_engine.snapshot(), "seq": next(self._seq),
                "prefix": self.async_engine.prefix_summary()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's saturation signals for :func:`stages.autoscaling.engine_policy`: waiting
        requests, KV-cache usage, and the mean engine-side TTFT of requests that got their first
        token since the last call (held while busy with none new, 0 when idle)."""
        from stages.autoscaling import KV_USAGE, TTFT, WAITING

        ttfts = self.async_engine.take_ttfts()
        stats = self.async_engine.stats()
        if ttfts:
            self._last_ttft = sum(ttfts) / len(ttfts)
        elif not stats.num_running and not stats.num_waiting:
            self._last_ttft = 0.0
        return {WAITING: float(stats.num_waiting), KV_USAGE: stats.kv_cache_usage, TTFT: self._last_ttft}

    async def _report_loop(self) -> None:
        interval = self.settings.report_interval_s
        while True:
            try:
                self._abort_forwarded(await self.directory.report(self._report()) or [])
            except Exception as exc:  # noqa: BLE001 - the directory restarts; keep reporting
                logger.warning("engine report to the directory failed: %r", exc)
            await asyncio.sleep(interval)

    async def inject_fault(self, kind: str = "step_exception", after_steps: int = 0) -> None:
        """Tests only: make an upcoming engine step raise (:mod:`stages.engine.driver.faults`). Refused
        unless ``engine.fault_injection`` (or ``LIFECYCLE_FAULT_INJECTION=1``) enabled it."""
        self.async_engine.arm_fault(kind, after_steps)

    def __del__(self) -> None:
        """Serve's graceful shutdown: stop the step loop before this process goes (pending requests
        are aborted; a core process would also stop on its own once this process is gone)."""
        engine = getattr(self, "async_engine", None)
        if engine is not None:
            engine.shutdown(timeout=5.0)

    def check_health(self) -> None:
        """Serve replaces the replica when this raises: the step loop died, or has had work and
        made no progress for ``engine.stall_timeout_s``."""
        problem = self.async_engine.health_problem()
        if problem is not None:
            raise RuntimeError(problem)
