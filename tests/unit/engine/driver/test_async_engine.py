"""The asyncio streams over the step loop on a thread (the in-process driver), with a fake model
(no Ray, no torch model)."""

from __future__ import annotations

import asyncio
import time

import pytest

from stages.engine.core.errors import (
    DuplicateRequestIdError,
    EngineOverloadedError,
    RequestRejectedError,
    SamplingError,
)
from stages.engine.driver.async_engine import AsyncEngine
from stages.engine.driver.in_process import InProcessDriver
from stages.transport.channel import merge_outputs
from stages.transport.messages import EngineOutput, EngineRequest
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


def _async(engine, *, stall_timeout_s: float = 60.0, **driver) -> AsyncEngine:
    return AsyncEngine(InProcessDriver(engine, **driver), stall_timeout_s=stall_timeout_s)


def run(coro):
    return asyncio.run(coro)


def test_stream_matches_reference_and_first_item_is_acceptance():
    async def main():
        eng = _async(_engine(), replica="r0")
        eng.start()
        prompt = [5, 6, 7, 8, 9]
        items = [o async for outs in eng.generate(EngineRequest("a", prompt, params(max_tokens=6))) for o in outs]
        eng.shutdown()
        return items

    items = run(main())
    assert items[0].replica == "r0"  # the acceptance (possibly merged with the first tokens)
    tokens = [t for o in items for t in o.new_token_ids]
    assert tokens == reference([5, 6, 7, 8, 9], 6)
    assert items[-1].finish_reason == "length"
    assert items[-1].timings["queue"] >= 0 and "decode" in items[-1].timings


def test_slow_consumer_gets_coalesced_items_fast_consumer_does_not():
    async def consume(eng: AsyncEngine, rid: str, delay: float) -> list[int]:
        sizes = []
        async for (out,) in eng.generate(EngineRequest(rid, [1, 2, 3], params(max_tokens=20))):
            if out.new_token_ids:  # (the first, empty item only says "accepted")
                sizes.append(len(out.new_token_ids))
                await asyncio.sleep(delay)
        return sizes

    async def main():
        eng = _async(_engine(step_s=0.01))
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
        eng = _async(engine)
        eng.start()
        gen = eng.generate(EngineRequest("gone", [1, 2, 3, 4], params(max_tokens=200)))
        async for (out,) in gen:
            if out.new_token_ids:
                break
        await gen.aclose()  # what a cancelled caller does
        for _ in range(200):
            if eng.stats().num_running == 0 and not engine.requests:
                break
            await asyncio.sleep(0.01)
        stats = eng.stats()
        cancel = eng.cancellation_stats()
        eng.shutdown()
        return stats, cancel, engine

    stats, cancel, engine = run(main())
    assert stats.finished_total["abort"] == 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert dict(cancel["abort_latency_buckets"])["+Inf"] == 1 and 0 < cancel["abort_latency_sum"] < 1.0


def test_queue_bound_and_invalid_requests_raise_engine_errors():
    async def main():
        eng = _async(_engine(step_s=0.02, max_num_seqs=1, max_waiting_requests=1))
        eng.start()
        with pytest.raises(RequestRejectedError):
            async for _ in eng.generate(EngineRequest("bad", [], params())):
                pass
        first = eng.generate(EngineRequest("r1", [1, 2], params(max_tokens=50)))
        await first.__anext__()
        # Accepted is not yet scheduled: r1 leaves the waiting queue at the next step. Until then a
        # second request would find the queue full (this raced under load).
        deadline = time.monotonic() + 5
        while eng.stats().num_running < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        second = eng.generate(EngineRequest("r2", [1, 2], params(max_tokens=50)))
        await second.__anext__()  # accepted, waiting
        await asyncio.sleep(0.1)
        with pytest.raises(EngineOverloadedError):
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


# -- groups (n > 1), ids, the queue bound, health ----------------------------------------------------------
def _collect(items: list[list[EngineOutput]]) -> tuple[dict[str, list[int]], dict[str, str]]:
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for outs in items:
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                assert o.request_id not in reasons, "a choice finished twice"
                reasons[o.request_id] = o.finish_reason
    return tokens, reasons


