"""The step loop in a child process (``engine.core_process``), against the same loop on a thread.

A tiny random-weight model (tests/tools_model.py) keeps each child's start to a few seconds; one
child serves most tests of this module, and the ones that kill or hang a child start their own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stages.config import EngineSettings
from stages.engine.core.errors import (
    EngineDeadError,
    EngineOverloadedError,
    PromptTooLongError,
    RequestRejectedError,
)
from stages.engine.driver.async_engine import AsyncEngine
from stages.engine.driver.core_process import ChildProcessDriver
from stages.engine.driver.in_process import InProcessDriver
from stages.engine.driver.interface import build_driver
from stages.engine.driver.messages import LoopSpec
from stages.transport.messages import EngineRequest, SamplingParams, StructuredOutputSpec


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from stages.model_info import cache_root
    from tests.tools_model import build_tools_model

    return build_tools_model(cache_root() / "test-models" / "tiny-hermes-tools")


def _config(model: Path, **kw: Any) -> tuple[str, EngineSettings]:
    """The model and its engine settings. Device auto: the child resolves it (the replica side
    never imports torch, see below)."""
    base = {"weights": "float32", "num_threads": 1, "kv_cache_memory_gb": 0.02, "max_num_seqs": 8,
            "max_num_batched_tokens": 256}
    return str(model), EngineSettings(**{**base, **kw})


class Loop:
    """One event loop on a thread for a module's engines (an engine delivers to the loop it started on)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        import threading

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.close()


def _start(loop: Loop, engine: AsyncEngine) -> AsyncEngine:
    async def start() -> None:
        await asyncio.to_thread(engine.start, asyncio.get_running_loop())
    loop.run(start())
    return engine


@pytest.fixture(scope="module")
def core(tiny_model: Path, loop: Loop) -> Iterator[AsyncEngine]:
    engine = _start(loop, AsyncEngine(ChildProcessDriver(LoopSpec(*_config(tiny_model, max_waiting_requests=16,
                                                                          fault_injection=True), replica="r-core"))))
    yield engine
    engine.shutdown()


def _params(max_tokens: int = 12, **kw: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **kw})


async def _collect(engine: AsyncEngine, request: EngineRequest) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    async for items in engine.generate(request):
        for out in items:
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
    return tokens


def _requests(tag: str) -> list[EngineRequest]:
    return [EngineRequest(f"{tag}-a", [5, 6, 7, 8], _params(10)),
            EngineRequest(f"{tag}-b", [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], _params(14)),
            EngineRequest(f"{tag}-c", [5, 6, 7, 8, 30], _params(6, temperature=0.8, seed=7)),
            EngineRequest(f"{tag}-d", [40, 41, 42], _params(9, seed=3, temperature=1.0), n=2)]


def test_a_child_process_gives_the_same_tokens_as_the_loop_on_a_thread(core, tiny_model, loop) -> None:
    threaded = AsyncEngine(build_driver(LoopSpec(*_config(tiny_model)), child_process=False))

    async def both() -> tuple[list[dict[int, list[int]]], list[dict[int, list[int]]]]:
        threaded.start()
        try:
            a = await asyncio.gather(*(_collect(threaded, r) for r in _requests("t")))
        finally:
            threaded.shutdown()
        b = await asyncio.gather(*(_collect(core, r) for r in _requests("p")))
        return a, b

    on_thread, in_process = loop.run(both())
    assert in_process == on_thread
    assert [len(t[0]) for t in in_process] == [10, 14, 6, 9] and len(in_process[3]) == 2
    assert core.replica == "r-core" and core.driver.pid != os.getpid()
    assert isinstance(threaded.driver, InProcessDriver) and threaded.driver.pid == os.getpid()
    assert threaded.loop_counters() == {"traced_requests": 0}  # the tracer runs where the loop does


