"""What one CPU-stage replica costs: resident memory (RSS, USS) and time from deploy to first served request.

    .venv/bin/python bench/experiments/bench_cpu_replica.py [--rounds 3] [--tokenizer] [--stages floor,preprocess,egress,...]

Starts its own Ray session (never touches another one), then per round and per stage deploys a
one-deployment Serve app holding only that stage (``num_replicas: 1``), times ``serve.run`` → the
first successful request, reads the replica process's RSS and USS with psutil (found by its process
title ``ray::ServeReplica:<unique app>:<deployment>``), and deletes the app. Stages:

* ``floor``: a deployment with an empty body: what ray + serve alone cost in a replica;
* ``preprocess``: the real ``PreprocessDeployment`` (first request: ``tokenize`` of a chat);
* ``egress``: the real ``EgressDeployment`` given a handle to a stub engine that runs in an app of
  its own, started once (first request: ``ping``; its
  tokenizer is loaded in ``__init__``, so the replica is complete when it answers);
* ``preprocess-hf``, ``egress-hf``: the same two stages loading transformers' ``AutoTokenizer``, as
  they did before ``stages/tokenizer.py`` (the "before" column, side by side in one session).

``--tokenizer`` also loads the tokenizer alone in fresh Python processes (no Ray), transformers'
``AutoTokenizer`` next to the CPU stages' :class:`stages.tokenizer.Tokenizer`, alternating.
Writes ``bench/results/cpu_replica[-<label>].json``; prints a Markdown table of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ray import serve  # noqa: E402

from stages.model_info import EMBEDDED_MODEL  # noqa: E402


@serve.deployment(name="Floor", ray_actor_options={"num_cpus": 0.25})
class Floor:
    """A replica that imports nothing beyond ray and serve (defined in ``__main__``: pickled by value)."""

    async def ping(self) -> bool:
        return True


@serve.deployment(name="StubEngine", ray_actor_options={"num_cpus": 0.25})
class StubEngine:
    """Stands in for the engine so Egress can be deployed alone."""

    async def ping(self) -> bool:
        return True


_STUB: dict[str, Any] = {}


def _stub_engine() -> Any:
    """A handle to a stub engine in its own app, started once: Egress's time to ready is its own."""
    if "handle" not in _STUB:
        _STUB["handle"] = serve.run(StubEngine.bind(), name=f"cpurep{os.getpid()}stub", route_prefix=None)
    return _STUB["handle"]


def _replica_pid(app: str, deployment: str, timeout_s: float = 10) -> int:
    import psutil

    needle = f"ServeReplica:{app}:{deployment}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if needle in " ".join(proc.info["cmdline"] or []):
                return int(proc.info["pid"])
        time.sleep(0.2)
    raise RuntimeError(f"no process titled {needle}")


def _memory(pid: int) -> dict[str, float]:
    import psutil

    full = psutil.Process(pid).memory_full_info()
    return {"rss_mb": round(full.rss / 2**20, 1), "uss_mb": round(full.uss / 2**20, 1)}


def _build(stage: str, model: str) -> tuple[Any, str, Any]:
    """(application, deployment name, first request given a handle)."""
    if stage == "floor":
        return Floor.bind(), "Floor", lambda h: h.ping.remote().result()
    if stage == "preprocess":
        from stages.preprocess.deployment import PreprocessDeployment

        body = {"prompt": None, "messages": [{"role": "user", "content": "Hello there"}],
                "add_generation_prompt": True, "add_special_tokens": False}
        return (PreprocessDeployment.options(num_replicas=1).bind(model, 0, None, None), "Preprocess",
                lambda h: list(h.options(stream=True).tokenize.remote(body)))  # replies in parts
    if stage == "egress":
        from stages.egress.deployment import EgressDeployment

        return (EgressDeployment.options(num_replicas=1).bind(_stub_engine(), model, None), "Egress",
                lambda h: h.ping.remote().result())
    if stage in ("preprocess-hf", "egress-hf"):
        return _build_hf(stage, model)
    raise ValueError(stage)


def _build_hf(stage: str, model: str) -> tuple[Any, str, Any]:
    """The same stage with transformers' AutoTokenizer, as every CPU stage loaded it before
    ``stages/tokenizer.py``: the "before" column, measured side by side in the same Ray session."""
    from stages.egress.deployment import EgressDeployment
    from stages.preprocess.deployment import PreprocessDeployment

    def with_transformers() -> None:
        import stages.model_info
        import stages.preprocess.preprocessor

        stages.model_info.load_cpu_tokenizer = stages.model_info.load_tokenizer  # in this replica only
        stages.preprocess.preprocessor.load_cpu_tokenizer = stages.model_info.load_tokenizer

    if stage == "preprocess-hf":
        class PreprocessHF(PreprocessDeployment.func_or_class):  # type: ignore[name-defined,misc]
            def __init__(self, *args: Any) -> None:
                with_transformers()
                super().__init__(*args)

        _, _, first = _build("preprocess", model)
        return (serve.deployment(PreprocessHF, name="PreprocessHF", ray_actor_options={"num_cpus": 0.25})
                .bind(model, 0, None, None), "PreprocessHF", first)

    class EgressHF(EgressDeployment.func_or_class):  # type: ignore[name-defined,misc]
        async def __init__(self, *args: Any) -> None:
            with_transformers()
            await super().__init__(*args)

    return (serve.deployment(EgressHF, name="EgressHF", ray_actor_options={"num_cpus": 0.25})
            .bind(_stub_engine(), model, None), "EgressHF", lambda h: h.ping.remote().result())


