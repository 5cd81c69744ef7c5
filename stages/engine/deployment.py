"""The Engine deployment: a thin Ray Serve adapter around :class:`AsyncEngine`.

One replica per GPU (CPU fallback). The step loop runs on its own thread inside the replica, or
(``engine.core_process``) alone in a child process of it (:mod:`stages.engine.driver.core_process`);
``submit`` admits a batch of requests in one call (:mod:`stages.transport.admission`) and answers with each
one's acceptance, while their tokens go to the consumer's mailbox, which ``attach`` streams: one
item per step for all of that Egress replica's requests (:mod:`stages.transport.channel`). ``generate`` is
the per-request path: it streams all choices of a request, coalesced, or (``request.channel``)
only their acceptance. Cancelling the stream (the caller went
away, or a stop string ended every choice) runs ``AsyncEngine.generate``'s ``finally``, which
aborts the request by id so its blocks are free at the next step (and a stream whose reading Egress
replica died is aborted by :class:`stages.transport.liveness.ConsumerWatch`, since a killed caller cancels
nothing); ``abort`` ends chosen requests
from outside the stream (cancel by id, a stop string in one of several choices), routed here by
:class:`stages.routing.EngineRouter`. The engine emits its spans (queue wait, prefill, decode)
after the fact from the request's own timestamps, so tracing adds no work to a step.

The replica publishes its state twice: to the router through ``record_routing_stats`` (where to
send the next request), and to the app's Directory every ``report_interval_s`` (``/health`` and
``/metrics`` for every engine replica, and the context length Preprocess must enforce).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from stages.transport.admission import AdmittedStreams
from stages.transport.channel import ChannelHub, merge_channel_items
from stages.config import EngineSettings, TracingSettings
from stages.engine.driver.async_engine import AsyncEngine
from stages.engine.driver.core_process import CoreProcess, CoreSpec
from stages.engine.core.engine import LLMEngine
from stages.engine.core.errors import EngineDeadError
from stages.engine.driver.faults import StepFaults
from stages.transport.liveness import ConsumerWatch, own_replica_id
from stages.transport.messages import (
    AbortRequest,
    Admission,
    AdmissionBatch,
    ChannelAttach,
    ChannelBatch,
    EngineOutput,
    EngineReport,
    EngineRequest,
    RoutedError,
)

logger = logging.getLogger("lifecycle.engine")


@serve.deployment(name="Engine", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 1},
                  health_check_period_s=5, health_check_timeout_s=30,
                  request_router_config=RequestRouterConfig(request_router_class="stages.routing.EngineRouter",
                                                            request_routing_stats_period_s=1.0,
                                                            request_routing_stats_timeout_s=5.0))
class EngineDeployment:
    """Owns the model; everything else reaches it through its handle."""

    async def __init__(self, model: str, engine: EngineSettings | None = None,
                       tracing: TracingSettings | None = None, directory: Any = None) -> None:
        """``engine`` and ``tracing`` are the app config's sections as validated (defaults when omitted)."""
        from stages.engine.driver.tracing import EngineTracer
        from stages.telemetry import configure_logging, configure_tracing

        configure_logging()
        configure_tracing(tracing, component="engine")
        self.settings = engine if engine is not None else EngineSettings()
        self.replica = own_replica_id()
        faults = StepFaults(self.settings.fault_injection)
        common = {"max_waiting": self.settings.max_waiting_requests, "replica": self.replica,
                  "stall_timeout_s": self.settings.stall_timeout_s, "faults": faults}
        self.tracer = EngineTracer()
        if self.settings.core_process:
            # The child loads the model and resolves device=auto: this process never imports torch.
            spec = CoreSpec(model, self.settings, max_waiting=self.settings.max_waiting_requests,
                            replica=self.replica, thread_nice=self.settings.step_thread_nice,
                            fault_injection=faults.enabled, tracing=tracing)
            self.async_engine = AsyncEngine(core=CoreProcess(spec), **common)
            # The child loads the model; this loop stays free meanwhile.
            await asyncio.to_thread(self.async_engine.start, asyncio.get_running_loop())
        else:
            engine_core = LLMEngine.from_config(model, self.settings)
            engine_core.on_finish = self.tracer.on_finish
            self.async_engine = AsyncEngine(engine_core, thread_nice=self.settings.step_thread_nice, **common)
            # Constructed on the loop Serve runs our calls on, so outputs are delivered there.
            self.async_engine.start(asyncio.get_running_loop())
        # Requests whose Egress replica died are aborted (no zombie decoding: stages.transport.liveness).
        self.consumers = ConsumerWatch(self._consumer_gone)
        #: Each Egress replica's mailbox: the tokens of its channel requests (stages.transport.channel).
        self.channels = ChannelHub(self.replica, merge=merge_channel_items)
        #: The streams of batch-admitted requests (:meth:`submit`), by their first choice's id.
        self.admitted = AdmittedStreams()
        #: Admission calls received and the requests they carried (their ratio is the batching).
        self.admission_calls = 0
        self.admission_requests = 0
        self._seq = itertools.count()
        self._last_ttft = 0.0
        self.directory = directory
        self._reporter = asyncio.create_task(self._report_loop()) if directory is not None else None
        logger.info("engine %s ready: %s, max_model_len=%d, %d KV blocks of %d tokens%s", self.replica,
                    model, self.async_engine.max_model_len, self.async_engine.num_blocks, self.settings.block_size,
                    f", step loop in process {self.async_engine.core.pid}" if self.async_engine.core else "")

    def _check_alive(self) -> None:
        problem = self.async_engine.health_problem()
        if problem is not None:
            raise EngineDeadError(problem + "; the replica will be replaced")

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[EngineOutput]]:
        """Stream the outputs of every choice of one request (first token at once, then coalesced).

        With ``request.channel`` this stream carries the acceptance item only and then stays open
        until the request ends (its cancellation still aborts it); the tokens go to the consumer's
        channel, which :meth:`attach` streams."""
        channel = request.consumer if request.channel and request.consumer else None
        # With a channel, the first item (the acceptance) comes back here and the rest go to the
        # channel straight from each step's delivery (``AsyncEngine.generate``'s ``sink``).
        async for outs in self._run(request, channel):
            yield outs

    async def submit(self, batch: AdmissionBatch) -> list[Admission]:
        """Batched admission (:mod:`stages.transport.admission`): start every request of the batch; answer
        with each one's acceptance item (or its refusal). Their tokens, and an error met after the
        acceptance, go to the consumer's channel; :meth:`abort` ends one, as does its consumer
        dying."""
        self.admission_calls += 1
        self.admission_requests += len(batch.items)
        return list(await asyncio.gather(*(self._admit(request) for request in batch.items)))

    def _admit(self, request: EngineRequest) -> Awaitable[Admission]:
        consumer = request.consumer
        first_id = request.choice_ids()[0]

        def rest(outs: list[EngineOutput]) -> None:  # not reached: ``_run`` yields the first item only
            self.channels.push(consumer, outs)

        def failed(exc: BaseException) -> None:
            self.channels.push(consumer, [RoutedError(first_id, exc)])

        return self.admitted.admit(first_id, self._run(request, consumer), rest, failed)

    async def _run(self, request: EngineRequest, channel: str | None) -> AsyncIterator[list[EngineOutput]]:
        """One request's outputs, with its consumer watched and its channel mailbox open. With a
        channel, only the first item is yielded and the rest go to the channel's mailbox."""
        self._check_alive()
        choices = tuple(request.choice_ids())
        key = (request.consumer, choices)
        self.consumers.add(request.consumer, key)
        sink = None
        if channel is not None:
            self.channels.open(channel)
            sink = functools.partial(self.channels.push, channel)
        try:
            async for outs in self.async_engine.generate(request, sink=sink):
                yield outs
        finally:
            if channel is not None:
                self.channels.close(channel)
            self.consumers.discard(request.consumer, key)

    async def attach(self, request: ChannelAttach) -> AsyncIterator[ChannelBatch]:
        """The channel of ``request.consumer`` on this replica (routed here by name): one item per
        engine step for all its channel requests; ends a moment after the last of them ends."""
        async for batch in self.channels.attach(request.consumer):
            yield batch

    def _consumer_gone(self, key: tuple[str, tuple[str, ...]]) -> None:
        consumer, choice_ids = key
        for rid in choice_ids:
            self.async_engine.abort(rid)
        self.channels.drop(consumer)

    async def abort(self, request: AbortRequest) -> None:
        """Abort by id (no-op if unknown or finished); blocks are free at the next step. An abort
        naming another replica reached this one because that one is draining (no longer a routing
        candidate): it goes to the directory, where that replica takes it with its next report."""
        if request.replica and request.replica != self.replica and self.directory is not None:
            await self.directory.forward_abort.remote(request)
            return
        for rid in request.request_ids:
            self.async_engine.abort(rid)

    def _abort_forwarded(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.async_engine.abort(rid)
        if request_ids:
            logger.info("aborted %d request(s) forwarded by the directory", len(request_ids))

    def _report(self) -> EngineReport:
        return EngineReport(replica=self.replica, node_id=ray.get_runtime_context().get_node_id(),
                            max_model_len=self.async_engine.max_model_len,
                            healthy=self.async_engine.health_problem() is None,
                            stats={**self.async_engine.snapshot(), **self.tracer.counters(),
                                   **self.async_engine.loop_counters(),
                                   "consumer_gone_aborts": self.consumers.ended,
                                   "channel_mailboxes": len(self.channels),
                                   "admitted_streams": len(self.admitted),
                                   "admission_calls": self.admission_calls,
                                   "admission_requests": self.admission_requests,
                                   "channel_pending": self.channels.num_pending(),
                                   "channel_batches": self.channels.batches_sent,
                                   "channel_items": self.channels.items_sent},
                            report_interval_s=self.settings.report_interval_s)

    async def stats(self) -> dict[str, Any]:
        """This replica's gauges and counters (tests; ``/metrics`` reads every replica's report)."""
        return {**self._report().stats, "replica": self.replica}

    async def info(self) -> dict[str, Any]:
        return {"max_model_len": self.async_engine.max_model_len, "alive": self.async_engine.is_alive,
                "replica": self.replica}

    def record_routing_stats(self) -> dict[str, Any]:
        """What :class:`stages.routing.EngineRouter` ranks replicas by (Serve calls this)."""
        return {**self.async_engine.snapshot(), "seq": next(self._seq)}

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
                self._abort_forwarded(await self.directory.report.remote(self._report()) or [])
            except Exception as exc:  # noqa: BLE001 - the directory restarts; keep reporting
                logger.warning("engine report to the directory failed: %r", exc)
            await asyncio.sleep(interval)

    async def inject_fault(self, kind: str = "step_exception", after_steps: int = 0) -> None:
        """Tests only: make an upcoming engine step raise (:mod:`stages.engine.driver.faults`). Refused
        unless ``engine.fault_injection`` (or ``LIFECYCLE_FAULT_INJECTION=1``) enabled it."""
        self.async_engine.arm_fault(kind, after_steps)

    def __del__(self) -> None:
        """Serve's graceful shutdown: stop the engine core process, if any, before this one goes
        (pending requests are aborted there; it would also stop on its own once this process is gone)."""
        engine = getattr(self, "async_engine", None)
        if engine is not None and engine.core is not None:
            engine.core.shutdown(timeout=5.0)

    def check_health(self) -> None:
        """Serve replaces the replica when this raises: the step loop died, or has had work and
        made no progress for ``engine.stall_timeout_s``."""
        problem = self.async_engine.health_problem()
        if problem is not None:
            raise RuntimeError(problem)
