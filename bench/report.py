"""Result files of one CLI run: ``<name>.json`` (everything measured, with machine, versions,
config, repeats and the spread between repeats), ``<name>.md`` (the table) and ``<name>.png``."""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from tqdm import tqdm


def progress(total: int, desc: str, enabled: bool = True) -> tqdm:
    """A progress bar on stderr (the CLI is never silent while it runs)."""
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True, leave=True,
                disable=not enabled)


# -- statistics --------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    """Percentile with linear interpolation; NaN for no values."""
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return float("nan")
    k = (len(vals) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def med(values: list[float]) -> float:
    return pct(values, 50)


def spread(per_repeat: list[float]) -> dict[str, Any]:
    """Per-repeat values, their median and the spread between repeats ((max − min) / median)."""
    vals = [v for v in per_repeat if v is not None and not math.isnan(v)]
    if not vals:
        return {"per_repeat": per_repeat, "median": float("nan"), "min": float("nan"), "max": float("nan"),
                "spread_pct": float("nan")}
    m = statistics.median(vals)
    return {"per_repeat": per_repeat, "median": m, "min": min(vals), "max": max(vals),
            "spread_pct": 100 * (max(vals) - min(vals)) / m if m else float("nan")}


def fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return "—" if math.isnan(v) else f"{v:,.{digits}f}"
    return str(v)


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(lines)


# -- provenance --------------------------------------------------------------------------------------
def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpus": os.cpu_count(), "cpu": cpu, "mem_gib": round(mem_gb, 1), "kernel": platform.release(),
            "os": platform.platform(), "load_avg_start": [round(x, 2) for x in os.getloadavg()]}


def versions() -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    git = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    return {"python": platform.python_version(), "lifecycle-serve (bench) git": git.stdout.strip() or None,
            "git_dirty": bool(dirty.stdout.strip()),
            **{p: _version(p) for p in ("httpx", "matplotlib", "tqdm", "torch", "ray")}}


class Run:
    """One CLI invocation: provenance collected at the start, files written at the end."""

    def __init__(self, name: str, args: Any, out_dir: str) -> None:
        self.name = name
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.command = "python -m bench " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        self.config = {k: v for k, v in vars(args).items() if k != "func"}
        self.machine = machine()
        self.versions = versions()

    def paths(self) -> dict[str, Path]:
        return {ext: self.out / f"{self.name}.{ext}" for ext in ("json", "md", "png")}

    def write(self, results: dict[str, Any], table_md: str, fig: Any | None, repeats: int,
              spreads: dict[str, Any], targets: list[Any], notes: list[str] | None = None,
              load_end: list[float] | None = None) -> dict[str, Path]:
        p = self.paths()
        self.machine["load_avg_end"] = load_end or [round(x, 2) for x in os.getloadavg()]
        doc = {"command": self.command, "subcommand": self.name, "started": self.started,
               "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": self.machine,
               "versions": self.versions, "config": self.config,
               "servers": [t.describe() for t in targets], "repeats": repeats, "spread": spreads,
               "notes": list(notes or []) + [n for t in targets for n in t.notes], "results": results}
        p["json"].write_text(json.dumps(doc, indent=1, default=_jsonable) + "\n")
        m = self.machine
        head = [f"# `{self.name}`", "", "```", self.command, "```", "",
                f"{self.started}; {m['cpus']} × {m['cpu']}, {m['mem_gib']} GiB; load average "
                f"{m['load_avg_start'][0]} → {m['load_avg_end'][0]}; Python {self.versions['python']}; "
                f"bench at `{self.versions['lifecycle-serve (bench) git']}`; repeats {repeats}.", ""]
        for t in targets:
            head.append(f"Server {t.url}: model `{t.model}`, version `{t.server_version}`, "
                        f"context {t.max_model_len}.")
        notes_all = doc["notes"]
        tail = ["", "Notes:", ""] + [f"- {n}" for n in notes_all] if notes_all else []
        p["md"].write_text("\n".join(head + ["", table_md] + tail) + "\n")
        if fig is not None:
            fig.savefig(p["png"], dpi=100, bbox_inches="tight")
        else:
            p.pop("png")
        print(table_md, flush=True)
        print("[bench] wrote " + ", ".join(str(v) for v in p.values()), flush=True)
        return p


def _jsonable(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "__dict__"):
        return vars(o)
    return str(o)


def figure(ncols: int = 1, width: float = 8.0, height: float = 4.2) -> tuple[Any, Any]:
    """A matplotlib figure sized to stay readable as a small PNG (800 px wide at 100 dpi)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.grid": True, "grid.alpha": 0.3})
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), constrained_layout=True)
    return fig, axes
