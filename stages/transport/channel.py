"""A producer replica's mailboxes: one per consumer replica, drained by one ``attach`` stream.

Why: every item a Serve stream carries costs both ends a round of serialisation, gRPC and event
loop wake-ups (about 0.6 ms of CPU per item per hop). With one stream per request, an engine step
at 32 streams would send 32 items to Egress, and Egress 32 more to Ingress; on a small machine that
CPU is taken from the engine's own step. Through a channel a step sends one item per consumer
replica, whatever the batch size. Both hops use it:

- **engine → Egress**: :class:`~stages.transport.messages.EngineOutput` items, merged per engine
  request while they wait (:class:`~stages.transport.channel_client.Inbox` on the Egress side);
- **Egress → Ingress**: :class:`~stages.transport.messages.RoutedFrame` items (a request's SSE
  frames, body parts and summary, in order; :class:`~stages.transport.channel_client.FrameInbox`).

Only data moves through the channel; control (acceptance, refusal, cancel, a consumer dying) is
:mod:`stages.transport.producer`'s. After the acceptance the producer puts the request's items in
its consumer's mailbox (:class:`ChannelHub`), and the consumer's ``attach`` stream to that replica
drains it, everything that accumulated in one :class:`~stages.transport.messages.ChannelBatch`.

Lifetimes: a mailbox's attach ends once the consumer has had no live request on the replica for
``linger_s`` (an open stream would hold up the replica's drain on shutdown); the client attaches
again when a request needs it. Items wait in the mailbox until an attach takes them, so the first
tokens of a request that arrive before its attach is open are not lost.

Plain asyncio (no Ray), so it is unit-tested directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from stages.transport.messages import ChannelBatch, EngineOutput, TokenLogprob

#: Seconds a consumer's attach stays open with no live request on the replica.
DEFAULT_LINGER_S = 1.0
#: Seconds a mailbox with no live request and no attach is kept for its consumer to come and take
#: what waits in it (a short request can end before its consumer's attach opens); then it goes.
UNCLAIMED_TTL_S = 30.0
#: Items at most in one batch (the rest go in the next): a consumer that fell far behind must not
#: get a batch past the message size limit between deployments.
MAX_BATCH_ITEMS = 256
#: Estimated bytes at most in one batch (items that say their size: body parts), half the 4 MiB
#: message limit; an item alone in a batch may be larger.
MAX_BATCH_BYTES = 2 * 1024 * 1024


def _batch_len(items: list[Any]) -> int:
    """How many of ``items`` the next batch takes: at most :data:`MAX_BATCH_ITEMS`, and no more
    estimated bytes than :data:`MAX_BATCH_BYTES` (at least one item)."""
    used = 0
    for i, item in enumerate(items[:MAX_BATCH_ITEMS]):
        used += getattr(item, "nbytes", 0)
        if used > MAX_BATCH_BYTES and i > 0:
            return i
    return min(len(items), MAX_BATCH_ITEMS)


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
    """An engine mailbox's batch: one merged output per request, then any :class:`~stages.transport.messages.RoutedError`
    (a request's failure comes after its outputs, as it happened)."""
    outs = [i for i in items if isinstance(i, EngineOutput)]
    if len(outs) == len(items):
        return merge_group(items)
    return [*merge_group(outs), *(i for i in items if not isinstance(i, EngineOutput))]


@dataclass
class _Mailbox:
    pending: list[Any] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    #: Requests of this consumer open on the replica.
    live: int = 0
    #: Bumped by every attach: an older attach of the same consumer ends (the newest one wins).
    attach_seq: int = 0
    #: Attach streams open on it now.
    attached: int = 0
    #: Bumped whenever it becomes unclaimed or claimed again: only the newest expiry may drop it.
    expiry_seq: int = 0


class ChannelHub:
    """A producer replica's mailboxes, one per consumer (the consumer replica's actor name).

    ``merge`` folds what waited in a mailbox into one batch's items (the engine merges each
    request's outputs into one; frames keep their order as they are)."""

    def __init__(self, replica: str, linger_s: float = DEFAULT_LINGER_S,
                 merge: Callable[[list[Any]], list[Any]] = list, unclaimed_ttl_s: float = UNCLAIMED_TTL_S) -> None:
        self.replica = replica
        self.linger_s = linger_s
        self.unclaimed_ttl_s = unclaimed_ttl_s
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
        box = self._boxes.setdefault(consumer, _Mailbox())
        box.live += 1
        box.expiry_seq += 1

    def close(self, consumer: str) -> None:
        """That request ended (its items are all pushed). A mailbox left with no live request and
        no attach is dropped after :attr:`unclaimed_ttl_s` unless its consumer attaches by then."""
        box = self._boxes.get(consumer)
        if box is not None:
            box.live -= 1
            box.event.set()  # an idle attach starts its linger
            if box.live <= 0 and not box.attached:
                box.expiry_seq += 1
                asyncio.get_running_loop().call_later(self.unclaimed_ttl_s, self._expire, consumer, box,
                                                      box.expiry_seq)

    def _expire(self, consumer: str, box: _Mailbox, seq: int) -> None:
        if (self._boxes.get(consumer) is box and box.expiry_seq == seq and box.live <= 0
                and not box.attached):
            del self._boxes[consumer]

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
        box.attached += 1
        box.expiry_seq += 1
        try:
            yield ChannelBatch(self.replica, [])
            while box.attach_seq == seq:
                box.event.clear()
                if box.pending:
                    outs = self.merge(box.pending)
                    take = _batch_len(outs)
                    box.pending = outs[take:]
                    batch = ChannelBatch(self.replica, outs[:take])
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
            box.attached -= 1
            if (box.attach_seq == seq and box.live <= 0 and not box.pending
                    and self._boxes.get(consumer) is box):
                del self._boxes[consumer]
