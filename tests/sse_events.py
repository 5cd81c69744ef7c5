"""A streamed response's SSE events as the tests read them: ``(id, data)`` pairs, their text, usage
and finish reason; a stream may be left after some events (dropping the connection)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


class Events:
    """A stream's SSE events as ``(id, data)``, read until ``stop`` content events or ``[DONE]``."""

    def __init__(self) -> None:
        self.events: list[tuple[int, str]] = []
        self._lines: Iterator[str] | None = None
        self._resp: httpx.Response | None = None

    def read(self, resp: httpx.Response, stop: int | None = None) -> Events:
        assert resp.status_code == 200, resp.read()
        if self._lines is None or self._resp is not resp:  # a second read of one response goes on
            self._lines, self._resp = resp.iter_lines(), resp
        event_id, content = None, 0
        for line in self._lines:
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: "):
                assert event_id is not None, line
                self.events.append((event_id, line[6:]))
                event_id = None
                if line[6:] == "[DONE]":
                    break
                if json.loads(line[6:]).get("choices"):
                    content += 1
                if stop is not None and content >= stop:
                    break  # leaving the stream drops the connection
        return self

    @property
    def last_id(self) -> int:
        return self.events[-1][0]

    @property
    def response_id(self) -> str:
        return json.loads(self.events[0][1])["id"]

    def text(self, index: int | None = None) -> str:
        """The streamed content, of choice ``index`` only when given."""
        out = []
        for _, data in self.events:
            if data != "[DONE]":
                for choice in json.loads(data).get("choices", []):
                    if index is None or choice["index"] == index:
                        out.append(choice["delta"].get("content") or "")
        return "".join(out)

    def ids(self) -> list[int]:
        return [i for i, _ in self.events]

    def usage(self) -> dict[str, Any]:
        return next(json.loads(d)["usage"] for _, d in self.events if d != "[DONE]" and json.loads(d).get("usage"))

    def finish_reason(self) -> str | None:
        reasons = [c["finish_reason"] for _, d in self.events if d != "[DONE]"
                   for c in json.loads(d).get("choices", []) if c.get("finish_reason")]
        return reasons[-1] if reasons else None
