"""Ports for servers the tests start."""

from __future__ import annotations

import socket

_handed_out: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, never one this process handed out before: servers bind seconds after
    they are given their port (imports first), and the kernel may offer a port again while it is unbound, so
    two servers started back to back could otherwise get the same one."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
