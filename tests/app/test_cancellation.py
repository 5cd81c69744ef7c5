"""Cancellation against the real app: a client that goes away (closed stream, client timeout) and a
stop string found by Egress both abort the request in the engine, and every KV block comes back.

Also home of the live-load helpers the other integration tests import: :class:`LongStreams` (long
``ignore_eos`` streams on a private event loop, each closable on its own) and :func:`wait_idle`.
Timings on this machine are noisy (other CPU-heavy jobs may run): only the 1 s cancellation bound
asked for by the design is asserted; everything else is printed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.serve

#: Generous: with 8 long requests on 2 busy cores a step can take a few hundred ms.
IDLE_TIMEOUT_S = 180.0


# -- helpers shared with test_streaming / test_errors_http ------------------------------------------------
def poll_stats(serve_app: Any, pred: Callable[[dict[str, Any]], bool], timeout: float,
               interval: float = 0.02) -> tuple[dict[str, Any], float]:
    """Poll the engine's stats until ``pred`` holds; return them and the seconds it took."""
    t0 = time.perf_counter()
    while True:
        stats = serve_app.engine_stats()
        if pred(stats):
            return stats, time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise AssertionError(f"engine stats did not reach the expected state in {timeout} s: {stats}")
        time.sleep(interval)


def wait_idle(serve_app: Any, timeout: float = IDLE_TIMEOUT_S) -> dict[str, Any]:
    """Block until the engine has nothing running or waiting and no open request stream."""
    stats, _ = poll_stats(serve_app, lambda s: s["num_running"] == 0 and s["num_waiting"] == 0
                          and s.get("num_streams", 0) == 0, timeout, interval=0.05)
    return stats


def assert_no_leaks(stats: dict[str, Any]) -> None:
    assert stats["num_free_blocks"] == stats["num_kv_blocks"], f"KV blocks leaked: {stats}"
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats


@dataclass
class StreamResult:
    """What one background stream saw."""

    status: int | None = None
    headers: httpx.Headers | None = None
    body: bytes = b""
    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    accepted: threading.Event = field(default_factory=threading.Event)
    first_token: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    closed_at: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


