"""How many of the machine's cores the other processes leave idle, measured as the engine runs.

A decode step at a few rows is bound by streaming the weights, and a second thread nearly halves it,
but on a small machine the CPU stages (Ingress, Preprocess, Egress, Ray's own processes) share the
same cores: a second decode thread that takes their core delays every token they carry. So the
step asks, at most every ``window_s``, how busy everything but this process has been since the last
look: ``/proc/stat``'s busy time of the whole machine, less this process's own CPU time, against
the CPUs this process may run on. It uses ``n`` threads while the others leave at least ``n - 1/2`` cores idle (on 2 cores: the
others use under half a core), else the configured base. Stat reads cost microseconds, once a
window. Where ``/proc/stat`` cannot be read, the base is used.

The reading is machine-wide: in a container it counts other tenants too, so it errs towards fewer
threads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

#: Seconds between two readings: long enough for the 10 ms tick to average out, short enough to
#: follow a burst of requests arriving.
WINDOW_S = 0.25


def _busy_seconds() -> float | None:
    """Busy CPU seconds of the whole machine since boot (all CPUs), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user and nice]
    values = [int(v) for v in fields[1:9]]
    busy = values[0] + values[1] + values[2] + values[5] + values[6] + values[7]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class SpareCores:
    """Decides a decode step's thread count from the other processes' recent CPU use."""

    def __init__(self, base: int, most: int, *, window_s: float = WINDOW_S, cores: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 busy: Callable[[], float | None] = _busy_seconds, own: Callable[[], float] = _own_seconds) -> None:
        """``base`` threads always, up to ``most`` when the other processes leave the cores idle."""
        self.base, self.most = base, max(base, most)
        self.window_s = window_s
        self.cores = cores if cores is not None else _cores()
        self._clock, self._busy, self._own = clock, busy, own
        self._last: tuple[float, float, float] | None = None
        #: The others' use (cores) over the last window, or None before the first full window.
        self.others: float | None = None
        self._threads = base

    def threads(self) -> int:
        """The thread count for the next decode step."""
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.window_s:
            return self._threads
        busy = self._busy()
        if busy is None:
            return self.base
        own = self._own()
        if self._last is not None:
            t0, busy0, own0 = self._last
            self.others = max(0.0, (busy - busy0) - (own - own0)) / (now - t0)
            self._threads = self._choose(self.others)
        self._last = (now, busy, own)
        return self._threads

    def _choose(self, others: float) -> int:
        for n in range(self.most, self.base, -1):
            if self.cores - others >= n - 0.5:
                return n
        return self.base
