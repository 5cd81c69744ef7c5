"""Serve the app as ``serve_config.yaml`` describes it (its args and its per-deployment options:
autoscaling, CPU shares) on a free loopback port (not 8000) until interrupted, for running
``python -m bench`` against it. Prints the URL (and writes it to ``--url-file``).

    .venv/bin/python bench/experiments/serve_local.py --url-file /tmp/bench_url &
    .venv/bin/python -m bench client --url "$(cat /tmp/bench_url)"
    kill %1   # SIGTERM/SIGINT: shuts Serve and Ray down

To serve the last commit while the working tree is being edited, run it from an export:
``git archive HEAD | tar -x -C /tmp/head && cd /tmp/head && /work/main/.venv/bin/python bench/experiments/serve_local.py``.
"""

from __future__ import annotations

import argparse
import copy
import signal
import sys
import threading
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "serve_config.yaml"))
    p.add_argument("--url-file", default="")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one app arg, e.g. --set engine.report_interval_s=0.1 (value parsed as YAML)")
    p.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE",
                   help="also serve a second app under /variant that differs in these args (an A/B in one "
                        "Ray: e.g. `python -m bench compare --url URL --peer-url URL/variant`)")
    p.add_argument("--args-only", action="store_true",
                   help="ignore the config's `deployments` options: one replica of each stage, code defaults")
    a = p.parse_args()
    import os

    # Always a private local Ray instance: never join a cluster someone else started on this machine.
    os.environ["RAY_ADDRESS"] = "local"
    from tests.serve_harness import start_app, stop_app

    cfg = yaml.safe_load(Path(a.config).read_text())
    app = cfg["applications"][0]
    args = _override(app["args"], a.set)
    print("args:", args, flush=True)
    # The config's per-deployment options too (autoscaling, CPU shares), as `serve run` applies them.
    options = {} if a.args_only else {d["name"]: {k: v for k, v in d.items() if k != "name"}
                                      for d in app.get("deployments", [])}
    url, _ = start_app(args, options=options)
    if a.variant:
        from tests.serve_harness import deploy_app

        variant = _override(copy.deepcopy(args), a.variant)
        print("variant args:", variant, flush=True)
        deploy_app(variant, name="variant", route_prefix="/variant", options=options)
        print(f"{url}/variant", flush=True)
    print(url, flush=True)
    if a.url_file:
        Path(a.url_file).write_text(url + "\n")
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    while not done.wait(0.5):
        pass
    stop_app()


def _override(args: dict, items: list[str]) -> dict:
    """``args`` with each ``a.b.c=value`` (value parsed as YAML) set."""
    for item in items:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = args
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = yaml.safe_load(value)
    return args


if __name__ == "__main__":
    main()
