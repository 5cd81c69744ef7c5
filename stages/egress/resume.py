"""Resumable streams: the events Egress keeps so a client that lost its connection can reconnect.

Rule: a stream that asked to be resumable (``X-Resumable``, :class:`ResumeTerms`) has every channel
item Egress sends for it recorded here, from its first frame to its summary (or its error), as the
client would have received them, each frame with its SSE ``id``. While a client is attached the
record only grows; when the client leaves, the Ingress *detaches* the stream and the request goes
on generating into the record; a reconnect (any Ingress replica, found through the directory)
*takes* the stream: the events after the client's ``Last-Event-ID`` are sent again, then the live
ones follow through the new Ingress replica's channel.

Why in Egress: Egress is where the frames are made, and it outlives the Ingress replica that held
the connection. An Ingress that dies is a detach like any other (its consumer watch notices), so
its clients can reconnect elsewhere; kept in the Ingress, the events would die with it.

Lifetimes: a detached stream is kept for ``grace_s``; if nobody takes it by then, it is *expired*:
the request is aborted (its KV blocks freed) and the record dropped. A finished stream's record
stays ``grace_s`` after the later of its finish and its last detach, so a client that lost the last
events before ``[DONE]`` can still take them; then it goes. Past ``max_bytes`` the record is
dropped at once (memory is bounded per stream): an attached stream goes on unresumable, and a
detached one answers its reconnect with :class:`~stages.errors.EventsDroppedError`.

Plain asyncio (no Ray), so it is unit-tested directly; :mod:`stages.egress.deployment` wires it up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stages.errors import ConflictError, NotFoundError
from stages.transport.messages import LiveEntry, ResumeTerms, RoutedFrame, StreamFrame, StreamStart

#: Bytes counted for an item of a record that is not a frame (a summary, an error).
OTHER_ITEM_BYTES = 512


def item_bytes(item: Any) -> int:
    """What one recorded channel item costs the record: a frame's text in UTF-8, else a small
    constant."""
    if isinstance(item, RoutedFrame) and isinstance(item.item, StreamFrame):
        data = item.item.data
        return len(data) if data.isascii() else len(data.encode())
    return OTHER_ITEM_BYTES


def event_id(item: Any) -> int | None:
    """The SSE id of a recorded frame; ``None`` for the summary and errors (always sent again)."""
    if isinstance(item, RoutedFrame) and isinstance(item.item, StreamFrame):
        return item.item.event_id
    return None


@dataclass
class Kept:
    """One resumable stream's record and state."""

    request_id: str
    terms: ResumeTerms
    #: How the directory names it while detached (``owner`` is this Egress replica).
    entry: LiveEntry
    #: What a reconnect needs to answer with (the engine replica, the closing events' shape).
    shape: dict[str, Any]
    start: StreamStart | None = None
    items: list[Any] = field(default_factory=list)
    nbytes: int = 0
    dropped: bool = False
    attached: bool = True
    finished: bool = False
    #: Ended by this store (its record was dropped while detached): never ended twice.
    aborted: bool = False
    reconnects: int = 0
    timer: asyncio.TimerHandle | None = None


#: Called when a detached stream expires: ``(request_id, still_running)``.
OnExpire = Callable[[str, bool], None]
#: The directory learns of a detached stream ``(entry, seconds kept)`` and of its end ``(request_id)``.
OnKeep = Callable[[LiveEntry, float], None]
OnUnkeep = Callable[[str], None]


