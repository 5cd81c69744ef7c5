"""Live requests of one Ingress replica: identity, cancel by id, and cleanup on every outcome.

Identity: every API request gets a server-minted id (:func:`mint_request_id`), unique across the
cluster and never reused. The engine, Egress and the directory key everything by it; the client's
``X-Request-Id`` is only a label (echoed, logged, traced, usable for cancel).

Cleanup: :meth:`Lifecycle.close` is the one exit of every request, whatever the outcome (ok,
client gone, cancelled, timeout, any error status). It runs exactly once per request: the entry
leaves the local registry and the directory, the span ends, metrics are observed and one log
line is written (through ``on_close``).

Cancel by id: :meth:`Lifecycle.cancel` finds requests by response id, minted id or client label,
here and (through the directory) on every other Ingress replica. The replica that owns a request
ends it the normal way: an abort by id, routed to the engine replica that runs it, so each choice
finishes with ``finish_reason="abort"`` and the client still gets what was generated and
``[DONE]``. A cancel that arrives before the engine has the request is applied the moment it does.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from stages.api.kinds import ApiKind
from stages.api.render import renderer
from stages.directory.client import MEMBERS_PERIOD_S
from stages.transport.messages import AbortRequest, EngineMoved, LiveEntry, StreamStart

logger = logging.getLogger("lifecycle.ingress")


class Outcome(StrEnum):
    """How a request ended: its log line's ``outcome``, and for a request that ended without its
    answer, the ``reason`` label of ``request_aborted_total``. A ``str`` enum, so both read exactly
    as these values."""

    #: Answered in full.
    OK = "ok"
    #: Answered, but ended early by a cancel by id (the choices finish with ``"abort"``).
    CANCELLED = "cancelled"
    #: The client disconnected before the answer was complete.
    CLIENT_GONE = "client_gone"
    #: ``http.request_timeout_s`` passed.
    TIMEOUT = "timeout"
    #: A streaming client stopped reading and its buffer filled (:class:`~stages.errors.SlowReaderError`).
    SLOW_READER = "slow_reader"
    #: Any other error (its HTTP status is in ``LiveRequest.status``).
    ERROR = "error"
    #: The client of a resumable stream left; the request goes on, kept for a reconnect.
    DETACHED = "detached"


def mint_request_id() -> str:
    """A fresh server request id: 128 random bits, hex (no ``-``, so choice ids stay unambiguous)."""
    return uuid.uuid4().hex


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


@dataclass
class LiveRequest:
    """Per-request state owned by Ingress: ids, clocks (this process only), span, outcome."""

    request_id: str
    kind: ApiKind
    span: Any
    client_request_id: str | None = None
    api_key_id: str | None = None
    t0: float = field(default_factory=time.perf_counter)
    #: Seconds from arrival until Preprocess returned (parse + template + tokenise + the hop).
    prep: float = 0.0
    ttft: float | None = None
    #: When the Egress call went out, and when the first token's frame came back (this process's
    #: ``perf_counter``): their difference minus the engine's own queue + prefill is the hops' time.
    dispatched_at: float | None = None
    first_frame_at: float | None = None
    #: Seconds from the first token's frame arriving to its ASGI send returning.
    first_flush: float | None = None
    last_token_at: float | None = None
    itls: list[float] = field(default_factory=list)
    outcome: Outcome = Outcome.OK
    status: int = 200
    #: Where the engine runs it; set once the engine accepted the request.
    engine_replica: str | None = None
    engine_ids: list[str] = field(default_factory=list)
    cancel_requested: bool = False
    closed: bool = False
    #: Rendered prompt, for opt-in logging only.
    prompt_text: str | None = None
    #: A resumable stream (its client may leave and reconnect), and its reconnects so far.
    resumable: bool = False
    reconnects: int = 0

    @property
    def response_id(self) -> str:
        return renderer(self.kind).response_id(self.request_id)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def mark_tokens(self, num_tokens: int) -> None:
        """Clock a streamed event carrying ``num_tokens`` tokens (TTFT and inter-token gaps)."""
        if not num_tokens:
            return
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.t0
            self.first_frame_at = now
        elif self.last_token_at is not None:
            # Coalesced events carry several tokens: spread the gap over them.
            self.itls.extend([(now - self.last_token_at) / num_tokens] * num_tokens)
        self.last_token_at = now

    def mark_flushed(self) -> None:
        """The frame counted by the first :meth:`mark_tokens` has been handed to the server."""
        if self.first_flush is None and self.first_frame_at is not None:
            self.first_flush = time.perf_counter() - self.first_frame_at

    def ttft_parts(self, engine_timings: dict[str, float]) -> dict[str, float]:
        """TTFT as this server saw it, in seconds, split into parts that add up to it: ``prep``
        (parse, template, tokenise and that hop), ``hops`` (Ingress→Egress→Engine and the first
        token's way back, with Egress's work on it), ``queue`` and ``prefill`` (the engine's own
        clocks) and ``first_flush`` (framing and handing it to the HTTP server). Each duration is
        taken in one process; only durations cross processes."""
        parts = {"prep": self.prep}
        engine_part = engine_timings.get("queue", 0.0) + engine_timings.get("prefill", 0.0)
        if self.dispatched_at is not None and self.first_frame_at is not None:
            parts["hops"] = max(self.first_frame_at - self.dispatched_at - engine_part, 0.0)
        if self.first_flush is not None:
            parts["first_flush"] = self.first_flush
        return parts

    def entry(self, owner: str) -> LiveEntry:
        return LiveEntry(self.request_id, self.response_id, owner, self.client_request_id, self.api_key_id)


#: Sends an abort to the engine replica it names.
AbortFn = Callable[[AbortRequest], Coroutine[Any, Any, None]]
#: Called once per request from :meth:`Lifecycle.close`: (request, summary or None, timings or None).
CloseHook = Callable[[LiveRequest, Any, "dict[str, float] | None"], None]


#: Seconds a detached stream's entry stays in the directory after its client left: its Egress
#: replica's ``keep`` replaces it meanwhile (a reconnect waits while it still looks attached).
DETACHED_REMOVAL_DELAY_S = 5.0
#: Seconds the directory sync waits after the first change before it goes out. A sync is a Serve
#: call on this replica's loop; sent at once, it would go out between a request's arrival and its
#: Egress call and delay that call. Waiting puts it in the idle time of the prefill, and batches
#: everything that changed meanwhile into one call. A cancel
#: by id sent to another replica within this long of the request's arrival may not find it yet.
#: Removals do not wait (:meth:`Lifecycle._pause`).
SYNC_DELAY_S = 0.02


class Lifecycle:
    """The live-request registry of one Ingress replica, kept in sync with the app's directory."""

    def __init__(self, owner: str, *, directory: Any = None, abort: AbortFn | None = None,
                 on_close: CloseHook | None = None, sync_delay_s: float = SYNC_DELAY_S,
                 end_kept: Callable[[str, list[str]], None] | None = None) -> None:
        self.owner = owner
        #: Ends detached resumable streams on the Egress replica keeping them: (replica, ids).
        self.end_kept = end_kept
        self.directory = directory
        self.sync_delay_s = sync_delay_s
        self._removal = asyncio.Event()
        self.abort = abort
        self.on_close = on_close
        self.live: dict[str, LiveRequest] = {}
        # Directory changes not yet sent; an entry opened and closed within one batch is never sent.
        self._added: dict[str, LiveEntry] = {}
        self._removed: list[str] = []
        #: Directory replicas that hold this replica's list, and those that must get all of it again.
        self._synced: set[str] = set()
        self._resync: set[str] = set()
        self._flushing = False
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- open / start / close ------------------------------------------------------------------------
    def open(self, kind: ApiKind, span: Any, *, client_request_id: str | None = None, api_key_id: str | None = None,
             t0: float | None = None, request_id: str | None = None) -> LiveRequest:
        """Register a new request under a freshly minted id, or under ``request_id`` (a reconnect
        to a resumable stream), here and in the directory (batched)."""
        live = LiveRequest(request_id or mint_request_id(), kind, span, client_request_id, api_key_id)
        if t0 is not None:
            live.t0 = t0
        self.live[live.request_id] = live
        self._added[live.request_id] = live.entry(self.owner)
        self._schedule_flush()
        return live

    def started(self, live: LiveRequest, start: StreamStart) -> None:
        """The engine accepted the request: remember where, and apply a cancel that came early."""
        live.engine_replica = start.engine_replica
        live.engine_ids = list(start.engine_request_ids)
        if live.cancel_requested:
            self._send_abort(live)

    def moved(self, live: LiveRequest, moved: EngineMoved) -> None:
        """The request moved to another engine replica (its first was lost): a cancel by id and
        the liveness check follow it there. A cancel that came during the move went to the lost
        replica: it is sent again, to the new one."""
        live.engine_replica = moved.engine_replica
        live.engine_ids = list(moved.engine_request_ids)
        live.span.add_event("engine_moved", {"lifecycle.engine_replica": moved.engine_replica})
        if live.cancel_requested:
            self._send_abort(live)

    def close(self, live: LiveRequest, outcome: Outcome | None = None, summary: Any = None,
              timings: dict[str, float] | None = None) -> bool:
        """End the request's life here: exactly once, whatever called it. Returns False when it
        had already been closed."""
        if live.closed:
            return False
        live.closed = True
        if outcome is not None:
            live.outcome = outcome
        self.live.pop(live.request_id, None)
        if self._added.pop(live.request_id, None) is None:
            if live.outcome == Outcome.DETACHED:
                # Its Egress replica now registers it as kept, which replaces this entry; removed
                # at once, a reconnect in between would find neither and answer 404.
                asyncio.get_running_loop().call_later(DETACHED_REMOVAL_DELAY_S, self._remove, live.request_id)
            else:
                self._remove(live.request_id)
        if self.on_close is not None:
            try:
                self.on_close(live, summary, timings)
            except Exception:  # observability must never break the response path
                logger.exception("close hook failed for %s", live.request_id)
        return True

    def _remove(self, request_id: str) -> None:
        self._removed.append(request_id)
        self._removal.set()
        self._schedule_flush()

    # -- cancel ----------------------------------------------------------------------------------------
    def find_local(self, key: str, api_key_id: str | None = None) -> list[LiveRequest]:
        """Local requests named by ``key`` (response id, minted id, or client label)."""
        by_id = self.live.get(key) or next((r for r in self.live.values() if r.response_id == key), None)
        found = [by_id] if by_id is not None else [r for r in self.live.values() if r.client_request_id == key]
        return [r for r in found if r.api_key_id is None or r.api_key_id == api_key_id]

    def cancel_local(self, request_id: str) -> bool:
        """Cancel one request this replica owns; False if it is not (or no longer) live here."""
        live = self.live.get(request_id)
        if live is None or live.closed:
            return False
        if not live.cancel_requested:
            live.cancel_requested = True
            live.span.add_event("cancel_requested")
            if live.engine_replica is not None:
                self._send_abort(live)
        return True

    async def cancel(self, key: str, api_key_id: str | None = None) -> list[LiveEntry]:
        """Cancel every live request ``key`` names, on any Ingress replica. Returns them."""
        local = self.find_local(key, api_key_id)
        for live in local:
            self.cancel_local(live.request_id)
        found = {live.request_id: live.entry(self.owner) for live in local}
        exact = len(local) == 1 and key in (local[0].request_id, local[0].response_id)
        if self.directory is not None and not exact:
            for entry in await self.directory.cancel(key, api_key_id):
                if entry.kept and self.end_kept is not None and entry.request_id not in found:
                    self.end_kept(entry.owner, [entry.request_id])
                found.setdefault(entry.request_id, entry)
        return list(found.values())

    def _send_abort(self, live: LiveRequest) -> None:
        if self.abort is None or not live.engine_ids:
            return
        self._spawn(self.abort(AbortRequest(live.engine_replica or "", list(live.engine_ids))))

    # -- directory sync ----------------------------------------------------------------------------------
    def _schedule_flush(self) -> None:
        if self.directory is None or self._flushing:
            return
        self._flushing = True
        self._spawn(self._flush())

    def _unsynced(self) -> set[str]:
        """Directory replicas that must get this replica's whole list: new ones, and those that
        asked for it or missed a batch."""
        return (set(self.directory.members()) - self._synced) | self._resync

    async def _flush(self) -> None:
        """One round of sync calls at a time, in order, each carrying everything that
        accumulated: the changes to every Directory replica that has the rest, the whole list to
        any that does not."""
        try:
            while self._added or self._removed or self._unsynced():
                await self._pause()
                try:
                    members = await self.directory.ready_members()
                except Exception as exc:  # noqa: BLE001 - no Directory replica yet; keep the batch
                    logger.warning("directory unreachable (%r); will sync later", exc)
                    await asyncio.sleep(1.0)
                    continue
                unsynced = self._unsynced()
                if not (self._added or self._removed or unsynced):
                    break  # opened and closed meanwhile: nothing to tell
                added, removed = list(self._added.values()), self._removed
                self._added, self._removed = {}, []
                self._resync -= unsynced
                whole = [live.entry(self.owner) for live in self.live.values()] if unsynced else []
                calls = [self.directory.sync(m, self.owner, whole, [], True) if m in unsynced
                         else self.directory.sync(m, self.owner, added, removed, False) for m in members]
                answers = await asyncio.gather(*calls, return_exceptions=True)
                failed = False
                for member, answer in zip(members, answers, strict=True):
                    if isinstance(answer, asyncio.CancelledError) and _being_cancelled():
                        raise answer  # this replica is shutting down
                    if isinstance(answer, BaseException):
                        # Cancelled under us, or the replica failed: the batch may be lost there.
                        logger.warning("directory sync to %s failed (%r); will resync it", member, answer)
                        self._resync.add(member)
                        self._synced.discard(member)
                        failed = failed or not isinstance(answer, asyncio.CancelledError)
                    else:
                        self._synced.add(member)
                self._synced &= set(members)
                if failed:  # the replica restarts: give it a moment
                    await asyncio.sleep(1.0)
        finally:
            self._flushing = False

    async def _pause(self) -> None:
        """Wait out :attr:`sync_delay_s` before a sync of new entries. A removal ends the wait: a
        finished request leaves the directory one sync round trip after its end, so a cancel of
        its id is a 404 everywhere from then on (one racing the end still finds it: a 200 that
        cancels nothing)."""
        if self.sync_delay_s <= 0 or self._removed:
            return
        self._removal.clear()
        try:
            await asyncio.wait_for(self._removal.wait(), self.sync_delay_s)
        except TimeoutError:
            pass

    async def watch_forever(self, members_period_s: float = MEMBERS_PERIOD_S) -> None:
        """Long-poll every Directory replica for cancels of requests this replica owns (a cancel
        may reach any of them), following the replicas as they come and go."""
        watches: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                try:
                    members = set(await self.directory.ready_members())
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - no Directory replica yet
                    logger.warning("directory unreachable: %r", exc)
                    members = set()
                for member in members - watches.keys():
                    watches[member] = asyncio.get_running_loop().create_task(self._watch(member))
                for member in watches.keys() - members:
                    watches.pop(member).cancel()
                if self._unsynced():
                    self._schedule_flush()
                await asyncio.sleep(members_period_s)
        finally:
            for task in watches.values():
                task.cancel()

    async def _watch(self, member: str) -> None:
        while True:
            try:
                reply = await self.directory.watch(member, self.owner)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep watching through directory restarts
                logger.warning("directory watch on %s failed: %r", member, exc)
                await asyncio.sleep(1.0)
                continue
            if reply.resync:
                self._resync.add(member)
                self._schedule_flush()
                await asyncio.sleep(0.05)
            for rid in reply.cancel_ids:
                self.cancel_local(rid)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        # A fresh, empty context: a task inherits its creator's context vars, and Serve cancels
        # every handle call made in the context of an Ingress request that gets cancelled (the
        # client left). A directory sync or an engine abort spawned while closing that request
        # must outlive it; in the request's context, Serve cancelled it and the batch was lost.
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._tasks.add(task)  # keep a reference until done (the loop holds only weak ones)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("ingress background call failed: %r", task.exception())
