"""The consumer side of the shared channels (:mod:`stages.transport.channel`): Egress reads engine outputs,
Ingress reads Egress's frames.

A :class:`ChannelClient` opens one attach stream per producer replica it has requests on and hands
each item to the inbox of its request (:class:`Inbox` for engine outputs, :class:`FrameInbox` for
frames); :mod:`stages.transport.consumer` reads them. An item whose request no inbox waits for any
more ends that request in its producer (``on_stray``).

Plain asyncio (no Ray), so it is unit-tested directly.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from stages.transport.channel import merge_group
from stages.transport.messages import ChannelBatch, EngineOutput, RoutedError, RoutedFrame, StreamSummary

logger = logging.getLogger("lifecycle.channel")

#: Attaches in a row that end with no output while requests still wait on them: the replica has
#: lost those requests (a killed replica's streams can end cleanly), so they fail.
MAX_EMPTY_ATTACHES = 3
#: Request ids a consumer remembers as ended or already aborted, so that the items of a request
#: nobody waits for any more cause at most one abort (:meth:`ChannelClient.unregister`).
MAX_SETTLED_IDS = 4096


class _Slot:
    """What a channel delivers to one API request: its items in arrival order, or a failure."""

    def __init__(self, keys: list[str]) -> None:
        #: The ids the channel's items are routed by.
        self.keys = keys
        self.replica = ""
        self._pending: list[Any] = []
        self._event = asyncio.Event()
        self._error: BaseException | None = None
        #: The producer sent the request's last item, or an error ending it there.
        self.finished = False

    def push(self, item: Any) -> None:
        self._pending.append(item)
        self._event.set()

    def fail(self, error: BaseException, *, by_producer: bool = False) -> None:
        """End the request with ``error`` once what came before it is taken; ``by_producer``: the
        producer sent it (the request ended there), else the channel was lost."""
        if self._error is None:
            self._error = error
            self.finished = self.finished or by_producer
        self._event.set()

    async def _wait(self) -> None:
        """Until something is pending; the failure is raised only once what came before it is taken."""
        while not self._pending:
            if self._error is not None:
                raise self._error
            await self._event.wait()
            self._event.clear()


class Inbox(_Slot):
    """The engine outputs of one API request (all its choices, by their engine request ids)."""

    def __init__(self, choice_ids: list[str]) -> None:
        super().__init__(choice_ids)
        self._open = set(choice_ids)

    @property
    def done(self) -> bool:
        """Every choice's final output has been taken (by :meth:`get`, or noted)."""
        return not self._open

    def note(self, outs: list[EngineOutput]) -> None:
        """Outputs that reached the request another way (its acceptance item): count their ends."""
        for out in outs:
            if out.finish_reason is not None:
                self._open.discard(out.request_id)
        self.finished = self.finished or not self._open

    async def get(self) -> list[EngineOutput]:
        """Everything delivered since the last call, one merged output per choice."""
        await self._wait()
        outs, self._pending = self._pending, []
        self.note(outs)
        return merge_group(outs)


class FrameInbox(_Slot):
    """The frames of one API request from its Egress replica, in order, up to its summary (a whole
    body comes as :class:`~stages.transport.messages.ReplyPart` items before it); an error Egress
    met after the start comes in its place, after the frames before it."""

    def __init__(self, request_id: str) -> None:
        super().__init__([request_id])

    async def __anext__(self) -> Any:
        """The next frame, body part or summary."""
        await self._wait()
        item: RoutedFrame = self._pending.pop(0)
        if isinstance(item.item, StreamSummary):
            self.finished = True
        return item.item


_S = TypeVar("_S", bound=_Slot)

#: Opens the consumer's attach stream to one producer replica.
Attach = Callable[[str], AsyncIterator[ChannelBatch]]
#: The error an inbox fails with when its replica's channel is lost without an error of its own.
LostError = Callable[[str], BaseException]
#: Ends a request its producer replica is still running and no inbox here waits for:
#: ``(replica, request_id)``.
Stray = Callable[[str, str], None]


def is_final(item: Any) -> bool:
    """Whether a channel item is the last its request will send (nothing left to abort)."""
    if isinstance(item, EngineOutput):
        return item.finish_reason is not None
    if isinstance(item, RoutedFrame):
        return isinstance(item.item, StreamSummary)
    return True  # a RoutedError


