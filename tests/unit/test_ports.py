"""helpers.ports.free_port: the tests' servers never get a port handed out before."""

from __future__ import annotations

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
    first = ports.WORKER_PORT_BASE + ports.WORKER_PORT_SPAN
    got = [ports.free_port() for _ in range(20)]
    assert len(set(got)) == 20
    assert all(first <= port < first + ports.WORKER_PORT_SPAN for port in got)
    assert ports.WORKER_PORT_BASE + ports.WORKER_PORT_SPAN * ports.MAX_WORKERS <= 32768  # below Linux's ephemeral range


def test_a_worker_skips_ports_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    first = ports.WORKER_PORT_BASE + 2 * ports.WORKER_PORT_SPAN
    monkeypatch.setattr(ports.random, "randrange", lambda n: 0)
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", first))
        except OSError:
            pytest.skip(f"port {first} is in use on this machine")
        taken.listen()
        assert ports.free_port() == first + 1


def test_the_worker_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{ports.MAX_WORKERS}")
    with pytest.raises(RuntimeError, match="port ranges for 12 xdist workers"):
        ports.free_port()
