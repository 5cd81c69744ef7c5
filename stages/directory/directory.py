"""The app-wide directory: which Ingress replica owns each live request, and what every engine
replica last reported.

Why it exists: with N Ingress replicas, a ``POST /v1/requests/{id}/cancel`` can land on any of
them, but only the replica holding the client's connection can end that stream properly; and
``/health`` and ``/metrics`` must speak for every engine replica, while a Serve handle reaches
only the one its router picks. Both need one place that knows the whole app. That place may be
several replicas, each holding all of it (:mod:`stages.directory.client`).

Design (built on Ray Serve itself: one small deployment, called through handles):
- **Owners sync, batched.** Each Ingress replica sends the requests it started and finished since
  its last call in one ``sync`` call to each Directory replica; a single flusher per owner keeps
  the calls in order and batches whatever accumulated while the previous call was in flight (cost:
  at most one call per request start and one per finish, usually far fewer under load).
- **Cancels travel on a long poll.** Each owner keeps one ``watch`` call open on each Directory
  replica; a cancel for one of its requests completes that call, and the owner ends the stream
  the normal way (an abort by id routed to the engine replica that runs it). So the cancel
  reaches the owner within one RPC.
- **Aborts for draining replicas.** An abort or cancel by id is routed to the replica it names
  only while that replica is among the router's candidates; a replica being scaled down is not,
  though it still runs its requests until they end. The replica that gets such an abort instead
  forwards it here (``forward_abort``), and the named replica takes it within one report interval:
  an engine in the reply to its ``report``, an Egress replica by ``take_aborts``. A replica that
  stopped asking died, and its requests with it: the ids forwarded to it go once it has missed
  its asks for a while (an engine: its report TTL; Egress: :data:`ASKER_TTL_S`), and ids for a
  replica never seen asking expire after ``abort_ttl_s``.
- **Kept streams.** A resumable stream whose client left is kept by its Egress replica for a grace
  period; that replica tells the directory (``keep``, which replaces the Ingress's entry, and
  ``unkeep`` when a client takes it again or it expires), so a reconnect on any Ingress replica
  finds the replica holding its events (``resume_lookup``). A kept entry also expires here on its
  own, a little after its grace period, in case its replica died.
- **Self-healing.** An owner that has not watched for ``owner_ttl_s`` is dead; its entries go. A
  directory replica that is new (a restart, or one more) answers the next ``watch`` with ``resync``,
  and the owner sends it its whole list again. Engine reports older than ``report_ttl_s`` count
  as gone.

:class:`LiveDirectory` is the pure bookkeeping (unit-tested without Ray); the Serve adapter is
:class:`stages.directory.deployment.DirectoryDeployment`.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field

from stages.transport.messages import AbortRequest, EngineReport, LiveEntry, ResumeLookup

#: An engine replica that missed this many of its reports in a row counts as gone ...
MISSED_REPORTS = 8
#: ... but never sooner than this many seconds (a busy 2-core machine delays reports).
MIN_REPORT_TTL_S = 3.0
#: Seconds a forwarded abort waits for its replica to take it (beyond any drain's graceful timeout).
ABORT_TTL_S = 300.0
#: Seconds after its last ask that an Egress replica (it asks every second) counts as gone.
ASKER_TTL_S = 10.0
#: Forwarded ids kept per replica at most (oldest dropped): a bound, not a limit ever expected to bind.
MAX_FORWARDED_PER_REPLICA = 4096


#: Seconds a kept entry outlives its grace period here (its Egress replica normally removes it).
KEPT_MARGIN_S = 5.0


class _Index:
    """Entries by server id, response id and client label."""

    def __init__(self) -> None:
        self.entries: dict[str, LiveEntry] = {}
        self._by_response: dict[str, str] = {}
        self._by_label: dict[str, set[str]] = defaultdict(set)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry: LiveEntry) -> None:
        self.remove(entry.request_id)
        self.entries[entry.request_id] = entry
        self._by_response[entry.response_id] = entry.request_id
        if entry.client_request_id:
            self._by_label[entry.client_request_id].add(entry.request_id)

    def remove(self, rid: str) -> LiveEntry | None:
        entry = self.entries.pop(rid, None)
        if entry is None:
            return None
        self._by_response.pop(entry.response_id, None)
        if entry.client_request_id:
            ids = self._by_label.get(entry.client_request_id)
            if ids is not None:
                ids.discard(rid)
                if not ids:
                    del self._by_label[entry.client_request_id]
        return entry

    def find(self, key: str, api_key_id: str | None = None) -> list[LiveEntry]:
        """A response id or minted id names exactly one entry; a client label every one carrying
        it. With API keys on, only the creating key's."""
        rid = self._by_response.get(key) or (key if key in self.entries else None)
        ids = [rid] if rid is not None else sorted(self._by_label.get(key, ()))
        found = [self.entries[i] for i in ids]
        return [e for e in found if e.api_key_id is None or e.api_key_id == api_key_id]


