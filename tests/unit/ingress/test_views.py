"""The Ingress's background metrics report (:func:`stages.ingress.views.report_metrics_forever`)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from stages.ingress import views


class _Directory:
    """Stands in for the Directory client: records what each report carried."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, str]] = []
        self.report_ingress = self

    async def __call__(self, replica: str, text: str) -> None:
        self.reports.append((replica, text))


def test_the_metrics_report_renders_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rendering a loaded replica's text took up to 78 ms on the loop, and every stream of the
    # replica waited that long. Here a render that blocks its thread for 0.3 s must not stop a
    # task that ticks every 10 ms on the loop.
    monkeypatch.setattr(views, "METRICS_REPORT_S", 0.01)
    loop_thread: list[int] = []
    render_threads: list[int] = []

    def exposition() -> str:
        render_threads.append(threading.get_ident())
        time.sleep(0.3)
        return "lifecycle:x 1\n"

    async def main() -> float:
        loop_thread.append(threading.get_ident())
        directory = _Directory()
        reporter = asyncio.create_task(views.report_metrics_forever(directory, "r1", exposition))
        worst, last = 0.0, time.perf_counter()
        deadline = last + 0.8
        while time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
        reporter.cancel()
        assert directory.reports and directory.reports[0] == ("r1", "lifecycle:x 1\n")
        return worst

    worst_gap = asyncio.run(main())
    assert render_threads and loop_thread[0] not in render_threads
    assert worst_gap < 0.15, f"the event loop stalled {worst_gap * 1e3:.0f} ms while the metrics rendered"
