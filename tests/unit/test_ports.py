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
    monkeypatch.setattr(ports, "_handed_out", set())
    _FakeSocket.offered = iter([41000, 41000, 41000, 41001])
    monkeypatch.setattr(socket, "socket", _FakeSocket)
    assert [ports.free_port(), ports.free_port()] == [41000, 41001]

