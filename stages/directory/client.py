"""How every stage calls the Directory, at one replica or many.

The rule: **every Directory replica holds the whole state; a change goes to each replica, a
question to any one.** So the Directory may run N replicas (``num_replicas`` or autoscaling): a
cancel or a reconnect answered by any replica finds a request registered through any other, and
losing a replica loses nothing the others hold. Its replacement starts empty and is filled again
by the writers themselves: an owner that a replica does not know is asked to resend its whole list
(``WatchReply.resync``), engines report every second, and Egress replicas keep their detached
streams again when a new replica appears.

Why replicated rather than sharded: what must scale with the cluster are the reads (every cancel,
reconnect, ``/health`` and ``/metrics`` scrape), and those go to one replica each. The writes are
small and batched (one ``sync`` per Ingress flush, one report per engine a second), so sending
each to N replicas costs N small calls, not N times the request rate. A shard's loss would lose its
part of the ids until the owners resent them, which is the same repair without the hash ring.

Addressing a replica: calls that name ``member=`` are routed to that replica by
:class:`stages.directory.router.DirectoryRouter`, which runs in this process's handle and tells
this module which replicas it currently routes to. A call naming a replica that just left goes to
another one instead; every write is idempotent (a second copy of a change changes nothing), and a
watch is a watch wherever it lands.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError

from stages.transport.membership import routed_replicas
from stages.transport.messages import AbortRequest, EngineReport, LiveEntry, ResumeLookup, WatchReply

logger = logging.getLogger(__name__)

#: Seconds one replica may take to answer a write before the writer counts it as failed (and,
#: for a sync, resends its whole list there later): a stuck replica must not hold up the others.
WRITE_TIMEOUT_S = 5.0

#: Seconds between two looks at which Directory replicas there are: one more, or a replacement,
#: gets every owner's whole list, a watch of its own and the kept streams within this long.
MEMBERS_PERIOD_S = 1.0

class DirectoryClient:
    """A Serve handle to the Directory, with the replication rule above.

    ``members``: where the current replica ids come from (by default this process's router;
    unit tests pass a fixed list)."""

    def __init__(self, handle: Any, members: Callable[[], list[str]] | None = None,
                 write_timeout_s: float = WRITE_TIMEOUT_S) -> None:
        self.handle = handle
        self._members = members or (lambda: routed_replicas(handle.app_name, handle.deployment_name))
        self.write_timeout_s = write_timeout_s

    # -- which replicas ---------------------------------------------------------------------------------
    def members(self) -> list[str]:
        """The replicas known now ([] before this process has called the Directory)."""
        return self._members()

    async def ready_members(self) -> list[str]:
        """The replicas, after one call if none is known yet: Serve starts a handle's router on
        its first call, and the router knows the replicas before it routes that call."""
        members = self.members()
        if not members:
            await self.handle.ping.remote()
            members = self.members()
        return members

    # -- writes: to each replica --------------------------------------------------------------------------
    async def write(self, member: str, method: str, *args: Any) -> Any:
        """One change to one replica, within :data:`WRITE_TIMEOUT_S`."""
        return await asyncio.wait_for(self._send(member, method, *args), self.write_timeout_s)

    async def _send(self, member: str, method: str, *args: Any) -> Any:
        """The call to one replica, in a fresh context. Serve gives every handle call made in a
        request's context that request's id, and concurrent calls sharing one id can be matched
        to each other's routing decision (seen: all but one of a fan-out stalled until its
        timeout). Nor must a client that leaves cancel a change on its way."""
        method_handle = getattr(self.handle, method)

        async def call() -> Any:  # ``.remote`` reads the context: it must run inside the task
            return await method_handle.remote(*args, member=member)

        return await asyncio.get_running_loop().create_task(call(), context=contextvars.Context())

    async def each(self, method: str, *args: Any) -> dict[str, Any]:
        """Send one change to every replica; each one's answer, or the exception it raised.
        Raises only when no replica took it."""
        members = await self.ready_members()
        answers = await asyncio.gather(*(self.write(m, method, *args) for m in members),
                                       return_exceptions=True)
        by_member = dict(zip(members, answers, strict=True))
        failed = {m: a for m, a in by_member.items() if isinstance(a, BaseException)}
        for member, exc in failed.items():
            if isinstance(exc, asyncio.CancelledError):
                raise exc
            logger.warning("directory replica %s did not take %s: %r", member, method, exc)
        if failed and len(failed) == len(by_member):
            raise next(iter(failed.values()))
        return by_member

    async def sync(self, member: str, owner: str, added: list[LiveEntry], removed: list[str],
                   full: bool) -> None:
        """An owner's batch of changes to one replica (the owner tracks which replica has what)."""
        await self.write(member, "sync", owner, added, removed, full)

    async def watch(self, member: str, owner: str) -> WatchReply:
        """An owner's long poll on one replica (a cancel may arrive at any of them)."""
        return await self._send(member, "watch", owner)

    async def report(self, report: EngineReport) -> list[str]:
        """An engine's report; the aborts forwarded to it, from every replica."""
        return _union(await self.each("report", report))

    async def forward_abort(self, request: AbortRequest) -> None:
        await self.each("forward_abort", request)

    async def take_aborts(self, replica: str) -> list[str]:
        """The aborts forwarded to ``replica``: each replica hands out its copy once."""
        return _union(await self.each("take_aborts", replica))

    async def keep(self, entry: LiveEntry, seconds: float) -> None:
        await self.each("keep", entry, seconds)

    async def unkeep(self, request_id: str) -> None:
        await self.each("unkeep", request_id)

    async def report_ingress(self, owner: str, metrics_text: str) -> None:
        await self.each("report_ingress", owner, metrics_text)

    # -- reads: any one replica -------------------------------------------------------------------------
    async def read(self, method: str, *args: Any) -> Any:
        """Ask any replica; once more (the router then routes elsewhere) if that one died."""
        try:
            return await getattr(self.handle, method).remote(*args)
        except (RayActorError, ActorUnavailableError) as exc:
            logger.warning("directory replica gone during %s (%r); asking another", method, exc)
            return await getattr(self.handle, method).remote(*args)

    async def ping(self) -> bool:
        return await self.read("ping")

    async def cancel(self, key: str, api_key_id: str | None = None) -> list[LiveEntry]:
        return await self.read("cancel", key, api_key_id)

    async def resume_lookup(self, key: str, api_key_id: str | None = None) -> ResumeLookup:
        return await self.read("resume_lookup", key, api_key_id)

    async def engines(self) -> list[EngineReport]:
        return await self.read("engines")

    async def max_model_len(self) -> int | None:
        return await self.read("max_model_len")

    async def metrics_snapshot(self) -> tuple[dict[str, str], list[EngineReport]]:
        return await self.read("metrics_snapshot")

    async def num_live(self) -> int:
        return await self.read("num_live")

    async def live_entries(self) -> list[LiveEntry]:
        return await self.read("live_entries")

    async def num_kept(self) -> int:
        return await self.read("num_kept")

    async def num_forwarded_aborts(self) -> int:
        return await self.read("num_forwarded_aborts")


def _union(answers: dict[str, Any]) -> list[str]:
    """Every id any replica answered with, once, in first-seen order."""
    seen: dict[str, None] = {}
    for answer in answers.values():
        if not isinstance(answer, BaseException):
            seen.update(dict.fromkeys(answer or ()))
    return list(seen)


def directory_client(handle: Any) -> DirectoryClient | None:
    """The client for a deployment's Directory handle (``None``: the app runs without one)."""
    return None if handle is None else DirectoryClient(handle)
