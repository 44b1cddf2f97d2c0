"""core_proc.remove_ipc_dir: an engine whose API process died (SIGKILL) removes the IPC sockets' directory the API
process made, and nothing else. The server-level checks are in tests/server/test_lifecycle.py."""

from __future__ import annotations

from pathlib import Path

from kvserve.engine.core_proc import IPC_DIR_PREFIX, remove_ipc_dir


def _sockets_dir(parent: Path, name: str) -> Path:
    directory = parent / name
    directory.mkdir()
    for socket_file in ("input-0", "output-0", "output-1"):
        (directory / socket_file).touch()
    return directory


def test_the_api_processs_ipc_directory_is_removed(tmp_path: Path) -> None:
    directory = _sockets_dir(tmp_path, IPC_DIR_PREFIX + "abc123")
    remove_ipc_dir([f"ipc://{directory}/input-0", f"ipc://{directory}/input-1"])
    assert not directory.exists()
    assert tmp_path.exists()


def test_other_addresses_are_left_alone(tmp_path: Path) -> None:
    other = _sockets_dir(tmp_path, "my-sockets")
    remove_ipc_dir([f"ipc://{other}/input-0"])  # not a directory kvserve made
    remove_ipc_dir(["tcp://127.0.0.1:5555"])
    remove_ipc_dir([])
    assert sorted(p.name for p in other.iterdir()) == ["input-0", "output-0", "output-1"]