@dataclass
class _Owner:
    last_seen: float
    mailbox: list[str] = field(default_factory=list)
    #: Set when a cancel arrives; every poll of this owner waiting here wakes.
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class LiveDirectory:
    """Live requests by id, response id and client label; owners' cancel mailboxes; engine reports."""

    def __init__(self, owner_ttl_s: float = 60.0, report_ttl_s: float = 10.0, abort_ttl_s: float = ABORT_TTL_S) -> None:
        self.owner_ttl_s = owner_ttl_s
        self.report_ttl_s = report_ttl_s
        self.abort_ttl_s = abort_ttl_s
        #: replica → {request id: monotonic time forwarded}: aborts that missed their replica.
        self._forwarded: dict[str, dict[str, float]] = {}
        #: replica → (monotonic time it last asked for its forwarded aborts, seconds it counts after)
        self._asked: dict[str, tuple[float, float]] = {}
        self._live = _Index()
        #: Detached resumable streams (owner: the Egress replica keeping their events), and when
        #: each entry goes if its replica does not remove it.
        self._kept = _Index()
        self._kept_until: dict[str, float] = {}
        self._owners: dict[str, _Owner] = {}
        #: replica → (report, monotonic time received)
        self._reports: dict[str, tuple[EngineReport, float]] = {}
        #: Ingress replica → its own metrics (Prometheus text)
        self.ingress_metrics: dict[str, str] = {}

    # -- owners --------------------------------------------------------------------------------------
    def sync(self, owner: str, added: list[LiveEntry], removed: list[str], full: bool = False) -> None:
        """Apply an owner's batch. ``full`` replaces everything it owned (after a resync)."""
        self._touch(owner)
        if full:
            for rid in [rid for rid, e in self.entries.items() if e.owner == owner]:
                self._remove(rid)
        for entry in added:
            self._add(entry)
        for rid in removed:
            self._remove(rid)

    def knows(self, owner: str) -> bool:
        return owner in self._owners

    def take_cancels(self, owner: str) -> list[str]:
        box = self._touch(owner)
        ids, box.mailbox = box.mailbox, []
        return ids

    def _touch(self, owner: str) -> _Owner:
        box = self._owners.get(owner)
        if box is None:
            box = self._owners[owner] = _Owner(time.monotonic())
        box.last_seen = time.monotonic()
        return box

    def prune(self, now: float | None = None) -> list[str]:
        """Forget owners that stopped watching (their replica died) and their entries."""
        now = time.monotonic() if now is None else now
        dead = [o for o, box in self._owners.items() if now - box.last_seen > self.owner_ttl_s]
        for owner in dead:
            del self._owners[owner]
            self.ingress_metrics.pop(owner, None)
            for rid in [rid for rid, e in self.entries.items() if e.owner == owner]:
                self._remove(rid)
        for replica in [r for r, (report, at) in self._reports.items() if now - at > self._report_ttl(report)]:
            del self._reports[replica]
        for rid in [rid for rid, until in self._kept_until.items() if now > until]:
            self.unkeep(rid)
        for replica in [r for r, (at, ttl) in self._asked.items() if now - at > ttl]:
            del self._asked[replica]  # it stopped asking: it died, its requests with it
            self._forwarded.pop(replica, None)
        for replica, ids in list(self._forwarded.items()):
            for rid in [rid for rid, at in ids.items() if now - at > self.abort_ttl_s]:
                del ids[rid]
            if not ids:
                del self._forwarded[replica]
        return dead

    def _report_ttl(self, report: EngineReport) -> float:
        """How long a report counts: a replica that missed ``MISSED_REPORTS`` of its own reports
        is gone (killed, or its event loop is stuck), so ``/health`` says 503 within seconds."""
        if report.report_interval_s <= 0:
            return self.report_ttl_s
        return min(self.report_ttl_s, max(MISSED_REPORTS * report.report_interval_s, MIN_REPORT_TTL_S))

    @property
    def entries(self) -> dict[str, LiveEntry]:
        """Live requests with a connection, by server id."""
        return self._live.entries

    def _add(self, entry: LiveEntry) -> None:
        self._live.add(entry)

    def _remove(self, rid: str) -> None:
        self._live.remove(rid)

    # -- cancel --------------------------------------------------------------------------------------
    def find(self, key: str, api_key_id: str | None = None) -> list[LiveEntry]:
        """Live requests named by ``key``: a response id or minted id names exactly one; a client
        label names every live request carrying it. With API keys on, only the creating key's."""
        return self._live.find(key, api_key_id)

    # -- kept (resumable) streams ----------------------------------------------------------------------
    def keep(self, entry: LiveEntry, seconds: float, now: float | None = None) -> None:
        """A stream's client left and ``entry.owner`` (an Egress replica) keeps it for ``seconds``:
        it is found by a reconnect, no longer by a cancel (nobody holds its connection)."""
        now = time.monotonic() if now is None else now
        self._live.remove(entry.request_id)
        self._kept.add(entry)
        self._kept_until[entry.request_id] = now + seconds + KEPT_MARGIN_S

    def unkeep(self, rid: str) -> None:
        """A client took the stream again, or it expired."""
        self._kept.remove(rid)
        self._kept_until.pop(rid, None)

    def num_kept(self) -> int:
        return len(self._kept)

    def resume_lookup(self, key: str, api_key_id: str | None = None) -> ResumeLookup:
        """What ``key`` names for a reconnect: kept streams, and live ones still attached."""
        self.prune()
        return ResumeLookup(kept=self._kept.find(key, api_key_id), attached=len(self._live.find(key, api_key_id)))

    def cancel(self, key: str, api_key_id: str | None = None) -> list[LiveEntry]:
        """Post a cancel to the owner of every live request ``key`` names; returns them, and the
        detached streams it names (``kept``: the caller ends those on their Egress replica)."""
        found = self.find(key, api_key_id)
        for entry in found:
            box = self._owners.get(entry.owner)
            if box is not None:
                box.mailbox.append(entry.request_id)
                box.wake.set()
        return found + self._kept.find(key, api_key_id)

    # -- aborts that missed their replica ---------------------------------------------------------
    def forward_abort(self, request: AbortRequest) -> None:
        """Keep ``request``'s ids for the replica it names, until that replica takes them."""
        if not request.replica:
            return
        ids = self._forwarded.setdefault(request.replica, {})
        now = time.monotonic()
        for rid in request.request_ids:
            ids[rid] = now
        while len(ids) > MAX_FORWARDED_PER_REPLICA:
            del ids[next(iter(ids))]

    def take_aborts(self, replica: str, ttl_s: float = ASKER_TTL_S) -> list[str]:
        """The ids forwarded to ``replica`` since it last asked (each is handed out once).
        ``ttl_s``: how long after this ask it still counts as alive."""
        self._asked[replica] = (time.monotonic(), ttl_s)
        return list(self._forwarded.pop(replica, {}))

    def forwarded(self) -> dict[str, list[str]]:
        """The ids forwarded and not yet taken, by the replica they wait for (tests, operators)."""
        return {replica: list(ids) for replica, ids in self._forwarded.items()}

    def num_forwarded(self) -> int:
        """Forwarded ids not yet taken (tests, leak checks)."""
        return sum(len(ids) for ids in self._forwarded.values())

    # -- engines -------------------------------------------------------------------------------------
    def report(self, report: EngineReport) -> list[str]:
        """Record an engine's report; the answer is the aborts forwarded to it."""
        self._reports[report.replica] = (report, time.monotonic())
        return self.take_aborts(report.replica, self._report_ttl(report))

    def engine_reports(self) -> list[EngineReport]:
        """The latest report of every engine replica still reporting."""
        self.prune()
        return [r for r, _ in self._reports.values()]
