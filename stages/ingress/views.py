"""Whole-app views from one Ingress replica: health of every stage, and every replica's metrics.

Each answer speaks for the whole app, not for the replica a handle happens to reach: engines and
Ingress replicas report to the Directory, and these functions read those reports.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from typing import Any

from stages.metrics import render_app

logger = logging.getLogger("lifecycle.ingress")

#: Seconds a health or metrics probe of another stage may take.
PROBE_TIMEOUT_S = 5.0
#: Seconds between an Ingress replica's metrics reports to the directory.
METRICS_REPORT_S = 2.0


async def health_problems(preprocess: Any, egress: Any, engine: Any, directory: Any) -> list[str]:
    """Why the app is not healthy (empty when it is): a stage not answering, no engine reporting,
    or an engine whose step loop is not making progress."""

    async def probe(name: str, call: Any) -> tuple[str, Any, BaseException | None]:
        try:
            return name, await asyncio.wait_for(call, PROBE_TIMEOUT_S), None
        except Exception as exc:  # noqa: BLE001 - any failure means not healthy
            return name, None, exc

    calls = [probe("Preprocess", preprocess.ping.remote()), probe("Egress", egress.ping.remote())]
    if directory is not None:
        calls.append(probe("Directory", directory.engines()))
    else:
        calls.append(probe("Engine", engine.info.remote()))
    problems = []
    for name, result, exc in await asyncio.gather(*calls):
        if exc is not None:
            problems.append(f"{name} is not answering ({type(exc).__name__})")
        elif name == "Directory":
            if not result:
                problems.append("no engine replica is reporting")
            problems += [f"engine {r.replica} is not making progress" for r in result if not r.healthy]
        elif name == "Engine" and not result.get("alive", False):
            problems.append("the engine step loop is not running")
    return problems


async def report_metrics_forever(directory: Any, replica: str, exposition: Any) -> None:
    """Send this replica's own metrics text to the directory every ``METRICS_REPORT_S``.

    The text is rendered on a worker thread: under load it is ~47 KB of histograms, 5-8 ms of
    CPU that took 5-78 ms of wall time on the event loop (the loop's thread loses the GIL to
    gRPC's poller meanwhile), and every stream of the replica waited that long (measured, 32
    streams on 2 cores)."""
    while True:
        await asyncio.sleep(METRICS_REPORT_S)
        try:
            text = await asyncio.to_thread(exposition)
            await directory.report_ingress(replica, text)
        except Exception as exc:  # noqa: BLE001 - the directory restarts; keep reporting
            logger.warning("metrics report to the directory failed: %r", exc)


async def metrics_page(directory: Any, replica: str, exposition: Callable[[], str], model_name: str
                       ) -> tuple[str, str]:
    """The whole app's ``/metrics`` body and content type. Both renders run on a worker thread,
    as in :func:`report_metrics_forever`, so a scrape does not stall the replica's streams."""
    own = await asyncio.to_thread(exposition)
    texts, engines = await app_metrics(directory, replica, own)
    return await asyncio.to_thread(render_app, model_name, texts, engines)


async def app_metrics(directory: Any, replica: str, own_text: str) -> tuple[dict[str, str], list[Any]]:
    """Every Ingress replica's metrics text and every engine report. This replica reports first:
    the directory's copy only moves forward, so whichever replica answers the next scrape, no
    counter goes backwards. Without a directory, only this replica's own text."""
    if directory is None:
        return {replica: own_text}, []
    try:
        await asyncio.wait_for(directory.report_ingress(replica, own_text), PROBE_TIMEOUT_S)
        return await asyncio.wait_for(directory.metrics_snapshot(), PROBE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - still serve this replica's own metrics
        logger.warning("directory unavailable for /metrics: %r", exc)
        return {replica: own_text}, []


class EngineLiveness:
    """Is the engine replica running a request still alive? Answered from the directory's engine
    reports (a killed replica stops reporting; a stuck one reports itself unhealthy), refreshed at
    most every ``max_age_s`` so any number of silent streams cost one call. Used at every SSE
    heartbeat tick: a heartbeat alone would keep a dead request's connection open forever.

    A replica counts as gone only after ``grace_s`` of being absent or unhealthy, and a directory
    that cannot be asked is no evidence, so a directory restart never aborts streams."""

    def __init__(self, directory: Any, max_age_s: float = 1.0, grace_s: float = 1.0) -> None:
        self.directory = directory
        self.max_age_s = max_age_s
        self.grace_s = grace_s
        self._healthy: set[str] = set()
        self._known: set[str] = set()
        self._fetched = 0.0
        self._bad_since: dict[str, float] = {}
        self._refresh: asyncio.Task[None] | None = None

    async def _fetch(self) -> None:
        try:
            reports = await asyncio.wait_for(self.directory.engines(), PROBE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - no answer is no evidence: keep the last view
            logger.warning("engine liveness: directory unavailable: %r", exc)
            return
        self._fetched = time.monotonic()
        self._healthy = {r.replica for r in reports if r.healthy}
        self._known = {r.replica for r in reports}

    async def problem(self, replica: str | None) -> str | None:
        """Why ``replica`` cannot finish its requests, or ``None`` (also when unknown or unsure)."""
        if self.directory is None or not replica:
            return None
        if time.monotonic() - self._fetched > self.max_age_s:
            if self._refresh is None or self._refresh.done():
                # A fresh context: in a request's context, Serve cancels the call with that request.
                self._refresh = asyncio.get_running_loop().create_task(self._fetch(), context=contextvars.Context())
            await asyncio.shield(self._refresh)
        now = time.monotonic()
        if replica in self._healthy:
            self._bad_since.pop(replica, None)
            return None
        since = self._bad_since.setdefault(replica, now)
        if now - since < self.grace_s:
            return None
        if replica in self._known:
            return f"engine replica {replica} is not making progress"
        return f"engine replica {replica} stopped reporting"
