"""The session-end check of tests/leftovers.py: a dead cluster address the session wrote fails it; a
live one, one already there before, or none do not; a process naming a registered temp dir is found."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from tests.leftovers import dead_address, ray_processes


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_written_during_the_session_where_nothing_answers_fails_it(tmp_path: Path) -> None:
    address_file = tmp_path / "ray_current_cluster"
    address_file.write_text(f"127.0.0.1:{_closed_port()}")
    problem = dead_address(address_file, None)
    assert problem is not None and "nothing answers" in problem
    assert dead_address(address_file, "127.0.0.1:1") is not None  # changed during the session


def test_a_live_address_an_old_one_or_none_pass(tmp_path: Path) -> None:
    address_file = tmp_path / "ray_current_cluster"
    assert dead_address(address_file, None) is None  # no file
    dead = f"127.0.0.1:{_closed_port()}"
    address_file.write_text(dead)
    assert dead_address(address_file, dead) is None  # there before the session: not its doing
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address_file.write_text(f"127.0.0.1:{server.getsockname()[1]}")
        assert dead_address(address_file, None) is None  # a live cluster, e.g. the user's own


def test_a_process_naming_a_registered_temp_dir_is_found(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--temp-dir={tmp_path}/ray"])
    try:
        assert [line.split(":")[0] for line in ray_processes([str(tmp_path)])] == [str(proc.pid)]
        assert ray_processes([str(tmp_path / "other")]) == []
    finally:
        proc.kill()
        proc.wait()
    assert ray_processes([str(tmp_path)]) == []
