"""A real multi-node Ray cluster on this machine, and the app deployed onto it as a user would.

Every node is its own ``ray start`` (a head, CPU workers, one "accelerator" worker marked by the
custom resource ``accelerator`` standing in for a GPU), all on loopback; the app goes on with
``serve run --address ... --non-blocking`` and a Serve config file.

A cluster leaves nothing behind. ``ray start`` writes its GCS address to the address file in its
temp dir, and a user's next ``serve run serve_config.yaml`` or ``ray.init()`` connects to whatever
the default one (``/tmp/ray/ray_current_cluster``) names, waiting forever once that cluster is
gone. So every node gets the cluster's own temp dir (``--temp-dir``), :meth:`LocalCluster.stop`
stops the nodes as ``ray stop`` does, and then removes that dir with the address file, Ray's
session, sockets and logs in it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from tests.leftovers import RAY_TEMP_DIRS
from tests.serve_harness import free_port

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
#: Loopback only, no auth token to hand around, no usage stats; direct ingress drains for 1 s.
#: Serve's proxy actor is the edge here, not HAProxy: every node of this cluster shares one
#: loopback, and HAProxy mode gives each node's HAProxy the same HTTP, stats and exporter ports
#: (pods, as in k8s/, each have their own).
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
       "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0.2",
       "RAY_SERVE_ENABLE_HA_PROXY": "0",
       # A stopped test node has nothing to drain for: SIGTERM stops it at once (Ray's default waits
       # up to 30 s per node for Serve to move traffic off it).
       "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


@dataclass
class Node:
    name: str
    resources: dict[str, float]
    proc: subprocess.Popen[bytes]
    node_id: str = ""

    def processes(self) -> list[psutil.Process]:
        """This node's ``ray start`` and every process under it (GCS, raylet, agents, workers)."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """Kill the node the way a machine dies: every process of it, with SIGKILL."""
        for p in self.processes():
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=30)


