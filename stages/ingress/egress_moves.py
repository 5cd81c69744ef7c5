"""Moving a stream off an Egress replica that was lost, without its client noticing.

Rule: when the Egress replica running a job dies mid-stream (SIGKILL, OOM, its node gone), the
Ingress replica holding the client's connection sends the job again to another Egress replica,
with what the client has received so far (:class:`~stages.transport.messages.StreamCarry`): per
choice, the tokens behind every event it got, which choices have ended, the next event id, and
the first prefill's usage and timings (so the summary, Server-Timing and the log report the
prefill the client waited for). Every frame carries its tokens for this. The new Egress replica
rebuilds its detokeniser, stop-string and tool-call state from those tokens, sends nothing they
produced again, and asks an engine for the rest, each choice carrying its tokens, as a move off a
lost engine does (:mod:`stages.egress.migration`). The engine aborts the old engine request by
itself (its reader died) and the new one runs under a fresh engine id, so the two never collide.

So the client sees one stream: no error event, no event twice or missing, ids in order. Tokens
generated but not yet received are generated again; with greedy or seeded sampling they are the
same tokens (each seeded draw depends only on the seed and the position), up to near-ties a new
batch can flip. A non-streamed request has received nothing and starts over on the new replica.

Why in Ingress: it is the only stage that knows what the client has received, and the Egress
state is a function of exactly that.

Bounds: at most ``engine.max_migrations`` moves per request (the same budget as engine moves);
only when another Egress replica is there (with none, the client gets the ``service_unavailable``
error event as before, rather than wait for Serve to start one); the new replica must accept
within :data:`MOVE_TIMEOUT_S`. A resumable stream goes on but is no longer resumable: its kept
events died with their replica. A stream reconnected through the resume endpoint is not moved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError

from stages.errors import EgressLostError, unwrap_error
from stages.transport.messages import (
    EngineMoved,
    GenerationJob,
    PrefillNote,
    StreamCarry,
    StreamFrame,
    StreamStart,
)

#: Seconds a moved job may wait for another Egress replica to accept it (Serve may still route to
#: the dead one for a moment: each such try fails fast and is retried).
MOVE_TIMEOUT_S = 10.0
#: Seconds between two tries.
RETRY_S = 0.2


#: What a call to an Egress replica fails with when that replica is gone.
_LOST = (EgressLostError, RayActorError, ActorUnavailableError)


def _lost(exc: BaseException) -> bool:
    return isinstance(exc, _LOST) or isinstance(unwrap_error(exc), _LOST)


class EgressMoves:
    """A started generation call (:class:`~stages.transport.consumer.FrameCall`) that moves to
    another Egress replica when its own is lost. Iterates as the call does, with an
    :class:`EngineMoved` item after each move; ``on_move(moves, start)`` is told of each."""

    def __init__(self, consumer: Any, call: Any, job: GenerationJob, start: StreamStart, *, max_moves: int,
                 replicas: Callable[[], list[str]], on_move: Callable[[int, StreamStart], None] | None = None,
                 ) -> None:
        self.consumer = consumer
        #: The Egress replicas there are now (:func:`stages.transport.membership.routed_replicas`).
        self.replicas = replicas
        self.egress_replica = start.egress_replica
        self.call = call
        self.job = job
        self.max_moves = max_moves
        self.on_move = on_move
        self.moves = 0
        self.prompt_tokens = start.prompt_tokens
        self._tokens: list[list[int]] = [[] for _ in range(job.n)]
        self._started: set[int] = set()
        self._finished: dict[int, str] = {}
        self._next_event = 0
        self._prefill: PrefillNote | None = None

    def __aiter__(self) -> EgressMoves:
        return self

    async def __anext__(self) -> Any:
        try:
            item = await self.call.__anext__()
        except Exception as exc:
            # The channel's own loss, or Ray's error for the replica (whichever the reader saw first).
            if (not _lost(exc) or self.moves >= self.max_moves
                    or not [r for r in self.replicas() if r != self.egress_replica]):
                raise
            return await self._move(exc)
        if isinstance(item, StreamFrame):
            self._tokens[item.index].extend(item.token_ids)
            self._started.add(item.index)
            if item.finish_reason is not None:
                self._finished[item.index] = item.finish_reason
            self._next_event = item.event_id + 1
            if item.prefill is not None:
                self._prefill = item.prefill
        return item

    def carry(self) -> StreamCarry:
        """What the client has received so far."""
        return StreamCarry([list(t) for t in self._tokens], sorted(self._started), dict(self._finished),
                           self._next_event, self.prompt_tokens, self._prefill)

    async def _move(self, lost: Exception) -> EngineMoved:
        """Send the job, with :meth:`carry`, to another Egress replica; raises ``lost`` when none
        accepts it in time."""
        self.call.cancel()  # in case that replica still runs: it ends the job and its engine request
        self.moves += 1
        first = self.job.engine_request
        request = dataclasses.replace(first, request_id=f"{first.request_id}.{self.moves}", output_token_ids=[],
                                      finished_choices=[], route=None)
        job = dataclasses.replace(self.job, engine_request=request, carry=self.carry(), resume=None)
        deadline = time.monotonic() + MOVE_TIMEOUT_S
        while True:
            call = self.consumer.open_frames(job)
            try:
                start = await call.start(max(deadline - time.monotonic(), 0.0))
                break
            except Exception as exc:  # noqa: BLE001 - a lost replica again is retried; others end it
                if not _lost(exc) or time.monotonic() + RETRY_S >= deadline:
                    raise lost from exc
                await asyncio.sleep(RETRY_S)
        self.call, self.egress_replica = call, start.egress_replica
        if self.on_move is not None:
            self.on_move(self.moves, start)
        return EngineMoved(start.engine_replica, start.engine_request_ids)

    # -- what the Ingress does with a call ---------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.call.finished

    def cancel(self) -> None:
        self.call.cancel()

    def detach(self) -> None:
        self.call.detach()

    def release(self) -> None:
        self.call.release()

    def forget(self) -> None:
        self.call.forget()
