"""Generate the RayService's ``serveConfigV2`` from ``serve_config.yaml`` (``make k8s``).

    python k8s/render_rayservice.py           # rewrite the serveConfigV2 block of k8s/rayservice.yaml
    python k8s/render_rayservice.py --check   # exit 1 when that block is not what this would write

``serve_config.yaml`` is the single source of the application: its ``args``, deployment names and
every deployment option are copied verbatim. Only what differs between one 2-core machine and a
cluster is overridden here (``CLUSTER_*`` below), and only these fields, which is exactly what
``tests/unit/test_deploy_files.py`` allows to differ ("in sync", issue 8):

- replica counts: ``num_replicas`` (for a deployment with a fixed count);
- autoscaling bounds: ``min_replicas`` / ``max_replicas`` / ``initial_replicas`` inside an
  ``autoscaling_config`` that serve_config.yaml already has (its targets, delays and policy stay);
- resources: ``num_cpus``, ``num_gpus``, ``memory``, ``resources`` in ``ray_actor_options``;
- outside the application: ``proxy_location`` and ``http_options`` (bind 0.0.0.0 in the pod).

Placement: the Engine asks for ``num_gpus: 1`` (so it lands on the GPU worker group, one replica
per GPU); every other deployment asks for one unit of the custom resource ``cpu_stage``, which only
the CPU worker group advertises, so CPU stages never take a GPU node's CPUs and the autoscaler
adds CPU pods, not GPU pods, for them. The head advertises no CPUs: it runs GCS, the Serve
controller and a proxy only.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIG = ROOT / "serve_config.yaml"
RAYSERVICE = ROOT / "k8s" / "rayservice.yaml"

#: The custom Ray resource that only the CPU worker group advertises (see k8s/rayservice.yaml).
CPU_STAGE_RESOURCE = "cpu_stage"
#: Fields a deployment may differ in between serve_config.yaml and the RayService.
REPLICA_KEYS = ("num_replicas",)
AUTOSCALING_BOUND_KEYS = ("min_replicas", "max_replicas", "initial_replicas")
RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type")

#: Top-level Serve settings for the cluster: a proxy on every node, reachable from the pod network.
#: keep_alive_timeout_s above the ingress controller's upstream keep-alive (nginx: 60 s), so the
#: proxy never closes a connection nginx is about to reuse.
CLUSTER_TOP = {"proxy_location": "EveryNode"}
CLUSTER_HTTP = {"host": "0.0.0.0", "keep_alive_timeout_s": 75}

#: Per deployment: ``replicas`` when serve_config.yaml fixes a count, ``bounds`` when it autoscales,
#: ``resources`` always (they replace every RESOURCE_KEYS entry of ray_actor_options).
_CPU_STAGE = {"replicas": 2, "bounds": {"min_replicas": 2, "max_replicas": 12},
              "resources": {"num_cpus": 1, "resources": {CPU_STAGE_RESOURCE: 1}}}
CLUSTER_DEPLOYMENTS: dict[str, dict] = {
    "Ingress": _CPU_STAGE,
    "Preprocess": _CPU_STAGE,
    "Egress": _CPU_STAGE,
    # Live requests (cancel by id, resume) and replica reports: every replica holds all of it, so
    # two keep cancels and /health answering while one is replaced (a node lost).
    "Directory": {"replicas": 2, "bounds": {"min_replicas": 2, "max_replicas": 2},
                  "resources": {"num_cpus": 0.25, "resources": {CPU_STAGE_RESOURCE: 1}}},
    # One engine replica per GPU; max_replicas equals the GPU worker group's maxReplicas.
    "Engine": {"replicas": 1, "bounds": {"min_replicas": 1, "max_replicas": 4},
               "resources": {"num_cpus": 2, "num_gpus": 1}},
}
#: A deployment serve_config.yaml gains later is a CPU stage until it is listed above.
CLUSTER_DEFAULT = _CPU_STAGE


def cluster_deployment(d: dict) -> dict:
    """One serve_config.yaml deployment block with the cluster's counts, bounds and resources."""
    out = copy.deepcopy(d)
    o = CLUSTER_DEPLOYMENTS.get(d["name"], CLUSTER_DEFAULT)
    if "autoscaling_config" in out:
        auto = out["autoscaling_config"]
        auto["min_replicas"] = o["bounds"]["min_replicas"]
        auto["max_replicas"] = o["bounds"]["max_replicas"]
        if "initial_replicas" in auto:
            auto["initial_replicas"] = o["bounds"]["min_replicas"]
        # num_replicas may only be absent or "auto" beside an autoscaling_config: leave it.
    else:
        out["num_replicas"] = o["replicas"]
    actor = {k: v for k, v in out.get("ray_actor_options", {}).items() if k not in RESOURCE_KEYS}
    out["ray_actor_options"] = {**actor, **copy.deepcopy(o["resources"])}
    return out


def render(serve_config: dict) -> dict:
    """The RayService's Serve config: serve_config.yaml with the cluster overrides applied."""
    cfg = copy.deepcopy(serve_config)
    cfg.update(copy.deepcopy(CLUSTER_TOP))
    cfg["http_options"] = {**cfg.get("http_options", {}), **CLUSTER_HTTP}
    for app in cfg["applications"]:
        app["deployments"] = [cluster_deployment(d) for d in app.get("deployments", [])]
    return cfg


HEADER = (
    "# GENERATED from serve_config.yaml by `make k8s` (k8s/render_rayservice.py): edit those, not\n"
    "# this block. Differs from serve_config.yaml only in replica counts, autoscaling bounds,\n"
    "# resources (num_gpus: 1 for Engine, cpu_stage for the rest), proxy_location and http_options.\n"
)


def render_block(serve_config: dict, indent: str = "    ") -> str:
    text = HEADER + yaml.safe_dump(render(serve_config), sort_keys=False, default_flow_style=False, width=100)
    return "".join(indent + line if line.strip() else line for line in text.splitlines(keepends=True))


def splice(manifest: str, block: str) -> str:
    """``manifest`` with the body of its ``serveConfigV2: |`` block scalar replaced by ``block``."""
    lines = manifest.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.rstrip() == "  serveConfigV2: |"]
    if len(starts) != 1:
        raise SystemExit(f"{RAYSERVICE}: expected one line '  serveConfigV2: |', found {len(starts)}")
    start = starts[0] + 1
    end = start
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith("    ")):
        end += 1
    while end > start and not lines[end - 1].strip():  # keep blank lines before the next key
        end -= 1
    return "".join(lines[:start]) + block + "".join(lines[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if k8s/rayservice.yaml is stale")
    args = parser.parse_args(argv)
    serve_config = yaml.safe_load(SERVE_CONFIG.read_text())
    current = RAYSERVICE.read_text()
    wanted = splice(current, render_block(serve_config))
    if args.check:
        if wanted != current:
            print(f"{RAYSERVICE.relative_to(ROOT)} is stale: run `make k8s`", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        RAYSERVICE.write_text(wanted)
        print(f"wrote {RAYSERVICE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
