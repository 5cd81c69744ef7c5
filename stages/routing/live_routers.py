"""The Engine routers of this process (one per deployment handle): :func:`stages.routing.router.refresh_views`
reads their replicas' latest routing stats. A module of its own so that the router class never
refers to it as a global (Serve may pickle the class by value; this list holds live objects)."""

from __future__ import annotations

from typing import Any

ROUTERS: list[Any] = []
