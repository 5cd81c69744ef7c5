"""Ending the work of a caller that died: no zombie streams when a replica is killed.

Why: a request does not end when the replica that sent it dies. A caller that gives up ends its
requests explicitly, but a caller killed by a signal (the OOM killer) ends nothing, and the
producer would run its requests to ``max_tokens`` for nobody, holding batch slots and KV blocks.

How: every request names its consumer, the Ray actor name of the replica that reads it
(:func:`own_actor_name`; ``GenerationJob.consumer`` for Ingress → Egress, ``EngineRequest.consumer``
for Egress → Engine). :class:`ConsumerWatch` keeps the open requests per consumer and, every
``period_s`` while any are open, asks Ray's GCS whether each consumer still exists
(``ray.get_actor``: a dead replica's name is released, Serve never restarts an actor in place). The
requests of a consumer that is gone are ended the normal way, through ``on_gone`` (their tasks are
cancelled: an abort by id in the engine, closing the engine call in Egress), so every ``finally``
runs and blocks are freed.

:class:`ConsumerWatch` takes the liveness check as a function, so it is tested without Ray.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("lifecycle.liveness")

#: Seconds between liveness checks while streams are open.
DEFAULT_PERIOD_S = 1.0
#: Returns the consumers (actor names) among those given that no longer exist.
GoneCheck = Callable[[list[str]], Awaitable[list[str]]]


def own_actor_name() -> str:
    """This replica's Ray actor name (``SERVE_REPLICA::app#Deployment#id``), or ``""`` outside Ray."""
    try:
        import ray

        if not ray.is_initialized():
            return ""
        return ray.get_runtime_context().get_actor_name() or ""
    except Exception:  # noqa: BLE001 - not in an actor (unit tests, the in-process benchmark)
        return ""


def own_replica_id() -> str:
    """This Serve replica's unique id (what routers and reports name it by), ``"local"`` outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (unit tests, the in-process benchmark)
        return "local"


def _namespace() -> str:
    """Serve names every replica actor in its own namespace (not the job's, which the runtime
    context reports: looking a replica up there finds nothing, and every consumer seemed dead)."""
    try:
        from ray.serve._private.constants import SERVE_NAMESPACE

        return SERVE_NAMESPACE
    except ImportError:  # pragma: no cover - the constant moved
        return "serve"


async def ray_actors_gone(names: list[str]) -> list[str]:
    """The named actors among ``names`` that no longer exist (GCS lookups, off the event loop)."""
    import ray

    def check() -> list[str]:
        gone = []
        namespace = _namespace()
        for name in names:
            try:
                ray.get_actor(name, namespace=namespace)
            except ValueError:  # no live actor has this name: it died (names are never reused)
                gone.append(name)
            except Exception as exc:  # noqa: BLE001 - GCS briefly unreachable: assume alive
                logger.debug("liveness check of %s failed: %r", name, exc)
        return gone

    return await asyncio.to_thread(check)


class ConsumerWatch:
    """Open streams by consumer; ends those whose consumer died (see the module docstring).

    ``on_gone(key)`` ends one stream; it is called once per stream, from the watch task.
    """

    def __init__(self, on_gone: Callable[[Any], Any], *, is_gone: GoneCheck = ray_actors_gone,
                 period_s: float = DEFAULT_PERIOD_S) -> None:
        self.on_gone = on_gone
        self.is_gone = is_gone
        self.period_s = period_s
        self._streams: dict[str, set[Any]] = {}
        self._task: asyncio.Task[None] | None = None
        #: Streams ended because their consumer died (a counter for tests and metrics).
        self.ended = 0

    def add(self, consumer: str, key: Any) -> None:
        """Watch ``key``'s consumer while the stream is open (no-op without a consumer name)."""
        if not consumer:
            return
        self._streams.setdefault(consumer, set()).add(key)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def discard(self, consumer: str, key: Any) -> None:
        keys = self._streams.get(consumer)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._streams[consumer]

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._streams.values())

    async def _run(self) -> None:
        while self._streams:
            await asyncio.sleep(self.period_s)
            try:
                gone = await self.is_gone(list(self._streams))
            except Exception as exc:  # noqa: BLE001 - keep watching
                logger.warning("consumer liveness check failed: %r", exc)
                continue
            for consumer in gone:
                keys = self._streams.pop(consumer, set())
                if keys:
                    logger.warning("consumer %s is gone: ending its %d stream(s)", consumer, len(keys))
                for key in keys:
                    self.ended += 1
                    try:
                        result = self.on_gone(key)
                        if asyncio.iscoroutine(result):
                            await result
                    except Exception:  # noqa: BLE001 - one stream's cleanup must not stop the rest
                        logger.exception("ending a stream of a dead consumer failed")
