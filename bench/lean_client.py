"""A streaming-completions client that does as little work per token as a Python client can.

Why: the benchmarks run their client on the same two cores as the server. ``httpx`` with a JSON
parse per SSE event costs 0.22-0.25 ms of CPU per token (round 14's ``cpu_split``), more than any
one stage of the graph, and round 15 showed that work beside the engine slows its decode steps
through memory traffic, not CPU time. A real client is on another machine. This one reads the
socket with asyncio, undoes the chunked framing, and counts content events by a byte pattern: no
HTTP library, no per-event JSON. Only the final usage event (token count, server timing) is
parsed.

It speaks just enough HTTP/1.1 for the server it measures: one POST per connection at a time,
keep-alive connections reused from a pool, ``Transfer-Encoding: chunked`` or ``Content-Length``
bodies. A non-200 status raises ``RuntimeError`` with the body.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

from bench.common import StreamResult

#: A content event's text field, as the server frames it (compact JSON separators). An escaped
#: quote inside a string is ``\"``, so the pattern cannot match inside a text.
_TEXT = b'"text":"'
_EMPTY_TEXT = b'"text":""'


class _Chunked:
    """Incremental ``Transfer-Encoding: chunked`` decoder over a byte buffer."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.left = 0  # bytes still due in the current chunk
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """Append ``data``; return the payload bytes complete so far."""
        self.buf += data
        out = bytearray()
        while not self.done:
            if self.left:
                take = min(self.left, len(self.buf))
                if not take:
                    break
                out += self.buf[:take]
                del self.buf[:take]
                self.left -= take
                if self.left:
                    break
                continue
            # Between chunks: the previous chunk's CRLF (if any), then a size line.
            if self.buf[:2] == b"\r\n":
                del self.buf[:2]
            end = self.buf.find(b"\r\n")
            if end < 0:
                break
            size = int(bytes(self.buf[:end]).split(b";")[0], 16)
            del self.buf[:end + 2]
            if size == 0:
                self.done = True  # the trailer's blank line is left in buf; the next request skips it
                break
            self.left = size
        return bytes(out)


class LeanClient:
    """Streams ``/v1/completions`` from one base URL over pooled keep-alive connections."""

    def __init__(self, base_url: str) -> None:
        u = urlsplit(base_url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _conn(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    async def aclose(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()

    async def stream_completion(self, body: dict[str, Any]) -> StreamResult:
        """POST a streaming completion; time every read that brings content events."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        raw = json.dumps(body).encode()
        t0 = time.perf_counter()
        reader, writer = await self._conn()
        writer.write(b"POST %s/v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                     b"Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                     % (self.prefix.encode(), self.host.encode(), self.port, len(raw), raw))
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)}
        chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        length = int(headers.get(b"content-length", b"-1"))
        if status != 200:
            err = await reader.readexactly(length) if length >= 0 else await reader.read(1 << 16)
            writer.close()
            raise RuntimeError(f"HTTP {status}: {err[:500]!r}")
        dechunk = _Chunked() if chunked else None
        ttft: float | None = None
        times: list[float] = []
        tail = b""  # SSE bytes after the last complete event
        final: dict[str, Any] | None = None
        got = 0
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            now = time.perf_counter()
            if dechunk is not None:
                payload = dechunk.feed(data)
            else:
                payload = data
                got += len(data)
            if payload:
                # Count only complete events, so a pattern split across two reads counts once.
                text = tail + payload
                cut = text.rfind(b"\n\n") + 2
                events, tail = text[:cut], text[cut:]
                n = events.count(_TEXT) - events.count(_EMPTY_TEXT)
                if n:
                    ttft = ttft if ttft is not None else now - t0
                    times.extend([now] * n)
                if b'"usage"' in events:
                    final = _last_usage_event(events)
            if (dechunk is not None and dechunk.done) or (length >= 0 and got >= length):
                break
        e2e = time.perf_counter() - t0
        reusable = (dechunk is not None and dechunk.done) or length >= 0
        if reusable and headers.get(b"connection", b"").lower() != b"close":
            if dechunk is not None and dechunk.buf[:2] != b"\r\n":
                await reader.readuntil(b"\r\n")  # the chunked body's closing blank line
            self._idle.append((reader, writer))
        else:
            writer.close()
        n_tokens = final["usage"]["completion_tokens"] if final and final.get("usage") else len(times)
        return StreamResult(ttft=ttft if ttft is not None else e2e, e2e=e2e, token_times=times,
                            num_tokens=n_tokens, final=final)


def _last_usage_event(events: bytes) -> dict[str, Any] | None:
    """The last ``data: {...}`` event that carries ``usage``, parsed (once per request)."""
    for block in reversed(events.split(b"\n\n")):
        for line in block.split(b"\n"):
            if line.startswith(b"data: {") and b'"usage"' in line:
                return json.loads(line[6:])
    return None
