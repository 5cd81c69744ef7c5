"""Machine-generated hostile input: schemathesis fuzzes the running app from its own ``/openapi.json``.

Every operation of the document gets valid (positive) and invalid (negative) requests generated from
its schemas, sent to the guarded app (tests/conftest.py: keys on, ``max_tokens`` at most 4 so
generation stays cheap). Checks: no 5xx (``not_a_server_error``), every response matches the
document (``response_schema_conformance``), and every error is in the OpenAI shape
(``{"error": {"message", "type", "param", "code"}}``); a streamed 200 ends with ``[DONE]``.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.conftest import GUARDED_KEYS, MODEL_NAME, ServeApp

pytestmark = pytest.mark.serve

#: Generated cases per operation and mode: (positive, negative). The generating routes get more.
#: The GET routes take no input, so there is nothing invalid to generate for them.
EXAMPLES = {"POST": (100, 50), "GET": (3, 0)}


def _check_error_shape(case: Any, response: Any) -> None:
    if response.status_code < 400:
        return
    body = json.loads(response.content)
    assert isinstance(body, dict) and set(body) == {"error"}, (case.operation.label, response.content[:300])
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]


def _check_stream(case: Any, response: Any) -> None:
    if response.status_code == 200 and response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        assert not response.stream_cut_short
        raw = response.content.decode("utf-8")
        events = [line for line in raw.split("\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", (case.body, raw[-600:])
        for event in events[:-1]:
            assert isinstance(json.loads(event[len("data: "):]), dict)


def _fuzz(op: Any, mode: GenerationMode, examples: int, url: str, auth: dict[str, str],
          statuses: Counter[int]) -> int:
    """Run ``examples`` generated cases of one operation; returns how many ran."""
    ran = 0

    @settings(max_examples=examples, deadline=None, phases=[Phase.generate], database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        nonlocal ran
        response = case.call(base_url=url, headers=auth, timeout=60)
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
        _check_error_shape(case, response)
        _check_stream(case, response)
        ran += 1
        statuses[response.status_code] += 1
        if os.environ.get("FUZZ_DEBUG") and response.status_code >= 400:
            print(op.label, mode.value, response.status_code, json.loads(response.content)["error"]["message"][:120])

    run()
    return ran


def test_schemathesis_fuzzing_finds_no_server_error(serve_app_guarded: ServeApp) -> None:
    auth = {"Authorization": f"Bearer {GUARDED_KEYS['fuzz']}"}
    doc = httpx.get(serve_app_guarded.url + "/openapi.json", headers=auth, timeout=30).json()
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["max_tokens"]["anyOf"][0]["maximum"] == 4 and props["n"]["maximum"] == 8  # the real bounds
    assert props["model"]["enum"] == [MODEL_NAME]
    # Whole streams are read (n=8 with 4 tokens each is 42 events; schemathesis stops at 20 by default).
    schema = schemathesis.openapi.from_dict(doc, config=SchemathesisConfig.from_dict({"max-stream-events": 100}))
    cases: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        op = result.ok()
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        for mode, examples in zip(modes, EXAMPLES[op.method.upper()], strict=True):
            if examples:
                cases[f"{op.label} {mode.value}"] = _fuzz(op, mode, examples, serve_app_guarded.url, auth, statuses)
    total = sum(cases.values())
    print(f"schemathesis: {total} generated cases in {time.monotonic() - t0:.1f} s; statuses {dict(statuses)}")
    for name, n in sorted(cases.items()):
        print(f"  {name}: {n}")
    assert total >= 400 and statuses[200] >= 100 and statuses[400] >= 50  # it reached both outcomes, often
    assert not any(s >= 500 for s in statuses)


def test_openapi_of_the_keyless_app_bounds_max_tokens_by_the_context(serve_app: ServeApp) -> None:
    doc = httpx.get(serve_app.url + "/openapi.json", timeout=30).json()  # no key needed: keys are off
    context = httpx.get(serve_app.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert props["max_tokens"]["anyOf"][0]["maximum"] == context - 1 and "security" not in doc
    assert doc["openapi"].startswith("3.")
