"""The threaded step loop and its asyncio streams, with a fake model (no Ray, no torch model)."""

from __future__ import annotations

import asyncio
import time

import pytest

from stages.engine.async_engine import AsyncEngine, merge_outputs
from stages.errors import InvalidRequestError, QueueFullError
from stages.protocol import EngineOutput, EngineRequest
from tests.fakes import make_engine, params, reference


class SlowRunner:
    """Wraps a runner so each step takes a fixed time (a stand-in for model work)."""

    def __init__(self, inner, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds
        self.num_blocks = inner.num_blocks

    def execute(self, batch):
        time.sleep(self.seconds)
        return self.inner.execute(batch)


def _engine(step_s: float = 0.0, **kw):
    engine = make_engine(**kw)
    if step_s:
        engine.runner = SlowRunner(engine.runner, step_s)
    return engine


def run(coro):
    return asyncio.run(coro)


def test_stream_matches_reference_and_first_item_is_acceptance():
    async def main():
        eng = AsyncEngine(_engine())
        eng.start()
        prompt = [5, 6, 7, 8, 9]
        items = [o async for o in eng.generate(EngineRequest("a", prompt, params(max_tokens=6)))]
        eng.shutdown()
        return items

    items = run(main())
    tokens = [t for o in items for t in o.new_token_ids]
    assert tokens == reference([5, 6, 7, 8, 9], 6)
    assert items[-1].finish_reason == "length"
    assert items[-1].timings["queue"] >= 0 and "decode" in items[-1].timings


def test_slow_consumer_gets_coalesced_items_fast_consumer_does_not():
    async def consume(eng: AsyncEngine, rid: str, delay: float) -> list[int]:
        sizes = []
        async for out in eng.generate(EngineRequest(rid, [1, 2, 3], params(max_tokens=20))):
            if out.new_token_ids:  # (the first, empty item only says "accepted")
                sizes.append(len(out.new_token_ids))
                await asyncio.sleep(delay)
        return sizes

    async def main():
        eng = AsyncEngine(_engine(step_s=0.01))
        eng.start()
        fast = await consume(eng, "fast", 0.0)
        slow = await consume(eng, "slow", 0.06)
        eng.shutdown()
        return fast, slow

    fast, slow = run(main())
    assert sum(fast) == sum(slow) == 20
    assert max(fast) == 1  # the consumer keeps up: one token per item
    assert slow[0] == 1  # the first token goes out at once
    assert max(slow) > 1 and len(slow) < 20  # later items carry what accumulated


def test_leaving_early_aborts_and_frees_blocks():
    async def main():
        engine = _engine(step_s=0.005)
        eng = AsyncEngine(engine)
        eng.start()
        gen = eng.generate(EngineRequest("gone", [1, 2, 3, 4], params(max_tokens=200)))
        async for out in gen:
            if out.new_token_ids:
                break
        await gen.aclose()  # what a cancelled caller does
        for _ in range(200):
            if eng.stats().num_running == 0 and not engine.requests:
                break
            await asyncio.sleep(0.01)
        stats = eng.stats()
        lat = list(eng.abort_latencies)
        eng.shutdown()
        return stats, lat, engine

    stats, latencies, engine = run(main())
    assert stats.finished_total["abort"] == 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert len(latencies) == 1 and latencies[0] < 1.0


def test_queue_bound_and_invalid_requests_raise_serve_errors():
    async def main():
        eng = AsyncEngine(_engine(step_s=0.02, max_num_seqs=1), max_waiting=1)
        eng.start()
        with pytest.raises(InvalidRequestError):
            async for _ in eng.generate(EngineRequest("bad", [], params())):
                pass
        first = eng.generate(EngineRequest("r1", [1, 2], params(max_tokens=50)))
        await first.__anext__()
        second = eng.generate(EngineRequest("r2", [1, 2], params(max_tokens=50)))
        await second.__anext__()  # accepted, waiting
        await asyncio.sleep(0.1)
        with pytest.raises(QueueFullError):
            await eng.generate(EngineRequest("r3", [1, 2], params(max_tokens=5))).__anext__()
        await first.aclose()
        await second.aclose()
        eng.shutdown()

    run(main())


def test_merge_outputs_keeps_order_and_final_fields():
    outs = [EngineOutput("x", [1], timings={"queue": 0.1}), EngineOutput("x", [2, 3]),
            EngineOutput("x", [4], finish_reason="stop", stop_token_id=4, timings={"decode": 0.2})]
    merged = merge_outputs("x", outs)
    assert merged.new_token_ids == [1, 2, 3, 4]
    assert merged.finish_reason == "stop" and merged.stop_token_id == 4
    assert merged.timings == {"queue": 0.1, "decode": 0.2}
