"""The Ingress side of resumable streams: who asks for them, and how a reconnect finds its stream.

A streamed request is resumable when it sends ``X-Resumable: <seconds>`` (1 to 600; 0 opts out),
or when ``http.resume_grace_s`` gives a default. Its events are kept by its Egress replica
(:mod:`stages.egress.resume`); when its client leaves, the Ingress detaches it instead of
aborting it. ``GET /v1/requests/{id}/events`` reconnects, with the last event id seen in the
``Last-Event-ID`` header (SSE's own reconnect hook) or ``?starting_after=<n>`` (OpenAI's form, for
clients that cannot set headers); the same numbers either way.

Finding the stream: the directory indexes detached streams by response id, server id and client
label (:meth:`stages.directory.directory.LiveDirectory.resume_lookup`). The server notices a
dropped connection only when it next reads or writes it, so a client that reconnects at once may
find its old connection still attached: the lookup waits up to :data:`SETTLE_S` for it to go
(and for its Egress replica to tell the directory it keeps the stream) before answering 409.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from typing import Any

from stages.config import MAX_RESUME_GRACE_S
from stages.errors import ConflictError, InvalidRequestError, NotFoundError
from stages.transport.messages import LiveEntry

#: Request header asking for a resumable stream, in seconds of grace.
RESUMABLE_HEADER = "x-resumable"
#: Seconds a reconnect waits for the old connection of its stream to be noticed gone, and for
#: its Egress replica to register it as kept.
SETTLE_S = 3.0
SETTLE_POLL_S = 0.05
_EVENT_ID = re.compile(r"-?[0-9]+")


def resume_grace(header: str | None, default: float) -> float:
    """The grace period a request asks for (``X-Resumable``), else the server's default; 0: not
    resumable."""
    if header is None:
        return default
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if value != 0 and not 1 <= value <= MAX_RESUME_GRACE_S:
        raise InvalidRequestError(f"X-Resumable must be a number of seconds from 1 to {MAX_RESUME_GRACE_S:g} "
                                  "(0: not resumable).", param="X-Resumable")
    return value


def last_event_id(headers: Any, query: Any) -> int:
    """The last event the client received (``Last-Event-ID``, or ``starting_after``); -1: none."""
    raw = headers.get("last-event-id")
    param = "Last-Event-ID"
    if raw is None:
        raw, param = query.get("starting_after"), "starting_after"
    if raw is None or raw == "":
        return -1
    if not _EVENT_ID.fullmatch(raw) or int(raw) < -1:
        raise InvalidRequestError(f"{param} must be the integer id of the last event received.", param=param)
    return int(raw)


async def find_kept(directory: Any, key: str, api_key_id: str | None) -> LiveEntry:
    """The detached stream ``key`` names (response id, server id, or a client label carried by
    exactly one live request). 404 when none, 409 while it still has a connection or when the
    label names several."""
    if directory is None:
        raise NotFoundError(f"No resumable stream has the id {key!r}.", param="request_id", code="request_not_found")
    deadline = time.monotonic() + SETTLE_S
    while True:
        found = await directory.resume_lookup(key, api_key_id)
        named = len(found.kept) + found.attached
        if named > 1:
            raise ConflictError(f"{named} live requests carry the id {key!r}; resume by the response id.",
                                param="request_id")
        if found.kept:
            return found.kept[0]
        if not found.attached:
            raise NotFoundError(f"No resumable stream has the id {key!r} (unknown, not resumable, or its grace "
                                "period ended).", param="request_id", code="request_not_found")
        if time.monotonic() >= deadline:
            raise ConflictError("The stream still has a connection attached.", param="request_id",
                                code="stream_attached")
        await asyncio.sleep(SETTLE_POLL_S)
