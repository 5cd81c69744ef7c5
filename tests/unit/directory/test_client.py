"""The Directory at several replicas (stages/directory/client.py): writes reach each replica, a
read any one, an owner's requests can be cancelled through every replica, and a new replica is
filled by the writers. The replicas are the real deployment class, outside Serve, behind a fake
handle that routes ``member=`` calls the way the Directory's router does."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from ray.exceptions import RayActorError

from stages.directory.client import DirectoryClient
from stages.directory.deployment import DirectoryDeployment
from stages.ingress.lifecycle import Lifecycle
from stages.transport.messages import AbortRequest, EngineReport, LiveEntry, StreamStart

Directory = DirectoryDeployment.func_or_class


class Replicas:
    """Directory replicas behind a fake handle. A call naming a live ``member`` goes there; any
    other call to the next live replica in turn. ``dead`` replicas raise as a dead actor does;
    ``failing`` ones raise once per listed method."""

    def __init__(self, *names: str) -> None:
        self.replicas: dict[str, Any] = {}
        self.dead: set[str] = set()
        self.failing: dict[str, list[str]] = {}
        self.calls: list[tuple[str, str]] = []
        self._turn = itertools.count()
        self.app_name, self.deployment_name = "app", "Directory"
        for name in names:
            self.add(name)

    def add(self, name: str) -> None:
        self.replicas[name] = Directory(watch_timeout_s=0.2)

    def members(self) -> list[str]:
        return sorted(n for n in self.replicas if n not in self.dead)

    def __getattr__(self, method: str) -> Any:
        outer = self

        class Method:
            def remote(self, *args: Any, member: str = "") -> Any:
                live = outer.members()
                target = member if member in live else live[next(outer._turn) % len(live)]
                return outer._call(target, method, args, member)

        return Method()

    async def _call(self, target: str, method: str, args: tuple[Any, ...], member: str) -> Any:
        self.calls.append((target, method))
        if target in self.dead:
            raise RayActorError()
        if method in self.failing.get(target, []):
            self.failing[target].remove(method)
            raise ConnectionError(f"{target} restarting")
        fn = getattr(self.replicas[target], method)
        return await (fn(*args, member=member) if member else fn(*args))


def client_for(replicas: Replicas) -> DirectoryClient:
    return DirectoryClient(replicas, members=replicas.members, write_timeout_s=1.0)


def entry(rid: str, owner: str = "ingress-a", label: str | None = None) -> LiveEntry:
    return LiveEntry(rid, f"chatcmpl-{rid}", owner, label)


async def wait_until(check: Any, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# -- writes and reads ---------------------------------------------------------------------------------
def test_a_write_reaches_each_replica_and_their_answers_are_merged() -> None:
    async def main() -> None:
        replicas = Replicas("d0", "d1")
        client = client_for(replicas)
        await client.forward_abort(AbortRequest("engine-x", ["r1", "r2"]))
        # A replica that missed one id (it was restarting) still hands out what it holds.
        await replicas.replicas["d1"].forward_abort(AbortRequest("engine-x", ["r3"]))
        for name in ("d0", "d1"):
            assert await replicas.replicas[name].num_forwarded_aborts() >= 2
        assert await client.take_aborts("engine-x") == ["r1", "r2", "r3"]  # each id once
        assert await client.num_forwarded_aborts() == 0  # taken from every replica
        await client.forward_abort(AbortRequest("engine-x", ["r4"]))
        assert await client.report(EngineReport("engine-x", "n", 100, True)) == ["r4"]
        for name in ("d0", "d1"):
            assert [r.replica for r in await replicas.replicas[name].engines()] == ["engine-x"]

    asyncio.run(main())


def test_a_write_one_replica_misses_still_reaches_the_others_and_only_all_failing_raises() -> None:
    async def main() -> None:
        replicas = Replicas("d0", "d1")
        client = client_for(replicas)
        replicas.failing["d1"] = ["keep"]
        await client.keep(entry("r1"), 30.0)  # d1 failed: logged, not raised
        assert await replicas.replicas["d0"].num_kept() == 1
        assert await replicas.replicas["d1"].num_kept() == 0
        replicas.failing = {"d0": ["unkeep"], "d1": ["unkeep"]}
        with pytest.raises(ConnectionError):
            await client.unkeep("r1")

    asyncio.run(main())


def test_a_read_asks_another_replica_when_the_first_died() -> None:
    async def main() -> None:
        replicas = Replicas("d0", "d1")
        client = client_for(replicas)
        await client.report(EngineReport("engine-x", "n", 100, True))
        replicas.dead.add("d0")
        replicas.members = lambda: ["d0", "d1"]  # type: ignore[method-assign]  # not yet told
        replicas._turn = itertools.count()  # the first read goes to d0
        assert [r.replica for r in await client.engines()] == ["engine-x"]
        assert [t for t, m in replicas.calls if m == "engines"] == ["d0", "d1"]

    asyncio.run(main())


# -- an owner's requests at several replicas ------------------------------------------------------------
class Owner:
    """An Ingress replica's lifecycle, watching every Directory replica; records its aborts."""

    def __init__(self, client: DirectoryClient, name: str = "ingress-a") -> None:
        self.aborts: list[AbortRequest] = []
        self.lc = Lifecycle(name, directory=client, abort=self._abort, sync_delay_s=0)
        self.watch = asyncio.get_running_loop().create_task(self.lc.watch_forever(members_period_s=0.02))

    async def _abort(self, request: AbortRequest) -> None:
        self.aborts.append(request)

    def start(self, label: str) -> Any:
        live = self.lc.open("chat", _Span(), client_request_id=label)
        self.lc.started(live, StreamStart(engine_replica="engine-x", engine_request_ids=[f"{live.request_id}-0"], prompt_tokens=1))
        return live

    def stop(self) -> None:
        self.watch.cancel()


