"""The Directory's Serve request router: a call naming ``member=`` goes to that replica.

It runs inside every caller's handle to the Directory and registers itself
(:mod:`stages.transport.membership`), so that :mod:`stages.directory.client` knows which replicas
it routes to (writes go to each of them). A call naming a replica that is no
longer a candidate (it died or is draining) goes to any other: every Directory write is idempotent,
so the copy does no harm, and the caller learns of the new membership on its next look. Calls
without ``member`` (reads) go wherever Serve's queue lengths say.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


def directory_router_config() -> RequestRouterConfig:
    return RequestRouterConfig(request_router_class="stages.directory.router.DirectoryRouter")


class DirectoryRouter(RequestRouter):
    """Serve ``RequestRouter`` for the Directory deployment."""

    def initialize_state(self, **_: Any) -> None:
        # Imported here, not at the top: Serve may pickle this class by value, and the registry
        # it writes to (live routers) must not come along.
        from stages.transport.membership import register_router

        register_router(self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        member = pending_request.kwargs.get("member") if pending_request is not None else None
        if member:
            target = [r for r in candidate_replicas if r.replica_id.unique_id == member]
            if target:
                return [target]
        return [candidate_replicas]
