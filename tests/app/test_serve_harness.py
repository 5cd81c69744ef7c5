"""The test harness's own helpers (no Ray)."""

from __future__ import annotations

import socket

from tests.serve_harness import _PORT_CEILING, _PORT_FLOOR, _ephemeral_low, free_port


def test_free_ports_avoid_the_ranges_other_processes_bind_by_themselves() -> None:
    # Ray's workers take 10002-19999, Serve's direct ingress 30000+, the kernel ephemeral ports
    # for any bind(0) or outgoing connection: a port handed out from those can be gone before use.
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports), "a port was handed out twice"
    high = min(_ephemeral_low(), _PORT_CEILING)
    for port in ports:
        assert _PORT_FLOOR <= port < high, port
        with socket.socket() as s:  # and it is bindable on loopback
            s.bind(("127.0.0.1", port))
