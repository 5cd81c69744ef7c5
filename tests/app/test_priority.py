"""CPU priorities in a running app: the stages at the workers' priority, the step thread above.

`make serve` and the test session start Ray's workers at nice 0 (``RAY_worker_niceness``:
tests/unit/test_deploy_files.py, tests/serve_harness.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.fault_harness import core_pid, replica_actors

CAP_SYS_NICE = 23


def _nices(pid: int) -> dict[int, int]:
    """Nice value of each thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = os.getpriority(os.PRIO_PROCESS, int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return out


def _may_raise_priority() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    return False


def test_stages_run_at_the_workers_priority_and_the_step_thread_above_them(fault_app: Any) -> None:
    # This app's engine takes one thread of the machine's cores, so its step thread may rise.
    assert fault_app.args["engine"]["num_threads"] < (os.cpu_count() or 1)
    workers = int(os.environ.get("RAY_worker_niceness", "15"))  # the session's (Ray's default: 15)
    replicas = replica_actors(fault_app.name)
    for deployment in ("Ingress", "Preprocess", "Egress", "Directory", "Engine"):
        for replica in replicas[deployment]:  # Ray sets its worker's main thread (the event loop's)
            assert os.getpriority(os.PRIO_PROCESS, replica["pid"]) == workers, (deployment, _nices(replica["pid"]))
    (engine,) = replicas["Engine"]
    nices = sorted(_nices(core_pid(engine["pid"])).values())
    # One thread (the step loop; the OpenMP workers it starts inherit it) at -5 where this machine
    # lets a process raise its priority, above every stage; none raised where it does not.
    if _may_raise_priority():
        assert nices[0] == -5 and nices[-1] > -5, nices
    else:
        assert nices[0] >= 0, nices
