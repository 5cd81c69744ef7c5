"""Shared fixtures and the session's rules.

- The real Serve app starts once per test session (it takes ~20-40 s here), in a Ray of its own
  whose files live in a temp dir removed at the end (kept when a test failed).
- Tests that use a Serve app get the ``serve`` marker; ``tests/unit`` may hold none of them.
- Tests under ``tests/gpu`` get the ``gpu`` marker, and ``gpu`` tests skip where CUDA is missing.
- Ray stops after the last test that uses it, so the tests that follow (cluster, parity, unit) do
  not share two cores with idle replicas. Apps are not deleted one by one before that: deleting
  an app reconfigures the HAProxy edge, which drops other apps' open connections.
- The session fails if it leaves a dead cluster address or a Ray process behind (tests/leftovers.py).
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import leftovers
from tests.otlp_receiver import OTLPReceiver
from tests.serve_harness import deploy_app, start_ray, stop_app

MODEL_NAME = "SmolLM2-135M-Instruct"

#: App configuration used by the integration tests: small limits so 413/429/heartbeats are
#: reachable quickly, tracing on to a real OTLP receiver. Float32 weights: many tests compare greedy
#: texts of requests that were batched differently (streamed vs not, alone vs concurrent, a retry vs
#: a clean run); float32 gives the same tokens whatever the batch, while the quantised paths
#: compute in bfloat16, where batch shape can flip a near-tie (their parity tests are separate).
TEST_ARGS: dict[str, Any] = {
    "model": "embedded:smollm2-135m-instruct",
    "engine": {"max_num_seqs": 8, "max_waiting_requests": 8, "max_num_batched_tokens": 256,
               "kv_cache_memory_gb": 0.5, "weights": "float32", "report_interval_s": 0.25},
    "http": {"max_body_bytes": 65536, "keepalive_interval_s": 0.5},
    "tracing": {"enabled": True, "sampling_ratio": 1.0},
}


#: The replicas test configuration: every stage at 2 replicas (the Directory too), CPU shares small
#: enough for 2 cores.
REPLICAS_ARGS: dict[str, Any] = {
    "model": "embedded:smollm2-135m-instruct",
    "engine": {"max_num_seqs": 8, "max_waiting_requests": 8, "max_num_batched_tokens": 256,
               "kv_cache_memory_gb": 0.25, "num_threads": 1, "report_interval_s": 0.5, "weights": "float32"},
    "http": {"max_body_bytes": 65536, "keepalive_interval_s": 0.5},
}
REPLICAS_OPTIONS: dict[str, dict[str, Any]] = {
    "Ingress": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.1}},
    "Preprocess": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.1}},
    "Egress": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.1}},
    "Engine": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}},
    "Directory": {"num_replicas": 2},
}


#: The fault tests' app (tests/app/test_faults.py): its replicas get killed, so it is nobody else's.
#: Small and quick to restart; the test-only step fault hook on; a small per-stream buffer so a
#: slow reader is cut quickly; Serve checks the engine's health every second, and an engine that
#: failed it (a hung step) is stopped after 2 s instead of the default config's 30 s drain.
FAULTS_ARGS: dict[str, Any] = {
    "model": "embedded:smollm2-135m-instruct",
    "engine": {"max_num_seqs": 16, "max_waiting_requests": 64, "max_num_batched_tokens": 256,
               "kv_cache_memory_gb": 0.25, "num_threads": 1, "report_interval_s": 0.25, "weights": "float32",
               "fault_injection": True, "stall_timeout_s": 5.0},
    "http": {"max_body_bytes": 65536, "keepalive_interval_s": 0.5, "max_stream_buffer_bytes": 16384,
             "slow_reader_grace_s": 30.0},
    # Every request through the Preprocess stage, whose replica these tests kill.
    "preprocess": {"inline_max_chars": 0},
}
FAULTS_OPTIONS: dict[str, dict[str, Any]] = {
    "Ingress": {"ray_actor_options": {"num_cpus": 0.1}},
    "Preprocess": {"ray_actor_options": {"num_cpus": 0.1}},
    "Egress": {"ray_actor_options": {"num_cpus": 0.1}},
    "Engine": {"ray_actor_options": {"num_cpus": 0.5}, "health_check_period_s": 1, "health_check_timeout_s": 10,
               "graceful_shutdown_timeout_s": 2},
}


#: API keys of the guarded app, fresh each session (so a leak into any log is unmistakable).
GUARDED_KEYS: dict[str, str] = {name: f"sk-{name}-{secrets.token_urlsafe(18)}"
                                for name in ("main", "other", "fuzz", "limited", "env")}
#: The guarded configuration: API keys (one of them only in the Ingress's LIFECYCLE_API_KEYS), only
#: /health open without one, 4 requests in flight per key, bodies up to the largest limit (3.5 MiB:
#: enough to reach the 4 MiB message limit between deployments), and max_tokens at most 4 so
#: fuzzing stays cheap. Quantised weights (the CPU default): nothing here compares greedy texts.
GUARDED_ARGS: dict[str, Any] = {
    "model": "embedded:smollm2-135m-instruct",
    "engine": {"max_num_seqs": 8, "max_waiting_requests": 64, "max_num_batched_tokens": 256,
               "kv_cache_memory_gb": 0.25, "num_threads": 1, "report_interval_s": 0.5},
    "http": {"max_body_bytes": 3670016, "keepalive_interval_s": 0.5, "max_tokens_limit": 4,
             "api_keys": [GUARDED_KEYS[k] for k in ("main", "other", "fuzz", "limited")],
             "auth_exempt_paths": ["/health"], "max_concurrent_requests_per_key": 4},
}
GUARDED_OPTIONS: dict[str, dict[str, Any]] = {
    "Ingress": {"ray_actor_options": {"num_cpus": 0.1,
                                      "runtime_env": {"env_vars": {"LIFECYCLE_API_KEYS": GUARDED_KEYS["env"]}}}},
    "Preprocess": {"ray_actor_options": {"num_cpus": 0.25}},
    "Egress": {"ray_actor_options": {"num_cpus": 0.1}},
    "Engine": {"ray_actor_options": {"num_cpus": 0.5}},
}


@dataclass
class ServeApp:
    url: str
    otlp: OTLPReceiver | None
    args: dict[str, Any]
    #: Ray's session directory.
    session_dir: str = ""
    #: The Ingress's per-request JSON-lines log (``http.request_log_file``).
    request_log: str = ""
    #: Serve application name.
    name: str = "lifecycle"

    def call(self, deployment: str, method: str, *args: Any) -> Any:
        """Call a deployment of this app through a Serve handle.

        With ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` a handle's router runs on the caller's event loop
        (``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP`` defaults to 0), so a blocking ``.result()`` from
        plain test code fails with "No event loop running". The call therefore runs on one private
        event loop thread, where each handle is created once and reused.
        """
        return asyncio.run_coroutine_threadsafe(_call(self.name, deployment, method, args),
                                                _handle_loop()).result(timeout=30)

    def directory_each(self, method: str, *args: Any) -> dict[str, Any]:
        """Ask every Directory replica: its id → its answer (or the exception it raised)."""
        return asyncio.run_coroutine_threadsafe(_directory_each(self.name, method, args), _handle_loop()).result(30)

    def engine_stats(self) -> dict[str, Any]:
        """One engine replica's own stats, straight from it (exact for a one-engine app)."""
        return self.call("Engine", "stats")

    def engine_reports(self) -> list[Any]:
        """Every engine replica's latest report to the Directory (at most a report period old)."""
        return self.call("Directory", "engines")

    def wait_engines_idle(self, engines: int, timeout: float = 120.0, *, directory_empty: bool = False) -> list[Any]:
        """Wait until ``engines`` healthy engine replicas report nothing running, waiting or
        streaming and every KV block free (and, with ``directory_empty``, no live request in the
        Directory); returns their reports."""
        deadline = time.monotonic() + timeout
        while True:
            reports = [r for r in self.engine_reports() if r.healthy]
            idle = len(reports) == engines and all(
                r.stats["num_running"] == 0 and r.stats["num_waiting"] == 0 and r.stats.get("num_streams", 0) == 0
                and r.stats["num_free_blocks"] == r.stats["num_kv_blocks"] for r in reports)
            if idle and (not directory_empty or self.call("Directory", "num_live") == 0):
                return reports
            if time.monotonic() > deadline:
                live = self.call("Directory", "live_entries")
                raise AssertionError(f"not idle after {timeout} s: live {live}; engines {[r.stats for r in reports]}")
            time.sleep(0.1)


_LOOP: asyncio.AbstractEventLoop | None = None
_HANDLES: dict[tuple[str, str], Any] = {}


def _handle_loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
        threading.Thread(target=_LOOP.run_forever, name="serve-handle-loop", daemon=True).start()
    return _LOOP


async def _call(app: str, deployment: str, method: str, args: tuple[Any, ...]) -> Any:
    from ray import serve

    from stages.directory.client import DirectoryClient

    key = (app, deployment)
    if key not in _HANDLES:
        handle = serve.get_deployment_handle(deployment, app_name=app)
        # The Directory may run several replicas: its client sends a change to each, a question to one.
        _HANDLES[key] = DirectoryClient(handle) if deployment == "Directory" else handle
    if deployment == "Directory":
        return await getattr(_HANDLES[key], method)(*args)
    return await getattr(_HANDLES[key], method).remote(*args)


async def _directory_each(app: str, method: str, args: tuple[Any, ...]) -> dict[str, Any]:
    await _call(app, "Directory", "ping", ())
    return await _HANDLES[(app, "Directory")].each(method, *args)


@pytest.fixture(scope="session")
def serve_session(request: pytest.FixtureRequest) -> Iterator[str]:
    """One Ray session (and Serve's edge) for every app the tests start. Ray's session and logs go
    to a temp dir of its own, removed at the end unless a test failed (HAProxy's files too, where
    Serve keeps them: :func:`tests.serve_harness.stop_app`)."""
    temp_dir = tempfile.mkdtemp(prefix="lifecycle-ray-")
    _, session_dir = start_ray(temp_dir=temp_dir)
    try:
        yield session_dir
    finally:
        stop_app(keep_dir=request.session.testsfailed > 0)


def _request_log(factory: pytest.TempPathFactory, name: str) -> str:
    """A fresh path for an app's per-request log, in pytest's temp dir (it keeps the last 3 sessions')."""
    return str(factory.mktemp(f"requests-{name}") / "requests.jsonl")


@pytest.fixture(scope="session")
def serve_app(serve_session: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeApp]:
    otlp = OTLPReceiver()
    request_log = _request_log(tmp_path_factory, "lifecycle")
    args = {**TEST_ARGS, "tracing": {**TEST_ARGS["tracing"], "otlp_endpoint": otlp.endpoint},
            "http": {**TEST_ARGS["http"], "request_log_file": request_log}}
    url = deploy_app(args)
    try:
        yield ServeApp(url=url, otlp=otlp, args=args, session_dir=serve_session, request_log=request_log)
    finally:
        otlp.close()


def _named_app(session_dir: str, base_args: dict[str, Any], name: str,
               options: dict[str, dict[str, Any]], request_log: str) -> ServeApp:
    """Deploy one more app into the session's Ray/Serve (name ``name`` at ``/name``), with its own
    request log."""
    args = {**base_args, "http": {**base_args["http"], "request_log_file": request_log}}
    url = deploy_app(args, name=name, route_prefix=f"/{name}", options=options)
    return ServeApp(url=url, otlp=None, args=args, session_dir=session_dir, request_log=request_log, name=name)


@pytest.fixture(scope="session")
def serve_app_replicas(serve_session: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeApp]:
    """The app with every stage at 2 replicas (its own name and route prefix, same Ray session)."""
    yield _named_app(serve_session, REPLICAS_ARGS, "replicas", REPLICAS_OPTIONS,
                     _request_log(tmp_path_factory, "replicas"))


@pytest.fixture(scope="session")
def fault_app(serve_session: str) -> Iterator[ServeApp]:
    """The fault tests' own app (its replicas get killed): name ``faults``, route ``/faults``."""
    url = deploy_app(FAULTS_ARGS, name="faults", route_prefix="/faults", options=FAULTS_OPTIONS)
    yield ServeApp(url=url, otlp=None, args=FAULTS_ARGS, session_dir=serve_session, name="faults")


@pytest.fixture(scope="session")
def serve_app_guarded(serve_session: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeApp]:
    """The app with API keys and fuzzing-friendly limits (own name and route prefix, same Ray session)."""
    yield _named_app(serve_session, GUARDED_ARGS, "guarded", GUARDED_OPTIONS,
                     _request_log(tmp_path_factory, "guarded"))


#: The tool-calling app: a tiny random-weight model with a tools-aware template (tests/tools_model.py).
TOOLS_ARGS: dict[str, Any] = {
    "engine": {"max_num_seqs": 4, "max_waiting_requests": 8, "max_num_batched_tokens": 256,
               "kv_cache_memory_gb": 0.05, "num_threads": 1, "weights": "float32", "report_interval_s": 0.5},
    "http": {"max_body_bytes": 65536, "keepalive_interval_s": 0.5},
}
TOOLS_OPTIONS: dict[str, dict[str, Any]] = {
    name: {"ray_actor_options": {"num_cpus": 0.1}} for name in ("Ingress", "Preprocess", "Egress", "Engine")}


@pytest.fixture(scope="session")
def serve_app_tools(serve_session: str) -> Iterator[ServeApp]:
    """The app serving the tiny tools model (its own name and route prefix, same Ray session)."""
    from stages.model_info import cache_root
    from tests.tools_model import build_tools_model

    model_dir = build_tools_model(cache_root() / "test-models" / "tiny-hermes-tools")
    args = {**TOOLS_ARGS, "model": str(model_dir), "served_model_name": "tiny-tools"}
    url = deploy_app(args, name="tools", route_prefix="/tools", options=TOOLS_OPTIONS)
    yield ServeApp(url=url, otlp=None, args=args, session_dir=serve_session, name="tools")


#: Fixtures that start a real Serve app.
SERVE_FIXTURES = {"serve_app", "serve_app_replicas", "fault_app", "serve_app_guarded", "serve_app_tools"}
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that use a real Serve app get the ``serve`` marker (``-m "not serve"`` skips them), and
    ``tests/unit`` may hold none of them (nor any ``cluster`` test): it is the loop that runs
    without Ray Serve. Tests under ``tests/gpu`` get the ``gpu`` marker; ``gpu`` tests skip where
    torch sees no CUDA device."""
    misplaced, gpu_items = [], []
    for item in items:
        if SERVE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.serve)
        path = Path(str(item.path))
        if path.is_relative_to(TESTS / "gpu"):
            item.add_marker(pytest.mark.gpu)
        if path.is_relative_to(TESTS / "unit") and (item.get_closest_marker("serve")
                                                    or item.get_closest_marker("cluster")):
            misplaced.append(item.nodeid)
        if item.get_closest_marker("gpu"):
            gpu_items.append(item)
    if misplaced:
        raise pytest.UsageError("tests/unit must run without a Serve app or a cluster; move these to "
                                "tests/app or tests/cluster:\n  " + "\n  ".join(misplaced))
    if gpu_items:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA device (torch sees none)")
            for item in gpu_items:
                item.add_marker(skip)


_ADDRESS_BEFORE = pytest.StashKey[str | None]()
#: The id of the last test that uses Ray (a Serve app or the session itself).
_LAST_RAY_TEST = pytest.StashKey[str]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Find, among the tests that will run, the last that uses Ray."""
    ray_fixtures = SERVE_FIXTURES | {"serve_session"}
    users = [item.nodeid for item in session.items if ray_fixtures & set(getattr(item, "fixturenames", ()))]
    session.config.stash[_LAST_RAY_TEST] = users[-1] if users else ""


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test that uses Ray (its module fixtures torn down too), stop it; the session
    fixture's own finalizer then finds nothing left to do."""
    yield
    if item.nodeid == item.config.stash.get(_LAST_RAY_TEST, None):
        stop_app(keep_dir=item.session.testsfailed > 0)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session if it left a dead cluster address or a Ray process behind."""
    found = leftovers.problems(session.config.stash.get(_ADDRESS_BEFORE, None))
    if not found:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.section("the session left state behind", sep="=", red=True, bold=True)
        for line in found:
            reporter.line(line, red=True)
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