def one_replica(stage: str, model: str, tag: str) -> dict[str, Any]:
    app_obj, deployment, first = _build(stage, model)
    app = f"cpurep{os.getpid()}{tag}"
    t0 = time.perf_counter()
    handle = serve.run(app_obj, name=app, route_prefix=None)
    t_running = time.perf_counter() - t0
    first(handle)
    ready = time.perf_counter() - t0
    pid = _replica_pid(app, deployment)
    mem = _memory(pid)
    serve.delete(app)
    return {"stage": stage, "ready_s": round(ready, 2), "running_s": round(t_running, 2), **mem}


TOKENIZER_SNIPPETS = {
    "transformers.AutoTokenizer": "from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained(d)",
    "stages.tokenizer.Tokenizer": "from stages.tokenizer import Tokenizer; t = Tokenizer.from_dir(d)",
}


def tokenizer_alone(model_dir: str, name: str) -> dict[str, Any]:
    """Load one tokenizer in a fresh interpreter; its wall time, RSS and USS, and whether torch came in."""
    code = ("import time, sys, json; t0 = time.perf_counter(); d = sys.argv[1]\n"
            f"{TOKENIZER_SNIPPETS[name]}\n"
            "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False, add_generation_prompt=True)\n"
            "dt = time.perf_counter() - t0\n"
            "import psutil; m = psutil.Process().memory_full_info()\n"
            "print(json.dumps({'load_s': round(dt, 2), 'rss_mb': round(m.rss / 2**20, 1), "
            "'uss_mb': round(m.uss / 2**20, 1), 'torch': 'torch' in sys.modules, "
            "'transformers': 'transformers' in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code, model_dir], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    return {"tokenizer": name, **json.loads(out.stdout.strip().splitlines()[-1])}


def median_rows(rows: list[dict[str, Any]], key: str, fields: list[str]) -> list[dict[str, Any]]:
    out = []
    for name in dict.fromkeys(r[key] for r in rows):
        mine = [r for r in rows if r[key] == name]
        out.append({key: name, "n": len(mine),
                    **{f: round(statistics.median(r[f] for r in mine), 2) for f in fields}})
    return out


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stages", default="floor,preprocess,egress,preprocess-hf,egress-hf")
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--tokenizer", action="store_true", help="also load each tokenizer alone, without Ray")
    p.add_argument("--no-serve", action="store_true", help="skip the Serve replicas (with --tokenizer)")
    p.add_argument("--label", default="")
    args = p.parse_args()

    from stages.model_info import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model))  # convert the embedded model here, not in a replica
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg(),
                    "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True, cwd=ROOT).stdout.strip()},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    if args.tokenizer:
        rows = [tokenizer_alone(model_dir, name) for _ in range(args.rounds) for name in TOKENIZER_SNIPPETS]
        result["tokenizer_alone"] = rows
        result["tokenizer_alone_median"] = median_rows(rows, "tokenizer", ["load_s", "rss_mb", "uss_mb"])
        print(table(result["tokenizer_alone_median"], ["tokenizer", "n", "load_s", "rss_mb", "uss_mb"]))
    if not args.no_serve:
        import ray

        from tests.serve_harness import SERVE_ENV

        for key, value in SERVE_ENV.items():
            os.environ.setdefault(key, value)
        # address="local": a new session of our own, never a cluster someone else started with `ray start`.
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": dict(SERVE_ENV)})
        serve.start(http_options={"location": "NoServer"})
        rows = []
        stages = [s for s in args.stages.split(",") if s]
        try:
            for r in range(args.rounds):
                for stage in stages:  # interleaved, so drift in machine load hits every stage alike
                    row = one_replica(stage, args.model, f"{stage}{r}")
                    print(row, flush=True)
                    rows.append(row)
                    result["replicas"] = rows
                    save(result, args.label)  # a session killed midway (someone's `ray stop`) keeps its rows
        finally:
            serve.shutdown()
            ray.shutdown()
        result["replicas"] = rows
        result["replica_median"] = median_rows(rows, "stage", ["ready_s", "running_s", "rss_mb", "uss_mb"])
        print(table(result["replica_median"], ["stage", "n", "ready_s", "running_s", "rss_mb", "uss_mb"]))
    save(result, args.label)


def save(result: dict[str, Any], label: str) -> None:
    out = ROOT / "bench" / "results" / f"cpu_replica{'-' + label if label else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