def test_group_runs_every_choice_and_siblings_share_the_cached_prompt():
    async def main():
        engine = _engine(step_s=0.002)
        eng = _async(engine)
        eng.start()
        prompt = list(range(1, 21))  # 5 full blocks of 4
        items = [outs async for outs in eng.generate(EngineRequest("g", prompt, params(max_tokens=5), n=3))]
        eng.shutdown()
        return items, engine

    items, engine = run(main())
    tokens, reasons = _collect(items)
    assert set(reasons) == {"g-0", "g-1", "g-2"} and set(reasons.values()) == {"length"}
    for rid in reasons:  # greedy: every choice is the reference continuation
        assert tokens[rid] == reference(list(range(1, 21)), 5)
    assert {o.index for outs in items for o in outs} == {0, 1, 2}
    assert engine.block_manager.stats.hits >= 2 * 16  # both siblings found the prompt's full blocks
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_moved_group_continues_each_open_choice_from_its_own_tokens_and_skips_the_finished():
    """A request with n = 3 moved here: choice 0 had finished, choices 1 and 2 carry 2 and 4 tokens.
    Choice 1 leads (its acceptance is the first item), each open choice continues its own tokens
    to max_tokens, and choice 0 is never run again."""
    prompt, ref = list(range(1, 21)), None

    async def main():
        eng = _async(_engine(step_s=0.002))
        eng.start()
        request = EngineRequest("g", prompt, params(max_tokens=6), n=3,
                                output_token_ids=[ref[:3], ref[:2], ref[:4]], finished_choices=[0])
        items = [outs async for outs in eng.generate(request)]
        eng.shutdown()
        return items

    ref = reference(prompt, 6)
    items = run(main())
    first = items[0][0]
    assert (first.request_id, first.index, first.new_token_ids) == ("g-1", 1, []) and first.replica is not None
    tokens, reasons = _collect(items)
    assert reasons == {"g-1": "length", "g-2": "length"}
    assert tokens["g-1"] == ref[2:] and tokens["g-2"] == ref[4:]


def test_abort_of_a_sibling_not_yet_started_ends_it_at_once():
    async def main():
        eng = _async(_engine(step_s=0.01))
        eng.start()
        gen = eng.generate(EngineRequest("g", [1, 2, 3], params(max_tokens=30), n=2))
        first = await gen.__anext__()  # acceptance of choice 0; choice 1 is not added yet
        eng.abort("g-1")
        eng.abort("g-0")
        rest = [outs async for outs in gen]
        eng.shutdown()
        return [first, *rest]

    _, reasons = _collect(run(main()))
    assert reasons == {"g-0": "abort", "g-1": "abort"}


def test_leaving_a_group_aborts_every_running_choice():
    async def main():
        engine = _engine(step_s=0.005)
        eng = _async(engine)
        eng.start()
        gen = eng.generate(EngineRequest("g", [1, 2, 3, 4], params(max_tokens=200), n=2))
        seen: set[int] = set()
        async for outs in gen:
            seen |= {o.index for o in outs if o.new_token_ids}
            if seen == {0, 1}:
                break
        await gen.aclose()
        for _ in range(200):
            if not engine.requests:
                break
            await asyncio.sleep(0.01)
        eng.shutdown()
        return engine

    engine = run(main())
    assert engine.finished_total["abort"] == 2
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_duplicate_live_id_raises_and_leaves_the_first_stream_alone():
    async def main():
        eng = _async(_engine(step_s=0.005))
        eng.start()
        first = eng.generate(EngineRequest("same", [1, 2], params(max_tokens=6)))
        await first.__anext__()
        with pytest.raises(DuplicateRequestIdError):
            await eng.generate(EngineRequest("same", [3, 4], params(max_tokens=6))).__anext__()
        rest = [o for outs in [outs async for outs in first] for o in outs]
        eng.shutdown()
        return rest

    rest = run(main())
    assert [t for o in rest for t in o.new_token_ids] == reference([1, 2], 6)