class ChannelClient:
    """Consumer side: one attach per producer replica with open requests; each item goes to the
    inbox registered for its ``request_id``.

    An item no inbox waits for belongs to a request this replica gave up on. Usually its owner
    already aborted it (``unregister(..., aborted=True)``). When it did not (a batch call failed as
    a whole, so the caller never learned which replica admitted its requests), the item names that
    replica, and ``on_stray`` ends the request there: a request the producer still runs for nobody
    must not hold its KV blocks or its step slot until ``max_tokens``. Each id is aborted once."""

    def __init__(self, attach: Attach, lost_error: LostError, on_stray: Stray | None = None) -> None:
        self.attach = attach
        self.lost_error = lost_error
        self.on_stray = on_stray
        self._inboxes: dict[str, _Slot] = {}
        self._by_replica: dict[str, set[_Slot]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: Ids that need no abort from here (ended, or aborted by their owner), oldest first.
        self._settled: OrderedDict[str, None] = OrderedDict()
        #: Requests ended through ``on_stray`` (tests, leak checks).
        self.strays_aborted = 0

    def register(self, choice_ids: list[str]) -> Inbox:
        """Before the request is sent: engine outputs for these ids are kept from now on."""
        return self.add(Inbox(choice_ids))

    def register_frames(self, request_id: str) -> FrameInbox:
        """Before the request is sent: its frames are kept from now on."""
        return self.add(FrameInbox(request_id))

    def add(self, inbox: _S) -> _S:
        for key in inbox.keys:
            self._inboxes[key] = inbox
        return inbox

    def bind(self, inbox: _Slot, replica: str) -> None:
        """The request was accepted by ``replica``: make sure its channel is attached."""
        inbox.replica = replica
        self._by_replica.setdefault(replica, set()).add(inbox)
        task = self._tasks.get(replica)
        if task is None or task.done():
            # A fresh context: the attach must not belong to the request that happened to start
            # it (Serve cancels a request's calls with it, and this one serves every request).
            self._tasks[replica] = asyncio.get_running_loop().create_task(self._run(replica),
                                                                          context=contextvars.Context())

    def unregister(self, inbox: _Slot, *, aborted: bool = False) -> None:
        """The request no longer reads its items. ``aborted``: its owner has ended it in the
        producer (or it had ended), so late items are dropped; otherwise they abort it there."""
        for key in inbox.keys:
            if self._inboxes.get(key) is inbox:
                del self._inboxes[key]
            if aborted:
                self._settle(key)
        waiting = self._by_replica.get(inbox.replica)
        if waiting is not None:
            waiting.discard(inbox)
            if not waiting:
                del self._by_replica[inbox.replica]

    def num_attached(self) -> int:
        return sum(1 for t in self._tasks.values() if not t.done())

    def settle(self, request_id: str) -> bool:
        """``request_id`` needs no abort from here (its owner ends it): its late items are dropped.
        False when it was settled already (it has been aborted, or it ended)."""
        if request_id in self._settled:
            return False
        self._settle(request_id)
        return True

    def _settle(self, request_id: str) -> None:
        self._settled[request_id] = None
        self._settled.move_to_end(request_id)
        while len(self._settled) > MAX_SETTLED_IDS:
            self._settled.popitem(last=False)

    def _stray(self, replica: str, item: Any) -> None:
        """An item nobody here waits for: end its request in ``replica`` unless it has ended."""
        request_id = item.request_id
        if self.on_stray is None or request_id in self._settled:
            return
        self._settle(request_id)
        if is_final(item):
            return
        self.strays_aborted += 1
        logger.info("ending request %s on %s: its items reach no request here", request_id, replica)
        self.on_stray(replica, request_id)

    def _fail(self, replica: str, error: BaseException) -> None:
        for inbox in self._by_replica.get(replica, ()):
            inbox.fail(error)

    async def _run(self, replica: str) -> None:
        empty = 0
        while self._by_replica.get(replica):
            delivered = 0
            try:
                async for batch in self.attach(replica):
                    if batch.replica != replica:  # the replica is gone and the call went elsewhere
                        self._fail(replica, self.lost_error(replica))
                        return
                    for item in batch.items:
                        inbox = self._inboxes.get(item.request_id)
                        if inbox is None:
                            self._stray(replica, item)
                            continue
                        if isinstance(item, RoutedError):
                            inbox.fail(item.error, by_producer=True)  # raised after the items before it
                        else:
                            inbox.push(item)
                    delivered += len(batch.items)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the replica or the call failed: its requests fail
                logger.warning("channel to replica %s failed: %r", replica, exc)
                self._fail(replica, exc)
                return
            # Ended normally (linger, or a newer attach): attach again while requests still wait.
            empty = 0 if delivered else empty + 1
            if empty >= MAX_EMPTY_ATTACHES:
                self._fail(replica, self.lost_error(replica))
                return
