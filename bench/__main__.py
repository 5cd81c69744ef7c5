"""``python -m bench``: the practice list (measure from a client, sweep prompt length, add load, test
cancellation, break streaming with a buffering proxy) plus a peer comparison, against any
OpenAI-compatible server. Each subcommand writes ``<name>.json``, ``<name>.md`` and ``<name>.png``
into ``--out``; tokens are counted from the server's ``usage``.

    python -m bench client --url http://127.0.0.1:8000 --concurrency 8
    python -m bench sweep  --lengths 100,1000,4000
    python -m bench load   --levels 1,8,32,64
    python -m bench cancel
    python -m bench proxy                       # starts and stops a real nginx on loopback
    python -m bench compare                     # starts and stops llama-server (`make peer` builds it)
    python -m bench multiturn --label cache_aware   # conversations resending their history (prefix cache)
    python -m bench docs --label cache_aware        # questions on shared long documents, interleaved
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# `python bench/...` and `python -m bench` from anywhere: the repository root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COMMANDS = {
    "client": ("bench.cmd_client", "TTFT, inter-event gap, TPOT, end-to-end and tok/s at one concurrency"),
    "sweep": ("bench.cmd_sweep", "TTFT vs prompt length (100 tokens to the context), fitted prefill tok/s"),
    "load": ("bench.cmd_load", "1/8/32/64 concurrent streams: TTFT split into queue and prefill, TPOT"),
    "cancel": ("bench.cmd_cancel", "drop clients mid-generation; engine running count and KV usage over time"),
    "proxy": ("bench.cmd_proxy", "the stream direct vs through nginx (default buffering, header ignored)"),
    "compare": ("bench.cmd_compare", "this server vs llama.cpp's llama-server, alternating rounds"),
    "multiturn": ("bench.cmd_prefix", "concurrent multi-turn conversations: TTFT and cache hits by turn"),
    "docs": ("bench.cmd_prefix", "questions on shared long documents, interleaved: TTFT and cache hits"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        sp.add_argument("--url", default="http://127.0.0.1:8000",
                        help="OpenAI-compatible base URL (with or without /v1)")
        sp.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
        sp.add_argument("--out", default="bench/results", help="results folder")
        sp.add_argument("--repeats", type=int, default=3 if name != "proxy" else 5,
                        help="repeats (rounds); the spread between them is recorded")
        sp.add_argument("--no-progress", action="store_true", help="no progress bar")
        importlib.import_module(module).add_args(sp)
        sp.set_defaults(module=module)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    importlib.import_module(a.module).cli(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
