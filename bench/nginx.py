"""A real nginx (Debian's package) as a reverse proxy on loopback, with its own config, started and
stopped by the benchmark. Two servers in one nginx: ``default`` (nginx's default proxy buffering,
which honours the upstream's ``X-Accel-Buffering: no``) and ``ignore`` (the same, plus
``proxy_ignore_headers X-Accel-Buffering``: the failure that header prevents)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

CONF = """\
{user}worker_processes 1;
daemon off;
master_process on;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 512; }}
http {{
    access_log off;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy_temp;
    fastcgi_temp_path {dir}/fastcgi_temp;
    uwsgi_temp_path {dir}/uwsgi_temp;
    scgi_temp_path {dir}/scgi_temp;
    upstream backend {{ server {upstream}; keepalive 32; }}
    # Everything not set here is nginx's default: proxy_buffering on, 8 × 4k/8k buffers.
    server {{
        listen 127.0.0.1:{port_default};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_read_timeout 600s;
        }}
    }}
    server {{
        listen 127.0.0.1:{port_ignore};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_read_timeout 600s;
            proxy_ignore_headers X-Accel-Buffering;
        }}
    }}
}}
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                          if os.access(p, os.X_OK)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nginx:
    """``with Nginx(upstream_url) as ng: ng.urls["default"], ng.urls["ignore"]``."""

    def __init__(self, upstream_url: str) -> None:
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed (Debian: apt-get install nginx-light; `make test` does it)")
        self.binary = binary
        u = urlparse(upstream_url)
        self.upstream = f"{u.hostname}:{u.port or 80}"
        self.dir = Path(tempfile.mkdtemp(prefix="bench-nginx-"))
        self.ports = {"default": _free_port(), "ignore": _free_port()}
        self.urls = {k: f"http://127.0.0.1:{p}" for k, p in self.ports.items()}
        self.proc: subprocess.Popen[bytes] | None = None

    def config(self) -> str:
        user = "user root;\n" if os.geteuid() == 0 else ""
        return CONF.format(user=user, dir=self.dir, upstream=self.upstream, port_default=self.ports["default"],
                           port_ignore=self.ports["ignore"])

    def start(self, timeout_s: float = 10) -> Nginx:
        conf = self.dir / "nginx.conf"
        conf.write_text(self.config())
        test = subprocess.run([self.binary, "-t", "-c", str(conf), "-p", str(self.dir)], capture_output=True, text=True)
        if test.returncode != 0:
            raise RuntimeError(f"nginx config rejected: {test.stderr}")
        self.proc = subprocess.Popen([self.binary, "-c", str(conf), "-p", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        for port in self.ports.values():
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"nginx exited: {self.proc.stderr.read().decode() if self.proc.stderr else ''}") from None
                    if time.monotonic() > deadline:
                        raise RuntimeError("nginx did not start listening") from None
                    time.sleep(0.05)
        return self

    def version(self) -> str:
        out = subprocess.run([self.binary, "-v"], capture_output=True, text=True)
        return (out.stderr or out.stdout).strip()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: fast shutdown of master and workers
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