def test_queue_bound_is_exact_under_a_burst():
    """All adds of a burst reach the step thread together; exactly ``max_waiting`` may wait."""
    async def main():
        eng = _async(_engine(step_s=0.05, max_num_seqs=1, max_waiting_requests=3))
        eng.start()
        gens = [eng.generate(EngineRequest(f"b{i}", [1, 2], params(max_tokens=40))) for i in range(10)]
        results = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
        for g in gens:
            await g.aclose()
        eng.shutdown()
        return results

    results = run(main())
    refused = [r for r in results if isinstance(r, EngineOverloadedError)]
    accepted = [r for r in results if isinstance(r, list)]
    # The first add may be scheduled at once (running), three wait; the rest are refused.
    assert len(accepted) <= 4 and len(accepted) + len(refused) == 10 and len(refused) >= 6


def test_health_problem_reports_a_stalled_or_dead_step_loop():
    class Stuck:
        def __init__(self, inner):
            self.inner, self.num_blocks = inner, inner.num_blocks
            self.release = asyncio.Event()

        def execute(self, batch):
            time.sleep(0.5)
            return self.inner.execute(batch)

    async def main():
        engine = _engine()
        engine.runner = Stuck(engine.runner)
        eng = _async(engine, stall_timeout_s=0.2)
        eng.start()
        assert eng.health_problem() is None  # idle is healthy
        gen = eng.generate(EngineRequest("s", [1, 2], params(max_tokens=3)))
        await gen.__anext__()
        await asyncio.sleep(0.35)
        stalled = eng.health_problem()
        await gen.aclose()
        eng.shutdown()
        return stalled, eng.health_problem()

    stalled, after_shutdown = run(main())
    assert stalled is not None and "no progress" in stalled
    assert after_shutdown is not None  # the loop is gone: not healthy


class FailingSampler:
    """Wraps a runner: request ``bad``'s sampling fails from its ``after``-th sampled token on (the
    runner's other requests are sampled as usual)."""

    def __init__(self, inner, after: int) -> None:
        self.inner, self.after = inner, after
        self.num_blocks = inner.num_blocks
        self.sampled = 0

    def execute(self, batch):
        out = self.inner.execute(batch)
        if "bad" in out:
            self.sampled += 1
            if self.sampled > self.after:
                out["bad"] = SamplingError("sampling failed for this request (IndexError: test)")
        return out


def test_a_sampling_failure_fails_that_stream_only_and_the_engine_goes_on():
    async def consume(eng, rid, prompt, n):
        tokens = []
        async for outs in eng.generate(EngineRequest(rid, prompt, params(max_tokens=n))):
            tokens += [t for o in outs for t in o.new_token_ids]
        return tokens

    async def main():
        engine = _engine()
        engine.runner = FailingSampler(engine.runner, after=3)
        eng = _async(engine, replica="r0")
        eng.start()
        # (Bounded: a failure nobody reports would leave "bad" waiting forever.)
        results = await asyncio.wait_for(asyncio.gather(consume(eng, "good", [1, 2, 3], 12),
                                                        consume(eng, "bad", [4, 5, 6], 12),
                                                        return_exceptions=True), 10)
        later = await consume(eng, "later", [7, 8], 5)  # the same engine, still serving
        stats = engine.stats()
        eng.shutdown()
        return results, later, stats, eng

    (good, bad), later, stats, eng = run(main())
    assert good == reference([1, 2, 3], 12)
    assert isinstance(bad, SamplingError), bad
    assert later == reference([7, 8], 5)
    assert eng.dead is None and stats.sampling_failures == 1
    assert stats.num_free_blocks == stats.num_kv_blocks and stats.num_running == 0


