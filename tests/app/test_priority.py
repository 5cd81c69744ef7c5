"""CPU priorities in a running app: the stages level with other processes, the step thread above."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.fault_harness import replica_actors

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


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry))
            except (OSError, ValueError):
                continue
    return kids


def _may_raise_priority() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    return False


def test_stages_run_at_nice_0_and_the_step_thread_above_them(fault_app: Any) -> None:
    # This app's engine takes one thread of the machine's cores, so its step thread may rise.
    assert fault_app.args["engine"]["num_threads"] < (os.cpu_count() or 1)
    # Ray's default would start every replica at nice 15, below any busy neighbour.
    replicas = replica_actors(fault_app.name)
    for deployment in ("Ingress", "Preprocess", "Egress", "Directory", "Engine"):
        for replica in replicas[deployment]:
            assert set(_nices(replica["pid"]).values()) == {0}, (deployment, _nices(replica["pid"]))
    (engine,) = replicas["Engine"]
    (core,) = [pid for pid in _children(engine["pid"])
               if b"stages.engine.driver.core_process" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    nices = sorted(_nices(core).values())
    # One thread (the step loop; the OpenMP workers it starts inherit it) at -5 where this
    # machine lets a process raise its priority; the rest of the process at the workers' 0.
    expected = -5 if _may_raise_priority() else 0
    assert nices[0] == expected and nices[-1] == 0, nices