class LongStreams:
    """``n`` long streaming completions (``ignore_eos``), each on its own connection, driven by a
    private event loop thread so sync tests can start them, watch them and close any of them.

    Closing one (:meth:`cancel`) cancels its task: httpx closes the half-read response, which drops
    the TCP connection, which is exactly what a client going away looks like to the server.
    """

    def __init__(self, url: str, n: int, *, max_tokens: int, prompt: str = "Tell me a very long story, part {i}:",
                 start_index: int = 0) -> None:
        self.url = url
        self.n = n
        self.max_tokens = max_tokens
        self.prompt = prompt
        self.start_index = start_index
        self.results: list[StreamResult] = []
        self._futures: list[Any] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="long-streams", daemon=True)
        self._thread.start()
        self._client: httpx.AsyncClient | None = None

    # -- lifecycle --
    def __enter__(self) -> LongStreams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, n: int | None = None) -> list[int]:
        """Start ``n`` more streams (default: all ``self.n``); returns their indices."""
        if self._client is None:
            async def make() -> httpx.AsyncClient:
                return httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=30.0),
                                         limits=httpx.Limits(max_connections=64, max_keepalive_connections=0))
            self._client = asyncio.run_coroutine_threadsafe(make(), self._loop).result(30)
        count = self.n if n is None else n
        first = len(self.results)
        for i in range(first, first + count):
            self.results.append(StreamResult())
            self._futures.append(asyncio.run_coroutine_threadsafe(self._run(i), self._loop))
        return list(range(first, first + count))

    def close(self) -> None:
        """Close every stream still open, then the client and the loop."""
        if self._loop.is_closed():
            return
        self.cancel(range(len(self.results)))
        if self._client is not None:
            asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    # -- control --
    def cancel(self, indices: Any, timeout: float = 30.0) -> float:
        """Close the given streams' connections; returns when all are closed (perf_counter time)."""
        indices = list(indices)
        for i in indices:
            if not self.results[i].done.is_set():
                self.results[i].cancelled = True
                self._futures[i].cancel()  # cancels the task on the loop
        for i in indices:
            assert self.results[i].done.wait(timeout), f"stream {i} did not close in {timeout} s"
        return max((self.results[i].closed_at or 0.0) for i in indices) if indices else time.perf_counter()

    def wait(self, event: str, indices: Any = None, timeout: float = 120.0) -> None:
        """Wait until ``event`` (accepted, first_token, done) is set on the given streams."""
        deadline = time.monotonic() + timeout
        for i in (range(len(self.results)) if indices is None else indices):
            r = self.results[i]
            while not getattr(r, event).wait(0.05):
                if r.done.is_set() and event != "done":
                    raise AssertionError(f"stream {i} ended before {event}: status={r.status} "
                                         f"body={r.body[:300]!r} error={r.error!r}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"stream {i}: no {event} within {timeout} s")

    # -- the stream --
    async def _run(self, i: int) -> None:
        r = self.results[i]
        body = {"model": MODEL_NAME, "prompt": self.prompt.format(i=i + self.start_index),
                "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            assert self._client is not None
            async with self._client.stream("POST", self.url + "/v1/completions", json=body) as resp:
                r.status, r.headers = resp.status_code, resp.headers
                if resp.status_code != 200:
                    r.body = await resp.aread()
                    return
                r.accepted.set()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: "):])
                    for choice in chunk["choices"]:
                        if choice["text"]:
                            r.texts.append(choice["text"])
                            r.first_token.set()
                        if choice["finish_reason"] is not None:
                            r.finish_reason = choice["finish_reason"]
                            r.first_token.set()
        except BaseException as exc:  # noqa: BLE001 - recorded for the test to inspect
            r.error = exc
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            r.closed_at = time.perf_counter()
            r.done.set()


# -- tests -------------------------------------------------------------------------------------------------
NUM_STREAMS = 8
LONG_TOKENS = 160


def test_closing_client_streams_frees_engine_slots_within_a_second(serve_app: Any) -> None:
    before = wait_idle(serve_app)
    assert before["num_free_blocks"] == before["num_kv_blocks"]
    with LongStreams(serve_app.url, NUM_STREAMS, max_tokens=LONG_TOKENS) as load:
        t0 = time.perf_counter()
        load.start()
        load.wait("first_token", timeout=120)
        stats, _ = poll_stats(serve_app, lambda s: s["num_running"] == NUM_STREAMS, timeout=30)
        print(f"\n{NUM_STREAMS} streams producing after {time.perf_counter() - t0:.2f} s; {stats['num_running']} running")
        assert stats["num_waiting"] == 0
        assert all(r.finish_reason is None for r in load.results), "streams ended before the cancel"

        closed_at = load.cancel(range(4))
        stats, _ = poll_stats(serve_app, lambda s: s["num_running"] <= 4, timeout=30, interval=0.01)
        latency = time.perf_counter() - closed_at
        print(f"client close -> engine num_running {stats['num_running']}: {latency * 1000:.0f} ms "
              f"(abort {before['finished_total']['abort']} -> {stats['finished_total']['abort']})")
        engine_side = (stats["abort_latency_sum"] - before["abort_latency_sum"]) / 4
        print(f"  of which engine-side (abort asked -> blocks freed), mean: {engine_side * 1000:.0f} ms")
        assert stats["num_running"] == 4, stats
        assert latency < 1.0, f"the engine noticed the 4 closed clients only after {latency:.2f} s"
        assert stats["finished_total"]["abort"] - before["finished_total"]["abort"] == 4

        load.wait("done", range(4, NUM_STREAMS), timeout=IDLE_TIMEOUT_S)
        print(f"remaining 4 finished after {time.perf_counter() - t0:.1f} s")
        for r in load.results[4:]:
            assert r.status == 200 and r.error is None, (r.status, r.error)
            assert r.finish_reason == "length"
        for r in load.results[:4]:
            assert r.cancelled and r.finish_reason is None

    after = wait_idle(serve_app)
    assert_no_leaks(after)
    assert after["finished_total"]["length"] - before["finished_total"]["length"] == 4
    assert after["finished_total"]["abort"] - before["finished_total"]["abort"] == 4
    lengths = after["generation_tokens_total"] - before["generation_tokens_total"]
    # 4 full generations plus what the cancelled ones produced before going away.
    assert 4 * LONG_TOKENS <= lengths < 8 * LONG_TOKENS


def test_non_streaming_client_timeout_aborts_in_engine(serve_app: Any) -> None:
    before = wait_idle(serve_app)
    max_tokens = 400
    t0 = time.perf_counter()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(serve_app.url + "/v1/completions", timeout=1.0,
                   json={"model": MODEL_NAME, "prompt": "Write a very long essay about rivers:", "max_tokens": max_tokens,
                         "ignore_eos": True, "temperature": 0})
    gone = time.perf_counter()
    stats, latency = poll_stats(serve_app, lambda s: s["num_running"] == 0 and s["num_waiting"] == 0, timeout=30)
    generated = stats["generation_tokens_total"] - before["generation_tokens_total"]
    print(f"\nclient timed out after {gone - t0:.2f} s; engine idle {latency * 1000:.0f} ms later, "
          f"{generated} of {max_tokens} tokens generated")
    assert stats["finished_total"]["abort"] == before["finished_total"]["abort"] + 1
    assert stats["finished_total"]["length"] == before["finished_total"]["length"]
    assert generated < max_tokens
    assert latency < 10.0
    assert_no_leaks(wait_idle(serve_app))


def test_stop_string_aborts_the_engine_request(serve_app: Any) -> None:
    """Egress finds the stop string (the engine cannot see text) and closes the engine stream."""
    prompt = "The history of the Roman Empire"
    base = httpx.post(serve_app.url + "/v1/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "ignore_eos": True, "temperature": 0}).json()
    words = [w.strip(".,:;!?") for w in base["choices"][0]["text"].split()]
    words = [w for w in words if len(w) >= 4]
    assert words, base
    stop = words[len(words) // 2]
    expected = base["choices"][0]["text"][: base["choices"][0]["text"].find(stop)]

    before = wait_idle(serve_app)
    max_tokens = 400
    t0 = time.perf_counter()
    texts, finish = [], None
    with httpx.stream("POST", serve_app.url + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stop": stop}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts.append(c["text"])
                    finish = c["finish_reason"] or finish
    elapsed = time.perf_counter() - t0
    stats = wait_idle(serve_app)
    generated = stats["generation_tokens_total"] - before["generation_tokens_total"]
    print(f"\nstop {stop!r} after {generated} tokens in {elapsed:.2f} s")
    assert finish == "stop"
    assert "".join(texts) == expected
    assert stats["finished_total"]["abort"] == before["finished_total"]["abort"] + 1
    assert stats["finished_total"]["length"] == before["finished_total"]["length"]
    assert stats["finished_total"]["stop"] == before["finished_total"]["stop"]
    assert generated < 40  # nowhere near max_tokens: the engine stopped soon after the match
    assert_no_leaks(stats)
