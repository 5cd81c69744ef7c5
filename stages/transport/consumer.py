"""The caller side of a hop: how a replica (Ingress, Egress) sends requests to the next stage and
reads their items back.

Rule: :meth:`Consumer.open` registers the request's inbox *before* it is sent (so no item can
arrive unseen), queues it for batched admission (:class:`~stages.transport.admission.AdmissionQueue`:
one ``submit`` call per loop turn and routing key), and returns a :class:`Call`. ``Call.start``
waits for the acceptance (or raises the refusal); the items after it come through the producer
replica's channel (:class:`~stages.transport.channel_client.ChannelClient`), one attach stream per
producer replica this replica has requests on.

Giving up is :meth:`Call.cancel`, one definition for every case:
- before the acceptance came back: the queued future is cancelled, and if the producer admits the
  request anyway, the admission queue's ``on_orphan`` aborts it there;
- after it: an abort by id to the replica that accepted it;
- refused, or the batch call failed as a whole (the caller cannot know which replica, if any, runs
  it): nothing is sent, but items that arrive for it later name their replica, and the channel
  client aborts it there once (``on_stray``);
- already finished: nothing.

Two kinds of call, one per hop: :class:`OutputCall` (Egress reading an engine request's outputs,
merged per choice per wake-up) and :class:`FrameCall` (Ingress reading a job's SSE frames and its
summary, in order; a whole body arrives in pickled slices and is joined here).

Plain asyncio around a Serve handle (nothing else of Ray), so it is unit-tested with a fake handle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

from stages.transport.admission import AdmissionQueue, fire_and_forget
from stages.transport.channel_client import ChannelClient, FrameInbox, Inbox, LostError, _Slot
from stages.transport.messages import (
    AbortRequest,
    Admission,
    AdmissionBatch,
    BodyPart,
    ChannelAttach,
    ChannelBatch,
    DetachRequest,
    EngineOutput,
    EngineRequest,
    GenerationJob,
    ResumeRequest,
    ResumeStart,
    StreamStart,
    StreamSummary,
)


class Consumer:
    """One replica's way to the next stage through its Serve ``handle``, which must have
    ``submit(AdmissionBatch)``, ``attach(ChannelAttach)`` (streamed) and ``abort(AbortRequest)``.
    ``name`` is this replica's Ray actor name: producers key its mailbox by it and end its requests
    if it dies. ``key`` groups what may share a submit call."""

    def __init__(self, handle: Any, name: str, lost_error: LostError, *,
                 key: Callable[[Any], Hashable] | None = None) -> None:
        key = key or admission_key
        self.handle = handle
        self._stream_handle = handle.options(stream=True)
        self.name = name
        self.client = ChannelClient(self._attach, lost_error, on_stray=self._abort_one)
        self.admission: AdmissionQueue[Any] = AdmissionQueue(self._submit, key=key, on_orphan=self._orphan)
        #: Calls opened here and not ended (tests, leak checks).
        self.open_calls = 0

    def open_outputs(self, request: EngineRequest) -> OutputCall:
        """Send an engine request (Egress → engine): all its choices, read as one call."""
        return OutputCall(self, dataclasses.replace(request, consumer=self.name), request.choice_ids())

    def open_frames(self, job: GenerationJob) -> FrameCall:
        """Send a generation job (Ingress → Egress)."""
        return FrameCall(self, dataclasses.replace(job, consumer=self.name), [job.engine_request.request_id])

    def open_resume(self, replica: str, request_id: str, after: int) -> FrameCall:
        """Take over a resumable stream kept by the Egress replica ``replica`` (Ingress → Egress):
        the acceptance is a :class:`ResumeStart`, the frames after event ``after`` follow."""
        request = ResumeRequest(replica, request_id, after, self.name)
        accepted = asyncio.ensure_future(self.handle.resume.remote(request))
        return FrameCall(self, request, [request_id], accepted=accepted)

    def detach(self, replica: str, request_id: str, *, delivered: bool = False) -> None:
        """Tell ``replica`` that the client of the resumable stream ``request_id`` left (fire and
        forget: it keeps the stream, or ends it if it is not resumable after all), or with
        ``delivered`` that it received the whole stream (its kept events may go)."""
        request = DetachRequest(replica, request_id, delivered)
        fire_and_forget(lambda: self.handle.detach.remote(request), "transport detach")

    # -- what the calls use ------------------------------------------------------------------------------
    async def _submit(self, items: list[Any]) -> list[Admission]:
        return await self.handle.submit.remote(AdmissionBatch(items))

    def _attach(self, replica: str) -> AsyncIterator[ChannelBatch]:
        return self._stream_handle.attach.remote(ChannelAttach(replica, self.name))

    def abort(self, replica: str, ids: list[str]) -> None:
        """End ``ids`` on ``replica`` (fire and forget: the caller may be going away)."""
        request = AbortRequest(replica, list(ids))
        fire_and_forget(lambda: self.handle.abort.remote(request), "transport abort")

    def _abort_one(self, replica: str, request_id: str) -> None:
        self.abort(replica, [request_id])

    def _orphan(self, item: Any, accepted: Any) -> None:
        """Accepted after its caller gave up on it: end it there (once: its stray items are not
        aborted again)."""
        ids = item.choice_ids() if isinstance(item, EngineRequest) else [item.engine_request.request_id]
        ids = [request_id for request_id in ids if self.client.settle(request_id)]
        if ids:
            self.abort(_replica_of(accepted), ids)


def admission_key(item: Any) -> Hashable:
    """What may share a submit call: requests avoiding the same engine replicas (the router places
    a call as a whole); a structured-output request goes alone (its acceptance waits for its
    grammar's matcher in the engine, and would hold up the others')."""
    req: EngineRequest = item if isinstance(item, EngineRequest) else item.engine_request
    return (tuple(req.avoid_replicas), req.request_id if req.grammar is not None else "")


def _replica_of(accepted: Any) -> str:
    """The producer replica named by an acceptance: a :class:`StreamStart` from Egress, or the
    engine's first outputs (the first carries its replica)."""
    if isinstance(accepted, StreamStart):
        return accepted.egress_replica
    if isinstance(accepted, ResumeStart):
        return accepted.start.egress_replica
    return (accepted[0].replica if accepted else None) or ""


