"""How an Ingress replica hands a generation job to Egress and reads its frames back.

Three ways, by configuration and request:
- **batch-admitted** (a streamed request, ``engine.batch_admission`` with ``engine.stream_channel``):
  the job's start comes in the reply of a ``submit`` call shared with this loop turn's other jobs
  (:mod:`stages.transport.admission`), its frames through the Egress replica's channel
  (:mod:`stages.transport.channel_client`); giving up on it is an explicit cancel by id;
- **channel** (streamed, without batch admission): the job's own Egress stream carries its start
  and stays open as its control; the frames come through the channel;
- **own stream** (a whole body, not streamed: one channel item must stay far below the message
  limit): everything on the job's own Egress stream.

:meth:`EgressDispatch.start` returns once Egress has accepted the job (so a full queue or a rejected
request still gets its HTTP status), with an iterator of the job's frames and summary that has a
``cancel()``. Whatever fails or is cancelled before that, it undoes itself: nothing is left running
in Egress for a request nobody reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from stages.transport.admission import AdmissionQueue, fire_and_forget
from stages.transport.channel_client import ChannelClient, FrameStream
from stages.errors import EngineUnavailableError
from stages.ingress.sse import first_item
from stages.transport.messages import AbortRequest, Admission, AdmissionBatch, ChannelAttach, GenerationJob, StreamStart


def _admission_key(job: GenerationJob) -> str:
    """A structured-output request's acceptance waits for its grammar's matcher in the engine: it
    goes in a call of its own, so it holds up no one else's."""
    req = job.engine_request
    return req.request_id if req.grammar is not None else ""


def _egress_lost(replica: str) -> BaseException:
    return EngineUnavailableError(f"The Egress replica {replica} was lost before the request finished. Retry.")


class EgressDispatch:
    """One Ingress replica's way to Egress (see the module docstring). ``actor_name`` is this
    replica's actor name: Egress keys its channel mailbox by it and ends our jobs if we die."""

    def __init__(self, egress: Any, actor_name: str | None, stream_channel: bool, batch_admission: bool) -> None:
        self.egress = egress
        self.egress_stream = egress.options(stream=True)
        self.actor_name = actor_name
        self.frames: ChannelClient | None = (
            ChannelClient(self._attach, _egress_lost, on_stray=self._cancel_stray)
            if stream_channel and actor_name else None)
        self.admission: AdmissionQueue[GenerationJob] | None = (
            AdmissionQueue(self._submit, key=_admission_key, on_orphan=self._cancel_orphan)
            if self.frames is not None and batch_admission else None)

    def uses_channel(self, stream: bool) -> bool:
        """Whether a request's frames come through the channel (streamed requests, channel on)."""
        return self.frames is not None and stream

    async def start(self, job: GenerationJob, timeout: float | None) -> tuple[Any, StreamStart]:
        """Send ``job`` to Egress and wait (up to ``timeout``) for its :class:`StreamStart`.
        Returns its frames (an async iterator with ``cancel()``) and the start."""
        frames = self.frames if job.channel else None
        request_id = job.engine_request.request_id
        inbox = frames.register_frames(request_id) if frames is not None else None
        gen: Any = None
        accepted: asyncio.Future[Any] | None = None
        try:
            if frames is not None and inbox is not None and self.admission is not None:
                accepted = self.admission.submit(job)
                start = await asyncio.wait_for(accepted, timeout)
                return FrameStream(None, inbox, frames, start.egress_replica,
                                   on_cancel=self._cancel_job(start.egress_replica, request_id)), start
            gen = self.egress_stream.stream.remote(job)
            start = await asyncio.wait_for(first_item(gen), timeout)
            if frames is not None and inbox is not None:
                return FrameStream(gen, inbox, frames, start.egress_replica), start
            return gen, start
        except BaseException:
            if gen is not None:
                gen.cancel()  # its Egress stream's ``finally`` ends the job
            elif accepted is not None and accepted.done() and not accepted.cancelled() and accepted.exception() is None:
                # Accepted in the very turn the client left (or the deadline hit): the start was
                # never taken, and the queue's on_orphan only sees futures given up before it.
                self._cancel_orphan(job, accepted.result())
            if frames is not None and inbox is not None:
                # A batch call that failed as a whole leaves it unknown whether Egress runs the
                # job: then its frames, if any come, cancel it there (ChannelClient.on_stray).
                refused = (accepted is not None and accepted.done() and not accepted.cancelled()
                           and accepted.exception() is not None)
                frames.unregister(inbox, aborted=not refused)
            raise

    async def _submit(self, jobs: list[GenerationJob]) -> list[Admission]:
        return await self.egress.submit.remote(AdmissionBatch(jobs))

    def _cancel_job(self, egress_replica: str, request_id: str) -> Callable[[], None]:
        """Cancels one batch-admitted job on the Egress replica running it (the engine aborts it)."""
        cancel = AbortRequest(egress_replica, [request_id])
        return lambda: fire_and_forget(lambda: self.egress.cancel.remote(cancel), "egress cancel")

    def _cancel_stray(self, egress_replica: str, request_id: str) -> None:
        self._cancel_job(egress_replica, request_id)()

    def _cancel_orphan(self, job: GenerationJob, start: StreamStart) -> None:
        """A job admitted after this replica gave up on it (client gone, timeout): cancel it."""
        self._cancel_job(start.egress_replica, job.engine_request.request_id)()

    def _attach(self, replica: str) -> Any:
        return self.egress_stream.attach.remote(ChannelAttach(replica, self.actor_name))
