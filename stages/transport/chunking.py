"""Replies too big for one inter-deployment message, sent as a stream of bounded parts.

Ray Serve's gRPC transport between deployments (on under ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``)
refuses any message over 4 MiB, and a handle call whose reply outgrows it fails with a bare
``AioRpcError``. ``/tokenize`` of a 1 MB prompt answers about 250,000 ids, their token strings and the
prompt (well over that), and ``/detokenize`` can grow the same way, so Preprocess streams such
replies: :func:`split_reply` cuts a reply dict into :class:`~stages.transport.messages.ReplyPart`
items of at most :data:`PART_BYTES` (estimated from above), and :func:`join_reply` puts them back
together in Ingress. A small reply is one part. (A non-streamed completion's body, whose size sits
inside nested choices, is sent as pickled slices instead: :func:`stages.transport.producer.frames`.) :func:`render_json` then writes the JSON in slices, yielding to
the event loop between them, so one huge answer does not hold up other requests on that replica.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, Iterator
from typing import Any

from stages.transport.messages import ReplyPart

#: Upper bound of one part's pickled size (a quarter of the 4 MiB message limit).
PART_BYTES = 1024 * 1024
#: Items of a list costed at once when cutting it into parts.
BLOCK = 8192
#: Items of a list rendered between two yields to the event loop.
RENDER_SLICE = 16384


def _cost(item: Any) -> int:
    """Pickled size of one list item, from above (a str is at most 4 bytes a character)."""
    return 4 * len(item) + 9 if isinstance(item, str) else 16 if not isinstance(item, int | float | None) else 9


def _block_cost(items: list[Any]) -> int:
    """The cost of a block of items. Token ids and token strings are costed without a Python-level
    loop over items; blocks stay small so that no single C call holds the GIL for long (this runs
    beside the event loop's thread)."""
    kinds = set(map(type, items))
    if kinds <= {int, bool, float, type(None)}:
        return 9 * len(items)
    if kinds == {str}:
        return 4 * sum(map(len, items)) + 9 * len(items)
    return sum(map(_cost, items))


def _fit(items: list[Any], start: int, room: int) -> tuple[int, int]:
    """``(end, cost)`` of the longest slice ``items[start:end]`` whose cost fits ``room``: whole
    blocks first, then item by item inside the block that does not fit when nothing else did."""
    end, used = start, 0
    while end < len(items):
        stop = min(end + BLOCK, len(items))
        cost = _block_cost(items[end:stop])
        if used + cost <= room:
            end, used = stop, used + cost
            continue
        if end == start:
            for item in items[end:stop]:
                cost = _cost(item)
                if used + cost > room:
                    break
                end, used = end + 1, used + cost
        break
    return end, used


def split_reply(reply: dict[str, Any], part_bytes: int = PART_BYTES) -> Iterator[ReplyPart]:
    """Cut ``reply`` into parts of at most ``part_bytes`` each: strings and lists are sliced,
    other values go whole. Keys keep their order, and a key's pieces come in order."""
    part: dict[str, Any] = {}
    room = part_bytes
    for key, value in reply.items():
        if isinstance(value, str):
            start = 0
            while True:
                rest = len(value) - start
                fit = max((room - 16) // 4, 0)
                if fit < min(rest, 1024) and part:  # too little room left here: start the next part
                    yield ReplyPart(part)
                    part, room = {}, part_bytes
                    continue
                n = min(rest, max(fit, 1))
                part[key] = value[start:start + n]
                room -= 4 * n + 16
                start += n
                if start >= len(value):
                    break
                yield ReplyPart(part)
                part, room = {}, part_bytes
        elif isinstance(value, list):
            start = 0
            while True:
                end, used = _fit(value, start, room - 16)
                if end == start < len(value):
                    if not part:
                        raise ValueError(f"one item of {key!r} is larger than a part")
                    yield ReplyPart(part)
                    part, room = {}, part_bytes
                    continue
                part[key] = value[start:end]
                room -= used + 16
                start = end
                if start >= len(value):
                    break
                yield ReplyPart(part)
                part, room = {}, part_bytes
        else:
            if room < 64 and part:
                yield ReplyPart(part)
                part, room = {}, part_bytes
            part[key] = value
            room -= 64
    if part or not reply:
        yield ReplyPart(part)


async def join_reply(parts: AsyncIterable[ReplyPart]) -> dict[str, Any]:
    """The reply :func:`split_reply` cut up, from a stream of its parts."""
    return join_parts([part async for part in parts])


def join_parts(parts: list[ReplyPart]) -> dict[str, Any]:
    """The reply :func:`split_reply` cut up: lists extended, strings concatenated, in order."""
    out: dict[str, Any] = {}
    texts: dict[str, list[str]] = {}
    for part in parts:
        for key, value in part.fields.items():
            if isinstance(value, str):
                texts.setdefault(key, []).append(value)
                out.setdefault(key, "")
            elif isinstance(value, list) and isinstance(out.get(key), list):
                out[key].extend(value)
            else:
                out[key] = value
    for key, pieces in texts.items():
        out[key] = "".join(pieces)
    return out


def _dumps(value: Any) -> str:
    # What Starlette's JSONResponse writes: compact, UTF-8, no NaN.
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


async def render_json(obj: dict[str, Any]) -> bytes:
    """``obj`` as compact JSON (the bytes ``JSONResponse`` would send), long lists rendered a
    slice at a time with a yield to the event loop between slices."""
    out: list[str] = []
    for i, (key, value) in enumerate(obj.items()):
        out.append(("{" if i == 0 else ",") + _dumps(key) + ":")
        if isinstance(value, list) and len(value) > RENDER_SLICE:
            slices = []
            for start in range(0, len(value), RENDER_SLICE):
                slices.append(_dumps(value[start:start + RENDER_SLICE])[1:-1])
                await asyncio.sleep(0)
            out.append("[" + ",".join(s for s in slices if s) + "]")
        else:
            out.append(_dumps(value))
    out.append("}" if obj else "{}")
    return "".join(out).encode("utf-8")