class Call:
    """One request on the caller side (see the module docstring)."""

    def __init__(self, consumer: Consumer, inbox: _Slot, item: Any, ids: list[str],
                 accepted: asyncio.Future[Any] | None = None) -> None:
        self.consumer = consumer
        self.inbox = inbox
        #: What was sent (the router may have noted on it where it went).
        self.item = item
        self.ids = ids
        self.replica = ""
        self._ended = False
        consumer.client.add(inbox)
        consumer.open_calls += 1
        #: The acceptance: from batched admission, or (a resume) from a call of its own.
        self._accepted = accepted if accepted is not None else consumer.admission.submit(item)

    async def start(self, timeout: float | None = None) -> Any:
        """The acceptance (waits up to ``timeout``), or the refusal raised. Whatever fails or is
        cancelled here is undone: nothing runs on for a request nobody reads."""
        try:
            first = await asyncio.wait_for(asyncio.shield(self._accepted), timeout)
        except BaseException:
            self.cancel()
            raise
        self.replica = _replica_of(first)
        self.consumer.client.bind(self.inbox, self.replica)
        return first

    @property
    def finished(self) -> bool:
        """The producer has sent the request's last item (nothing left to end there)."""
        return self.inbox.finished

    def cancel(self) -> None:
        """End the request in the producer, unless it has ended (idempotent)."""
        if self._ended:
            return
        self._ended = True
        self.consumer.open_calls -= 1
        accepted = self._accepted
        aborted = True
        if not accepted.done() or accepted.cancelled():
            # Admitted after all: the admission queue's on_orphan aborts it. Its call failed as a
            # whole: nobody knows where it runs, so a stray item of it must still end it there.
            accepted.cancel()
            aborted = False
        elif accepted.exception() is not None:
            aborted = False  # refused, or unknown where it runs: a stray item will end it there
        elif not self.finished:
            self.consumer.abort(_replica_of(accepted.result()), self.ids)
        self.consumer.client.unregister(self.inbox, aborted=aborted)

    def detach(self) -> None:
        """Stop reading a resumable request without ending it: its producer keeps it for the
        client to take again (:meth:`Consumer.open_resume`); before its acceptance, as
        :meth:`cancel`."""
        accepted = self._accepted
        if (self._ended or not accepted.done() or accepted.cancelled() or accepted.exception() is not None
                or self.finished):
            self.cancel()
            return
        self._ended = True
        self.consumer.open_calls -= 1
        self.consumer.detach(_replica_of(accepted.result()), self.ids[0])
        self.consumer.client.unregister(self.inbox, aborted=True)  # late frames are dropped, not aborted

    def forget(self) -> None:
        """Stop reading without ending the request in its producer: that replica is gone (an abort
        sent there would only wait in the directory for a replica that never asks)."""
        self._finish()

    def release(self) -> None:
        """The client received the whole of a resumable stream: its producer may forget it."""
        if self.replica:
            self.consumer.detach(self.replica, self.ids[0], delivered=True)

    def _finish(self) -> None:
        """The request ended in the producer: stop reading, nothing to abort."""
        if not self._ended:
            self._ended = True
            self.consumer.open_calls -= 1
        self.consumer.client.unregister(self.inbox, aborted=True)


class OutputCall(Call):
    """An engine request read by Egress: :meth:`outputs` yields the acceptance (the first outputs),
    then everything delivered since, one merged output per choice, until every choice finished."""

    def __init__(self, consumer: Consumer, request: EngineRequest, ids: list[str]) -> None:
        super().__init__(consumer, Inbox(ids), request, ids)

    async def outputs(self) -> AsyncIterator[list[EngineOutput]]:
        first = await self.start()
        inbox = self.inbox
        assert isinstance(inbox, Inbox)
        inbox.note(first)
        yield first
        while not inbox.done:
            try:
                outs = await inbox.get()
            except BaseException:
                if inbox.finished:  # an error the engine sent: the request ended there
                    self._finish()
                raise
            yield outs
        self._finish()


class FrameCall(Call):
    """A generation job read by Ingress: after :meth:`start` (its :class:`StreamStart`), an async
    iterator of its frames and finally its summary; a whole body sent in parts comes back joined
    on the summary."""

    def __init__(self, consumer: Consumer, job: GenerationJob | ResumeRequest, ids: list[str],
                 accepted: asyncio.Future[Any] | None = None) -> None:
        super().__init__(consumer, FrameInbox(ids[0]), job, ids, accepted)
        self._parts: list[bytes] = []
        self._done = False

    def __aiter__(self) -> FrameCall:
        return self

    async def __anext__(self) -> Any:
        inbox = self.inbox
        assert isinstance(inbox, FrameInbox)
        if self._done:
            raise StopAsyncIteration
        while True:
            try:
                item = await inbox.__anext__()
            except BaseException:
                if inbox.finished:  # an error the producer sent: it ended the request there
                    self._finish()
                raise
            if isinstance(item, BodyPart):
                self._parts.append(item.data)
                continue
            if isinstance(item, StreamSummary):
                if self._parts:
                    item.body = pickle.loads(b"".join(self._parts))
                    self._parts = []
                self._done = True
                self._finish()
            return item
