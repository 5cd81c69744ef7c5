"""Both drivers offer everything AsyncEngine uses, so it never needs to know which it has."""

from __future__ import annotations

from stages.config import EngineSettings
from stages.engine.driver.core_process import ChildProcessDriver
from stages.engine.driver.in_process import InProcessDriver
from stages.engine.driver.interface import Driver
from stages.engine.driver.messages import LoopSpec
from tests.fakes import make_engine


def _members() -> set[str]:
    """What the protocol declares: its annotated attributes, methods and properties."""
    return {*Driver.__annotations__, *(n for n in vars(Driver) if not n.startswith("_"))}


def test_both_drivers_are_drivers_and_own_the_loop_settings() -> None:
    in_process = InProcessDriver(make_engine(max_waiting_requests=7), replica="r1")
    child = ChildProcessDriver(LoopSpec("m", EngineSettings(device="cpu", max_waiting_requests=9), replica="r2"))
    try:
        for driver, waiting, replica in ((in_process, 7, "r1"), (child, 9, "r2")):
            missing = {n for n in _members() if not hasattr(type(driver), n) and n not in vars(driver)}
            assert not missing, (type(driver).__name__, missing)
            assert (driver.max_waiting, driver.replica) == (waiting, replica)
            assert driver.dead is None and not driver.alive() and driver.step_started() is None
    finally:
        child.shutdown()  # never started: only its shared slot to close
        in_process.shutdown()


def test_the_in_process_driver_takes_its_loop_settings_from_the_engine_config() -> None:
    driver = InProcessDriver(make_engine())
    defaults = EngineSettings()
    assert (driver.max_waiting, driver.replica, driver.loop.thread_nice) == (
        defaults.max_waiting_requests, "", defaults.step_thread_nice)
