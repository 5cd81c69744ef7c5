"""One stream per Egress–engine replica pair for the tokens of all the requests between them.

Why: every item a Serve stream carries costs both ends a round of serialisation, gRPC and event
loop wake-ups (about 0.6 ms of CPU per item per hop, measured). With one stream per request, an
engine step at 32 streams sends 32 items to Egress; on a small machine that CPU is taken from the
engine's own step. Here a step sends one item per Egress replica, whatever the batch size.

What stays per request: each request keeps its own engine stream for *control*. It carries the
acceptance (or the refusal: a full queue is still retried elsewhere), cancelling it aborts the
request in the engine, it fails when the engine replica dies, and the engine's consumer watch ends
it when the Egress replica dies (:mod:`stages.liveness`). Only the tokens move: after the
acceptance item the engine puts the request's outputs in its consumer's mailbox
(:class:`ChannelHub`), and the consumer's ``attach`` stream to that replica drains the mailbox,
everything that accumulated in one :class:`~stages.protocol.ChannelBatch`. Egress's
:class:`ChannelClient` opens one attach per engine replica it has requests on and hands each
output to its request's :class:`Inbox`.

Lifetimes: a mailbox's attach ends once the consumer has had no live request on the replica for
``linger_s`` (an open stream would hold up the replica's drain on shutdown); the client attaches
again when a request needs it. Outputs wait in the mailbox until an attach takes them, so the
first tokens of a request that arrive before its attach is open are not lost.

Both sides are plain asyncio (no Ray), so they are unit-tested directly.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from stages.protocol import ChannelBatch, EngineOutput, TokenLogprob

logger = logging.getLogger("lifecycle.channel")

#: Seconds a consumer's attach stays open with no live request on the replica.
DEFAULT_LINGER_S = 1.0
#: Attaches in a row that end with no output while requests still wait on them: the replica has
#: lost those requests (a killed replica's streams can end cleanly), so they fail.
MAX_EMPTY_ATTACHES = 3


def merge_outputs(request_id: str, outs: list[EngineOutput]) -> EngineOutput:
    """Coalesce consecutive outputs of one engine request into one."""
    tokens: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    timings: dict[str, float] = {}
    for o in outs:
        tokens.extend(o.new_token_ids)
        if o.logprobs is not None:
            logprobs = (logprobs or []) + o.logprobs
        timings.update(o.timings)
    last = outs[-1]
    return EngineOutput(request_id, tokens, logprobs, last.finish_reason, last.stop_token_id,
                        last.num_prompt_tokens, last.num_cached_tokens, timings, index=outs[0].index,
                        replica=next((o.replica for o in outs if o.replica), None))


def merge_group(outs: list[EngineOutput]) -> list[EngineOutput]:
    """Coalesce outputs of several engine requests: one output per request, first-seen order."""
    by_id: dict[str, list[EngineOutput]] = {}
    for o in outs:
        by_id.setdefault(o.request_id, []).append(o)
    return [group[0] if len(group) == 1 else merge_outputs(rid, group) for rid, group in by_id.items()]


# -- engine side -----------------------------------------------------------------------------------
@dataclass
class _Mailbox:
    pending: list[EngineOutput] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    #: Requests of this consumer open on the replica.
    live: int = 0
    #: Bumped by every attach: an older attach of the same consumer ends (the newest one wins).
    attach_seq: int = 0


class ChannelHub:
    """The engine replica's mailboxes, one per consumer (an Egress replica's actor name)."""

    def __init__(self, replica: str, linger_s: float = DEFAULT_LINGER_S) -> None:
        self.replica = replica
        self.linger_s = linger_s
        self._boxes: dict[str, _Mailbox] = {}

    def open(self, consumer: str) -> None:
        """A request of ``consumer`` starts sending its tokens through the channel."""
        self._boxes.setdefault(consumer, _Mailbox()).live += 1

    def close(self, consumer: str) -> None:
        """That request's engine stream ended (its outputs are all pushed)."""
        box = self._boxes.get(consumer)
        if box is not None:
            box.live -= 1
            box.event.set()  # an idle attach starts its linger

    def push(self, consumer: str, outs: list[EngineOutput]) -> None:
        box = self._boxes.get(consumer)
        if box is not None:  # dropped: the consumer is gone, nobody would read these
            box.pending.extend(outs)
            box.event.set()

    def drop(self, consumer: str) -> None:
        """The consumer died: forget its mailbox (its attach, if any, ends)."""
        box = self._boxes.pop(consumer, None)
        if box is not None:
            box.attach_seq += 1
            box.event.set()

    def num_pending(self) -> int:
        """Outputs waiting for an attach, over all consumers (tests, leak checks)."""
        return sum(len(b.pending) for b in self._boxes.values())

    def __len__(self) -> int:
        return len(self._boxes)

    async def attach(self, consumer: str) -> AsyncIterator[ChannelBatch]:
        """The consumer's stream: a hello, then one batch whenever outputs are waiting; ends after
        ``linger_s`` with no live request and nothing pending, or when a newer attach replaces it."""
        box = self._boxes.setdefault(consumer, _Mailbox())
        box.attach_seq += 1
        seq = box.attach_seq
        yield ChannelBatch(self.replica, [])
        try:
            while box.attach_seq == seq:
                box.event.clear()
                if box.pending:
                    outs, box.pending = box.pending, []
                    yield ChannelBatch(self.replica, merge_group(outs))
                    continue
                if box.live > 0:
                    await box.event.wait()
                    continue
                try:
                    await asyncio.wait_for(box.event.wait(), self.linger_s)
                except TimeoutError:
                    if box.live <= 0 and not box.pending:
                        return
        finally:
            if (box.attach_seq == seq and box.live <= 0 and not box.pending
                    and self._boxes.get(consumer) is box):
                del self._boxes[consumer]


