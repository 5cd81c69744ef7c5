"""Batched admission: the requests a replica sends the next stage in one loop turn travel in one call.

Why: a request used to open its own streamed call on each hop (Ingress → Egress, Egress →
engine), whose first item said "accepted" and which stayed open until the request ended. Each of
those calls costs both ends a round of Serve routing, gRPC and event-loop work (~1 ms of CPU per
end, measured), and in a burst of 32 requests that work queues on the one core the engine's step
thread leaves to the stages: round 9 measured ~300 ms from the burst's first send to its last
request reaching the engine. Since the shared channels (:mod:`stages.transport.channel`) already carry
everything after the acceptance, only the acceptance needs a call, and the acceptances of one
loop turn can share it.

How: :meth:`AdmissionQueue.submit` queues a request and returns a future for its acceptance. The
queue sends everything waiting as :class:`AdmissionBatch` calls (one per routing key, at most
``max_batch`` requests each, so a burst still spreads over several replicas). The callee starts
each request as it would a stream of its own and answers with one :class:`Admission` per request:
the stream's first item, or its refusal.

When to send: with no call of this queue in flight (an idle server), at the end of the loop turn,
so a lone request waits for nothing. With calls in flight (a burst is being admitted: an answer
takes until the engine's next step boundary), requests wait up to ``window_s`` for others. A
burst's requests reach a stage a few milliseconds apart, each on its own loop turn (measured: a
burst of 32 through the app sent 1.4 requests per call with no window).

What the per-request stream used to do, and where it went:
- its first item (accept or refuse) → the :class:`Admission` in the reply;
- its later items → the caller's channel, as before;
- a failure after the acceptance → a :class:`RoutedError` in the channel, in order;
- the producer replica dying → the channel's attach fails (its requests fail with it);
- the caller dying → the callee's :class:`stages.transport.liveness.ConsumerWatch`, as before;
- the caller cancelling → an explicit :class:`AbortRequest` to the replica that accepted it; a
  request given up before its acceptance came back is aborted when it comes (``on_orphan``).

The calls go out in a fresh ``contextvars`` context: Serve cancels the calls a request makes when
that request is cancelled, and a batch call belongs to no single request.

Plain asyncio (no Ray), so it is unit-tested directly.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

from stages.transport.messages import Admission

logger = logging.getLogger("lifecycle.admission")

T = TypeVar("T")

#: Requests at most in one call. A burst of 32 goes out in a few calls, which the router may send
#: to different replicas; one call for all would put the whole burst on one.
DEFAULT_MAX_BATCH = 8

#: Seconds a request waits for others while calls are in flight (never when none is).
DEFAULT_WINDOW_S = 0.005

#: Sends one batch; returns one :class:`Admission` per item, in order.
Send = Callable[[list[Any]], Awaitable[list[Admission]]]


class AdmissionQueue(Generic[T]):
    """Caller side of batched admission (see the module docstring).

    ``key(item)`` groups what may share a call (e.g. requests that must avoid the same replicas);
    ``on_orphan(item, accepted)`` is called for a request that was accepted after its caller gave
    up on it (its future cancelled): the caller must abort it there.
    """

    def __init__(self, send: Send, *, key: Callable[[T], Hashable] | None = None,
                 on_orphan: Callable[[T, Any], None] | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.send = send
        self.window_s = window_s
        self.key = key
        self.on_orphan = on_orphan
        self.max_batch = max(1, max_batch)
        self._waiting: list[tuple[T, asyncio.Future[Any]]] = []
        self._scheduled = False
        self._calls: set[asyncio.Task[None]] = set()
        #: Calls sent and requests they carried (their ratio is the batching achieved).
        self.calls_sent = 0
        self.items_sent = 0

    def submit(self, item: T) -> asyncio.Future[Any]:
        """Queue ``item``; the future gets its stream's first item, or raises its refusal."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._waiting.append((item, future))
        if not self._scheduled:
            self._scheduled = True
            if self._calls and self.window_s > 0:
                loop.call_later(self.window_s, self._flush, context=contextvars.Context())
            else:
                loop.call_soon(self._flush, context=contextvars.Context())
        return future

    def num_in_flight(self) -> int:
        """Calls sent and not answered yet (tests, leak checks)."""
        return len(self._calls)

    def _flush(self) -> None:
        self._scheduled = False
        waiting, self._waiting = self._waiting, []
        groups: dict[Hashable, list[tuple[T, asyncio.Future[Any]]]] = {}
        for entry in waiting:
            if entry[1].done():  # given up before it was sent: nothing to admit or abort
                continue
            groups.setdefault(self.key(entry[0]) if self.key is not None else None, []).append(entry)
        loop = asyncio.get_running_loop()
        for group in groups.values():
            for start in range(0, len(group), self.max_batch):
                batch = group[start:start + self.max_batch]
                task = loop.create_task(self._call(batch), context=contextvars.Context())
                self._calls.add(task)
                task.add_done_callback(self._calls.discard)

    async def _call(self, batch: list[tuple[T, asyncio.Future[Any]]]) -> None:
        self.calls_sent += 1
        self.items_sent += len(batch)
        try:
            replies = await self.send([item for item, _ in batch])
            if len(replies) != len(batch):
                raise RuntimeError(f"admission reply has {len(replies)} answers for {len(batch)} requests")
        except BaseException as exc:  # noqa: BLE001 - the call failed: so does every request in it
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for (item, future), reply in zip(batch, replies, strict=True):
            if future.done():
                if reply.error is None and self.on_orphan is not None:
                    self.on_orphan(item, reply.item)
            elif reply.error is not None:
                future.set_exception(reply.error)
            else:
                future.set_result(reply.item)

    async def close(self) -> None:
        """Wait for the calls in flight (shutdown, tests)."""
        if self._calls:
            await asyncio.gather(*self._calls, return_exceptions=True)