def test_the_acceptance_names_the_replica_and_the_stats_come_from_the_child(core, loop) -> None:
    async def run() -> Any:
        firsts = []
        async for items in core.generate(EngineRequest("acc", [1, 2, 3], _params(3))):
            firsts.append(items)
        return firsts
    items = loop.run(run())
    assert items[0][0].replica == "r-core" and items[0][0].num_prompt_tokens == 3
    stats = core.stats()
    assert stats.num_steps > 0 and stats.generation_tokens_total >= 3
    assert core.max_model_len > 0 and core.num_blocks == stats.num_kv_blocks
    snap = core.snapshot()
    assert snap["block_size"] == 16 and snap["max_waiting"] == 16 and snap["stalled_s"] == 0.0
    assert all(t > 0 for t in core.take_ttfts()) and core.take_ttfts() == []


def test_leaving_a_stream_aborts_in_the_child_and_frees_its_blocks(core, loop) -> None:
    async def run() -> None:
        agen = core.generate(EngineRequest("long", list(range(3, 40)), _params(2000)))
        n = 0
        async for _ in agen:
            n += 1
            if n == 3:
                break
        await agen.aclose()
        for _ in range(100):
            stats = core.stats()
            if stats.num_running == 0 and stats.num_free_blocks == stats.num_kv_blocks:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"blocks not freed: {core.stats()}")
    before = dict(core.cancellation_stats()["abort_latency_buckets"])["+Inf"]
    loop.run(run())
    after = core.cancellation_stats()
    assert dict(after["abort_latency_buckets"])["+Inf"] == before + 1 and after["abort_latency_sum"] > 0


def test_refusals_cross_the_process_with_their_type_and_fields(core, loop) -> None:
    async def first(request: EngineRequest) -> Any:
        async for items in core.generate(request):
            return items
    with pytest.raises(PromptTooLongError):
        loop.run(first(EngineRequest("too-long", [1] * (core.max_model_len + 1), _params(2))))
    with pytest.raises(RequestRejectedError, match="token ids"):
        loop.run(first(EngineRequest("bad-ids", [1, 10**9], _params(2))))

    async def overload() -> list[Any]:
        async def one(i: int) -> Any:
            try:
                await _collect(core, EngineRequest(f"ov{i}", [1, 2, 3, i + 4], _params(200)))
            except EngineOverloadedError as exc:
                return exc
            return None
        return await asyncio.gather(*(one(i) for i in range(40)))
    refused = [r for r in loop.run(overload()) if r is not None]
    # At most 8 run and 16 wait while these arrive (each needs 200 steps): 16 or more are refused.
    assert len(refused) >= 16, len(refused)
    assert all(r.replica == "r-core" and r.retry_after == 1.0 for r in refused)
    assert core.snapshot()["rejected_overloaded"] >= len(refused)


def test_a_grammar_is_built_in_the_child_off_its_step_thread(core, tiny_model, loop) -> None:
    from stages.model_info import load_cpu_tokenizer, model_info
    from stages.preprocess.grammar import GrammarCompiler

    tok = load_cpu_tokenizer(str(tiny_model))
    info = model_info(str(tiny_model), tokenizer=tok)
    spec = GrammarCompiler(tok, info.vocab_size, info.eos_token_ids).compile_sync(
        StructuredOutputSpec("regex", "[0-9]{4}"))
    request = EngineRequest("re", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0.0), grammar=spec)
    tokens = loop.run(_collect(core, request))[0]
    assert len(tok.decode(tokens, skip_special_tokens=True)) == 4
    assert tok.decode(tokens, skip_special_tokens=True).isdigit()
    assert core.stats().grammar_templates_built == 1

    # Left at once, while its grammar may still be building in the child: whether the abort meets
    # the add there (dropped when it comes back) or in the engine, nothing is left running.
    other = GrammarCompiler(tok, info.vocab_size, info.eos_token_ids).compile_sync(
        StructuredOutputSpec("json_schema", json.dumps({"type": "object", "properties": {
            "a": {"type": "string", "maxLength": 30}}, "required": ["a"]})))

    async def leave_at_once() -> None:
        agen = core.generate(EngineRequest("gone", [1, 2, 3], SamplingParams(max_tokens=500, temperature=0.0),
                                           grammar=other))
        task = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(1.0)
    loop.run(leave_at_once())
    assert core.stats().num_running == 0 and core.stats().num_waiting == 0


