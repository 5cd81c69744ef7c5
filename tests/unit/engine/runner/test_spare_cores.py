"""The decode thread count follows what the other processes leave idle (fake clocks, no sleeping)."""

from __future__ import annotations

import os

from stages.engine.runner.spare_cores import SpareCores, _busy_seconds


class Machine:
    """A fake machine: ``run(seconds, others=, own=)`` advances time with that many cores busy."""

    def __init__(self) -> None:
        self.now = 100.0
        self.busy_s = 5000.0
        self.own_s = 10.0

    def run(self, seconds: float, others: float, own: float = 1.0) -> None:
        self.now += seconds
        self.busy_s += (others + own) * seconds
        self.own_s += own * seconds

    def spare(self, base: int = 1, most: int = 2, cores: int = 2) -> SpareCores:
        return SpareCores(base, most, cores=cores, clock=lambda: self.now, busy=lambda: self.busy_s,
                          own=lambda: self.own_s)


def test_two_threads_only_while_the_others_use_under_half_a_core():
    m = Machine()
    s = m.spare()
    assert s.threads() == 1, "no reading yet: the base"
    m.run(0.3, others=0.2)
    assert s.threads() == 2 and abs(s.others - 0.2) < 1e-9
    m.run(0.3, others=0.8)
    assert s.threads() == 1, "the stages got busy: give their core back"
    m.run(0.3, others=0.45, own=2.0)
    assert s.threads() == 2, "our own second thread is not counted against us"


def test_one_reading_per_window():
    m = Machine()
    s = m.spare()
    s.threads()
    m.run(0.3, others=0.0)
    assert s.threads() == 2
    m.run(0.1, others=2.0)
    assert s.threads() == 2, "within the window the last decision stands"
    m.run(0.2, others=2.0)
    assert s.threads() == 1


def test_more_cores_allow_more_threads_in_steps():
    m = Machine()
    s = m.spare(base=2, most=8, cores=8)
    s.threads()
    m.run(0.5, others=3.2)  # 4.8 idle: 5 threads need 4.5
    assert s.threads() == 5
    m.run(0.5, others=7.9)
    assert s.threads() == 2


def test_without_proc_stat_the_base():
    s = SpareCores(1, 2, cores=2, busy=lambda: None)
    assert s.threads() == 1 and s.threads() == 1 and s.others is None


def test_this_machines_reading_is_sane():
    busy = _busy_seconds()
    if not os.path.exists("/proc/stat"):
        assert busy is None
        return
    assert busy is not None and busy > 0
