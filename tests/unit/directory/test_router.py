"""The Directory's router (stages/directory/router.py): a call naming ``member`` goes there."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from stages.directory.router import DirectoryRouter


def replica(name: str) -> Any:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))


def choose(candidates: list[Any], **kwargs: Any) -> list[list[str]]:
    pending = SimpleNamespace(args=[], kwargs=kwargs)
    ranks = asyncio.run(DirectoryRouter.choose_replicas(None, candidates, pending))  # type: ignore[arg-type]
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_a_call_naming_a_member_goes_to_it() -> None:
    assert choose([replica("d0"), replica("d1")], member="d1") == [["d1"]]


def test_a_member_that_left_and_a_read_go_to_any_replica() -> None:
    assert choose([replica("d0"), replica("d1")], member="d9") == [["d0", "d1"]]
    assert choose([replica("d0"), replica("d1")]) == [["d0", "d1"]]
