"""Replica counts against offered load over time, on the multi-node test cluster.

    .venv/bin/python bench/experiments/bench_cluster.py        # ~3 min: runs tests/cluster/test_cluster.py's scaling test

Runs the cluster test's scale-up/scale-down scenario (tests/configs/cluster.yaml: CPU stages
autoscaling with small targets) with the timeline recorded, then plots Preprocess and Egress
replica counts (sampled from Ray's state API every 0.5 s) against the number of clients.
Writes bench/results/cluster_scaling.json and .png.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results"


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    timeline = OUT / "cluster_scaling.json"
    env = {**os.environ, "LIFECYCLE_CLUSTER_TIMELINE": str(timeline)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "tests/cluster/test_cluster.py", "-k",
                    "accelerator_node or scale_up"], cwd=ROOT, env=env, check=True)
    plot(json.loads(timeline.read_text()), OUT / "cluster_scaling.png")


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = data["samples"]
    fig, ax = plt.subplots(figsize=(7, 3.4), dpi=110)
    t = [s["t"] for s in samples]
    for name, style in (("Egress", "-"), ("Preprocess", "--"), ("Engine", ":")):
        ax.step(t, [s.get(name, 0) for s in samples], style, where="post", label=f"{name} replicas")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("replicas")
    ax.set_ylim(0, max(max(s.get("Egress", 0), s.get("Preprocess", 0)) for s in samples) + 1)
    ax.yaxis.get_major_locator().set_params(integer=True)
    load = data["load"] + [(t[-1], data["load"][-1][1])]
    ax2 = ax.twinx()
    ax2.step([x for x, _ in load], [c for _, c in load], color="grey", alpha=0.5, where="post",
             label="clients (offered load)")
    ax2.set_ylabel("concurrent clients")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)
    ax.set_title("CPU stages autoscaling on a 4-node Ray cluster (one 2-core machine)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
