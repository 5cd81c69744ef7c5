"""The typed messages between an AsyncEngine and its step loop."""

from __future__ import annotations

import dataclasses
import pickle

from stages.engine.core.errors import EngineDeadError
from stages.engine.driver import messages
from stages.engine.driver.messages import Abort, AddRequest, Dead, Fail, Kind, LoopStatus, Outputs, StepBatch
from stages.transport.messages import EngineOutput, EngineRequest
from tests.fakes import make_engine, params


def _message_classes() -> list[type]:
    return [c for c in vars(messages).values()
            if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == messages.__name__]


def test_every_message_has_its_own_kind() -> None:
    classes = _message_classes()
    kinds = [c.kind for c in classes]
    assert all(isinstance(k, Kind) for k in kinds)
    assert len(set(kinds)) == len(kinds) == len(Kind)


def test_the_kind_is_not_on_the_wire() -> None:
    """``kind`` is a class attribute: a message pickles as its fields only."""
    for message in (Abort("r", 1.0), Outputs([]), StepBatch([])):
        assert "kind" not in vars(message)
        assert "kind" not in {f.name for f in dataclasses.fields(message)}


def test_a_step_batch_crosses_a_pickle_whole() -> None:
    stats = make_engine().stats()
    batch = StepBatch([Outputs([EngineOutput("a", [1, 2]), EngineOutput("b", [3], finish_reason="stop")]),
                       Fail("c", EngineDeadError("gone")), Dead(EngineDeadError("engine step loop died: x"))],
                      LoopStatus(stats, 2, [0, 1], 0.5, [0.1], {"traced_requests": 4}))
    back = pickle.loads(pickle.dumps(batch))
    assert [e.kind for e in back.events] == [Kind.OUTPUTS, Kind.FAIL, Kind.DEAD]
    assert [o.request_id for o in back.events[0].outputs] == ["a", "b"]
    assert str(back.events[1].error) == "gone" and back.status == batch.status


def test_an_add_carries_its_request_and_params() -> None:
    request = EngineRequest("r", [1, 2, 3], params(max_tokens=4), n=2)
    add = pickle.loads(pickle.dumps(AddRequest("r-0", 0, request, request.sampling_params, 2, 1.5)))
    assert add.kind is Kind.ADD and add.request.prompt_token_ids == [1, 2, 3] and add.admit == 2
    assert add.grammar_template is None
