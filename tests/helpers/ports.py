"""Ports for servers the tests start."""

from __future__ import annotations

import os
import random
import socket

from helpers.xdist import worker_index

_handed_out: set[int] = set()

# Under pytest-xdist (`make test` runs two or more worker processes) each worker takes its ports from a range of
# its own: ports WORKER_PORT_BASE .. EPHEMERAL_START - 1 split evenly between the workers, below Linux's default
# ephemeral range (32768-60999, where the kernel puts port-0 binds: kvserve's own internal ports,
# torch.distributed's rendezvous). A port handed out here waits seconds before its server binds it, so without
# the split two workers could be offered the same free port in that gap.
WORKER_PORT_BASE = 20000
EPHEMERAL_START = 32768
MIN_WORKER_SPAN = 100
DEFAULT_WORKER_SLOTS = 8  # when the worker count is not in the environment


def worker_ports(worker: int, worker_count: int) -> range:
    """The ports xdist worker `worker` of `worker_count` hands out."""
    span = (EPHEMERAL_START - WORKER_PORT_BASE) // max(worker_count, 1)
    if span < MIN_WORKER_SPAN or not 0 <= worker < max(worker_count, 1):
        raise RuntimeError(f"helpers.ports cannot give xdist worker {worker} of {worker_count} a range of "
                           f"{MIN_WORKER_SPAN}+ ports in {WORKER_PORT_BASE}-{EPHEMERAL_START - 1}")
    first = WORKER_PORT_BASE + worker * span
    return range(first, first + span)


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
        # A worker that replaces a crashed one gets the next id (gw2 of 2): it takes the crashed one's range.
        count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
        slots = int(count) if count.isdigit() and int(count) > 0 else DEFAULT_WORKER_SLOTS
        ports = worker_ports(worker % slots, slots)
        start = random.randrange(len(ports))
        for offset in range(len(ports)):
            port = ports[(start + offset) % len(ports)]
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
        raise RuntimeError(f"no free port left in {ports.start}-{ports.stop - 1} for xdist worker {worker}")
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