class AdmittedStreams:
    """Callee side: each admitted request's stream runs as a task of its own, keyed by request id.

    :meth:`admit` answers with the stream's first item (or its error) as soon as it comes; the
    stream then goes on in its task, handing each later item to ``rest`` and an error after the
    first item to ``failed`` (both put it in the caller's channel). :meth:`cancel` cancels a
    stream's task, which runs its ``finally`` as a cancelled stream call would."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    async def admit(self, key: str, stream: AsyncIterator[Any], rest: Callable[[Any], None],
                    failed: Callable[[BaseException], None]) -> Admission:
        loop = asyncio.get_running_loop()
        first: asyncio.Future[Any] = loop.create_future()
        # A fresh context: the stream outlives the batch call that started it.
        task = loop.create_task(self._drive(stream, first, rest, failed), context=contextvars.Context())
        self._tasks[key] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._tasks.get(key) is t:
                del self._tasks[key]
            if not first.done():  # cancelled before ``_drive`` ever ran: the answer must not hang
                first.set_exception(RuntimeError("the request was cancelled before it was accepted"))

        task.add_done_callback(done)
        try:
            return Admission(item=await asyncio.shield(first))
        except Exception as exc:  # noqa: BLE001 - the refusal goes back as the request's answer
            return Admission(error=exc)

    def cancel(self, key: str) -> bool:
        """Cancel the stream of ``key`` (no-op when unknown or done)."""
        task = self._tasks.get(key)
        if task is None:
            return False
        task.cancel()
        return True

    @staticmethod
    async def _drive(stream: AsyncIterator[Any], first: asyncio.Future[Any], rest: Callable[[Any], None],
                     failed: Callable[[BaseException], None]) -> None:
        try:
            async for item in stream:
                if not first.done():
                    first.set_result(item)
                else:
                    rest(item)
            if not first.done():
                first.set_exception(RuntimeError("the stream ended before its first item"))
        except asyncio.CancelledError:
            if not first.done():
                first.set_exception(RuntimeError("the request was cancelled before it was accepted"))
            raise
        except Exception as exc:  # noqa: BLE001 - before the first item a refusal, after it a failure
            if not first.done():
                first.set_exception(exc)
            else:
                failed(exc)


_background: set[asyncio.Task[None]] = set()


def fire_and_forget(call: Callable[[], Awaitable[Any]], what: str) -> asyncio.Task[None]:
    """Run ``call`` in a fresh context (no request's cancellation reaches it), logging a failure:
    aborts sent when a request goes away must not be cancelled with it."""

    async def run() -> None:
        try:
            await call()
        except Exception as exc:  # noqa: BLE001 - the owner is gone too: nothing left to abort
            logger.debug("%s failed: %r", what, exc)

    task = asyncio.get_running_loop().create_task(run(), context=contextvars.Context())
    _background.add(task)  # the loop keeps only a weak reference to its tasks
    task.add_done_callback(_background.discard)
    return task
