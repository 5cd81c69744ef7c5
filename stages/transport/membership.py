"""Which replicas of a deployment this process's handle routes to, as its request router knows them.

A Serve handle's router (it runs in the caller's process) learns the replicas of its deployment
from the controller and drops one as soon as a call finds it dead. The routers that need it
(the Directory's and Egress's) register here when Serve creates them, so that a caller can ask:
the Directory client sends a change to each replica, and an Ingress moves a stream only when
another Egress replica is there to take it.
"""

from __future__ import annotations

from typing import Any

#: The registered routers of this process, by (app, deployment).
_ROUTERS: dict[tuple[str, str], Any] = {}


def register_router(router: Any) -> None:
    """Called from a ``RequestRouter``'s ``initialize_state``."""
    deployment = router._deployment_id
    _ROUTERS[(deployment.app_name, deployment.name)] = router


def routed_replicas(app: str, deployment: str) -> list[str]:
    """The replica ids the handle routes to now, sorted ([] before its first call)."""
    router = _ROUTERS.get((app, deployment))
    if router is None:
        return []
    return sorted(replica.unique_id for replica in list(router.curr_replicas))
