"""The engine step thread's CPU priority.

Why: the step thread is the one thread whose speed is everyone's throughput. Left level with the
CPU stages (Ingress, Egress, HAProxy), it waits on the run queue each time they wake in a burst
after a step (each step's tokens go out through them), so every step ends later; so it runs above
them, and they still get every core the engine does not use. The stages themselves run at nice 0,
level with whatever else the machine runs: Ray starts its workers at nice 15 by default, where any
busy neighbour starves the stages that deliver the tokens, so the Makefile (the Dockerfile, the tests)
start Ray with ``RAY_worker_niceness=0``. The step thread's default, nice -5, keeps it above both the
stages and such neighbours (BENCHMARKS.md, "a busy machine": with two CPU-bound neighbours on two
cores, 2-3× the throughput of Ray's default priorities, and the same when the machine is quiet).

Only where the engine leaves a core for everything else (its threads fewer than the machine's
cores): on a one-core machine a busy engine would starve the stages that deliver its tokens.
The rule is per machine, but each engine sees only itself: two engine replicas that each leave a
core free can together take every core, at a priority above the stages that deliver their tokens
(both engines then prefill slower and every token waits in the stages). So an engine deployment
that may run more than one replica leaves its step threads at the workers' priority, level with
the stages (:func:`step_thread_nice`).

Lowering a nice value needs ``CAP_SYS_NICE`` (root, or a container granted it); without it the
thread stays as it was and the log says so.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)


def step_thread_nice(configured: int | None, engine_replicas: int) -> int | None:
    """The step thread's nice value for an engine deployment that may run ``engine_replicas``
    replicas: the configured one for a sole replica, none (leave Ray's) for more."""
    return configured if engine_replicas <= 1 else None


def raise_thread_priority(nice: int | None, engine_threads: int) -> str:
    """Give the calling thread nice value ``nice`` if that raises its priority and the engine's
    ``engine_threads`` leave a core free; returns what was done, for the log."""
    if nice is None:
        return "priority left as it is (engine.step_thread_nice: null)"
    cores = os.cpu_count() or 1
    if engine_threads <= 0 or engine_threads >= cores:
        return f"priority left as it is: the engine's {engine_threads or 'default'} threads leave no core of {cores} free"
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)  # on Linux, PRIO_PROCESS with a tid is that thread
        if nice >= current:
            return f"priority left as it is: nice {current} already"
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (OSError, AttributeError) as exc:  # EPERM without CAP_SYS_NICE; no getpriority off Unix
        return f"priority left as it is: could not set nice {nice} ({exc})"
    return f"step thread at nice {nice} (was {current})"
