"""The Ingress side of resumable streams (stages/ingress/resume.py), without Ray: the X-Resumable
header, the last event a reconnect names, and how a reconnect finds its kept stream."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from stages.config import MAX_RESUME_GRACE_S
from stages.errors import ConflictError, InvalidRequestError, NotFoundError
from stages.ingress import resume as resume_module
from stages.ingress.resume import find_kept, last_event_id, resume_grace
from stages.transport.messages import LiveEntry, ResumeLookup


def entry(rid: str) -> LiveEntry:
    return LiveEntry(rid, f"cmpl-{rid}", "egress-A", "L", None)


# -- X-Resumable ----------------------------------------------------------------------------------------------
def test_no_resumable_header_takes_the_servers_default() -> None:
    """No X-Resumable header: the configured default grace period applies."""
    assert resume_grace(None, 45.0) == 45.0
    assert resume_grace(None, 0.0) == 0.0


@pytest.mark.parametrize(("header", "grace"), [("0", 0.0), ("1", 1.0), ("30", 30.0), ("2.5", 2.5),
                                               ("600", MAX_RESUME_GRACE_S)])
def test_a_resumable_header_from_1_to_600_or_0_is_the_grace_period(header: str, grace: float) -> None:
    """X-Resumable of 0 (opt out) or 1..600 seconds overrides the default."""
    assert resume_grace(header, 45.0) == grace


@pytest.mark.parametrize("header", ["601", "0.5", "abc", "-1", "", "nan", "inf"])
def test_a_resumable_header_out_of_range_or_not_a_number_is_a_400(header: str) -> None:
    """Any other X-Resumable value is an InvalidRequestError naming the header."""
    with pytest.raises(InvalidRequestError) as err:
        resume_grace(header, 45.0)
    assert err.value.param == "X-Resumable"


# -- Last-Event-ID / starting_after ---------------------------------------------------------------------------
def test_the_last_event_id_header_wins_over_the_query() -> None:
    """Last-Event-ID is read first; starting_after only when the header is absent."""
    assert last_event_id({"last-event-id": "5"}, {"starting_after": "9"}) == 5
    assert last_event_id({}, {"starting_after": "9"}) == 9
    assert last_event_id({"last-event-id": "0"}, {}) == 0


def test_no_last_event_means_every_event() -> None:
    """Neither header nor query (or an empty value): -1, and -1 itself is accepted."""
    assert last_event_id({}, {}) == -1
    assert last_event_id({"last-event-id": ""}, {}) == -1
    assert last_event_id({}, {"starting_after": "-1"}) == -1
    assert last_event_id({"last-event-id": "-1"}, {}) == -1


@pytest.mark.parametrize(("headers", "query", "param"), [
    ({"last-event-id": "x"}, {}, "Last-Event-ID"),
    ({"last-event-id": "-2"}, {"starting_after": "3"}, "Last-Event-ID"),
    ({}, {"starting_after": "x"}, "starting_after"),
    ({}, {"starting_after": "-2"}, "starting_after"),
    ({}, {"starting_after": "1.5"}, "starting_after"),
])
def test_a_last_event_that_is_not_an_id_is_a_400_naming_its_source(headers: dict[str, str], query: dict[str, str],
                                                                    param: str) -> None:
    """A non-integer or below -1 value is an InvalidRequestError naming the header or query field used."""
    with pytest.raises(InvalidRequestError) as err:
        last_event_id(headers, query)
    assert err.value.param == param


@pytest.mark.parametrize("raw", ["--1", "²"])
def test_a_malformed_last_event_id_that_looks_numeric_is_still_a_400(raw: str) -> None:
    """Values such as '--1' or '²' are InvalidRequestError too, never an unhandled ValueError."""
    with pytest.raises(InvalidRequestError):
        last_event_id({"last-event-id": raw}, {})


# -- finding the kept stream ------------------------------------------------------------------------------------
class Lookup:
    """``directory.resume_lookup(key, api_key_id)`` answers the next scripted lookup
    (the last one again once the script runs out) and records the calls."""

    def __init__(self, answers: list[ResumeLookup]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, str | None]] = []

    async def _lookup(self, key: str, api_key_id: str | None) -> ResumeLookup:
        self.calls.append((key, api_key_id))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def __call__(self, key: str, api_key_id: str | None) -> Any:
        return self._lookup(key, api_key_id)


class FakeDirectory:
    def __init__(self, *answers: ResumeLookup) -> None:
        self.resume_lookup = Lookup(list(answers))


@pytest.fixture
def short_settle(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(resume_module, "SETTLE_S", 0.1)
    return 0.1


def test_find_kept_returns_the_one_kept_stream_the_key_names() -> None:
    """One kept stream and nothing attached: that entry, from one lookup with the caller's key."""
    directory = FakeDirectory(ResumeLookup(kept=[entry("r1")]))
    assert asyncio.run(find_kept(directory, "cmpl-r1", "k1")) == entry("r1")
    assert directory.resume_lookup.calls == [("cmpl-r1", "k1")]


def test_find_kept_of_nothing_is_request_not_found() -> None:
    """Nothing kept and nothing attached: NotFoundError (request_not_found), without waiting."""
    directory = FakeDirectory(ResumeLookup())
    with pytest.raises(NotFoundError) as err:
        asyncio.run(find_kept(directory, "cmpl-r1", None))
    assert err.value.code == "request_not_found" and err.value.param == "request_id"
    assert len(directory.resume_lookup.calls) == 1


def test_find_kept_without_a_directory_is_not_found() -> None:
    """No directory (a single-replica setup without one): NotFoundError."""
    with pytest.raises(NotFoundError) as err:
        asyncio.run(find_kept(None, "cmpl-r1", None))
    assert err.value.code == "request_not_found"


def test_find_kept_of_a_stream_still_attached_is_a_conflict_after_the_settle_wait(short_settle: float) -> None:
    """Still attached after SETTLE_S of polling: ConflictError (stream_attached)."""
    directory = FakeDirectory(ResumeLookup(attached=1))

    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(ConflictError) as err:
            await find_kept(directory, "cmpl-r1", None)
        assert err.value.code == "stream_attached"
        return loop.time() - t0

    waited = asyncio.run(main())
    assert waited >= short_settle and len(directory.resume_lookup.calls) >= 2


def test_find_kept_waits_for_an_attached_stream_to_be_detached(short_settle: float) -> None:
    """Attached on the first lookups, kept on a later one: the kept entry."""
    directory = FakeDirectory(ResumeLookup(attached=1), ResumeLookup(attached=1), ResumeLookup(kept=[entry("r1")]))
    assert asyncio.run(find_kept(directory, "L", None)) == entry("r1")
    assert len(directory.resume_lookup.calls) == 3


@pytest.mark.parametrize("found", [ResumeLookup(kept=[entry("r1"), entry("r2")]),
                                   ResumeLookup(kept=[entry("r1")], attached=1),
                                   ResumeLookup(attached=2)])
def test_find_kept_of_a_label_naming_two_requests_is_a_conflict(found: ResumeLookup) -> None:
    """A label naming several requests (kept or attached) is ambiguous: ConflictError at once."""
    directory = FakeDirectory(found)
    with pytest.raises(ConflictError) as err:
        asyncio.run(find_kept(directory, "L", None))
    assert "2 live requests" in err.value.message and err.value.code == "conflict"
    assert len(directory.resume_lookup.calls) == 1