def test_a_hung_step_in_the_child_shows_as_a_stall(tiny_model, loop) -> None:
    engine = _start(loop, AsyncEngine(ChildProcessDriver(LoopSpec(*_config(tiny_model, fault_injection=True))),
                                      stall_timeout_s=0.5))
    try:
        engine.arm_fault("step_hang")

        async def run() -> None:
            agen = engine.generate(EngineRequest("h", [1, 2, 3], _params(5)))
            task = asyncio.ensure_future(agen.__anext__())
            for _ in range(100):
                await asyncio.sleep(0.05)
                if engine.stalled_for() > 0.6:
                    break
            assert engine.health_problem() is not None and "no progress" in engine.health_problem()
            # Its acceptance came before the hung step (the child sends it as the add is taken).
            assert task.done() and task.result()[0].num_prompt_tokens == 3
            await agen.aclose()
        loop.run(run())
    finally:
        started = time.monotonic()
        engine.shutdown()  # releases the hang: the child stops at once, not after 600 s
        assert time.monotonic() - started < 20 and not engine.is_alive
        engine.shutdown()  # again, as the replica's __del__ may after an explicit one: a no-op


def test_a_killed_child_fails_its_streams_and_the_health_check(tiny_model, loop) -> None:
    engine = _start(loop, AsyncEngine(ChildProcessDriver(LoopSpec(*_config(tiny_model)))))
    try:
        async def run() -> BaseException:
            agen = engine.generate(EngineRequest("k", [1, 2, 3], _params(3000)))
            try:
                async for _ in agen:
                    os.kill(engine.driver.pid, signal.SIGKILL)
            except EngineDeadError as exc:
                return exc
            raise AssertionError("the stream ended without an error")
        error = loop.run(run())
        assert "exited" in str(error)
        assert not engine.is_alive and "died" in engine.health_problem()
        with pytest.raises(EngineDeadError):
            loop.run(_collect(engine, EngineRequest("after", [1, 2], _params(2))))
    finally:
        engine.shutdown()


def test_the_child_dies_with_its_parent(tiny_model, tmp_path) -> None:
    """A replica killed outright (SIGKILL: no shutdown runs) leaves no engine process behind."""
    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import asyncio, pathlib, time
        from stages.engine.driver.async_engine import AsyncEngine
        from stages.engine.driver.core_process import ChildProcessDriver
        from stages.engine.driver.messages import LoopSpec
        from stages.config import EngineSettings
        config = EngineSettings(weights="float32", num_threads=1, kv_cache_memory_gb=0.02)
        async def main():
            engine = AsyncEngine(ChildProcessDriver(LoopSpec({str(tiny_model)!r}, config)))
            await asyncio.to_thread(engine.start, asyncio.get_running_loop())
            pathlib.Path({str(pid_file)!r}).write_text(str(engine.driver.pid))
            await asyncio.sleep(600)
        asyncio.run(main())
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[4])
    try:
        for _ in range(1200):
            if pid_file.exists() and pid_file.read_text():
                break
            assert parent.poll() is None, "the parent exited early"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        os.kill(child, 0)  # alive
    finally:
        parent.kill()
        parent.wait()
    for _ in range(200):
        if not _running(child):
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the engine core process outlived its parent")


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped (an orphan's reaper may be slow, or absent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_the_replica_side_never_imports_torch() -> None:
    """With a core process the Engine replica's own process needs no torch: the child resolves
    ``device: auto`` and loads the model. (The replica would otherwise spend seconds of start-up
    and ~300 MB on an import it never uses.)"""
    code = textwrap.dedent("""
        import sys
        import stages.engine.deployment, stages.engine.driver.tracing
        from stages.config import EngineSettings
        from stages.engine.driver.async_engine import AsyncEngine
        from stages.engine.driver.interface import build_driver
        from stages.engine.driver.messages import LoopSpec
        config = EngineSettings()
        AsyncEngine(build_driver(LoopSpec("embedded:smollm2-135m-instruct", config), child_process=True))
        print(config.device, "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                         cwd=Path(__file__).resolve().parents[4])
    assert out.stdout.split() == ["auto", "False"], out.stderr[-2000:]
