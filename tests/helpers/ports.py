"""Ports for servers the tests start."""

from __future__ import annotations

import random
import socket

from helpers.xdist import worker_index

_handed_out: set[int] = set()

# Under pytest-xdist (`make test` runs two or more worker processes) each worker takes its ports from a range of
# its own, below Linux's ephemeral range (32768-60999, where the kernel puts port-0 binds: kvserve's own
# internal ports, torch.distributed's rendezvous). A port handed out here waits seconds before its server binds
# it, so without the split two workers could be offered the same free port in that gap.
WORKER_PORT_BASE = 20000
WORKER_PORT_SPAN = 1000
MAX_WORKERS = 12


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free on 127.0.0.1 now, never one this process handed out before: servers bind seconds after
    they are given their port (imports first), and the kernel may offer a port again while it is unbound, so
    two servers started back to back could otherwise get the same one. Under pytest-xdist, from this worker's
    own range."""
    worker = worker_index()
    if worker is not None:
        if worker >= MAX_WORKERS:
            raise RuntimeError(f"helpers.ports has port ranges for {MAX_WORKERS} xdist workers, not worker {worker}")
        first = WORKER_PORT_BASE + worker * WORKER_PORT_SPAN
        start = random.randrange(WORKER_PORT_SPAN)
        for offset in range(WORKER_PORT_SPAN):
            port = first + (start + offset) % WORKER_PORT_SPAN
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
        raise RuntimeError(f"no free port left in {first}-{first + WORKER_PORT_SPAN - 1} for xdist worker {worker}")
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
