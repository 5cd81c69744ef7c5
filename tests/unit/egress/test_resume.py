"""Resumable streams' records in Egress (stages/egress/resume.py), without Ray: recording and its
byte cap, detach and take, the grace period's expiry, finished streams, and the drain."""

from __future__ import annotations

import asyncio

import pytest

from stages.egress.resume import OTHER_ITEM_BYTES, ResumeStore, event_id, item_bytes
from stages.errors import ConflictError, NotFoundError
from stages.transport.messages import (
    LiveEntry,
    ResumeTerms,
    RoutedError,
    RoutedFrame,
    StreamFrame,
    StreamStart,
    StreamSummary,
)

OWNER = "egress-A"


def fr(eid: int, rid: str = "r1", data: str | None = None) -> RoutedFrame:
    """The channel item of the stream's event ``eid``."""
    return RoutedFrame(rid, StreamFrame(data if data is not None else f"id: {eid}\ndata: {eid}\n\n", 0, 1, None, eid))


def summ(rid: str = "r1") -> RoutedFrame:
    return RoutedFrame(rid, StreamSummary(3, 2, 0, ["stop"], {}, 0.0))


def terms(grace_s: float = 30.0, max_bytes: int = 10_000, label: str | None = None,
          key: str | None = None) -> ResumeTerms:
    return ResumeTerms(grace_s, max_bytes, label, key)


class Calls:
    """What the store told its owner: expiries, keeps and unkeeps."""

    def __init__(self) -> None:
        self.expired: list[tuple[str, bool]] = []
        self.kept: list[tuple[LiveEntry, float]] = []
        self.unkept: list[str] = []


def make_store() -> tuple[ResumeStore, Calls]:
    calls = Calls()
    store = ResumeStore(OWNER, on_expire=lambda rid, running: calls.expired.append((rid, running)),
                        on_keep=lambda entry, s: calls.kept.append((entry, s)), on_unkeep=calls.unkept.append)
    return store, calls


def opened(store: ResumeStore, rid: str = "r1", t: ResumeTerms | None = None) -> None:
    """Open ``rid`` and mark it accepted, as Egress does."""
    store.open(rid, t or terms(), f"cmpl-{rid}", shape={"kind": "completion"})
    store.started(rid, StreamStart("engine-0", [rid], 3, OWNER))


async def gone(store: ResumeStore, rid: str, timeout: float = 2.0) -> None:
    """Wait until ``rid`` is no longer kept."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while rid in store:
        assert loop.time() < deadline, f"{rid} still kept after {timeout} s"
        await asyncio.sleep(0.01)


# -- recording ---------------------------------------------------------------------------------------------
def test_item_bytes_counts_a_frames_text_and_a_constant_for_anything_else() -> None:
    """A frame costs its text's length; a summary or an error costs OTHER_ITEM_BYTES."""
    assert item_bytes(fr(0, data="x" * 37)) == 37
    assert item_bytes(summ()) == OTHER_ITEM_BYTES
    assert item_bytes(RoutedError("r1", RuntimeError("boom"))) == OTHER_ITEM_BYTES
    assert (event_id(fr(7)), event_id(summ()), event_id(RoutedError("r1", RuntimeError()))) == (7, None, None)


def test_record_adds_up_the_bytes_of_what_was_recorded() -> None:
    """Recorded items add their item_bytes to the stream's and the store's byte count."""
    store, _ = make_store()
    opened(store)
    opened(store, "r2")
    store.record("r1", [fr(0, data="a" * 10), fr(1, data="b" * 20)])
    store.record("r1", [summ()])
    store.record("r2", [fr(0, "r2", data="c" * 5)])
    store.record("unknown", [fr(0, "unknown", data="d" * 1000)])  # not kept: ignored
    assert store.nbytes == 10 + 20 + OTHER_ITEM_BYTES + 5
    assert len(store) == 2 and store.opened == 2


