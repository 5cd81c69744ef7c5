"""A real nginx (Debian's package) as a reverse proxy on loopback, with its own config, started and
stopped by the benchmark. One nginx, one ``server`` per variant (``VARIANTS``):

- ``default``: nginx's defaults (``proxy_buffering on``), which honour the upstream's
  ``X-Accel-Buffering: no`` by switching that response to unbuffered, flushed writes;
- ``ignore``: the same plus ``proxy_ignore_headers X-Accel-Buffering``, so the response is buffered;
- ``gzip`` / ``gzip+ignore``: ``gzip on`` for ``text/event-stream`` (a common setting), with the
  header honoured / ignored. Unbuffered responses flush the compressor per write; buffered ones do
  not, and the stream arrives in one piece.

Measured with nginx 1.22: a buffered response from an upstream that sends HTTP/1.1 chunks is still
passed on chunk by chunk (nginx hands a complete chunk to the client at once), so ``ignore`` alone
does not clump this server's stream; ``gzip+ignore`` does.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

from tests.serve_harness import free_port

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
    upstream backend {{ server {upstream};{keepalive} }}
    # Everything not set here is nginx's default: proxy_buffering on, 8 × 4k/8k buffers, gzip off.
{servers}
}}
"""

SERVER = """\
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://backend;
{http11}            proxy_read_timeout 600s;
{extra}        }}
    }}
"""

#: The proxies one nginx runs, by name: extra directives inside ``location /``.
VARIANTS: dict[str, str] = {
    "default": "",
    "ignore": "            proxy_ignore_headers X-Accel-Buffering;\n",
    "gzip": "            gzip on;\n            gzip_types text/event-stream;\n",
    "gzip+ignore": "            gzip on;\n            gzip_types text/event-stream;\n"
                   "            proxy_ignore_headers X-Accel-Buffering;\n",
}


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                          if os.access(p, os.X_OK)), None)



class Nginx:
    """``with Nginx(upstream_url) as ng: ng.urls["default"], ng.urls["ignore"]``."""

    def __init__(self, upstream_url: str, http11: bool = True, variants: dict[str, str] | None = None) -> None:
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed (Debian: apt-get install nginx-light; `make test` does it)")
        self.binary = binary
        u = urlparse(upstream_url)
        self.upstream = f"{u.hostname}:{u.port or 80}"
        self.dir = Path(tempfile.mkdtemp(prefix="bench-nginx-"))
        self.variants = dict(variants or VARIANTS)
        self.ports = {k: free_port() for k in self.variants}
        self.urls = {k: f"http://127.0.0.1:{p}" for k, p in self.ports.items()}
        self.http11 = http11
        self.proc: subprocess.Popen[bytes] | None = None

    def config(self) -> str:
        user = "user root;\n" if os.geteuid() == 0 else ""
        http11 = ('            proxy_http_version 1.1;\n            proxy_set_header Connection "";\n'
                  if self.http11 else "")
        servers = "".join(SERVER.format(port=self.ports[k], http11=http11, extra=extra)
                          for k, extra in self.variants.items())
        return CONF.format(user=user, dir=self.dir, upstream=self.upstream, servers=servers,
                           keepalive=" keepalive 32;" if self.http11 else "")

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
