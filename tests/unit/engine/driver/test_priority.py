"""The engine step thread's priority (stages/engine/driver/priority.py), on real threads."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from stages.engine.driver.priority import raise_thread_priority


def in_thread(start_nice: int, fn: Any) -> tuple[str, int]:
    """Run ``fn`` on a fresh thread that first lowers its own priority to ``start_nice`` (as Ray
    starts workers); returns what ``fn`` said and the thread's nice value afterwards."""
    out: dict[str, Any] = {}

    def body() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, start_nice)
        out["said"] = fn()
        out["nice"] = os.getpriority(os.PRIO_PROCESS, tid)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out["said"], out["nice"]


def test_none_and_a_busy_machine_leave_the_thread_alone():
    said, nice = in_thread(15, lambda: raise_thread_priority(None, 1))
    assert nice == 15 and "null" in said
    cores = os.cpu_count() or 1
    said, nice = in_thread(15, lambda: raise_thread_priority(0, cores))
    assert nice == 15 and "no core" in said
    said, nice = in_thread(15, lambda: raise_thread_priority(0, 0))  # torch's default: every core
    assert nice == 15


def test_never_lowers_priority():
    said, nice = in_thread(5, lambda: raise_thread_priority(10, 1))
    assert nice == 5 and "already" in said


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs a core left for the other stages")
def test_raises_only_the_calling_thread():
    if os.geteuid() != 0:
        said, nice = in_thread(15, lambda: raise_thread_priority(0, 1))
        assert nice == 15 and "could not" in said  # no CAP_SYS_NICE: it says so and carries on
        return
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    said, nice = in_thread(15, lambda: raise_thread_priority(2, 1))
    assert nice == 2 and "nice 2 (was 15)" in said
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before, "other threads keep theirs"


def test_an_engine_deployment_of_more_than_one_replica_keeps_rays_priority() -> None:
    """Two engines that each leave a core free can together hold every core above the stages."""
    from stages.engine.driver.priority import step_thread_nice

    assert step_thread_nice(0, 1) == 0
    assert step_thread_nice(0, 2) is None
    assert step_thread_nice(None, 1) is None
