"""The Egress deployment: the Ray Serve wrapper around :class:`stages.egress.egress.Egress`.

It owns what crossing replicas takes: the engine stream of each request (batch-admitted through
:mod:`stages.transport.admission` by default, or one streamed call per request), the channel from each engine
replica and the mailbox for each Ingress replica (:mod:`stages.transport.channel`), the jobs Ingress admitted
in batches (``submit``, ``cancel`` by id), the liveness watch on the Ingress replicas reading
(:mod:`stages.transport.liveness`), and the stats Serve's router and autoscaler read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from stages.transport.admission import AdmissionQueue, AdmittedStreams, fire_and_forget
from stages.transport.channel import ChannelHub
from stages.transport.channel_client import ChannelClient, engine_items
from stages.egress.egress import Egress, EngineStream
from stages.errors import EngineUnavailableError
from stages.transport.liveness import ConsumerWatch, own_actor_name, own_replica_id
from stages.transport.messages import (
    AbortRequest,
    Admission,
    AdmissionBatch,
    ChannelAttach,
    ChannelBatch,
    EngineOutput,
    EngineRequest,
    GenerationJob,
    RoutedFrame,
    StreamFrame,
    StreamStart,
    StreamSummary,
)
from stages.config import TracingSettings
from stages.telemetry import get_tracer, span_from_context

logger = logging.getLogger("lifecycle.egress")

#: Seconds between an Egress replica's asks for the cancels the directory holds for it.
FORWARDED_POLL_S = 1.0


@serve.deployment(name="Egress", max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.25},
                  request_router_config=RequestRouterConfig(request_router_class="stages.routing.EgressRouter",
                                                            request_routing_stats_period_s=1.0,
                                                            request_routing_stats_timeout_s=5.0))
class EgressDeployment:
    """CPU stage between the engine and Ingress; scale it with ``num_replicas``."""

    async def __init__(self, engine: Any, model: str, tracing: TracingSettings | None = None,
                 stream_channel: bool = True, batch_admission: bool = True, directory: Any = None) -> None:
        from stages.model_info import load_cpu_tokenizer
        from stages.telemetry import configure_tracing

        configure_tracing(tracing, component="egress")
        self.engine = engine  # DeploymentHandle of the engine, created once and reused
        self._stream_handle = engine.options(stream=True)
        self.egress = Egress(load_cpu_tokenizer(model), self._open, self._abort)
        #: This replica's actor name: the engine aborts our streams if we die (stages.transport.liveness).
        self.name = own_actor_name()
        #: How to end each open engine call by request id: a stream whose Ingress replica died is
        #: ended this way (an abort in the engine).
        self._engine_calls: dict[str, Callable[[], None]] = {}
        self.consumers = ConsumerWatch(self._consumer_gone)
        # The tokens of every request on one engine replica share one stream (stages.transport.channel);
        # it needs our actor name, which the engine keys the mailbox by.
        self.channel = (ChannelClient(self._attach, _channel_lost, on_stray=self._abort_stray)
                        if stream_channel and self.name else None)
        # The engine requests this replica sends in one loop turn share one call (stages.transport.admission).
        self.admission: AdmissionQueue[EngineRequest] | None = (
            AdmissionQueue(self._submit, key=_admission_key, on_orphan=self._abort_orphan)
            if batch_admission and self.channel is not None else None)
        #: Jobs Ingress admitted in batches (:meth:`submit`), each running as its own task.
        self.admitted = AdmittedStreams()
        self._routing_seq = 0
        #: Each Ingress replica's mailbox: the frames of its channel requests (stages.transport.channel).
        self.replica = own_replica_id()
        self.frames = ChannelHub(self.replica)
        # Cancels meant for this replica that reached another (this one draining) wait in the
        # directory; with batch admission, cancels by id are how jobs end early (stages.directory.directory).
        self.directory = directory
        self._forwarded_poll = (asyncio.get_running_loop().create_task(self._take_forwarded_forever())
                                if directory is not None and self.admission is not None else None)

    def _attach(self, replica: str) -> AsyncIterator[ChannelBatch]:
        return self._stream_handle.attach.remote(ChannelAttach(replica, self.name))

    def _open(self, req: Any) -> EngineStream:
        channel = self.channel
        if self.admission is not None and channel is not None:
            return self._open_admitted(req, self.admission, channel)
        gen = self._stream_handle.generate.remote(dataclasses.replace(req, consumer=self.name,
                                                                      channel=channel is not None))
        cancel = gen.cancel  # cancellation reaches the engine replica's generator → abort by request id
        self._engine_calls[req.request_id] = cancel
        inbox = channel.register(req.choice_ids()) if channel is not None else None

        async def close() -> None:
            cancel()
            if self._engine_calls.get(req.request_id) is cancel:
                del self._engine_calls[req.request_id]
            if inbox is not None and channel is not None:
                channel.unregister(inbox, aborted=True)  # cancelling the call aborted it

        if inbox is None or channel is None:
            return EngineStream(gen, close)
        return EngineStream(engine_items(gen.__anext__(), inbox, channel, control=gen), close)

    def _open_admitted(self, req: EngineRequest, admission: AdmissionQueue[EngineRequest],
                       channel: ChannelClient) -> EngineStream:
        """The engine stream of one request through batched admission: the acceptance comes in
        the batch call's reply, the outputs through the channel; closing it early aborts by id."""
        inbox = channel.register(req.choice_ids())
        accepted = admission.submit(dataclasses.replace(req, consumer=self.name, channel=True))

        def cancel() -> bool:
            """End it in the engine: an abort by id once accepted; else when it is (``on_orphan``).
            False when its acceptance failed: refused (nothing runs), or the batch call failed
            as a whole, when the replica that may run it is known only from its channel items."""
            if not accepted.done():
                accepted.cancel()
            elif accepted.cancelled() or accepted.exception() is not None:
                return accepted.cancelled()
            elif not inbox.done:
                self._abort_soon(AbortRequest(accepted.result()[0].replica or "", req.choice_ids()))
            return True

        self._engine_calls[req.request_id] = cancel

        async def close() -> None:
            aborted = cancel()
            if self._engine_calls.get(req.request_id) is cancel:
                del self._engine_calls[req.request_id]
            channel.unregister(inbox, aborted=aborted)

        return EngineStream(engine_items(accepted, inbox, channel), close)

    async def _submit(self, requests: list[EngineRequest]) -> list[Admission]:
        return await self.engine.submit.remote(AdmissionBatch(requests))

    def _abort_orphan(self, req: EngineRequest, accepted: list[EngineOutput]) -> None:
        self._abort_soon(AbortRequest(accepted[0].replica or "", req.choice_ids()))

    def _abort_stray(self, replica: str, request_id: str) -> None:
        self._abort_soon(AbortRequest(replica, [request_id]))

    def _abort_soon(self, req: AbortRequest) -> None:
        fire_and_forget(lambda: self.engine.abort.remote(req), "engine abort")

    def _consumer_gone(self, key: tuple[str, str]) -> None:
        """The Ingress replica reading this stream died: end its request here and in the engine."""
        consumer, request_id = key
        if not self.admitted.cancel(request_id):  # its job task's ``finally`` closes the engine stream
            cancel = self._engine_calls.pop(request_id, None)
            if cancel is not None:
                cancel()
        self.frames.drop(consumer)

    async def _abort(self, req: AbortRequest) -> None:
        await self.engine.abort.remote(req)

    async def stats(self) -> dict[str, Any]:
        """Batched admission on this replica (tests, benchmarks): jobs running here, and the calls
        and engine requests it sent to the engines."""
        sent = self.admission
        return {"replica": self.replica, "admitted_jobs": len(self.admitted),
                "engine_admission_calls": sent.calls_sent if sent else 0,
                "engine_admission_requests": sent.items_sent if sent else 0,
                "open_engine_calls": len(self._engine_calls)}

    async def ping(self) -> bool:
        """Liveness for the app's ``/health``."""
        return True

    def record_routing_stats(self) -> dict[str, Any]:
        """What :class:`stages.routing.EgressRouter` places batches of jobs by (Serve calls this)."""
        self._routing_seq += 1
        return {"admitted_jobs": len(self.admitted), "seq": self._routing_seq}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What :func:`stages.autoscaling.stage_policy` corrects Serve's count of ongoing requests
        by: the channel attaches open here (one per Ingress replica), which are not load, and the
        batch-admitted jobs running here, which are."""
        from stages.autoscaling import ADMITTED, ATTACHES

        return {ATTACHES: float(self.frames.attaches), ADMITTED: float(len(self.admitted))}

    async def attach(self, request: ChannelAttach) -> AsyncIterator[ChannelBatch]:
        """The channel of the Ingress replica ``request.consumer`` (routed here by name): the
        frames of all its channel requests, one item per wake-up; ends a moment after the last."""
        async for batch in self.frames.attach(request.consumer):
            yield batch

    async def submit(self, batch: AdmissionBatch) -> list[Admission]:
        """Batched admission (:mod:`stages.transport.admission`) of channel jobs from one Ingress replica:
        start each job's :meth:`stream`; answer with its :class:`StreamStart` (or its refusal).
        The rest goes through the consumer's channel, as it does for a streamed job; ``cancel``
        ends one, as does its consumer dying."""
        return list(await asyncio.gather(*(self._admit(job) for job in batch.items)))

    def _admit(self, job: GenerationJob) -> Awaitable[Admission]:
        request_id, consumer = job.engine_request.request_id, job.consumer

        def rest(item: Any) -> None:  # a channel job's stream yields its start only
            logger.warning("unexpected item after the start of %s: %s", request_id, type(item).__name__)

        def failed(exc: BaseException) -> None:
            self.frames.push(consumer, [RoutedFrame(request_id, error=exc)])

        return self.admitted.admit(request_id, self.stream(job), rest, failed)

    async def cancel(self, request: AbortRequest) -> None:
        """End batch-admitted jobs by API request id (their Ingress gave up on them): each job's
        ``finally`` runs, which aborts it in the engine. Unknown or finished ids are ignored. A
        cancel naming another replica reached this one because that one is draining: it goes to
        the directory, where that replica takes it within :data:`FORWARDED_POLL_S`."""
        if request.replica and request.replica != self.replica and self.directory is not None:
            await self.directory.forward_abort.remote(request)
            return
        for request_id in request.request_ids:
            self.admitted.cancel(request_id)

    async def _take_forwarded_forever(self) -> None:
        while True:
            await asyncio.sleep(FORWARDED_POLL_S)
            try:
                ids = await self.directory.take_aborts.remote(self.replica)
            except Exception as exc:  # noqa: BLE001 - the directory restarts; ask again next time
                logger.debug("taking forwarded cancels failed: %r", exc)
                continue
            cancelled = sum(self.admitted.cancel(rid) for rid in ids)
            if ids:
                logger.info("cancelled %d of %d job(s) forwarded by the directory", cancelled, len(ids))

    async def stream(self, job: GenerationJob) -> AsyncIterator[StreamStart | StreamFrame | StreamSummary]:
        """The request's :class:`StreamStart`, frames and summary. With ``job.channel`` only the
        start comes here: the rest, or an error met after the start, goes to the consumer's
        channel in order, and this stream stays open until the summary is sent."""
        summary: StreamSummary | None = None
        request_id = job.engine_request.request_id
        key = (job.consumer, request_id)
        self.consumers.add(job.consumer, key)
        channel = job.consumer if job.channel and job.consumer else None
        started = False
        if channel is not None:
            self.frames.open(channel)
        try:
            with span_from_context(get_tracer(), "egress.stream" if job.stream else "egress.complete",
                                   job.engine_request.trace_context,
                                   {"lifecycle.request_id": request_id}) as span:
                try:
                    async for item in self.egress.stream(job):
                        if isinstance(item, StreamSummary):
                            _annotate(span, item)
                            summary = item
                            break  # end the span before the last item: the caller may answer at once
                        if isinstance(item, StreamStart):
                            item.egress_replica = self.replica
                            started = True
                            yield item
                        elif channel is not None:
                            self.frames.push(channel, [RoutedFrame(request_id, item)])
                        else:
                            yield item
                except Exception as exc:
                    if channel is None or not started:
                        raise
                    # After the start the client hears of it in order, after the frames before it.
                    self.frames.push(channel, [RoutedFrame(request_id, error=exc)])
                    return
            if summary is not None:
                if channel is not None:
                    self.frames.push(channel, [RoutedFrame(request_id, summary)])
                else:
                    yield summary
        finally:
            if channel is not None:
                self.frames.close(channel)
            self.consumers.discard(job.consumer, key)


def _admission_key(req: EngineRequest) -> tuple[Any, ...]:
    """What may share an engine ``submit`` call: requests avoiding the same replicas (the router
    places a call as a whole); a structured-output request goes alone (its acceptance waits for its
    grammar's matcher, and would hold up the others')."""
    return (tuple(req.avoid_replicas), req.request_id if req.grammar is not None else "")


def _channel_lost(replica: str) -> BaseException:
    return EngineUnavailableError(f"The engine replica {replica} was lost before the request finished. Retry.")


def _annotate(span: Any, summary: StreamSummary) -> None:
    if not span.is_recording():
        return
    span.set_attribute("lifecycle.egress_busy_ms", summary.egress_busy * 1000)
    span.set_attribute("gen_ai.usage.output_tokens", summary.completion_tokens)
    if summary.aborted_by_stop_string:
        span.add_event("abort", {"reason": "stop_string"})