# -- ``sink``: after the first item, outputs go to a callback from the step's delivery ---------------
def _sink_run(request: EngineRequest, *, step_s: float = 0.002, abort_after: int | None = None,
              runner_wrap=None):
    """Drive ``generate(request, sink=...)``: what it yielded, what the sink got, and the engine."""
    async def main():
        engine = _engine(step_s=step_s)
        if runner_wrap is not None:
            engine.runner = runner_wrap(engine.runner)
        eng = _async(engine, replica="r0")
        eng.start()
        sunk: list[list[EngineOutput]] = []
        loop_thread = []

        def sink(items: list[EngineOutput]) -> None:
            loop_thread.append(asyncio.get_running_loop() is not None)  # raises off the loop
            sunk.append(items)
            if abort_after is not None and sum(len(o.new_token_ids) for i in sunk for o in i) >= abort_after:
                eng.abort(request.request_id if request.n == 1 else f"{request.request_id}-0")

        yielded, error = [], None
        try:
            async for outs in eng.generate(request, sink=sink):
                yielded.append(outs)
        except Exception as exc:  # noqa: BLE001 - returned for the test to check
            error = exc
        for _ in range(200):
            if not engine.requests:
                break
            await asyncio.sleep(0.01)
        eng.shutdown()
        return yielded, sunk, engine, error, all(loop_thread)

    return run(main())


def test_sink_gets_every_output_after_the_first_item_and_the_stream_ends_with_the_request():
    yielded, sunk, engine, error, on_loop = _sink_run(EngineRequest("s", [5, 6, 7, 8, 9], params(max_tokens=12)))
    assert error is None and on_loop
    assert len(yielded) == 1 and yielded[0][0].replica == "r0"  # only the acceptance is yielded
    items = [o for outs in yielded + sunk for o in outs]
    assert [t for o in items for t in o.new_token_ids] == reference([5, 6, 7, 8, 9], 12)
    assert items[-1].finish_reason == "length" and all(o.finish_reason is None for o in items[:-1])
    assert len(sunk) >= 2  # step by step, not one lump at the end
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sink_gets_every_choice_of_a_group_and_the_siblings_start():
    yielded, sunk, engine, error, _ = _sink_run(EngineRequest("g", list(range(1, 21)), params(max_tokens=5), n=3))
    tokens, reasons = _collect(yielded + sunk)
    assert error is None and len(yielded) == 1
    assert set(reasons) == {"g-0", "g-1", "g-2"} and set(reasons.values()) == {"length"}
    for rid in reasons:
        assert tokens[rid] == reference(list(range(1, 21)), 5)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_an_abort_reaches_the_sink_as_the_final_item_and_frees_the_blocks():
    yielded, sunk, engine, error, _ = _sink_run(EngineRequest("a", [1, 2, 3], params(max_tokens=500)),
                                               step_s=0.005, abort_after=3)
    assert error is None
    assert sunk[-1][-1].finish_reason == "abort"
    assert sum(len(o.new_token_ids) for outs in sunk for o in outs) < 100
    assert engine.finished_total["abort"] == 1 and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_failure_after_the_first_item_ends_a_sink_stream_with_its_error():
    yielded, sunk, engine, error, _ = _sink_run(EngineRequest("bad", [4, 5, 6], params(max_tokens=12)),
                                               runner_wrap=lambda r: FailingSampler(r, after=3))
    assert isinstance(error, SamplingError), error
    assert len(yielded) == 1 and all(o.finish_reason is None for outs in sunk for o in outs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_sink_that_raises_fails_its_own_request_only():
    async def main():
        eng = _async(_engine(step_s=0.002))
        eng.start()

        def bad_sink(items):
            raise ValueError("broken sink")

        async def drive(rid, sink):
            out = []
            async for outs in eng.generate(EngineRequest(rid, [1, 2, 3], params(max_tokens=8)), sink=sink):
                out.append(outs)
            return out

        got: list = []
        results = await asyncio.wait_for(asyncio.gather(drive("bad", bad_sink), drive("good", got.append),
                                                        return_exceptions=True), 10)
        eng.shutdown()
        return results, got

    (bad, good), got = run(main())
    assert isinstance(bad, ValueError)
    assert [t for outs in good + got for o in outs for t in o.new_token_ids] == reference([1, 2, 3], 8)
