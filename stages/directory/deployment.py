"""The Directory deployment: the Ray Serve adapter around :class:`LiveDirectory` (see
:mod:`stages.directory.directory` for what it keeps and why)."""

from __future__ import annotations

import asyncio
from typing import Any

from ray import serve

from stages.autoscaling import most_replicas
from stages.directory.directory import LiveDirectory
from stages.transport.messages import AbortRequest, EngineReport, LiveEntry, ResumeLookup, WatchReply


@serve.deployment(name="Directory", num_replicas=1, max_ongoing_requests=4096,
                  ray_actor_options={"num_cpus": 0.05}, graceful_shutdown_timeout_s=1)
class DirectoryDeployment:
    """One replica: the directory's state must be in one place. Restarts heal (see module doc)."""

    def __init__(self, watch_timeout_s: float = 10.0, report_ttl_s: float = 5.0) -> None:
        refuse_more_than_one(serve.get_replica_context()._deployment_config)
        self.watch_timeout_s = watch_timeout_s
        self.live = LiveDirectory(owner_ttl_s=max(6 * watch_timeout_s, 30.0), report_ttl_s=report_ttl_s)

    async def ping(self) -> bool:
        return True

    async def sync(self, owner: str, added: list[LiveEntry], removed: list[str], full: bool = False) -> None:
        self.live.sync(owner, added, removed, full)

    async def watch(self, owner: str) -> WatchReply:
        """Long poll: returns as soon as a cancel for ``owner`` arrives, or after the timeout. An
        owner this directory does not know (it restarted, or pruned the owner) must resync."""
        if not self.live.knows(owner):
            return WatchReply(resync=True)
        box = self.live._touch(owner)
        if not box.mailbox:
            box.wake = asyncio.Event()
            try:
                await asyncio.wait_for(box.wake.wait(), self.watch_timeout_s)
            except TimeoutError:
                pass
            finally:
                box.wake = None
        self.live.prune()
        return WatchReply(cancel_ids=self.live.take_cancels(owner))

    async def cancel(self, key: str, api_key_id: str | None = None) -> list[LiveEntry]:
        return self.live.cancel(key, api_key_id)

    async def report(self, report: EngineReport) -> list[str]:
        """An engine's report; returns the request ids other replicas forwarded to it to abort."""
        return self.live.report(report)

    async def forward_abort(self, request: AbortRequest) -> None:
        """An abort or cancel by id that reached another replica than the one it names (that one
        is draining): kept until the named replica takes it."""
        self.live.forward_abort(request)

    async def take_aborts(self, replica: str) -> list[str]:
        """The ids forwarded to ``replica`` to abort (an Egress replica asks each interval)."""
        self.live.prune()
        return self.live.take_aborts(replica)

    async def num_forwarded_aborts(self) -> int:
        return self.live.num_forwarded()

    async def report_ingress(self, owner: str, metrics_text: str) -> None:
        """A replica's own metrics text (Ingress, and Egress for its kept streams); one that stops
        reporting is forgotten with the owners that stop watching."""
        self.live._touch(owner)
        self.live.ingress_metrics[owner] = metrics_text

    async def keep(self, entry: LiveEntry, seconds: float) -> None:
        """An Egress replica keeps a detached resumable stream (see :meth:`LiveDirectory.keep`)."""
        self.live.keep(entry, seconds)

    async def unkeep(self, request_id: str) -> None:
        self.live.unkeep(request_id)

    async def resume_lookup(self, key: str, api_key_id: str | None = None) -> ResumeLookup:
        return self.live.resume_lookup(key, api_key_id)

    async def num_kept(self) -> int:
        return self.live.num_kept()

    async def metrics_snapshot(self) -> tuple[dict[str, str], list[EngineReport]]:
        """Every Ingress replica's metrics text and every engine's latest report."""
        return dict(self.live.ingress_metrics), self.live.engine_reports()

    async def engines(self) -> list[EngineReport]:
        return self.live.engine_reports()

    async def num_live(self) -> int:
        """Live requests known app-wide (tests and the soak check that nothing is left)."""
        return len(self.live.entries)

    async def live_entries(self) -> list[LiveEntry]:
        """Every live request the directory knows (for operators and tests)."""
        return list(self.live.entries.values())

    async def max_model_len(self) -> int | None:
        """The smallest context length of the engines reporting (what every stage must enforce)."""
        lens = [r.max_model_len for r in self.live.engine_reports() if r.max_model_len]
        return min(lens) if lens else None


class DirectoryReplicasError(ValueError):
    """The Directory was configured to run more than one replica."""


def refuse_more_than_one(config: Any) -> None:
    """Refuse to start a Directory that may run beside another (``num_replicas`` above 1, or an
    ``autoscaling_config`` allowing more): each replica would hold part of the live requests, and a
    cancel by id that reaches the wrong one answers 404, or 200 while the stream runs on. Raised
    from the replica's constructor, so ``serve run`` fails the deployment with this message; the
    check sits here rather than in ``graph.py`` because ``serve run`` applies a config file's
    ``deployments`` overrides after the builder has run."""
    most = most_replicas(config)
    if most > 1:
        auto = config.autoscaling_config is not None
        setting = f"autoscaling_config.max_replicas: {most}" if auto else f"num_replicas: {most}"
        raise DirectoryReplicasError(
            f"the Directory deployment must run exactly one replica, but it is configured with {setting}. "
            "Its state (which Ingress replica owns each live request) lives in one place; set "
            "num_replicas: 1 and no autoscaling_config for Directory in serve_config.yaml.")