class ResumeStore:
    """An Egress replica's kept streams (see the module docstring)."""

    def __init__(self, owner: str, *, on_expire: OnExpire, on_keep: OnKeep | None = None,
                 on_unkeep: OnUnkeep | None = None) -> None:
        self.owner = owner
        self.on_expire = on_expire
        self.on_keep = on_keep
        self.on_unkeep = on_unkeep
        self._kept: dict[str, Kept] = {}
        self._empty = asyncio.Event()
        self._empty.set()
        #: Counters (metrics): streams kept, reconnects taken, events sent again, expiries, drops.
        self.opened = 0
        self.reconnects = 0
        self.replayed = 0
        self.expired = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._kept

    @property
    def nbytes(self) -> int:
        """Bytes of events kept, over every stream."""
        return sum(k.nbytes for k in self._kept.values())

    def is_detached(self, request_id: str) -> bool:
        kept = self._kept.get(request_id)
        return kept is not None and not kept.attached

    def detached(self) -> int:
        """Streams kept with nobody attached."""
        return sum(1 for k in self._kept.values() if not k.attached)

    def detached_entries(self) -> list[tuple[LiveEntry, float]]:
        """Each detached stream's directory entry and the seconds left of its grace period (a
        new Directory replica learns of them again)."""
        now = asyncio.get_running_loop().time()
        return [(k.entry, max(0.0, k.timer.when() - now)) for k in self._kept.values()
                if not k.attached and k.timer is not None]

    # -- a stream's life ------------------------------------------------------------------------------
    def open(self, request_id: str, terms: ResumeTerms, response_id: str, shape: dict[str, Any]) -> None:
        """Start recording a resumable stream (attached: its first client holds it)."""
        entry = LiveEntry(request_id, response_id, self.owner, terms.client_request_id, terms.api_key_id, kept=True)
        self._kept[request_id] = Kept(request_id, terms, entry, shape)
        self._empty.clear()
        self.opened += 1

    def started(self, request_id: str, start: StreamStart) -> None:
        kept = self._kept.get(request_id)
        if kept is not None:
            kept.start = start

    def record(self, request_id: str, items: list[Any]) -> None:
        """Items sent (or, detached, due) to the stream's client, in order."""
        kept = self._kept.get(request_id)
        if kept is None or kept.dropped:
            return
        kept.items.extend(items)
        kept.nbytes += sum(item_bytes(i) for i in items)
        if kept.nbytes > kept.terms.max_bytes:
            kept.items, kept.nbytes, kept.dropped = [], 0, True
            self.dropped += 1
            if not kept.attached and not kept.finished:
                # Nobody can get all of it any more: stop it now; the record stays, empty, so a
                # reconnect within the grace period learns why.
                kept.aborted = True
                self.on_expire(request_id, True)

    def detach(self, request_id: str) -> bool:
        """The client left: keep the stream for its grace period. False when it is not kept (not
        resumable, or its events were dropped while attached): the caller ends it as before."""
        kept = self._kept.get(request_id)
        if kept is None or not kept.attached:
            return kept is not None
        if kept.dropped and not kept.finished:
            self._forget(kept)
            return False
        kept.attached = False
        self._expire_in(kept, kept.terms.grace_s)
        if self.on_keep is not None:
            self.on_keep(kept.entry, kept.terms.grace_s)
        return True

    def finish(self, request_id: str) -> None:
        """The stream's last item is recorded: keep it ``grace_s`` more (the client may have lost
        the last events just before it left)."""
        kept = self._kept.get(request_id)
        if kept is None:
            return
        if kept.start is None:  # refused or cancelled before its acceptance: nothing to resume
            self._forget(kept)
            return
        kept.finished = True
        self._expire_in(kept, kept.terms.grace_s)

    def take(self, request_id: str, after: int) -> tuple[Kept, list[Any]]:
        """A reconnect: the stream's recorded items after event ``after`` (the summary and any
        error always), and it is attached again. Raises :class:`NotFoundError` when nothing is
        kept, :class:`ConflictError` while a client is attached. A dropped record answers with no
        items and ``dropped`` set; it is then forgotten (the caller ends the request)."""
        kept = self._kept.get(request_id)
        if kept is None:
            raise NotFoundError(f"No resumable stream has the id {request_id!r} (unknown, or its grace period ended).",
                                param="request_id", code="request_not_found")
        if kept.attached:
            raise ConflictError("The stream already has a connection attached.", param="request_id")
        if self.on_unkeep is not None:
            self.on_unkeep(request_id)
        kept.reconnects += 1
        self.reconnects += 1
        if kept.dropped:
            self._forget(kept)
            return kept, []
        kept.attached = True
        items = [i for i in kept.items if (eid := event_id(i)) is None or eid > after]
        self.replayed += sum(1 for i in items if event_id(i) is not None)
        if kept.finished:
            self._expire_in(kept, kept.terms.grace_s)
        else:
            self._cancel_timer(kept)
        return kept, items

    def forget(self, request_id: str) -> None:
        """Drop a stream's record now (it was aborted, or its job ended without a record to keep)."""
        kept = self._kept.get(request_id)
        if kept is not None:
            self._forget(kept)

    async def drained(self) -> None:
        """Until no stream is kept (an Egress replica's drain waits for this)."""
        await self._empty.wait()

    # -- internals --------------------------------------------------------------------------------------
    def _expire_in(self, kept: Kept, seconds: float) -> None:
        self._cancel_timer(kept)
        kept.timer = asyncio.get_running_loop().call_later(seconds, self._expire, kept)

    def _cancel_timer(self, kept: Kept) -> None:
        if kept.timer is not None:
            kept.timer.cancel()
        kept.timer = None

    def _expire(self, kept: Kept) -> None:
        if self._kept.get(kept.request_id) is not kept:
            return
        running = not kept.finished and not kept.aborted
        if not kept.attached:
            self.expired += 1
            if self.on_unkeep is not None:
                self.on_unkeep(kept.request_id)
        self._forget(kept)
        if not kept.attached:
            self.on_expire(kept.request_id, running)

    def _forget(self, kept: Kept) -> None:
        self._cancel_timer(kept)
        if self._kept.get(kept.request_id) is kept:
            del self._kept[kept.request_id]
        kept.items = []
        if not self._kept:
            self._empty.set()