@dataclass
class LocalCluster:
    """Head + workers started with ``ray start --block`` (each stays our child, so it can be killed).

    ``log_dir`` holds everything of the cluster: each node's output (``NAME.log``), the Serve config
    and ``serve run``'s output, and Ray's temp dir (``ray/``)."""

    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    nodes: list[Node] = field(default_factory=list)
    log_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="lifecycle-cluster-"))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def temp_dir(self) -> str:
        """Ray's temp dir for every node of this cluster (its address file, sessions, sockets, logs)."""
        return os.path.join(self.log_dir, "ray")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, name: str, args: list[str], num_cpus: float, resources: dict[str, float]) -> Node:
        # A resource only this node has, so its Ray node id can be found by name.
        resources = {**resources, self.marker(name): 1}
        log = open(os.path.join(self.log_dir, f"{name}.log"), "wb")  # noqa: SIM115 - lives with the node
        cmd = [str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
               f"--resources={json.dumps(resources)}", f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
               *args]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
        node = Node(name, resources, proc)
        self.nodes.append(node)
        return node

    def start(self, workers: dict[str, tuple[float, dict[str, float]]], head_resources: dict[str, float],
              timeout_s: float = 120) -> None:
        """Start the head, then each worker ``name: (num_cpus, resources)``; wait until all joined."""
        RAY_TEMP_DIRS.append(self.temp_dir)
        self._start("head", ["--head", f"--port={self.gcs_port}", "--include-dashboard=true",
                             "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}"],
                    1, head_resources)
        self._wait_gcs(timeout_s)
        # One at a time: a raylet must register within 30 s (hard-coded in Ray), and several
        # starting together on a busy 2-core machine can miss that; a node that did is retried.
        for name, (cpus, resources) in workers.items():
            for _attempt in range(3):
                node = self._start(name, [f"--address={self.address}"], cpus, resources)
                deadline = time.monotonic() + timeout_s
                while len(self.alive_nodes()) < len(self.nodes) and node.proc.poll() is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"node {name} did not join; logs in {self.log_dir}:\n"
                                           + self.log_tail(name))
                    time.sleep(1)
                if node.proc.poll() is None:
                    break
                self.nodes.remove(node)
            else:
                raise RuntimeError(f"node {name} failed to start 3 times; logs in {self.log_dir}:\n"
                                   + self.log_tail(name))
        for info in self.alive_nodes():
            for node in self.nodes:
                if self.marker(node.name) in info["resources_total"]:
                    node.node_id = info["node_id"]

    @staticmethod
    def marker(name: str) -> str:
        return "lifecycle_node_" + name.replace("-", "_")

    def _wait_gcs(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(self.dashboard + "/api/version", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the head did not start; logs in {self.log_dir}:\n" + self.log_tail("head"))
            time.sleep(1)

    def alive_nodes(self) -> list[dict[str, Any]]:
        from ray.util.state import list_nodes

        try:
            return [dict(n) if isinstance(n, dict) else vars(n) for n in
                    list_nodes(address=self.dashboard, filters=[("state", "=", "ALIVE")], detail=True)]
        except Exception:  # noqa: BLE001 - the head is still coming up
            return []

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def serve_run(self, config: dict[str, Any], timeout_s: float = 300) -> None:
        """Deploy ``config`` (a Serve config dict) with ``serve run --non-blocking``; wait for /health."""
        config = {**config, "http_options": {**config.get("http_options", {}), "host": "127.0.0.1",
                                             "port": self.http_port}}
        path = os.path.join(self.log_dir, "serve_config.yaml")
        Path(path).write_text(yaml.safe_dump(config))
        subprocess.run([str(BIN / "serve"), "run", "--non-blocking", f"--address={self.address}", path],
                       check=True, env=ENV, cwd=ROOT, timeout=timeout_s,
                       stdout=open(os.path.join(self.log_dir, "serve_run.log"), "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the app did not become healthy; logs in {self.log_dir}:\n"
                                   + self.log_tail("serve_run"))
            time.sleep(1)

    def replicas(self) -> dict[str, list[dict[str, Any]]]:
        """Alive Serve replica actors by deployment name: ``[{"actor_id", "node_id", "pid"}]``."""
        from ray.util.state import list_actors

        out: dict[str, list[dict[str, Any]]] = {}
        for a in list_actors(address=self.dashboard, filters=[("state", "=", "ALIVE")], limit=1000):
            name = a.name or ""
            if not name.startswith("SERVE_REPLICA::"):
                continue
            deployment = name.split("#")[1]
            out.setdefault(deployment, []).append({"actor_id": a.actor_id, "node_id": a.node_id, "pid": a.pid})
        return out

    def stop(self, keep_dir: bool = False, grace_s: float = 30) -> None:
        """Stop every node as ``ray stop`` does, but only this cluster's: SIGTERM to each node's
        ``ray start``, which stops its raylet first and the GCS last; the workers before the head; a
        SIGKILL for whatever outlives ``grace_s``. Then remove :attr:`log_dir` (with Ray's temp dir
        and the address file in it) unless ``keep_dir``: a failed test keeps the logs to read."""
        workers = [n for n in self.nodes if n.name != "head"]
        heads = [n for n in self.nodes if n.name == "head"]
        for group in (workers, heads):
            procs = [p for node in group for p in node.processes()]
            for node in group:
                if node.proc.poll() is None:
                    node.proc.send_signal(signal.SIGTERM)
            _, alive = psutil.wait_procs(procs, timeout=grace_s)
            for p in alive:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(alive, timeout=10)
            for node in group:
                node.proc.wait(timeout=10)
        self.nodes.clear()
        if not keep_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of ``NAME.log`` in :attr:`log_dir` (a node's output, or ``serve_run``'s)."""
        try:
            return Path(self.log_dir, f"{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""