class _Span:
    def add_event(self, *args: Any, **kwargs: Any) -> None:
        pass


def live_ids(replica: Any) -> set[str]:
    return set(replica.live.entries)


def test_a_cancel_through_either_replica_reaches_the_owner() -> None:
    async def main() -> None:
        replicas = Replicas("d0", "d1")
        owner = Owner(client_for(replicas))
        first, second = owner.start("label-1"), owner.start("label-2")
        await wait_until(lambda: all(live_ids(r) == {first.request_id, second.request_id}
                                     for r in replicas.replicas.values()))
        # Another Ingress replica's cancel, answered by each Directory replica in turn.
        assert [e.request_id for e in await replicas.replicas["d1"].cancel("label-1")] == [first.request_id]
        await wait_until(lambda: len(owner.aborts) == 1)
        assert [e.request_id for e in await replicas.replicas["d0"].cancel(second.response_id)] == [second.request_id]
        await wait_until(lambda: len(owner.aborts) == 2)
        assert [a.request_ids for a in owner.aborts] == [[f"{first.request_id}-0"], [f"{second.request_id}-0"]]
        owner.lc.close(first)
        owner.lc.close(second)
        await wait_until(lambda: all(not live_ids(r) for r in replicas.replicas.values()))
        owner.stop()

    asyncio.run(main())


def test_a_new_replica_gets_every_owners_list_and_a_lost_one_is_left_behind() -> None:
    """One more replica (or a replacement, which starts empty) is filled by the owners within a
    look at the membership; with a replica gone, cancels through the rest still work."""

    async def main() -> None:
        replicas = Replicas("d0", "d1")
        owners = [Owner(client_for(replicas), "ingress-a"), Owner(client_for(replicas), "ingress-b")]
        lives = [o.start(f"label-{i}") for i, o in enumerate(owners)]
        ids = {live.request_id for live in lives}
        await wait_until(lambda: all(live_ids(r) == ids for r in replicas.replicas.values()))
        replicas.add("d2")
        await wait_until(lambda: live_ids(replicas.replicas["d2"]) == ids)
        replicas.dead.add("d0")
        assert [e.owner for e in await replicas.replicas["d2"].cancel("label-1")] == ["ingress-b"]
        await wait_until(lambda: len(owners[1].aborts) == 1)
        assert owners[0].aborts == []
        later = owners[0].start("label-later")
        await wait_until(lambda: later.request_id in live_ids(replicas.replicas["d2"]))
        assert later.request_id not in live_ids(replicas.replicas["d0"])  # the dead one is not written to
        for o in owners:
            o.stop()

    asyncio.run(main())


def test_a_replica_that_missed_a_batch_gets_the_whole_list_the_others_only_changes() -> None:
    async def main() -> None:
        replicas = Replicas("d0", "d1")
        owner = Owner(client_for(replicas))
        first = owner.start("label-1")
        await wait_until(lambda: all(live_ids(r) == {first.request_id} for r in replicas.replicas.values()))
        replicas.failing["d1"] = ["sync"]
        second = owner.start("label-2")
        await wait_until(lambda: live_ids(replicas.replicas["d0"]) == {first.request_id, second.request_id})
        assert live_ids(replicas.replicas["d1"]) == {first.request_id}  # that batch was lost there
        await wait_until(lambda: live_ids(replicas.replicas["d1"]) == {first.request_id, second.request_id},
                         timeout=5.0)
        owner.stop()

    asyncio.run(main())
