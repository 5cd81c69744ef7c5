"""The Directory deployment's long poll (stages/directory/deployment.py), outside Serve."""

from __future__ import annotations

import asyncio

from stages.directory.deployment import DirectoryDeployment
from stages.transport.messages import LiveEntry, WatchReply


def test_two_polls_of_one_owner_both_wake_on_a_cancel_and_one_takes_it() -> None:
    """A poll meant for a replica that left lands on another one, beside that owner's own poll
    there: a cancel must still wake them at once, not after the poll timeout."""

    async def main() -> tuple[list[WatchReply], float]:
        d = DirectoryDeployment.func_or_class(watch_timeout_s=5.0)
        await d.sync("ingress-a", [LiveEntry("r1", "chatcmpl-r1", "ingress-a")], [], True)
        polls = [asyncio.create_task(d.watch("ingress-a")) for _ in range(2)]
        await asyncio.sleep(0.05)
        t0 = asyncio.get_running_loop().time()
        await d.cancel("r1")
        replies = await asyncio.gather(*polls)
        return replies, asyncio.get_running_loop().time() - t0

    replies, waited = asyncio.run(main())
    assert waited < 1.0
    assert sorted(r.cancel_ids for r in replies) == [[], ["r1"]]


def test_an_owner_a_replica_does_not_know_is_asked_for_its_whole_list() -> None:
    async def main() -> WatchReply:
        return await DirectoryDeployment.func_or_class().watch("ingress-new", member="d1")

    assert asyncio.run(main()).resync is True
