"""The Egress deployment: the Ray Serve adapter around :class:`stages.egress.egress.Egress`.

Egress sits in the middle of the transport (:mod:`stages.transport`): towards Ingress it is a
producer (jobs admitted in batches by ``submit``, frames through each Ingress replica's channel by
``attach``, ended early by ``abort``), towards the engine a consumer (each job's engine request
sent and read back through :class:`~stages.transport.consumer.Consumer`). Closing a job early
closes its engine call, which aborts the request in the engine.

It also keeps the events of resumable streams (:mod:`stages.egress.resume`): ``detach`` when their
client leaves, ``resume`` when one reconnects through any Ingress replica; the directory indexes
the detached ones so that a reconnect finds this replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Hashable
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from stages.config import MAX_RESUME_GRACE_S, TracingSettings
from stages.directory.client import MEMBERS_PERIOD_S, directory_client
from stages.egress.egress import Egress, EngineStream
from stages.egress.resume import ResumeStore, event_id
from stages.errors import EngineUnavailableError, EventsDroppedError
from stages.heap import start_trimmer
from stages.routing.router import placement_key
from stages.telemetry import get_tracer, span_from_context
from stages.transport.admission import fire_and_forget
from stages.transport.channel_client import is_final
from stages.transport.consumer import Consumer, admission_key
from stages.transport.liveness import own_actor_name, own_replica_id
from stages.transport.messages import (
    AbortRequest,
    Admission,
    AdmissionBatch,
    ChannelAttach,
    ChannelBatch,
    DetachRequest,
    EngineMoved,
    EngineRequest,
    GenerationJob,
    LiveEntry,
    ResumeRequest,
    ResumeStart,
    RoutedError,
    StreamFrame,
    StreamStart,
    StreamSummary,
)
from stages.transport.producer import Job, Producer, frames

logger = logging.getLogger("lifecycle.egress")


#: A draining replica waits for its kept streams' grace periods (bounded by the longest allowed).
@serve.deployment(name="Egress", max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.25},
                  graceful_shutdown_timeout_s=MAX_RESUME_GRACE_S + 10,
                  request_router_config=RequestRouterConfig(request_router_class="stages.routing.router.EgressRouter",
                                                            request_routing_stats_period_s=1.0,
                                                            request_routing_stats_timeout_s=5.0))
class EgressDeployment:
    """CPU stage between the engine and Ingress; scale it with ``num_replicas``."""

    async def __init__(self, engine: Any, model: str, tracing: TracingSettings | None = None,
                       directory: Any = None, max_migrations: int = 0) -> None:
        from stages.model_info import load_cpu_tokenizer
        start_trimmer()
        from stages.telemetry import configure_tracing

        configure_tracing(tracing, component="egress")
        self.engine = engine  # DeploymentHandle of the engine, created once and reused
        directory = directory_client(directory)
        self.egress = Egress(load_cpu_tokenizer(model), self._open, self._abort, max_migrations=max_migrations,
                             healthy_engines=self._healthy_engines if directory is not None else None)
        self.replica = own_replica_id()
        #: Towards the engine: this replica's actor name keys its mailbox on every engine replica.
        self.to_engine = Consumer(engine, own_actor_name(), _channel_lost, key=_engine_admission_key)
        #: Towards Ingress: the jobs it sends, and each Ingress replica's mailbox of frames.
        self.transport = Producer(self.replica, directory=directory)
        self.transport.poll_forwarded()
        self._routing_seq = 0
        self.directory = directory
        #: Resumable streams' events, for a client that reconnects (any Ingress replica).
        self.kept = ResumeStore(self.replica, on_expire=self._expired, on_keep=self._keep_entry,
                                on_unkeep=self._unkeep_entry)
        self._background: list[asyncio.Task[None]] = []
        if directory is not None:
            from stages.ingress.views import report_metrics_forever
            from stages.metrics import egress_exposition

            self._background.append(asyncio.create_task(
                report_metrics_forever(directory, self.replica, lambda: egress_exposition(self.kept, self.egress))))
            self._background.append(asyncio.create_task(self._keep_again_forever()))

    def _open(self, req: EngineRequest) -> EngineStream:
        call = self.to_engine.open_outputs(req)

        async def close() -> None:
            call.cancel()

        return EngineStream(call.outputs(), close, call.item, call.forget)

    async def _abort(self, req: AbortRequest) -> None:
        await self.engine.abort.remote(req)

    async def _healthy_engines(self) -> list[str]:
        """The engine replicas reporting healthy to the directory (a move needs another one)."""
        return [r.replica for r in await self.directory.engines() if r.healthy]

    # -- the producer side (Ingress calls these) ----------------------------------------------------------
    async def submit(self, batch: AdmissionBatch) -> list[Admission]:
        """Admit a batch of jobs from one Ingress replica; answer with each one's
        :class:`StreamStart` (or its refusal); frames follow through that replica's channel."""
        return await self.transport.submit(batch, self._job)

    def _job(self, job: GenerationJob) -> Job:
        request_id = job.engine_request.request_id
        wrap = lambda item: frames(request_id, item)  # noqa: E731
        if job.resume is None or not job.stream:
            return Job(request_id, job.consumer, self._stream(job), wrap=wrap)
        self.kept.open(request_id, job.resume, job.response_id, shape={
            "kind": job.kind, "model_name": job.model_name, "response_id": job.response_id, "created": job.created,
            "include_usage": job.include_usage, "trace_context": dict(job.engine_request.trace_context or {})})
        return Job(request_id, job.consumer, self._stream(job), wrap=wrap,
                   record=lambda items: self.kept.record(request_id, items),
                   keep=lambda: self.kept.detach(request_id),
                   on_end=lambda: self.kept.finish(request_id))

    async def attach(self, request: ChannelAttach) -> AsyncIterator[ChannelBatch]:
        """The channel of the Ingress replica ``request.consumer`` (routed here by name): the
        frames of all its jobs here, one item per wake-up; ends a moment after the last."""
        async for batch in self.transport.attach(request.consumer):
            yield batch

    async def abort(self, request: AbortRequest) -> None:
        """End jobs by API request id (their Ingress gave up on them, or a cancel by id named a
        detached resumable stream, whose kept events go too): each job's ``finally`` runs, which
        aborts it in the engine. Unknown or finished ids are ignored; ids naming another replica
        (draining) are forwarded to the directory."""
        if request.replica == self.replica:
            for rid in request.request_ids:
                if self.kept.is_detached(rid):
                    self._unkeep_entry(rid)
                    self.kept.forget(rid)
        await self.transport.abort(request)

    # -- resumable streams -----------------------------------------------------------------------------------
    async def detach(self, request: DetachRequest) -> bool:
        """The client of ``request.request_id`` left (its Ingress says so): keep a resumable stream
        running, detached, for its grace period; end any other as an abort would. True when kept.
        ``delivered``: the client received it all, so its kept events go now."""
        rid = request.request_id
        if request.delivered:  # nothing left to resume
            self.kept.forget(rid)
            return False
        if request.replica != self.replica:  # the named replica is draining: it must end the job
            await self.transport.abort(AbortRequest(request.replica, [rid]))
            return False
        if self.kept.detach(rid):
            self.transport.detach(rid)
            return True
        self.transport.end([rid])
        return False

    async def resume(self, request: ResumeRequest) -> ResumeStart:
        """A client reconnected through the Ingress replica ``request.consumer``: the kept events
        after ``request.after`` go to that replica's channel, then the live ones. Raises
        :class:`~stages.errors.NotFoundError` (nothing kept) or :class:`~stages.errors.ConflictError`
        (a connection is attached)."""
        rid = request.request_id
        kept, items = self.kept.take(rid, request.after)
        if kept.dropped:
            items = [RoutedError(rid, EventsDroppedError())]
        elif not self.transport.running(rid) and not (items and is_final(items[-1])):
            # Ended without its last item (cancelled): say so rather than leave the client waiting.
            items.append(RoutedError(rid, EngineUnavailableError("The request ended before it finished. Retry.")))
        self.transport.retarget(rid, request.consumer, items)
        if kept.dropped:
            self.transport.end([rid])
        assert kept.start is not None  # kept from the acceptance on
        return ResumeStart(start=kept.start, reconnects=kept.reconnects, dropped=kept.dropped,
                           replayed=sum(1 for i in items if event_id(i) is not None), **kept.shape)

    def _expired(self, request_id: str, running: bool) -> None:
        """Nobody reconnected within the grace period: abort the request (its blocks are freed)."""
        if running:
            self.transport.end([request_id])
        logger.info("resumable stream %s expired%s", request_id, " and was aborted" if running else "")

    def _keep_entry(self, entry: LiveEntry, seconds: float) -> None:
        if self.directory is not None:
            fire_and_forget(lambda: self.directory.keep(entry, seconds), "directory keep")

    async def _keep_again_forever(self, period_s: float = MEMBERS_PERIOD_S) -> None:
        """A Directory replica that appears (one more, or a replacement) starts empty: tell the
        Directory again of every stream kept here, so a reconnect that it answers finds them."""
        seen: set[str] = set()
        while True:
            await asyncio.sleep(period_s)
            members = set(self.directory.members())
            if seen and members - seen:
                for entry, seconds in self.kept.detached_entries():
                    self._keep_entry(entry, seconds)
            seen = members

    def _unkeep_entry(self, request_id: str) -> None:
        if self.directory is not None:
            fire_and_forget(lambda: self.directory.unkeep(request_id), "directory unkeep")

    async def __del__(self) -> None:
        """Drain: wait until the kept streams' grace periods have ended (Serve stops waiting at
        ``graceful_shutdown_timeout_s``)."""
        if len(self.kept):
            logger.info("draining: waiting for %d kept stream(s)", len(self.kept))
            await self.kept.drained()

    async def _stream(self, job: GenerationJob) -> AsyncIterator[StreamStart | StreamFrame | StreamSummary | EngineMoved]:
        """The job's :class:`StreamStart` (naming this replica), its frames, and its summary."""
        summary: StreamSummary | None = None
        with span_from_context(get_tracer(), "egress.stream" if job.stream else "egress.complete",
                               job.engine_request.trace_context,
                               {"lifecycle.request_id": job.engine_request.request_id}) as span:
            async for item in self.egress.stream(job):
                if isinstance(item, StreamSummary):
                    _annotate(span, item)
                    summary = item
                    break  # end the span before the last item: the caller may answer at once
                if isinstance(item, StreamStart):
                    item.egress_replica = self.replica
                    self.kept.started(job.engine_request.request_id, item)
                yield item
        if summary is not None:
            yield summary

    # -- views -----------------------------------------------------------------------------------------------
    async def stats(self) -> dict[str, Any]:
        """The transport on this replica (tests, benchmarks): jobs running here, and the calls and
        engine requests it sent to the engines."""
        sent = self.to_engine.admission
        return {"replica": self.replica, "admitted_jobs": len(self.transport), "kept_streams": len(self.kept),
                "kept_bytes": self.kept.nbytes, "migrations": self.egress.migrations,
                "engine_admission_calls": sent.calls_sent, "engine_admission_requests": sent.items_sent,
                "open_engine_calls": self.to_engine.open_calls}

    async def ping(self) -> bool:
        """Liveness for the app's ``/health``."""
        return True

    def record_routing_stats(self) -> dict[str, Any]:
        """What :class:`stages.routing.router.EgressRouter` places batches of jobs by (Serve calls this)."""
        self._routing_seq += 1
        return {"admitted_jobs": len(self.transport), "seq": self._routing_seq}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What :func:`stages.autoscaling.stage_policy` corrects Serve's count of ongoing requests
        by: the channel attaches open here (one per Ingress replica), which are not load, and the
        jobs running here, which are."""
        from stages.autoscaling import ADMITTED, ATTACHES

        return {ATTACHES: float(self.transport.hub.attaches), ADMITTED: float(len(self.transport))}


def _channel_lost(replica: str) -> BaseException:
    return EngineUnavailableError(f"The engine replica {replica} was lost before the request finished. Retry.")


def _annotate(span: Any, summary: StreamSummary) -> None:
    if not span.is_recording():
        return
    span.set_attribute("lifecycle.egress_busy_ms", summary.egress_busy * 1000)
    span.set_attribute("gen_ai.usage.output_tokens", summary.completion_tokens)
    if summary.aborted_by_stop_string:
        span.add_event("abort", {"reason": "stop_string"})


def _engine_admission_key(request: EngineRequest) -> Hashable:
    """Requests share a submit call only when they may go to the same engine replica: the
    transport's rule, plus the router's (:func:`stages.routing.router.placement_key`)."""
    return (admission_key(request), placement_key(request))
