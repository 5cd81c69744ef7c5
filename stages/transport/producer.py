"""The callee side of a hop: how a deployment that others send requests to (Egress, the engine)
admits them, runs them, streams their items back and ends them early.

Rule: every request arrives in an :class:`~stages.transport.messages.AdmissionBatch` (all the
requests one caller replica sent in one loop turn), runs as a task of its own, and answers with
its first item (the acceptance) or the error it raised before that (the refusal). Every later item
goes to the mailbox of the caller replica (its *consumer*) in this replica's
:class:`~stages.transport.channel.ChannelHub`, which that replica drains through one ``attach``
stream: one item per wake-up for all its requests here, whatever their number. Why: a Serve call
or stream item costs both ends serialisation, routing and loop wake-ups; per request and per step
that CPU is taken from the engine's own step on a small machine.

A request ends early in one of three ways, each running its task's ``finally``:
- :meth:`Producer.end` by key (the caller gave up; the default cancels the task, a deployment may
  pass its own way, e.g. an engine abort that still ends the stream with ``finish_reason="abort"``);
- its consumer replica died (:class:`~stages.transport.liveness.ConsumerWatch`): a killed caller
  cancels nothing, so the producer asks Ray whether it still exists;
- an abort naming another replica reached this one because that one is draining (no longer a
  routing candidate): it is forwarded to the directory, where the named replica picks it up.

An error after the acceptance reaches the caller in order, as a
:class:`~stages.transport.messages.RoutedError` after the items before it.

Plain asyncio (no Ray import), so it is unit-tested with fakes.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import pickle
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from stages.transport.channel import ChannelHub
from stages.transport.chunking import PART_BYTES
from stages.transport.liveness import ConsumerWatch, GoneCheck, ray_actors_gone
from stages.transport.messages import (
    AbortRequest,
    Admission,
    AdmissionBatch,
    BodyPart,
    ChannelBatch,
    RoutedError,
    RoutedFrame,
    StreamSummary,
)

logger = logging.getLogger("lifecycle.transport")

#: Seconds between a producer's asks for the aborts the directory holds for it.
FORWARDED_POLL_S = 1.0


@dataclass
class Job:
    """One admitted request as the producer runs it.

    ``items`` yields the acceptance first; each later item becomes channel items through ``wrap``
    (a job may also push to its consumer's mailbox itself, through :meth:`Producer.push`: the
    engine hands each step's outputs over from its step delivery, not through this generator).

    A job whose client may come back (a resumable stream) has ``record`` (every list of channel
    items due to its consumer, delivered or not), ``keep`` (its consumer died: return True to keep
    it running detached, :meth:`Producer.detach`) and ``on_end`` (its task ended)."""

    key: str
    #: The consumer replica reading it; ``None`` while detached.
    consumer: str | None
    items: AsyncIterator[Any]
    wrap: Callable[[Any], list[Any]]
    record: Callable[[list[Any]], None] | None = None
    keep: Callable[[], bool] | None = None
    on_end: Callable[[], None] | None = None


def frames(request_id: str, item: Any) -> list[RoutedFrame]:
    """The channel items of one Egress item: a frame, or a summary; a summary carrying a whole
    body sends the body first, pickled, in slices of at most :data:`PART_BYTES` (the consumer
    joins them: :class:`stages.transport.consumer.FrameCall`)."""
    if isinstance(item, StreamSummary) and item.body is not None:
        data = pickle.dumps(item.body, protocol=pickle.HIGHEST_PROTOCOL)
        parts = [RoutedFrame(request_id, BodyPart(data[i:i + PART_BYTES])) for i in range(0, len(data), PART_BYTES)]
        return [*parts, RoutedFrame(request_id, dataclasses.replace(item, body=None))]
    return [RoutedFrame(request_id, item)]


class Producer:
    """A replica's side of the requests sent to it (see the module docstring).

    ``merge`` folds what waited in a mailbox into one batch's items; ``directory`` is the app's
    Directory handle (forwarded aborts), or ``None``."""

    def __init__(self, replica: str, *, merge: Callable[[list[Any]], list[Any]] = list, directory: Any = None,
                 is_gone: GoneCheck = ray_actors_gone, watch_period_s: float | None = None) -> None:
        self.replica = replica
        self.hub = ChannelHub(replica, merge=merge)
        self.directory = directory
        self._jobs: dict[str, asyncio.Task[None]] = {}
        self._running: dict[str, Job] = {}
        self._end: Callable[[list[str]], Any] = self._cancel_tasks
        watch_args = {} if watch_period_s is None else {"period_s": watch_period_s}
        self.consumers = ConsumerWatch(self._consumer_gone, is_gone=is_gone, **watch_args)
        #: Admission calls received and the requests they carried (their ratio is the batching).
        self.calls = 0
        self.requests = 0
        self._poll: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    def set_end(self, end: Callable[[list[str]], Any]) -> None:
        """How requests are ended by key (default: cancel their tasks)."""
        self._end = end

    def __len__(self) -> int:
        """Requests running here."""
        return len(self._jobs)

    def running(self, key: str) -> bool:
        """Whether the request ``key`` still runs here."""
        return key in self._jobs

    # -- admission ---------------------------------------------------------------------------------
    async def submit(self, batch: AdmissionBatch, start: Callable[[Any], Job]) -> list[Admission]:
        """Admit every request of ``batch`` (``start`` makes its :class:`Job`); one answer each."""
        self.calls += 1
        self.requests += len(batch.items)
        return list(await asyncio.gather(*(self._admit(start(item)) for item in batch.items)))

    async def _admit(self, job: Job) -> Admission:
        loop = asyncio.get_running_loop()
        first: asyncio.Future[Any] = loop.create_future()
        assert job.consumer is not None
        self.hub.open(job.consumer)
        self.consumers.add(job.consumer, (job.consumer, job.key))
        # A fresh context: the job outlives the batch call that started it.
        task = loop.create_task(self._drive(job, first), context=contextvars.Context())
        self._jobs[job.key] = task
        self._running[job.key] = job

        def done(t: asyncio.Task[None]) -> None:
            if self._jobs.get(job.key) is t:
                del self._jobs[job.key]
                del self._running[job.key]
            if job.consumer is not None:
                self.hub.close(job.consumer)
                self.consumers.discard(job.consumer, (job.consumer, job.key))
            if not first.done():  # cancelled before ``_drive`` ever ran: the answer must not hang
                first.set_exception(RuntimeError("the request was cancelled before it was accepted"))
            if job.on_end is not None:
                job.on_end()

        task.add_done_callback(done)
        try:
            return Admission(item=await asyncio.shield(first))
        except Exception as exc:  # noqa: BLE001 - the refusal goes back as the request's answer
            return Admission(error=exc)

    async def _drive(self, job: Job, first: asyncio.Future[Any]) -> None:
        try:
            async for item in job.items:
                if not first.done():
                    first.set_result(item)
                else:
                    self._send(job, job.wrap(item))
            if not first.done():
                first.set_exception(RuntimeError("the request ended before it was accepted"))
        except asyncio.CancelledError:
            if not first.done():
                first.set_exception(RuntimeError("the request was cancelled before it was accepted"))
            raise
        except Exception as exc:  # noqa: BLE001 - before the acceptance a refusal, after it a failure
            if not first.done():
                first.set_exception(exc)
            else:
                self._send(job, [RoutedError(job.key, exc)])

    def _send(self, job: Job, items: list[Any]) -> None:
        if job.record is not None:
            job.record(items)
        if job.consumer is not None:
            self.hub.push(job.consumer, items)

    def push(self, consumer: str, items: list[Any]) -> None:
        """Items of a running request, straight into its consumer's mailbox."""
        self.hub.push(consumer, items)

    # -- a client that leaves and comes back ---------------------------------------------------------------
    def detach(self, key: str) -> bool:
        """The request ``key`` goes on with no consumer (its items are only recorded) until
        :meth:`retarget`; False when it is not running here."""
        job = self._running.get(key)
        if job is None:
            return False
        if job.consumer is not None:
            self.hub.close(job.consumer)
            self.consumers.discard(job.consumer, (job.consumer, key))
            job.consumer = None
        return True

    def retarget(self, key: str, consumer: str, items: list[Any]) -> None:
        """Send ``items`` (what the new consumer missed) to ``consumer``'s mailbox, then the
        request's own items as they come, if it still runs."""
        job = self._running.get(key)
        self.hub.open(consumer)
        self.hub.push(consumer, items)
        if job is None:  # finished: what was pushed is all there is
            self.hub.close(consumer)
            return
        if job.consumer is not None:
            self.hub.close(job.consumer)
            self.consumers.discard(job.consumer, (job.consumer, key))
        job.consumer = consumer
        self.consumers.add(consumer, (consumer, key))

    # -- the consumer's stream -------------------------------------------------------------------------
    async def attach(self, consumer: str) -> AsyncIterator[ChannelBatch]:
        """The channel of ``consumer`` on this replica: everything waiting, one batch per wake-up."""
        async for batch in self.hub.attach(consumer):
            yield batch

    # -- ending requests early ---------------------------------------------------------------------------
    async def abort(self, request: AbortRequest) -> None:
        """End ``request.request_ids`` here, or forward them to the directory when they name
        another replica (that one is draining). Unknown or finished ids are ignored."""
        if request.replica and request.replica != self.replica and self.directory is not None:
            await self.directory.forward_abort(request)
            return
        self.end(request.request_ids)

    def end(self, keys: Iterable[str]) -> None:
        result = self._end(list(keys))
        if asyncio.iscoroutine(result):
            task = asyncio.get_running_loop().create_task(result)
            self._tasks.add(task)  # the loop keeps only a weak reference
            task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """Stop the forwarded-abort poll (shutdown, tests); running requests are not touched."""
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None

    def _cancel_tasks(self, keys: list[str]) -> int:
        cancelled = 0
        for key in keys:
            task = self._jobs.get(key)
            if task is not None:
                task.cancel()
                cancelled += 1
        return cancelled

    def _consumer_gone(self, entry: tuple[str, str]) -> None:
        """The replica reading this request died: end it here, and forget its mailbox."""
        consumer, key = entry
        job = self._running.get(key)
        if job is not None and job.consumer == consumer and job.keep is not None and job.keep():
            self.detach(key)  # resumable: it runs on for a client that may come back elsewhere
        else:
            self._cancel_tasks([key])
        self.hub.drop(consumer)

    def poll_forwarded(self, period_s: float = FORWARDED_POLL_S) -> None:
        """Take the aborts the directory holds for this replica every ``period_s`` (for a producer
        with no report loop of its own to carry them)."""
        if self.directory is not None and self._poll is None:
            self._poll = asyncio.get_running_loop().create_task(self._poll_forever(period_s))

    async def _poll_forever(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                ids = await self.directory.take_aborts(self.replica)
            except Exception as exc:  # noqa: BLE001 - the directory restarts; ask again next time
                logger.debug("taking forwarded aborts failed: %r", exc)
                continue
            if ids:
                self.end(ids)
                logger.info("ended %d request(s) forwarded by the directory", len(ids))

    def stats(self) -> dict[str, float]:
        """Counters and gauges of this side of the transport (reports, tests, leak checks)."""
        return {"admitted_streams": len(self._jobs), "admission_calls": self.calls,
                "admission_requests": self.requests, "consumer_gone_aborts": self.consumers.ended,
                "channel_mailboxes": len(self.hub), "channel_pending": self.hub.num_pending(),
                "channel_batches": self.hub.batches_sent, "channel_items": self.hub.items_sent}
