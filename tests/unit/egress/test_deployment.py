"""The Egress deployment's own loop (stages/egress/deployment.py), outside Serve: a Directory
replica that appears is told again of every stream kept here."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from stages.egress.deployment import EgressDeployment
from stages.transport.messages import LiveEntry


def test_a_new_directory_replica_is_told_of_the_kept_streams_once() -> None:
    entry = LiveEntry("r1", "cmpl-r1", "egress-A", kept=True)
    looks = [["d0"], ["d0"], ["d0", "d1"], ["d0", "d1"], ["d1", "d2"]]  # one more, then a replacement
    kept: list[tuple[LiveEntry, float]] = []

    async def main() -> None:
        fake: Any = SimpleNamespace(
            directory=SimpleNamespace(members=lambda: looks.pop(0) if len(looks) > 1 else looks[0]),
            kept=SimpleNamespace(detached_entries=lambda: [(entry, 12.0)]),
            _keep_entry=lambda e, seconds: kept.append((e, seconds)))
        loop = asyncio.create_task(EgressDeployment.func_or_class._keep_again_forever(fake, period_s=0.001))
        while looks[1:]:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        loop.cancel()

    asyncio.run(main())
    assert kept == [(entry, 12.0), (entry, 12.0)]  # d1 appeared, then d2; never for the first look