# -- Egress side -----------------------------------------------------------------------------------
class Inbox:
    """The outputs of one API request (all its choices) as its channel delivers them."""

    def __init__(self, choice_ids: list[str]) -> None:
        self.choice_ids = choice_ids
        self.replica = ""
        self._pending: list[EngineOutput] = []
        self._event = asyncio.Event()
        self._error: BaseException | None = None
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

    def push(self, out: EngineOutput) -> None:
        self._pending.append(out)
        self._event.set()

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._event.set()

    async def get(self) -> list[EngineOutput]:
        """Everything delivered since the last call, one merged output per choice (waits for
        something; raises the failure, if any, once what arrived before it is taken)."""
        while not self._pending:
            if self._error is not None:
                raise self._error
            await self._event.wait()
            self._event.clear()
        outs, self._pending = self._pending, []
        self.note(outs)
        return merge_group(outs)


#: Opens the consumer's attach stream to one engine replica.
Attach = Callable[[str], AsyncIterator[ChannelBatch]]
#: The error an inbox fails with when its replica's channel is lost without an error of its own.
LostError = Callable[[str], BaseException]


class ChannelClient:
    """Egress side: one attach per engine replica with open requests, outputs to their inboxes."""

    def __init__(self, attach: Attach, lost_error: LostError) -> None:
        self.attach = attach
        self.lost_error = lost_error
        self._inboxes: dict[str, Inbox] = {}
        self._by_replica: dict[str, set[Inbox]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def register(self, choice_ids: list[str]) -> Inbox:
        """Before the request is sent: outputs for these ids are kept from now on."""
        inbox = Inbox(choice_ids)
        for rid in choice_ids:
            self._inboxes[rid] = inbox
        return inbox

    def bind(self, inbox: Inbox, replica: str) -> None:
        """The request was accepted by ``replica``: make sure its channel is attached."""
        inbox.replica = replica
        self._by_replica.setdefault(replica, set()).add(inbox)
        task = self._tasks.get(replica)
        if task is None or task.done():
            # A fresh context: the attach must not belong to the request that happened to start
            # it (Serve cancels a request's calls with it, and this one serves every request).
            self._tasks[replica] = asyncio.get_running_loop().create_task(self._run(replica),
                                                                          context=contextvars.Context())

    def unregister(self, inbox: Inbox) -> None:
        for rid in inbox.choice_ids:
            if self._inboxes.get(rid) is inbox:
                del self._inboxes[rid]
        waiting = self._by_replica.get(inbox.replica)
        if waiting is not None:
            waiting.discard(inbox)
            if not waiting:
                del self._by_replica[inbox.replica]

    def num_attached(self) -> int:
        return sum(1 for t in self._tasks.values() if not t.done())

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
                    for out in batch.outputs:
                        inbox = self._inboxes.get(out.request_id)
                        if inbox is not None:
                            inbox.push(out)
                    delivered += len(batch.outputs)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the replica or the call failed: its requests fail
                logger.warning("channel to engine %s failed: %r", replica, exc)
                self._fail(replica, exc)
                return
            # Ended normally (linger, or a newer attach): attach again while requests still wait.
            empty = 0 if delivered else empty + 1
            if empty >= MAX_EMPTY_ATTACHES:
                self._fail(replica, self.lost_error(replica))
                return
