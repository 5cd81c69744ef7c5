"""The HTTP edge: Serve's HAProxy ingress in front of the Ingress replicas' own HTTP servers.

``make serve`` and the test harness run HAProxy (``RAY_SERVE_ENABLE_HA_PROXY=1``) on the app's
port, through ``bin/haproxy-edge``, which edits Ray's HAProxy config (no request splicing, so a
client's abort reaches the replica; every listener on loopback). These tests check what a user
relies on: the port they call is HAProxy's, nothing it opens listens beyond 127.0.0.1, a stream and
a disconnect pass through it, and the wrapper's edit itself. (tests/app/test_cancellation.py checks
that a non-streamed request whose client gave up is aborted in the engine, through this edge.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from tests.conftest import MODEL_NAME, ServeApp

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = ROOT / "bin" / "haproxy-edge"


def _listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on."""
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN]


def _listening_pid(port: int) -> int:
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise AssertionError(f"nothing listens on port {port}")


@pytest.fixture(scope="module")
def edge_pid(serve_app: ServeApp) -> int:
    if os.environ.get("LIFECYCLE_EDGE", "haproxy") != "haproxy":
        pytest.skip("LIFECYCLE_EDGE=proxy: Serve's proxy actor is the edge")
    port = urlsplit(serve_app.url).port
    assert port is not None
    return _listening_pid(port)


def test_the_app_port_is_haproxys(edge_pid: int) -> None:
    proc = psutil.Process(edge_pid)
    assert proc.name() == "haproxy", proc.cmdline()
    # Ray started it through the wrapper, which exec'd the real binary with Ray's arguments.
    assert "-f" in proc.cmdline()


def test_every_haproxy_listener_is_on_loopback(edge_pid: int) -> None:
    # Ray writes its stats page and Prometheus exporter as `bind *:PORT`; without the wrapper two of
    # these would be 0.0.0.0.
    listeners = _listeners(edge_pid)
    assert len(listeners) >= 3, listeners  # the app's port, the stats page, the exporter
    assert all(ip == "127.0.0.1" for ip, _ in listeners), listeners


def test_a_stream_and_its_disconnect_pass_through_haproxy(serve_app: ServeApp, edge_pid: int) -> None:
    body = {"model": MODEL_NAME, "prompt": "Count: 1, 2, 3,", "max_tokens": 2000, "stream": True,
            "ignore_eos": True, "temperature": 0}
    events = 0
    with httpx.Client(timeout=60) as client, client.stream("POST", serve_app.url + "/v1/completions",
                                                            json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                events += 1
            if events == 5:
                break  # leave mid-stream: HAProxy closes its side to the replica (abortonclose)
    assert events == 5
    # The replica saw the disconnect through HAProxy and the engine dropped the request.
    deadline = time.monotonic() + 20
    while True:
        stats = serve_app.engine_stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            assert stats["num_free_blocks"] == stats["num_kv_blocks"], stats
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


RAY_CONFIG = ("defaults\n    mode http\n    option abortonclose\n    option splice-request\n"
              "    option splice-response\nlisten stats\n  bind *:8404\nfrontend prometheus\n    bind :9101\n"
              "frontend http_frontend\n    bind 127.0.0.1:8000\n    bind 10.0.0.5:8001\n")


def _wrap(cfg: Path, **env: str) -> list[str]:
    out = subprocess.run([str(WRAPPER), "-db", "-f", str(cfg), "-sf", "123"], capture_output=True, text=True,
                         timeout=30, env={**os.environ, "LIFECYCLE_HAPROXY_BINARY": "echo", **env}, check=True)
    return out.stdout.split()


def test_the_wrapper_drops_request_splicing_and_keeps_listeners_on_loopback(tmp_path: Path) -> None:
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(RAY_CONFIG)
    # The real binary gets exactly the arguments Ray gave.
    assert _wrap(cfg) == ["-db", "-f", str(cfg), "-sf", "123"]
    # splice-request goes (with http-reuse it kept a client's abort from the replica); only binds on
    # every interface move to loopback.
    assert cfg.read_text() == ("defaults\n    mode http\n    option abortonclose\n    option splice-response\n"
                               "listen stats\n  bind 127.0.0.1:8404\nfrontend prometheus\n    bind 127.0.0.1:9101\n"
                               "frontend http_frontend\n    bind 127.0.0.1:8000\n    bind 10.0.0.5:8001\n")


def test_the_wrapper_keeps_rays_binds_in_a_pod(tmp_path: Path) -> None:
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(RAY_CONFIG)
    _wrap(cfg, LIFECYCLE_HAPROXY_ALL_INTERFACES="1")
    text = cfg.read_text()
    assert "bind *:8404" in text and "bind :9101" in text and "splice-request" not in text


def test_the_wrapper_runs_the_haproxy_ray_ships() -> None:
    from tests.serve_harness import real_haproxy

    out = subprocess.run([str(WRAPPER), "-v"], capture_output=True, text=True, check=True, timeout=30,
                         env={**os.environ, "LIFECYCLE_HAPROXY_BINARY": real_haproxy()})
    assert out.stdout.startswith("HAProxy version")


def test_the_wrapper_refuses_to_run_itself() -> None:
    # RAY_SERVE_HAPROXY_BINARY_PATH names the wrapper, so resolving "the real binary" through it
    # would give the wrapper back: it must stop, not exec itself forever.
    out = subprocess.run([str(WRAPPER), "-v"], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "LIFECYCLE_HAPROXY_BINARY": str(WRAPPER)})
    assert out.returncode != 0
    assert "names this wrapper" in out.stderr


def test_serve_proxy_actor_is_off_the_path_but_answers(serve_app: ServeApp, edge_pid: int) -> None:
    # The fallback proxy actor still serves the app (used by the A/B benchmarks), on loopback.
    from tests.serve_harness import serve_proxy_url

    url = serve_proxy_url()
    assert url is not None
    port = urlsplit(url).port
    assert port is not None and port != urlsplit(serve_app.url).port
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == MODEL_NAME


def test_haproxy_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """Ray's HAProxy manager actor killed outright (``ray stop --force``, an OOM kill) must not
    leave its HAProxy holding the port: the next ``make serve``, or the restarted manager's own
    HAProxy (``-dR``: no port sharing), could not bind it."""
    from tests.serve_harness import real_haproxy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(f"defaults\n    mode http\n    timeout connect 1s\n    timeout client 5s\n    timeout server 5s\n"
                   f"frontend http_frontend\n    bind 127.0.0.1:{port}\n    http-request return status 200\n")
    # The "manager": a process that starts the wrapper as Ray's does (a child it keeps) and waits.
    manager = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, time\n"
         f"p = subprocess.Popen([{str(WRAPPER)!r}, '-db', '-f', {str(cfg)!r}])\n"
         "print(p.pid, flush=True)\ntime.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "LIFECYCLE_HAPROXY_BINARY": real_haproxy()})
    try:
        assert manager.stdout is not None
        haproxy = int(manager.stdout.readline())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise AssertionError("the wrapped HAProxy never answered")
        assert psutil.Process(haproxy).name() == "haproxy"  # the wrapper exec'd into it: same pid
        manager.kill()
        manager.wait(timeout=10)
        psutil.Process(haproxy).wait(timeout=5)  # gone, not orphaned
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # and the port is free again
    finally:
        manager.kill()
