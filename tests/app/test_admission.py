"""Batched admission in the real app (stages/transport/admission.py): the Engine's ``submit`` through a
Serve handle, and streamed requests over HTTP going through batch calls on both hops."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import httpx

from stages.engine.core.errors import RequestRejectedError
from stages.errors import unwrap_error
from stages.transport.messages import (
    AbortRequest,
    AdmissionBatch,
    ChannelAttach,
    EngineOutput,
    EngineRequest,
    SamplingParams,
)
from tests.app.test_cancellation import assert_no_leaks, wait_idle
from tests.app.test_streaming import SSE, check_framing, stream_sse, streamed_text
from tests.conftest import MODEL_NAME, _handle_loop


def _request(prompt: list[int], max_tokens: int) -> EngineRequest:
    # consumer "" : no liveness watch (no actor has that name), the mailbox is keyed by "".
    return EngineRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt,
                         sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                         consumer="")


async def _submit_and_drain(app: str, batch: list[EngineRequest], abort_after_first: str | None = None,
                            ) -> tuple[list[Any], dict[str, list[EngineOutput]]]:
    """One ``submit`` call for ``batch``; then the consumer's channel until every accepted request
    has its final output (aborting ``abort_after_first`` once it has a token)."""
    from ray import serve

    engine = serve.get_deployment_handle("Engine", app_name=app)
    replies = await engine.submit.remote(AdmissionBatch(batch))
    accepted = {req.request_id: reply for req, reply in zip(batch, replies, strict=True) if reply.error is None}
    outs: dict[str, list[EngineOutput]] = {rid: [] for rid in accepted}
    if not accepted:
        return replies, outs
    replica = next(iter(accepted.values())).item[0].replica
    gen = engine.options(stream=True).attach.remote(ChannelAttach(replica, ""))
    aborted = False
    try:
        async for item in gen:
            for out in item.items:
                outs.setdefault(out.request_id, []).append(out)
            if abort_after_first and not aborted and any(o.new_token_ids for o in outs[abort_after_first]):
                aborted = True
                await engine.abort.remote(AbortRequest(replica, [abort_after_first]))
            if all(o and o[-1].finish_reason for o in outs.values()):
                break
    finally:
        gen.cancel()
    return replies, outs


def _run(coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, _handle_loop()).result(timeout=120)


def test_one_submit_call_admits_each_request_on_its_own_and_streams_them_through_the_channel(serve_app: Any) -> None:
    """Three requests in one call: each gets its own answer (a bad one is refused alone, with the
    engine's own error), the accepted ones' tokens come through the channel, each exactly its
    own (the same as when run alone); a request aborted by id ends with ``abort``; nothing leaks."""
    before = wait_idle(serve_app)
    a, b = _request([1, 2, 3, 4, 5, 6, 7, 8], 12), _request([9, 10, 11, 12], 12)
    bad = _request([10**9], 4)  # no such token
    long = _request([13, 14, 15, 16], 400)
    replies, outs = _run(_submit_and_drain(serve_app.name, [a, bad, b, long], abort_after_first=long.request_id))
    assert [r.error is None for r in replies] == [True, False, True, True]
    assert isinstance(unwrap_error(replies[1].error), RequestRejectedError), replies[1].error
    for req, reply in zip((a, b, long), (replies[0], replies[2], replies[3]), strict=True):
        first = reply.item[0]
        assert first.request_id == req.request_id and first.num_prompt_tokens == len(req.prompt_token_ids)
        assert first.replica
    tokens = {rid: [t for o in seq for t in o.new_token_ids] for rid, seq in outs.items()}
    assert outs[a.request_id][-1].finish_reason == "length" and len(tokens[a.request_id]) == 12
    assert outs[b.request_id][-1].finish_reason == "length" and len(tokens[b.request_id]) == 12
    assert outs[long.request_id][-1].finish_reason == "abort" and len(tokens[long.request_id]) < 400
    # Alone, each request gets the same tokens (float32 weights: batch shape does not matter).
    for req in (a, b):
        _, alone = _run(_submit_and_drain(serve_app.name, [_request(req.prompt_token_ids, 12)]))
        assert [t for o in next(iter(alone.values())) for t in o.new_token_ids] == tokens[req.request_id]
    stats = wait_idle(serve_app)
    assert_no_leaks(stats)
    assert stats["admission_calls"] - before["admission_calls"] == 3
    assert stats["admission_requests"] - before["admission_requests"] == 6
    deadline = time.monotonic() + 10
    while serve_app.engine_stats()["admitted_streams"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert serve_app.engine_stats()["admitted_streams"] == 0


def test_concurrent_streamed_requests_are_admitted_in_shared_calls_on_both_hops(serve_app: Any) -> None:
    """Eight streamed requests at once over HTTP: every one reaches the engine through a batch
    call (none through a stream of its own), fewer calls than requests went out, each client got
    its own text, and once idle no admitted job or stream is left on Egress or the engine."""
    prompts = [f"Write the number {i} in words, then count down from {i + 9}:" for i in range(8)]
    body = {"model": MODEL_NAME, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    alone = [httpx.post(serve_app.url + "/v1/completions", json={**body, "prompt": p}, timeout=120).json()
             ["choices"][0]["text"] for p in prompts]
    before_engine = wait_idle(serve_app)
    before_egress = serve_app.call("Egress", "stats")
    results: dict[int, SSE] = {}
    barrier = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        barrier.wait()
        results[i] = stream_sse(serve_app.url, "/v1/completions", {**body, "prompt": prompts[i], "stream": True})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i in range(len(prompts)):
        check_framing(results[i], "completion", include_usage=False)
        assert streamed_text(results[i], "completion") == alone[i], f"stream {i} got other tokens"
    engine = wait_idle(serve_app)
    egress = serve_app.call("Egress", "stats")
    sent = engine["admission_requests"] - before_engine["admission_requests"]
    calls = engine["admission_calls"] - before_engine["admission_calls"]
    assert sent == len(prompts), (sent, calls)
    assert egress["engine_admission_requests"] - before_egress["engine_admission_requests"] == len(prompts)
    assert calls < sent, f"{sent} requests in {calls} calls: no two were admitted together"
    deadline = time.monotonic() + 10
    while (egress["admitted_jobs"] or egress["open_engine_calls"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        egress = serve_app.call("Egress", "stats")
    assert egress["admitted_jobs"] == 0 and egress["open_engine_calls"] == 0, egress
    assert_no_leaks(engine)
