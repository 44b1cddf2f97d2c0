"""The engine's IPC sockets' directory. core_client.make_ipc_dir: where it goes (a path a Unix socket takes).
core_proc.remove_ipc_dir: an engine whose API process died (SIGKILL) removes the directory the API process made,
and nothing else. The server-level checks are in tests/server/test_lifecycle.py."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from kvserve.engine import core_client
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


def test_the_ipc_directory_goes_to_tmp_when_tmpdir_is_too_deep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Unix socket's path holds at most 107 characters: under a deep TMPDIR (as CI runners and job schedulers
    set) the engine's sockets could not bind, and the server died with ZeroMQ's error."""
    deep = tmp_path / ("t" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    directory = core_client.make_ipc_dir(api_server_count=1)
    try:
        assert os.path.dirname(directory) == "/tmp" and os.path.basename(directory).startswith(IPC_DIR_PREFIX)
        assert all(len(address) - len("ipc://") <= core_client.IPC_PATH_MAX_LEN
                   for address in core_client._addresses(directory, 0))
    finally:
        os.rmdir(directory)
    assert os.listdir(deep) == []  # the directory it could not use is removed


def test_a_short_tmpdir_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    short = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")  # (pytest's tmp_path may itself be deep)
    try:
        monkeypatch.setattr(tempfile, "tempdir", short)
        directory = core_client.make_ipc_dir(api_server_count=4)
        assert os.path.dirname(directory) == short
    finally:
        shutil.rmtree(short)


def test_no_short_directory_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deep = tmp_path / ("t" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.setattr(core_client, "_SHORT_TMP", str(deep))
    with pytest.raises(core_client.IpcPathError, match="in /tmp would be too long as well: set TMPDIR to a shorter"):
        core_client.make_ipc_dir(api_server_count=1)
    assert os.listdir(deep) == []
    monkeypatch.setattr(core_client, "_SHORT_TMP", str(tmp_path / "missing"))
    with pytest.raises(core_client.IpcPathError, match="there is no .*missing: set TMPDIR"):
        core_client.make_ipc_dir(api_server_count=1)


def test_an_unwritable_tmp_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deep = tmp_path / ("t" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*args: object, dir: str | None = None, **kwargs: object) -> str:
        if dir == "/tmp":
            raise PermissionError(13, "Permission denied", dir)
        return real_mkdtemp(*args, dir=dir, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    with pytest.raises(core_client.IpcPathError, match="/tmp is not writable .*Permission denied"):
        core_client.make_ipc_dir(api_server_count=1)


def test_the_limit_is_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """/tmp/kvt-XXXXXXXX/ + 40 two-byte characters: the sockets' paths have 88 characters, 128 bytes."""
    short = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    try:
        deep = os.path.join(short, "é" * 40)
        os.mkdir(deep)
        monkeypatch.setattr(tempfile, "tempdir", deep)
        directory = core_client.make_ipc_dir(api_server_count=1)
        assert len(os.path.join(deep, os.path.basename(directory), "output-0")) <= core_client.IPC_PATH_MAX_LEN
        assert os.path.dirname(directory) == "/tmp"
        os.rmdir(directory)
    finally:
        shutil.rmtree(short)
