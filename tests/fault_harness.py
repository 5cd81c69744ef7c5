"""Helpers for the fault, slow-reader and soak tests: replica processes from Ray's state, SSE
clients that record exactly what they saw and when, and process memory from /proc.

Replica PIDs come from the GCS actor table (``ray._private.state``): ``ray.util.state.list_actors``
asks the dashboard, which the tests' Ray session does not start (to save memory on small CI boxes).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.conftest import MODEL_NAME

#: Keys of an OpenAI error object.
ERROR_KEYS = {"message", "type", "param", "code"}


def replica_actors(app: str) -> dict[str, list[dict[str, Any]]]:
    """Alive Serve replicas of ``app`` by deployment: ``{"Engine": [{"pid", "actor_id", "name"}]}``."""
    import ray._private.state as ray_state

    out: dict[str, list[dict[str, Any]]] = {}
    for actor in ray_state.actors().values():
        name = actor.get("Name") or ""
        if actor.get("State") != "ALIVE" or not name.startswith(f"SERVE_REPLICA::{app}#"):
            continue
        deployment = name.split("#")[1]
        out.setdefault(deployment, []).append({"pid": actor["Pid"], "actor_id": actor["ActorID"], "name": name})
    return out


def busiest_egress(app: str) -> dict[str, Any]:
    """The Egress replica holding the most jobs, as each replica answers itself (Serve's
    ``record_routing_stats`` on the replica actor: no router in between, so every replica is asked)."""
    import ray

    replicas = replica_actors(app)["Egress"]
    actors = [ray.get_actor(r["name"], namespace="serve") for r in replicas]
    jobs = [s["admitted_jobs"] for s in ray.get([a.record_routing_stats.remote() for a in actors], timeout=30)]
    assert max(jobs) > 0, f"no Egress replica holds a job: {jobs}"
    return replicas[jobs.index(max(jobs))]


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def direct_ingress_url(app: str, route_prefix: str) -> str:
    """The HTTP address of ``app``'s Ingress replica itself (Serve's direct ingress), bypassing the
    edge (HAProxy or Serve's proxy): there the replica's ASGI ``send`` is uvicorn's, which waits for
    a slow client."""
    import ray
    from ray.serve._private.constants import (
        RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT,
        RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT,
        SERVE_CONTROLLER_NAME,
        SERVE_NAMESPACE,
    )

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    # As the HAProxy manager asks (from_proxy_manager): the replicas themselves, not HAProxy; the
    # replicas' ports are the direct-ingress range (Serve's fallback proxy may be listed beside them).
    ports = range(RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT + 1)
    for group in ray.get(controller.get_target_groups.remote(app, True), timeout=30):
        if str(group.protocol).upper().endswith("HTTP") and group.route_prefix == route_prefix:
            for target in group.targets:
                if target.port in ports:
                    # The replica binds to the Serve HTTP host (loopback in the tests), not the node's IP.
                    return f"http://127.0.0.1:{target.port}{route_prefix.rstrip('/')}"
    raise AssertionError(f"no direct-ingress HTTP target for app {app!r}")


def wait_for(pred: Callable[[], Any], timeout: float, what: str, period: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(period)


@dataclass
class StreamResult:
    """One streamed completion as the client saw it."""

    status: int | None = None
    events: int = 0
    tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None
    done: bool = False
    #: The event after the error event (must be ``[DONE]``).
    after_error: str | None = None
    exception: str | None = None
    body: str = ""
    started: threading.Event = field(default_factory=threading.Event)
    ended_at: float | None = None
    first_token_at: float | None = None


def stream_completion(url: str, out: StreamResult, *, max_tokens: int = 400, timeout: float = 120,
                      prompt: str = "Tell me a long story about the sea:", extra: dict[str, Any] | None = None,
                      ) -> StreamResult:
    """POST a streamed completion and record everything (never raises)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, **(extra or {})}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.body = resp.read().decode()
                return out
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                out.events += 1
                if out.error is not None and out.after_error is None:
                    out.after_error = data
                if data == "[DONE]":
                    out.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = event["error"]
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        out.tokens += 1
                        if out.first_token_at is None:
                            out.first_token_at = time.monotonic()
                        out.started.set()
                    if choice.get("finish_reason"):
                        out.finish_reasons.append(choice["finish_reason"])
    except httpx.HTTPError as exc:
        out.exception = repr(exc)
    finally:
        out.ended_at = time.monotonic()
        out.started.set()
    return out


class Streams:
    """``n`` streamed completions in threads."""

    def __init__(self, url: str, n: int, **kwargs: Any) -> None:
        self.results = [StreamResult() for _ in range(n)]
        self.threads = [threading.Thread(target=stream_completion, args=(url, r), kwargs=kwargs, daemon=True)
                        for r in self.results]
        for t in self.threads:
            t.start()

    def wait_started(self, timeout: float = 90) -> None:
        for r in self.results:
            assert r.started.wait(timeout), "a stream did not start"

    def join(self, timeout: float) -> list[StreamResult]:
        """Wait up to ``timeout`` in all; a client still waiting then fails the test."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, t in zip(self.results, self.threads, strict=True) if t.is_alive()]
        assert not hung, f"{len(hung)} client(s) still waiting after {timeout} s: {hung[:2]}"
        return self.results


class RawStream:
    """A streamed request on a raw socket whose reading is under the test's control (a tiny
    receive buffer, so the server's writes block as soon as the client stops reading)."""

    def __init__(self, url: str, body: dict[str, Any], rcvbuf: int = 4096, path: str = "/v1/completions") -> None:
        parts = urlsplit(url)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.connect((parts.hostname, parts.port))
        payload = json.dumps(body).encode()
        request = (f"POST {parts.path}{path} HTTP/1.1\r\nHost: {parts.hostname}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
        self.sock.sendall(request + payload)

    def read_all(self, timeout: float = 30) -> bytes:
        """Read until the server closes the connection or the chunked body ends."""
        self.sock.settimeout(timeout)
        chunks = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                break
            if not data:
                break
            chunks.append(data)
            if b"0\r\n\r\n" in data[-16:]:
                break
        return b"".join(chunks)

    def close(self) -> None:
        self.sock.close()


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads in a raw HTTP/1.1 chunked SSE response (chunk sizes skipped)."""
    out = []
    for line in raw.decode(errors="replace").split("\n"):
        line = line.rstrip("\r")
        if line.startswith("data: "):
            out.append(line[6:])
    return out


def core_pid(replica_pid: int) -> int:
    """The engine core process (``engine.core_process``) a replica started."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if b"stages.engine.driver.core_process" in cmd and ppid == replica_pid:
            return int(entry)
    raise AssertionError(f"no engine core process under replica {replica_pid}")
