"""Fakes for the transport's unit tests (no Ray): producer deployments around a real
:class:`~stages.transport.producer.Producer`, a Serve handle that calls them in the same event loop
(every message pickled on the way, as crossing a deployment does), a directory, and a leak check.

A :class:`FakeStage` plays a deployment (an Egress or engine replica): each request's job waits for
the test to ``send`` it items (``END`` ends it, an exception raises it there), may be held before
its acceptance (``hold``), or refused (``refuse``). :class:`FakeHandle` routes ``submit`` to a
chosen replica, ``attach`` and ``abort`` to the replica they name (or to another one when that one
is gone or draining), and records everything it carries.
"""

from __future__ import annotations

import asyncio
import functools
import pickle
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from stages.transport import admission as admission_module
from stages.transport.channel import merge_channel_items
from stages.transport.consumer import Consumer
from stages.transport.messages import (
    AbortRequest,
    Admission,
    AdmissionBatch,
    ChannelAttach,
    ChannelBatch,
    EngineOutput,
    EngineRequest,
    GenerationJob,
    SamplingParams,
    StreamFrame,
    StreamStart,
    StreamSummary,
)
from stages.transport.producer import Job, Producer, frames

#: Put in a job's queue: the job ends normally.
END = object()


class LostError(Exception):
    """What a consumer's inbox fails with when its channel to ``replica`` is lost."""


def lost(replica: str) -> LostError:
    return LostError(f"channel to {replica} lost")