def test_detach_keeps_the_stream_and_tells_the_directory_once() -> None:
    """detach: the stream stays, detached, and on_keep gets its entry (owner: this store) and grace."""
    async def main() -> None:
        store, calls = make_store()
        opened(store, t=terms(grace_s=12.5, label="L", key="k1"))
        assert store.detached() == 0
        assert store.detach("r1") is True
        assert calls.kept == [(LiveEntry("r1", "cmpl-r1", OWNER, "L", "k1", kept=True), 12.5)]
        assert store.detach("r1") is True and len(calls.kept) == 1, "already detached: no second keep"
        assert store.detached() == 1 and "r1" in store
        assert store.detach("nope") is False
        store.forget("r1")
    asyncio.run(main())


def test_detached_entries_are_what_a_new_directory_replica_is_told_again() -> None:
    """Only detached streams, each with the seconds left of its grace period."""
    async def main() -> None:
        store, _ = make_store()
        opened(store, "r1", terms(grace_s=30.0))
        opened(store, "r2", terms(grace_s=30.0))
        assert store.detached_entries() == []
        store.detach("r1")
        await asyncio.sleep(0.05)
        (entry, left), = store.detached_entries()
        assert entry.request_id == "r1" and entry.owner == OWNER and 29.0 < left < 30.0
        store.forget("r1")
        store.forget("r2")
    asyncio.run(main())


# -- reconnects --------------------------------------------------------------------------------------------
def test_take_returns_the_frames_after_the_last_event_then_the_summary() -> None:
    """take(after): frames with event_id > after, plus every non-frame item, in recorded order."""
    async def main() -> None:
        store, calls = make_store()
        opened(store)
        store.record("r1", [fr(0), fr(1)])
        store.record("r1", [fr(2), summ()])
        store.detach("r1")
        kept, items = store.take("r1", 0)
        assert items == [fr(1), fr(2), summ()]
        assert kept.attached and store.detached() == 0
        assert (kept.reconnects, store.reconnects, store.replayed) == (1, 1, 2)
        assert calls.unkept == ["r1"]
        store.detach("r1")
        _, again = store.take("r1", -1)
        assert again == [fr(0), fr(1), fr(2), summ()], "after=-1: every event"
        assert (store.reconnects, store.replayed) == (2, 5)
        store.forget("r1")
    asyncio.run(main())


def test_take_of_an_unknown_stream_is_not_found_and_of_an_attached_one_a_conflict() -> None:
    """take raises NotFoundError (request_not_found) for an unknown id, ConflictError while attached."""
    async def main() -> None:
        store, calls = make_store()
        with pytest.raises(NotFoundError) as missing:
            store.take("nope", -1)
        assert missing.value.code == "request_not_found"
        opened(store)
        with pytest.raises(ConflictError):
            store.take("r1", -1)  # its first client holds it
        store.detach("r1")
        store.take("r1", -1)
        with pytest.raises(ConflictError):
            store.take("r1", -1)  # the reconnect holds it now
        assert store.reconnects == 1 and calls.unkept == ["r1"]
        store.forget("r1")
    asyncio.run(main())


# -- lifetimes ---------------------------------------------------------------------------------------------
def test_a_detached_running_stream_expires_after_its_grace_period() -> None:
    """Nobody takes it within grace_s: on_unkeep, on_expire(rid, running=True), and the record goes."""
    async def main() -> None:
        store, calls = make_store()
        opened(store, t=terms(grace_s=0.05))
        store.record("r1", [fr(0)])
        store.detach("r1")
        assert calls.expired == []
        await gone(store, "r1")
        assert calls.expired == [("r1", True)] and calls.unkept == ["r1"]
        assert store.expired == 1 and store.nbytes == 0 and len(store) == 0
        with pytest.raises(NotFoundError):
            store.take("r1", -1)
    asyncio.run(main())


def test_taking_a_running_stream_stops_its_expiry() -> None:
    """A running stream taken within its grace period is not expired while attached."""
    async def main() -> None:
        store, calls = make_store()
        opened(store, t=terms(grace_s=0.05))
        store.detach("r1")
        store.take("r1", -1)
        await asyncio.sleep(0.2)
        assert "r1" in store and calls.expired == [] and store.expired == 0
        store.forget("r1")
    asyncio.run(main())


