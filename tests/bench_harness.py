"""Run ``python -m bench`` as a user does and check what every result carries: shared by the CLI's
unit tests (against a bare server) and its app tests (against the real app)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_bench(args: list[str], out: Path, timeout: float = 300) -> dict[str, Any]:
    """Run ``python -m bench ARGS --out OUT``; return its JSON result after checking all three files."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "bench", *args, "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = args[0]
    for ext in ("json", "md", "png"):
        path = out / f"{name}.{ext}"
        assert path.is_file() and path.stat().st_size > 0, f"{path} missing"
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / f"{name}.json").read_text())
    # Provenance every result file carries.
    assert doc["machine"]["cpus"] >= 1 and doc["machine"]["cpu"]
    assert doc["versions"]["python"] and doc["versions"]["httpx"]
    assert doc["config"]["url"] and doc["repeats"] >= 1
    assert doc["spread"] and all("per_repeat" in s and "spread_pct" in s for s in doc["spread"].values())
    assert doc["servers"][0]["model"]
    md = (out / f"{name}.md").read_text()
    assert md.startswith(f"# `{name}`") and "|---|" in md and "python -m bench " + name in md
    return doc


def finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)