def run_async(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test on a fresh event loop (the suite has no asyncio plugin)."""
    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))
    return wrapper


def copy(value: Any) -> Any:
    """What crossing a deployment does to a message."""
    return pickle.loads(pickle.dumps(value))


class Remote:
    """``handle.method`` of a fake handle: ``.remote(arg)`` calls ``fn(arg)``."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def remote(self, arg: Any) -> Any:
        return self.fn(arg)


async def wait_until(check: Callable[[], bool], timeout: float = 3.0) -> None:
    """Poll ``check`` until it holds; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {check}")
        await asyncio.sleep(0.005)


# -- producer deployments -----------------------------------------------------------------------------
class FakeStage:
    """A producer deployment's replica around a real :class:`Producer` (see the module docstring)."""

    def __init__(self, name: str, *, merge: Callable[[list[Any]], list[Any]] = list,
                 directory: Any = None, dead: set[str] | None = None,
                 watch_period_s: float = 0.01, linger_s: float = 0.05, unclaimed_ttl_s: float = 0.2) -> None:
        self.name = name
        #: Consumer replicas that no longer exist (what the injected liveness check answers).
        self.dead: set[str] = dead if dead is not None else set()
        self.liveness_checks: list[list[str]] = []
        self.producer = Producer(name, merge=merge, directory=directory, is_gone=self._is_gone,
                                 watch_period_s=watch_period_s)
        self.producer.hub.linger_s = linger_s
        #: Short, so that a mailbox no attach drains goes within a leak check's wait.
        self.producer.hub.unclaimed_ttl_s = unclaimed_ttl_s
        self.producer.set_end(self._end)
        self.refuse: dict[str, BaseException] = {}
        self.holds: dict[str, asyncio.Event] = {}
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        #: Keys of jobs whose generator began, and of those whose ``finally`` ran.
        self.started: list[str] = []
        self.finally_ran: list[str] = []
        #: Every ``end(keys)`` call the producer made (aborts by id, forwarded aborts).
        self.ended: list[list[str]] = []

    async def _is_gone(self, names: list[str]) -> list[str]:
        self.liveness_checks.append(list(names))
        return [n for n in names if n in self.dead]

    def _end(self, keys: list[str]) -> Any:
        self.ended.append(list(keys))
        return self.producer._cancel_tasks(keys)  # the default: cancel the jobs' tasks

    # -- what the test drives ---------------------------------------------------------------------------
    def hold(self, key: str) -> asyncio.Event:
        """Hold ``key``'s acceptance until the returned event is set."""
        return self.holds.setdefault(key, asyncio.Event())

    def queue(self, key: str) -> asyncio.Queue[Any]:
        return self.queues.setdefault(key, asyncio.Queue())

    def send(self, key: str, *items: Any) -> None:
        """Items the job of ``key`` yields next (``END`` ends it, an exception is raised there)."""
        for item in items:
            self.queue(key).put_nowait(item)

    def running(self) -> int:
        return len(self.producer)

    async def _stream(self, key: str, accept: Any) -> AsyncIterator[Any]:
        self.started.append(key)
        try:
            hold = self.holds.get(key)
            if hold is not None:
                await hold.wait()
            error = self.refuse.get(key)
            if error is not None:
                raise error
            yield accept
            while True:
                item = await self.queue(key).get()
                if item is END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.finally_ran.append(key)

    def job(self, item: Any) -> Job:  # pragma: no cover - each stage makes its own
        raise NotImplementedError

    # -- the deployment's methods (what the handle calls) ----------------------------------------------
    async def submit(self, batch: AdmissionBatch) -> list[Admission]:
        return await self.producer.submit(batch, self.job)

    async def attach(self, request: ChannelAttach) -> AsyncIterator[ChannelBatch]:
        async for batch in self.producer.attach(request.consumer):
            yield batch

    async def abort(self, request: AbortRequest) -> None:
        await self.producer.abort(request)


class FakeEgress(FakeStage):
    """An Egress replica: jobs answer with a :class:`StreamStart` naming it; later items (frames,
    a summary) become :class:`RoutedFrame` items through :func:`frames`."""

    def job(self, job: GenerationJob) -> Job:
        rid = job.engine_request.request_id
        start = StreamStart("engine-0", [rid], 3, egress_replica=self.name)
        return Job(rid, job.consumer, self._stream(rid, start), wrap=lambda item: frames(rid, item))


class FakeEngine(FakeStage):
    """An engine replica: requests answer with empty outputs per choice naming it; later outputs
    come as lists (``wrap=list``) or straight into the mailbox (:meth:`push`, the step delivery).
    Ending a request by id ends its stream with ``finish_reason="abort"``, as the real engine does."""

    def __init__(self, name: str, **kwargs: Any) -> None:
        super().__init__(name, merge=merge_channel_items, **kwargs)
        self.consumer_of: dict[str, str] = {}
        self.key_of: dict[str, str] = {}

    def job(self, request: EngineRequest) -> Job:
        ids = request.choice_ids()
        for cid in ids:
            self.key_of[cid] = ids[0]
        self.consumer_of[ids[0]] = request.consumer
        accept = [EngineOutput(cid, [], index=i, replica=self.name) for i, cid in enumerate(ids)]
        return Job(ids[0], request.consumer, self._stream(ids[0], accept), wrap=list)

    def push(self, key: str, *outs: EngineOutput) -> None:
        self.producer.push(self.consumer_of[key], list(outs))

    def _end(self, keys: list[str]) -> None:
        self.ended.append(list(keys))
        by_job: dict[str, list[EngineOutput]] = {}
        for cid in keys:
            key = self.key_of.get(cid)
            if key is not None and key not in self.finally_ran:
                by_job.setdefault(key, []).append(EngineOutput(cid, [], finish_reason="abort"))
        for key, outs in by_job.items():
            self.send(key, outs, END)


# -- the directory ------------------------------------------------------------------------------------
class FakeDirectory:
    """Holds aborts forwarded for a replica until that replica takes them."""

    def __init__(self) -> None:
        self.forwarded: list[AbortRequest] = []
        self.held: dict[str, list[str]] = {}
        self.forward_abort = self._forward
        self.take_aborts = self._take

    async def _forward(self, request: AbortRequest) -> None:
        request = copy(request)
        self.forwarded.append(request)
        self.held.setdefault(request.replica, []).extend(request.request_ids)

    async def _take(self, replica: str) -> list[str]:
        return self.held.pop(replica, [])


# -- the Serve handle ----------------------------------------------------------------------------------
@dataclass
class HandleLog:
    """What a fake handle carried (shared by its ``options`` views)."""

    #: (replica, request keys) per submit call.
    submits: list[tuple[str, list[str]]] = field(default_factory=list)
    #: (replica named, replica reached, consumer) per attach call.
    attaches: list[tuple[str, str, str]] = field(default_factory=list)
    #: (request, replica reached) per abort call.
    aborts: list[tuple[AbortRequest, str]] = field(default_factory=list)
    #: Every channel batch delivered, with the consumer it went to.
    batches: list[tuple[str, ChannelBatch]] = field(default_factory=list)


def item_key(item: Any) -> str:
    return item.request_id if isinstance(item, EngineRequest) else item.engine_request.request_id


class FakeHandle:
    """A Serve handle to the replicas ``stages`` (see the module docstring).

    ``route(batch)`` names the replica a submit goes to (default: the first); a replica in ``gone``
    is not reachable (attaches and aborts naming it land on another one), one in ``draining`` is
    no routing candidate (aborts naming it land on another one). ``lose_reply``: a submit reaches
    its replica but its reply is lost (the caller gets the error)."""

    def __init__(self, stages: list[FakeStage], *, stream: bool = False, shared: FakeHandle | None = None) -> None:
        if shared is None:
            self.stages = {s.name: s for s in stages}
            self.log = HandleLog()
            self.route: Callable[[AdmissionBatch], str] = lambda batch: stages[0].name
            self.gone: set[str] = set()
            self.draining: set[str] = set()
            self.lose_reply: BaseException | None = None
            self.attach_error: BaseException | None = None
            self._root = self
        else:
            self._root = shared._root
        self.stream = stream
        self.submit = Remote(self._submit)
        self.attach = Remote(self._attach)
        self.abort = Remote(self._abort)

    def __getattr__(self, name: str) -> Any:  # the shared state lives on the root handle
        if name == "_root":
            raise AttributeError(name)
        return getattr(self._root, name)

    def options(self, *, stream: bool = False) -> FakeHandle:
        return FakeHandle([], stream=stream, shared=self)

    def _other(self, name: str, avoid: set[str]) -> FakeStage:
        for stage in self.stages.values():
            if stage.name != name and stage.name not in avoid:
                return stage
        raise ConnectionError(f"no replica to route to instead of {name}")

    async def _submit(self, batch: AdmissionBatch) -> list[Admission]:
        assert not self.stream, "submit is a unary call"
        stage = self.stages[self.route(batch)]
        self.log.submits.append((stage.name, [item_key(i) for i in batch.items]))
        replies = await stage.submit(copy(batch))
        if self.lose_reply is not None:
            raise self.lose_reply
        return copy(replies)

    def _attach(self, request: ChannelAttach) -> AsyncIterator[ChannelBatch]:
        assert self.stream, "attach is a streamed call"
        request = copy(request)
        stage = self.stages.get(request.replica)
        if stage is None or stage.name in self.gone:
            stage = self._other(request.replica, self.gone)
        self.log.attaches.append((request.replica, stage.name, request.consumer))
        return self._stream_batches(stage, request)

    async def _stream_batches(self, stage: FakeStage, request: ChannelAttach) -> AsyncIterator[ChannelBatch]:
        stream = stage.attach(request)
        try:
            async for batch in stream:
                batch = copy(batch)
                self.log.batches.append((request.consumer, batch))
                yield batch
                if self.attach_error is not None:  # the call fails after its hello
                    raise self.attach_error
        finally:
            await stream.aclose()  # what Serve does to the callee's stream when its call ends

    def _abort(self, request: AbortRequest) -> Awaitable[None]:
        assert not self.stream, "abort is a unary call"
        request = copy(request)
        stage = self.stages.get(request.replica)
        if stage is None or stage.name in self.gone | self.draining:
            stage = self._other(request.replica, self.gone | self.draining)
        self.log.aborts.append((request, stage.name))
        return stage.abort(request)


# -- requests -------------------------------------------------------------------------------------------
def engine_request(rid: str, consumer: str = "egress-1", n: int = 1) -> EngineRequest:
    return EngineRequest(rid, [1, 2, 3], SamplingParams(), n=n, consumer=consumer)


def generation_job(rid: str, consumer: str = "ingress-1") -> GenerationJob:
    return GenerationJob(engine_request(rid, consumer=""), "completion", "m", f"cmpl-{rid}", 0, consumer=consumer)


def frame(text: str, index: int = 0) -> StreamFrame:
    return StreamFrame(f"data: {text}\n\n", index, 1)


def summary(body: dict[str, Any] | None = None) -> StreamSummary:
    return StreamSummary(3, 2, 0, ["stop"], {"queue": 0.01}, 0.002, body=body)


# -- leaks ------------------------------------------------------------------------------------------------
def leaks(consumers: list[Consumer], stages: list[FakeStage]) -> list[str]:
    """What is still held anywhere after every request ended (empty when nothing leaks)."""
    found: list[str] = []
    for s in stages:
        p = s.producer
        if len(p):
            found.append(f"{s.name}: {len(p)} job task(s)")
        if len(p.hub):
            found.append(f"{s.name}: mailboxes {sorted(p.hub._boxes)}")
        if p.hub.num_pending():
            found.append(f"{s.name}: {p.hub.num_pending()} pending item(s)")
        if p.hub.attaches:
            found.append(f"{s.name}: {p.hub.attaches} attach(es) open")
        if len(p.consumers):
            found.append(f"{s.name}: {len(p.consumers)} watched stream(s)")
        if p.consumers._task is not None and not p.consumers._task.done():
            found.append(f"{s.name}: consumer watch still running")
    for c in consumers:
        if c.open_calls:
            found.append(f"{c.name}: {c.open_calls} open call(s)")
        if c.client._inboxes:
            found.append(f"{c.name}: inboxes {sorted(c.client._inboxes)}")
        if c.client._by_replica:
            found.append(f"{c.name}: bound to {sorted(c.client._by_replica)}")
        if c.client.num_attached():
            found.append(f"{c.name}: {c.client.num_attached()} attach task(s)")
        if c.admission.num_in_flight() or c.admission._waiting:
            found.append(f"{c.name}: admission calls in flight")
    if admission_module._background:
        found.append(f"{len(admission_module._background)} fire-and-forget task(s)")
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        found.append(f"tasks alive: {sorted(t.get_coro().__qualname__ for t in others)}")
    return found


async def assert_no_leaks(consumers: list[Consumer], stages: list[FakeStage], timeout: float = 3.0) -> None:
    """Wait for lingering attaches and watches to end, then check that nothing is left."""
    try:
        await wait_until(lambda: not leaks(consumers, stages), timeout)
    except AssertionError:
        pass
    found = leaks(consumers, stages)
    assert not found, f"left after every request ended: {found}"
