"""helpers.ports.free_port: the tests' servers never get a port handed out before."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator

import pytest
from helpers import ports


class _FakeSocket:
    """Binds to the next port of a fixed list, as the kernel may offer an unbound port twice."""

    offered: Iterator[int]

    def __enter__(self) -> _FakeSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        self.port = next(self.offered)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_port_offered_again_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # outside xdist: the kernel's choice
    monkeypatch.setattr(ports, "_handed_out", set())
    _FakeSocket.offered = iter([41000, 41000, 41000, 41001])
    monkeypatch.setattr(socket, "socket", _FakeSocket)
    assert [ports.free_port(), ports.free_port()] == [41000, 41001]


def test_xdist_workers_take_ports_from_ranges_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    got = [ports.free_port() for _ in range(20)]
    assert len(set(got)) == 20
    assert all(26384 <= port < 32768 for port in got)  # worker 1 of 2: the upper half, below the ephemeral range


def test_the_ranges_split_the_ports_below_the_ephemeral_range() -> None:
    for count in (1, 2, 3, 8, 64):
        ranges = [ports.worker_ports(worker, count) for worker in range(count)]
        assert ranges[0].start == ports.WORKER_PORT_BASE and ranges[-1].stop <= 32768
        assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))  # adjacent, never overlapping
        assert min(len(r) for r in ranges) >= ports.MIN_WORKER_SPAN
    with pytest.raises(RuntimeError, match="cannot give xdist worker 0 of 1000"):
        ports.worker_ports(0, 1000)
    with pytest.raises(RuntimeError, match="worker 2 of 2"):
        ports.worker_ports(2, 2)


def test_a_worker_skips_ports_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    first = ports.worker_ports(2, 4).start
    monkeypatch.setattr(ports.random, "randrange", lambda n: 0)
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", first))
        except OSError:
            pytest.skip(f"port {first} is in use on this machine")
        taken.listen()
        assert ports.free_port() == first + 1


def test_a_replacement_worker_takes_the_crashed_ones_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """xdist gives a worker that replaces a crashed one the next id (gw2 when two run)."""
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert ports.free_port() in ports.worker_ports(0, 2)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")  # no count: a fixed split
    assert ports.free_port() in ports.worker_ports(2, ports.DEFAULT_WORKER_SLOTS)
