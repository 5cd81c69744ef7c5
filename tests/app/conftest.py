"""Fixtures shared by the app tests."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest


@pytest.fixture(scope="session")
def ingress_ports(serve_app_replicas: Any) -> dict[str, int]:
    """Ingress replica id → its direct-ingress port, for both Ingress replicas of the app with
    every stage at 2 replicas. Serve's direct ingress (on under ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``)
    gives each Ingress replica an HTTP port of its own; its ``/health`` names the replica."""
    prefix = serve_app_replicas.url.rsplit("/", 1)[-1]
    found: dict[str, int] = {}
    deadline = time.monotonic() + 60
    while len(found) < 2 and time.monotonic() < deadline:
        for port in range(30000, 30064):
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/{prefix}/health", timeout=1)
            except httpx.HTTPError:
                continue
            if r.status_code == 200 and "replica" in r.json():
                found[r.json()["replica"]] = port
        if len(found) < 2:
            time.sleep(1)
    assert len(found) == 2, f"expected 2 Ingress replicas on direct-ingress ports, found {found}"
    return found
