"""What a test session must not leave on the machine, checked when it ends (``tests/conftest.py``).

- **A dead cluster address.** ``ray start`` writes its GCS address to Ray's address file, and a
  user's next ``serve run serve_config.yaml`` or ``ray.init()`` with no address connects to what the
  default file (``/tmp/ray/ray_current_cluster``) names: a cluster the tests started and stopped
  would keep it waiting forever. The file may name a live cluster (a user's own ``ray start``), or
  one that died before the session (not the tests' doing); it fails the session only when it
  changed during the session and names an address where nothing answers.
- **Ray processes.** Every Ray process a test starts has its temp dir in its command line
  (``--temp-dir``, a log or socket path); the harnesses register those dirs here and no process
  naming one may outlive the session.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import psutil

#: Ray temp dirs the session's Ray instances and clusters use (appended by the harnesses).
RAY_TEMP_DIRS: list[str] = []


def default_address_file() -> Path:
    """Ray's default address file (what ``ray start`` writes and ``ray.init()`` reads)."""
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(None))


def read_address(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def answers(address: str, timeout: float = 2.0) -> bool:
    """Whether something accepts TCP connections at ``host:port`` (a live GCS does)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def dead_address(path: Path, before: str | None) -> str | None:
    """A problem to report if ``path`` changed since ``before`` and names an address nobody answers."""
    now = read_address(path)
    if now is None or now == before or answers(now):
        return None
    return (f"{path} names {now}, where nothing answers: a cluster the tests stopped. "
            f"A plain `serve run serve_config.yaml` would wait for it forever.")


def ray_processes(temp_dirs: list[str]) -> list[str]:
    """Processes still alive whose command line names one of ``temp_dirs``, as ``pid: command``."""
    if not temp_dirs:
        return []
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.pid != os.getpid() and any(d in cmd for d in temp_dirs):
            left.append(f"{p.pid}: {cmd[:160]}")
    return left


def problems(address_before: str | None, grace_s: float = 10) -> list[str]:
    """Everything this session left behind (empty when it left nothing). Ray processes get
    ``grace_s`` to finish exiting."""
    found = []
    dead = dead_address(default_address_file(), address_before)
    if dead:
        found.append(dead)
    deadline = time.monotonic() + grace_s
    while (left := ray_processes(RAY_TEMP_DIRS)) and time.monotonic() < deadline:
        time.sleep(0.5)
    found += [f"Ray process left running: {p}" for p in left]
    return found
