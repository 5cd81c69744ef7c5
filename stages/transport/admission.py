"""Batched admission, the caller's half: the requests a replica sends the next stage in one loop
turn travel in one ``submit`` call.

Why: each Serve call costs both ends a round of routing, gRPC and event-loop work (about 1 ms of
CPU per end), and in a burst of 32 requests that work queues on the one core the engine's step
leaves to the stages. Only the acceptance needs a call (the channels carry everything after it),
and the acceptances of one loop turn can share it.

How: :meth:`AdmissionQueue.submit` queues a request and returns a future for its acceptance. The
queue sends everything waiting as :class:`~stages.transport.messages.AdmissionBatch` calls (one per
routing key, at most ``max_batch`` requests each, so a burst still spreads over several replicas).
The callee (:mod:`stages.transport.producer`) answers with one
:class:`~stages.transport.messages.Admission` per request: its first item, or its refusal.

When to send: with no call of this queue in flight (an idle server), at the end of the loop turn,
so a lone request waits for nothing. With calls in flight (a burst is being admitted: an answer
takes until the engine's next step boundary), requests wait up to ``window_s`` for others, since a
burst's requests reach a stage a few milliseconds apart, each on its own loop turn.

A request given up before its acceptance came back (its future cancelled) is handed to
``on_orphan`` when the acceptance comes, so the caller can end it there.

The calls go out in a fresh ``contextvars`` context: Serve cancels the calls a request makes when
that request is cancelled, and a batch call belongs to no single request.

Plain asyncio (no Ray), so it is unit-tested directly.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Hashable
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