def test_a_finished_attached_stream_lingers_its_grace_period_then_goes_quietly() -> None:
    """finish: the record stays grace_s (for a late reconnect), then goes with no on_expire while attached."""
    async def main() -> None:
        store, calls = make_store()
        opened(store, t=terms(grace_s=0.3))
        store.record("r1", [fr(0), summ()])
        store.finish("r1")
        await asyncio.sleep(0.1)
        assert "r1" in store
        await gone(store, "r1")
        assert calls.expired == [] and calls.unkept == [] and store.expired == 0
    asyncio.run(main())


def test_a_finished_detached_stream_expires_grace_s_after_its_finish_as_not_running() -> None:
    """Finished while detached: kept grace_s from the finish, then on_expire(rid, running=False)."""
    async def main() -> None:
        store, calls = make_store()
        opened(store, t=terms(grace_s=0.5))
        store.detach("r1")
        await asyncio.sleep(0.3)
        store.record("r1", [summ()])
        store.finish("r1")
        await asyncio.sleep(0.3)  # past the detach's grace period, within the finish's
        assert "r1" in store and calls.expired == []
        await gone(store, "r1")
        assert calls.expired == [("r1", False)] and calls.unkept == ["r1"]
    asyncio.run(main())


def test_taking_a_finished_stream_rearms_its_grace_period() -> None:
    """A finished stream taken again stays grace_s more, then goes without on_expire (attached)."""
    async def main() -> None:
        store, calls = make_store()
        opened(store, t=terms(grace_s=0.3))
        store.record("r1", [fr(0), summ()])
        store.finish("r1")
        store.detach("r1")
        await asyncio.sleep(0.2)
        _, items = store.take("r1", 0)
        assert items == [summ()]
        await asyncio.sleep(0.2)  # past the first grace period, within the one the take started
        assert "r1" in store
        await gone(store, "r1")
        assert calls.expired == [] and calls.unkept == ["r1"]
    asyncio.run(main())


def test_finish_before_the_acceptance_forgets_at_once() -> None:
    """A stream that never started (refused, cancelled before acceptance) has nothing to resume."""
    store, calls = make_store()
    store.open("r1", terms(), "cmpl-r1", shape={})
    store.record("r1", [summ()])
    store.finish("r1")
    assert "r1" not in store and len(store) == 0 and store.nbytes == 0
    assert calls.expired == [] and calls.unkept == []
    store.finish("r1")  # unknown now: ignored


# -- the byte cap ------------------------------------------------------------------------------------------
def test_a_record_past_max_bytes_is_dropped_and_records_no_more() -> None:
    """At max_bytes the record is kept; one byte past, its items go and later ones are ignored."""
    store, _ = make_store()
    opened(store, t=terms(max_bytes=100))
    store.record("r1", [fr(0, data="x" * 60), fr(1, data="x" * 40)])
    assert store.nbytes == 100 and store.dropped == 0, "exactly at the cap is within it"
    store.record("r1", [fr(2, data="y")])
    assert store.nbytes == 0 and store.dropped == 1
    store.record("r1", [fr(3, data="z")])
    assert store.nbytes == 0 and store.dropped == 1 and "r1" in store


def test_detaching_a_dropped_running_stream_refuses_and_forgets_it() -> None:
    """A dropped, unfinished record cannot be resumed: detach answers False and forgets it."""
    async def main() -> None:
        store, calls = make_store()
        opened(store, t=terms(max_bytes=10))
        store.record("r1", [fr(0, data="x" * 11)])
        assert store.detach("r1") is False
        assert "r1" not in store and calls.kept == [] and len(store) == 0
    asyncio.run(main())


def test_taking_a_dropped_finished_stream_answers_dropped_with_no_items_and_forgets_it() -> None:
    """take of a dropped record: (kept, []) with kept.dropped set; it is then forgotten."""
    async def main() -> None:
        store, calls = make_store()
        opened(store, t=terms(max_bytes=10))
        store.record("r1", [fr(0, data="x" * 11)])
        store.finish("r1")
        assert store.detach("r1") is True, "finished: kept, so the reconnect learns of the drop"
        kept, items = store.take("r1", -1)
        assert kept.dropped and items == [] and kept.reconnects == 1
        assert "r1" not in store and calls.unkept == ["r1"]
        await asyncio.sleep(0.05)
        assert calls.expired == []
    asyncio.run(main())


