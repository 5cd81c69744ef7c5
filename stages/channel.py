"""Shared streams between the replicas of two stages: one per consumer–producer replica pair.

Why: every item a Serve stream carries costs both ends a round of serialisation, gRPC and event
loop wake-ups (about 0.6 ms of CPU per item per hop, measured). With one stream per request, an
engine step at 32 streams sends 32 items to Egress, and Egress 32 more to Ingress; on a small
machine that CPU is taken from the engine's own step. Through a channel a step sends one item per
consumer replica, whatever the batch size. Two hops use it:

- **engine → Egress**: :class:`~stages.protocol.EngineOutput` items, merged per engine request
  while they wait (:class:`Inbox` on the Egress side);
- **Egress → Ingress**: :class:`~stages.protocol.RoutedFrame` items (a request's SSE frames and
  its summary, in order; :class:`FrameInbox` on the Ingress side).

What stays per request is *control*: the acceptance (or the refusal: a full queue is still
retried elsewhere), cancellation, and failure. With batched admission (:mod:`stages.admission`,
the default) the acceptance comes in the reply of a ``submit`` call shared with other requests,
cancellation is an explicit cancel or abort by id, an error after the acceptance is a
:class:`~stages.protocol.RoutedError` in the channel, and a dead producer fails its channel.
Without it each request keeps its own stream for control: it carries the acceptance, cancelling it
cancels the request downstream, and it fails when the producer replica dies. Either way the
producer's consumer watch ends a request whose consumer replica died (:mod:`stages.liveness`), and
only the data moves through the channel: after the acceptance the producer puts the request's items
in its consumer's mailbox (:class:`ChannelHub`), and the consumer's ``attach`` stream to that
replica drains the mailbox, everything that accumulated in one :class:`~stages.protocol.ChannelBatch`. The
consumer's :class:`ChannelClient` opens one attach per producer replica it has requests on and
hands each item to its request's inbox.

Lifetimes: a mailbox's attach ends once the consumer has had no live request on the replica for
``linger_s`` (an open stream would hold up the replica's drain on shutdown); the client attaches
again when a request needs it. Items wait in the mailbox until an attach takes them, so the first
tokens of a request that arrive before its attach is open are not lost.

Both sides are plain asyncio (no Ray), so they are unit-tested directly.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from stages.protocol import ChannelBatch, EngineOutput, RoutedError, RoutedFrame, StreamSummary, TokenLogprob

logger = logging.getLogger("lifecycle.channel")

#: Seconds a consumer's attach stays open with no live request on the replica.
DEFAULT_LINGER_S = 1.0
#: Items at most in one batch (the rest go in the next): a consumer that fell far behind must not
#: get a batch past the message size limit between deployments.
MAX_BATCH_ITEMS = 256
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


def merge_channel_items(items: list[Any]) -> list[Any]:
    """An engine mailbox's batch: one merged output per request, then any :class:`RoutedError`
    (a request's failure comes after its outputs, as it happened)."""
    outs = [i for i in items if isinstance(i, EngineOutput)]
    if len(outs) == len(items):
        return merge_group(items)
    return [*merge_group(outs), *(i for i in items if not isinstance(i, EngineOutput))]


# -- producer side (the engine, Egress) --------------------------------------------------------------
@dataclass
class _Mailbox:
    pending: list[Any] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    #: Requests of this consumer open on the replica.
    live: int = 0
    #: Bumped by every attach: an older attach of the same consumer ends (the newest one wins).
    attach_seq: int = 0


class ChannelHub:
    """A producer replica's mailboxes, one per consumer (the consumer replica's actor name).

    ``merge`` folds what waited in a mailbox into one batch's items (the engine merges each
    request's outputs into one; frames keep their order as they are)."""

    def __init__(self, replica: str, linger_s: float = DEFAULT_LINGER_S,
                 merge: Callable[[list[Any]], list[Any]] = list) -> None:
        self.replica = replica
        self.linger_s = linger_s
        self.merge = merge
        self._boxes: dict[str, _Mailbox] = {}
        #: Batches sent and the items they carried (their ratio is the multiplexing achieved).
        self.batches_sent = 0
        self.items_sent = 0
        #: Attach calls open now: Serve counts each as an ongoing request of this replica, which
        #: its autoscaling must not take for load (:func:`stages.autoscaling.stage_policy`).
        self.attaches = 0

    def open(self, consumer: str) -> None:
        """A request of ``consumer`` starts sending its tokens through the channel."""
        self._boxes.setdefault(consumer, _Mailbox()).live += 1

    def close(self, consumer: str) -> None:
        """That request's engine stream ended (its outputs are all pushed)."""
        box = self._boxes.get(consumer)
        if box is not None:
            box.live -= 1
            box.event.set()  # an idle attach starts its linger

    def push(self, consumer: str, outs: list[Any]) -> None:
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
        """Items waiting for an attach, over all consumers (tests, leak checks)."""
        return sum(len(b.pending) for b in self._boxes.values())

    def __len__(self) -> int:
        return len(self._boxes)

    async def attach(self, consumer: str) -> AsyncIterator[ChannelBatch]:
        """The consumer's stream: a hello, then one batch whenever items are waiting; ends after
        ``linger_s`` with no live request and nothing pending, or when a newer attach replaces it."""
        box = self._boxes.setdefault(consumer, _Mailbox())
        box.attach_seq += 1
        seq = box.attach_seq
        self.attaches += 1
        try:
            yield ChannelBatch(self.replica, [])
            while box.attach_seq == seq:
                box.event.clear()
                if box.pending:
                    outs = self.merge(box.pending)
                    box.pending = outs[MAX_BATCH_ITEMS:]
                    batch = ChannelBatch(self.replica, outs[:MAX_BATCH_ITEMS])
                    self.batches_sent += 1
                    self.items_sent += len(batch.items)
                    yield batch
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
            self.attaches -= 1
            if (box.attach_seq == seq and box.live <= 0 and not box.pending
                    and self._boxes.get(consumer) is box):
                del self._boxes[consumer]


# -- consumer side (Egress, Ingress) -----------------------------------------------------------------
class _Slot:
    """What a channel delivers to one API request: its items in arrival order, or a failure."""

    def __init__(self, keys: list[str]) -> None:
        #: The ids the channel's items are routed by.
        self.keys = keys
        self.replica = ""
        self._pending: list[Any] = []
        self._event = asyncio.Event()
        self._error: BaseException | None = None

    def push(self, item: Any) -> None:
        self._pending.append(item)
        self._event.set()

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
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

    async def get(self) -> list[EngineOutput]:
        """Everything delivered since the last call, one merged output per choice."""
        await self._wait()
        outs, self._pending = self._pending, []
        self.note(outs)
        return merge_group(outs)


class FrameInbox(_Slot):
    """The frames of one API request from its Egress replica, in order, up to its summary; an
    error Egress met after the start comes in its place, after the frames before it."""

    def __init__(self, request_id: str) -> None:
        super().__init__([request_id])
        #: The request ended in Egress with an error it sent (not a lost channel).
        self.ended_by_producer = False

    async def __anext__(self) -> Any:
        """The next frame or summary."""
        await self._wait()
        item: RoutedFrame = self._pending.pop(0)
        if item.error is not None:
            self.ended_by_producer = True
            raise item.error
        return item.item


_S = TypeVar("_S", bound=_Slot)

#: Opens the consumer's attach stream to one producer replica.
Attach = Callable[[str], AsyncIterator[ChannelBatch]]
#: The error an inbox fails with when its replica's channel is lost without an error of its own.
LostError = Callable[[str], BaseException]


class ChannelClient:
    """Consumer side: one attach per producer replica with open requests; each item goes to the
    inbox registered for its ``request_id``."""

    def __init__(self, attach: Attach, lost_error: LostError) -> None:
        self.attach = attach
        self.lost_error = lost_error
        self._inboxes: dict[str, _Slot] = {}
        self._by_replica: dict[str, set[_Slot]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

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

    def unregister(self, inbox: _Slot) -> None:
        for key in inbox.keys:
            if self._inboxes.get(key) is inbox:
                del self._inboxes[key]
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
                    for item in batch.items:
                        inbox = self._inboxes.get(item.request_id)
                        if inbox is None:
                            continue
                        if isinstance(item, RoutedError):
                            inbox.fail(item.error)  # raised once the items before it are taken
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


# -- a request's items on the consumer side: its own stream's start, then its inbox -------------------
async def watch_control(gen: Any, inbox: Any) -> None:
    """Follow a channel request's own stream after its first item: it carries nothing more in
    the normal case (anything that comes is kept); its failure is the request's failure."""
    try:
        async for items in gen:
            for item in items if isinstance(items, list) else [items]:
                inbox.push(item)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - the call failed (its replica died): so does the request
        inbox.fail(exc)


def _watch(gen: Any, inbox: Any) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(watch_control(gen, inbox))


async def engine_items(accepted: Awaitable[list[EngineOutput]], inbox: Inbox, client: ChannelClient,
                       control: Any = None) -> AsyncIterator[list[EngineOutput]]:
    """Egress's view of a channel request: its acceptance (the first item of its own engine
    stream ``control``, or a batch call's answer), then its outputs as the channel delivers them,
    one merged list per wake-up. A ``control`` stream is watched: its failure fails the request."""
    first = await accepted
    inbox.note(first)
    client.bind(inbox, first[0].replica or "")
    watch = _watch(control, inbox) if control is not None else None
    try:
        yield first
        while not inbox.done:
            yield await inbox.get()
        # The engine ends a request only after its final output: nothing is lost.
    finally:
        if watch is not None:
            watch.cancel()


class FrameStream:
    """Ingress's view of a channel request after its :class:`~stages.protocol.StreamStart`: the
    frames and the summary from the channel. ``cancel()`` ends the request in Egress (which aborts
    it in the engine), as cancelling a plain stream would: by cancelling the request's own stream
    ``gen``, or, for a batch-admitted request (no stream of its own, ``gen`` is ``None``), through
    ``on_cancel``."""

    def __init__(self, gen: Any, inbox: FrameInbox, client: ChannelClient, replica: str,
                 on_cancel: Callable[[], None] | None = None) -> None:
        self._gen = gen
        self._inbox = inbox
        self._client = client
        self._on_cancel = on_cancel
        self._ended = False
        client.bind(inbox, replica)
        self._watch = _watch(gen, inbox) if gen is not None else None

    def __aiter__(self) -> FrameStream:
        return self

    async def __anext__(self) -> Any:
        try:
            item = await self._inbox.__anext__()
        except BaseException:
            # An error Egress sent ended the request there; a cancelled wait or a lost channel
            # (Egress may still be running it) did not: cancel() still sends the cancel.
            self._ended = self._ended or self._inbox.ended_by_producer
            self._client.unregister(self._inbox)
            raise
        if isinstance(item, StreamSummary):
            # The request's own stream ends by itself now (the watch sees it end).
            self._ended = True
            self._client.unregister(self._inbox)
        return item

    def cancel(self) -> None:
        if self._gen is not None:
            self._gen.cancel()  # the watch ends with it
        elif self._on_cancel is not None and not self._ended:
            self._ended = True
            self._on_cancel()
        self._client.unregister(self._inbox)
