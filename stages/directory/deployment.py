"""The Directory deployment: the Ray Serve adapter around :class:`LiveDirectory` (see
:mod:`stages.directory.directory` for what it keeps and why). It may run any number of replicas:
each holds the whole state (:mod:`stages.directory.client` says how callers keep them so). The
``member`` argument of the writes and of ``watch`` names the replica the caller meant; the
Directory's router reads it, and the method ignores it; every method takes it, so that a
question too can be put to each replica (operators, tests)."""

from __future__ import annotations

import asyncio

from ray import serve

from stages.directory.directory import LiveDirectory
from stages.directory.router import directory_router_config
from stages.transport.messages import AbortRequest, EngineReport, LiveEntry, ResumeLookup, WatchReply


@serve.deployment(name="Directory", num_replicas=1, max_ongoing_requests=4096,
                  ray_actor_options={"num_cpus": 0.05}, graceful_shutdown_timeout_s=1,
                  request_router_config=directory_router_config())
class DirectoryDeployment:
    """The app's live requests and engine reports; a new replica is filled by the writers."""

    def __init__(self, watch_timeout_s: float = 10.0, report_ttl_s: float = 5.0) -> None:
        self.watch_timeout_s = watch_timeout_s
        self.live = LiveDirectory(owner_ttl_s=max(6 * watch_timeout_s, 30.0), report_ttl_s=report_ttl_s)

    async def ping(self, member: str = "") -> bool:
        return True

    async def sync(self, owner: str, added: list[LiveEntry], removed: list[str], full: bool = False,
                   member: str = "") -> None:
        self.live.sync(owner, added, removed, full)

    async def watch(self, owner: str, member: str = "") -> WatchReply:
        """Long poll: returns as soon as a cancel for ``owner`` arrives, or after the timeout. An
        owner this replica does not know (it is new, or pruned the owner) must resync. Two polls
        of one owner may wait here at once (one was meant for a replica that left): a cancel
        wakes both, and the first takes it."""
        if not self.live.knows(owner):
            return WatchReply(resync=True)
        box = self.live._touch(owner)
        if not box.mailbox:
            box.wake.clear()
            try:
                await asyncio.wait_for(box.wake.wait(), self.watch_timeout_s)
            except TimeoutError:
                pass
        self.live.prune()
        return WatchReply(cancel_ids=self.live.take_cancels(owner))

    async def cancel(self, key: str, api_key_id: str | None = None, member: str = "") -> list[LiveEntry]:
        return self.live.cancel(key, api_key_id)

    async def report(self, report: EngineReport, member: str = "") -> list[str]:
        """An engine's report; returns the request ids other replicas forwarded to it to abort."""
        return self.live.report(report)

    async def forward_abort(self, request: AbortRequest, member: str = "") -> None:
        """An abort or cancel by id that reached another replica than the one it names (that one
        is draining): kept until the named replica takes it."""
        self.live.forward_abort(request)

    async def take_aborts(self, replica: str, member: str = "") -> list[str]:
        """The ids forwarded to ``replica`` to abort (an Egress replica asks each interval)."""
        self.live.prune()
        return self.live.take_aborts(replica)

    async def forwarded_aborts(self, member: str = "") -> dict[str, list[str]]:
        self.live.prune()
        return self.live.forwarded()

    async def num_forwarded_aborts(self, member: str = "") -> int:
        self.live.prune()
        return self.live.num_forwarded()

    async def report_ingress(self, owner: str, metrics_text: str, member: str = "") -> None:
        """A replica's own metrics text (Ingress, and Egress for its kept streams); one that stops
        reporting is forgotten with the owners that stop watching."""
        self.live._touch(owner)
        self.live.ingress_metrics[owner] = metrics_text

    async def keep(self, entry: LiveEntry, seconds: float, member: str = "") -> None:
        """An Egress replica keeps a detached resumable stream (see :meth:`LiveDirectory.keep`)."""
        self.live.keep(entry, seconds)

    async def unkeep(self, request_id: str, member: str = "") -> None:
        self.live.unkeep(request_id)

    async def resume_lookup(self, key: str, api_key_id: str | None = None, member: str = "") -> ResumeLookup:
        return self.live.resume_lookup(key, api_key_id)

    async def num_kept(self, member: str = "") -> int:
        return self.live.num_kept()

    async def metrics_snapshot(self, member: str = "") -> tuple[dict[str, str], list[EngineReport]]:
        """Every Ingress replica's metrics text and every engine's latest report."""
        return dict(self.live.ingress_metrics), self.live.engine_reports()

    async def engines(self, member: str = "") -> list[EngineReport]:
        return self.live.engine_reports()

    async def num_live(self, member: str = "") -> int:
        """Live requests known app-wide (tests and the soak check that nothing is left)."""
        return len(self.live.entries)

    async def live_entries(self, member: str = "") -> list[LiveEntry]:
        """Every live request the directory knows (for operators and tests; ``member`` asks one
        replica in particular)."""
        return list(self.live.entries.values())

    async def max_model_len(self, member: str = "") -> int | None:
        """The smallest context length of the engines reporting (what every stage must enforce)."""
        lens = [r.max_model_len for r in self.live.engine_reports() if r.max_model_len]
        return min(lens) if lens else None
