"""Whole-app views from one Ingress replica: health of every stage, and every replica's metrics.

Each answer speaks for the whole app, not for the replica a handle happens to reach: engines and
Ingress replicas report to the Directory, and these functions read those reports.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

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
        calls.append(probe("Directory", directory.engines.remote()))
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
    """Send this replica's own metrics text to the directory every ``METRICS_REPORT_S``."""
    while True:
        await asyncio.sleep(METRICS_REPORT_S)
        try:
            await directory.report_ingress.remote(replica, exposition())
        except Exception as exc:  # noqa: BLE001 - the directory restarts; keep reporting
            logger.warning("metrics report to the directory failed: %r", exc)


async def app_metrics(directory: Any, replica: str, own_text: str) -> tuple[dict[str, str], list[Any]]:
    """Every Ingress replica's metrics text and every engine report. This replica reports first:
    the directory's copy only moves forward, so whichever replica answers the next scrape, no
    counter goes backwards. Without a directory, only this replica's own text."""
    if directory is None:
        return {replica: own_text}, []
    try:
        await asyncio.wait_for(directory.report_ingress.remote(replica, own_text), PROBE_TIMEOUT_S)
        return await asyncio.wait_for(directory.metrics_snapshot.remote(), PROBE_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - still serve this replica's own metrics
        logger.warning("directory unavailable for /metrics: %r", exc)
        return {replica: own_text}, []