def test_a_record_dropped_while_detached_answers_its_reconnect_as_dropped() -> None:
    """Past max_bytes while detached: the take gets (kept, []) with dropped set, and it is forgotten."""
    async def main() -> None:
        store, _ = make_store()
        opened(store, t=terms(max_bytes=10))
        store.record("r1", [fr(0, data="x" * 5)])
        assert store.detach("r1") is True
        store.record("r1", [fr(1, data="x" * 6)])
        kept, items = store.take("r1", -1)
        assert kept.dropped and items == [] and "r1" not in store and store.dropped == 1
    asyncio.run(main())


def test_a_detached_running_record_past_max_bytes_is_expired_at_once_and_kept_as_a_tombstone() -> None:
    """Dropped while detached and unfinished: on_expire(rid, True) at once; the empty record stays, so
    a later take answers dropped with no items."""
    async def main() -> None:
        store, calls = make_store()
        opened(store, t=terms(grace_s=30.0, max_bytes=10))
        store.record("r1", [fr(0, data="x" * 5)])
        assert store.detach("r1") is True
        store.record("r1", [fr(1, data="x" * 6)])
        assert calls.expired == [("r1", True)], "stopped now, not at the end of the grace period"
        assert "r1" in store and store.nbytes == 0 and store.dropped == 1
        store.record("r1", [fr(2, data="y")])
        assert calls.expired == [("r1", True)] and store.nbytes == 0, "a tombstone records nothing more"
        kept, items = store.take("r1", -1)
        assert kept.dropped and items == [] and "r1" not in store
        assert calls.expired == [("r1", True)]
    asyncio.run(main())


def test_an_attached_record_past_max_bytes_is_dropped_without_on_expire() -> None:
    """Dropped while attached: the stream goes on unresumable; on_expire is not called."""
    async def main() -> None:
        store, calls = make_store()
        opened(store, t=terms(max_bytes=10))
        store.record("r1", [fr(0, data="x" * 11)])
        assert store.dropped == 1 and calls.expired == [] and "r1" in store
        store.record("r1", [summ()])
        store.finish("r1")
        assert calls.expired == []
        store.forget("r1")
    asyncio.run(main())


def test_a_detached_finished_record_past_max_bytes_is_not_expired_at_once() -> None:
    """Finished and detached: nothing runs to stop, so passing the cap calls no on_expire."""
    async def main() -> None:
        store, calls = make_store()
        opened(store, t=terms(max_bytes=10))
        store.record("r1", [fr(0, data="x" * 5)])
        store.finish("r1")
        store.detach("r1")
        store.record("r1", [fr(1, data="x" * 6)])
        assert store.dropped == 1 and calls.expired == []
        kept, items = store.take("r1", -1)
        assert kept.dropped and items == []
    asyncio.run(main())


# -- forgetting and draining --------------------------------------------------------------------------------
def test_forget_drops_the_record_and_its_expiry() -> None:
    """forget: the stream is gone at once, and its pending expiry never fires."""
    async def main() -> None:
        store, calls = make_store()
        opened(store, t=terms(grace_s=0.05))
        store.record("r1", [fr(0)])
        store.detach("r1")
        store.forget("r1")
        store.forget("nope")  # unknown: ignored
        assert "r1" not in store and store.nbytes == 0
        await asyncio.sleep(0.15)
        assert calls.expired == [] and store.expired == 0
    asyncio.run(main())


def test_drained_completes_once_every_record_is_gone() -> None:
    """drained() waits while any stream is kept and returns when the last one goes."""
    async def main() -> None:
        store, _ = make_store()
        await asyncio.wait_for(store.drained(), 1)  # nothing kept: at once
        opened(store)
        opened(store, "r2", terms(grace_s=0.1))
        waiter = asyncio.ensure_future(store.drained())
        await asyncio.sleep(0.02)
        store.forget("r1")
        await asyncio.sleep(0.02)
        assert not waiter.done(), "r2 is still kept"
        store.detach("r2")
        await asyncio.wait_for(waiter, 2)
        assert len(store) == 0
    asyncio.run(main())
