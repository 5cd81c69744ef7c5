"""The cluster harness cleans up after itself: a stopped test cluster leaves no address file that
names it, no process, no listening port and no temp directory.

Why: ``ray start`` records the cluster's GCS address in Ray's address file, and a plain
``serve run serve_config.yaml`` (or ``ray.init()``) afterwards connects to whatever that file
names; once the test has killed the cluster, it waits forever for a dead GCS.
"""

from __future__ import annotations

import socket
from pathlib import Path

import psutil
import pytest
from ray._common.utils import get_ray_address_file

from tests.cluster_harness import LocalCluster

pytestmark = [pytest.mark.cluster]

#: The file a user's ``serve run`` / ``ray.init()`` reads when no address is given.
DEFAULT_ADDRESS_FILE = Path(get_ray_address_file(None))


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _listening(port: int) -> bool:
    """Whether something listens on ``port`` (TIME_WAIT connections of a closed server do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_a_stopped_cluster_leaves_nothing_behind() -> None:
    cluster = LocalCluster()
    try:
        # A worker as well as the head: a worker's ``ray start --address 127.0.0.1:PORT`` writes the
        # address too, resolved to the machine's own IP.
        cluster.start({"worker": (1, {})}, head_resources={})
        procs = [p for node in cluster.nodes for p in _tree(node.proc.pid)]
        assert len(procs) >= 6, procs  # each node: `ray start`, raylet, agents; the head: GCS, dashboard
        assert _listening(cluster.gcs_port) and _listening(cluster.dashboard_port)
    finally:
        cluster.stop()
    named = DEFAULT_ADDRESS_FILE.read_text().strip() if DEFAULT_ADDRESS_FILE.exists() else ""
    assert not named.endswith(f":{cluster.gcs_port}"), f"{DEFAULT_ADDRESS_FILE} names the stopped cluster: {named}"
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, alive
    assert not _listening(cluster.gcs_port) and not _listening(cluster.dashboard_port)
    assert not Path(cluster.log_dir).exists(), sorted(p.name for p in Path(cluster.log_dir).iterdir())
