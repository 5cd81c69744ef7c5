"""A bounded buffer per stream between what Egress sends and what the client has taken.

Where the buffering happens: Ingress reads the Egress stream and hands each SSE event to the ASGI
``send``. When the ASGI server applies backpressure (uvicorn's ``send`` waits while the socket is
full: Serve's direct-ingress HTTP server on the Ingress replica, or any plain ASGI server), a client
that stops reading stops the writer; the reader keeps taking what the engine produces (so a slow
client never stalls the Egress and engine replicas other streams share) and it piles up here.
:class:`StreamBuffer` bounds that pile: past ``limit_bytes`` the request is aborted
(:class:`stages.errors.SlowReaderError`), its engine work is cancelled and its blocks freed, and the
buffered events are dropped in favour of the error event and ``[DONE]``.

Behind Serve's own HTTP proxy, the Ingress replica's ``send`` never waits: Serve streams each ASGI
message to the proxy as a Ray streaming-generator item without backpressure, so the backlog of a
slow reader sits in the proxy process, bounded only by the response's length (``max_tokens``), and
the Ingress cannot see that client's socket. See docs/operations.md, "Slow readers".

Pure asyncio; unit-tested without Ray.
"""

from __future__ import annotations

import asyncio
from collections import deque


class StreamBuffer:
    """Bytes read from upstream and not yet taken by the writer, bounded by ``limit_bytes``.

    One producer (:meth:`put`, :meth:`fail`, :meth:`close`) and one consumer (:meth:`get`).
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.size = 0
        #: Largest backlog seen (bytes), for tests and the benchmark.
        self.peak = 0
        self._chunks: deque[bytes] = deque()
        self._ready = asyncio.Event()
        #: Set while everything queued has been taken and sent (see :meth:`mark_sent`).
        self._sent = asyncio.Event()
        self._sent.set()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, chunk: bytes) -> bool:
        """Queue ``chunk``; False when the backlog now exceeds the bound (the caller aborts)."""
        if self._closed:
            return True
        self._chunks.append(chunk)
        self._sent.clear()
        self.size += len(chunk)
        self.peak = max(self.peak, self.size)
        self._ready.set()
        return self.size <= self.limit_bytes

    def replace(self, chunks: list[bytes]) -> None:
        """Drop the whole backlog, queue ``chunks`` as the last ones, and close."""
        self._chunks.clear()
        self._chunks.extend(chunks)
        self.size = sum(len(c) for c in chunks)
        self.close()

    def close(self) -> None:
        """No more chunks: :meth:`get` returns ``None`` once the backlog is taken."""
        self._closed = True
        self._ready.set()

    def mark_sent(self) -> None:
        """The writer has sent the chunk it took last."""
        if not self._chunks:
            self._sent.set()

    async def wait_sent(self, timeout_s: float) -> bool:
        """Wait until everything queued so far has been sent (False after ``timeout_s``)."""
        try:
            await asyncio.wait_for(self._sent.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def get(self) -> bytes | None:
        """The next chunk (everything queued, joined, to save writes), or ``None`` at the end."""
        while not self._chunks:
            if self._closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        if len(self._chunks) == 1:
            chunk = self._chunks.popleft()
        else:
            chunk = b"".join(self._chunks)
            self._chunks.clear()
        self.size -= len(chunk)
        return chunk
