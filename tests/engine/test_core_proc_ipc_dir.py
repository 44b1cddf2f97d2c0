"""The engine's IPC sockets' directory. core_client.make_ipc_dir: where it goes (a path a Unix socket takes), and
its name, which in a data-parallel replica carries the replica's tag (KVSERVE_DP_REPLICA_TAG).
core_proc.remove_ipc_dir: an engine whose API process died (SIGKILL) removes the directory the API process made,
and nothing else. core_client.remove_replica_dirs: what `kvserve serve -dp N` removes after it killed a
replica's process group (the IPC and metrics directories that carry exactly that replica's tag), and nothing
else. The server-level checks are in tests/server/test_lifecycle.py and
tests/server/test_data_parallel_server.py."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from kvserve import envs
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


@pytest.mark.parametrize("tag, prefix", [
    (None, "kvserve-ipc-"),  # a server run alone: the name it always had
    ("0123456789abcdef", "kvserve-ipc-0123456789abcdef-"),  # a data-parallel replica's (`kvserve serve -dp N`)
    ("", "kvserve-ipc-"),  # an invalid tag is ignored
    ("ab-cd", "kvserve-ipc-"),
    ("../x", "kvserve-ipc-"),
    ("ab_cd", "kvserve-ipc-"),
    ("١٢", "kvserve-ipc-"),  # (digits of another script)
    ("a" * 33, "kvserve-ipc-"),
])
def test_the_ipc_directorys_name_carries_the_replica_tag(tag: str | None, prefix: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    short = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    try:
        monkeypatch.setattr(tempfile, "tempdir", short)
        monkeypatch.setattr(envs, "KVSERVE_DP_REPLICA_TAG", tag)
        assert core_client.tagged_prefix(IPC_DIR_PREFIX) == prefix
        assert core_client.tagged_prefix(core_client.METRICS_DIR_PREFIX) == prefix.replace("-ipc-", "-metrics-")
        directory = core_client.make_ipc_dir(api_server_count=1)
        name = os.path.basename(directory)
        assert os.path.dirname(directory) == short and name.startswith(prefix)
        assert re.fullmatch(r"\w{8}", name[len(prefix):], re.ASCII), name  # mkdtemp's part, as before
        remove_ipc_dir([f"ipc://{directory}/input-0"])  # the engine core's own check still knows it
        assert os.listdir(short) == []
    finally:
        shutil.rmtree(short)


def _replica_dirs(parent: Path, tag: str) -> list[Path]:
    return [_sockets_dir(parent, f"kvserve-ipc-{tag}-abc_1234"), _sockets_dir(parent, f"kvserve-metrics-{tag}-x1y2")]


def test_the_directories_of_one_tag_are_removed_and_nothing_else(tmp_path: Path) -> None:
    """What a killed replica (tag abc) left, in the temporary directory and in /tmp (here `first` and `second`),
    its IPC and its metrics directories, is removed; the directories of another tag (another replica's, or
    another server's: the temporary directory may be shared), of a tag that starts alike (abcd), of a server run
    alone (no tag), other files and a symbolic link named alike are left alone, and so is where the link
    points."""
    first, second, elsewhere = tmp_path / "tmpdir", tmp_path / "short", tmp_path / "elsewhere"
    for parent in (first, second, elsewhere):
        parent.mkdir()
    ours = [*_replica_dirs(first, "abc"), _sockets_dir(second, "kvserve-ipc-abc-xyz")]
    others = [*_replica_dirs(first, "abcd"), *_replica_dirs(first, "ABC"), *_replica_dirs(second, "ab"),
              _sockets_dir(first, "kvserve-ipc-abcdefgh"), _sockets_dir(first, "kvserve-ipc-abc-x-y"),
              _sockets_dir(first, "kvserve-ipc-abc-"), _sockets_dir(first, "my-kvserve-ipc-abc-xyz"),
              _sockets_dir(first, "kvserve-cache-abc-xyz")]
    (second / "kvserve-ipc-abc-file").write_text("not a directory")
    target = _sockets_dir(elsewhere, "target")
    (second / "kvserve-ipc-abc-link").symlink_to(target)
    (second / "kvserve-metrics-abc-link").symlink_to(target)
    removed = core_client.remove_replica_dirs("abc", [str(first), str(second), str(tmp_path / "missing")])
    assert sorted(removed) == sorted(str(d) for d in ours)
    assert not any(d.exists() for d in ours)
    assert all(sorted(p.name for p in d.iterdir()) == ["input-0", "output-0", "output-1"] for d in [*others, target])
    assert sorted(p.name for p in second.iterdir()) == sorted(
        ["kvserve-ipc-abc-file", "kvserve-ipc-abc-link", "kvserve-metrics-abc-link", "kvserve-ipc-ab-abc_1234",
         "kvserve-metrics-ab-x1y2"])
    assert core_client.remove_replica_dirs("abc", [str(first), str(second)]) == []  # (nothing left of it)


@pytest.mark.parametrize("tag", ["", "ab-cd", "*", "a" * 33])
def test_an_invalid_tag_removes_nothing(tag: str, tmp_path: Path) -> None:
    _sockets_dir(tmp_path, f"kvserve-ipc-{tag}-abc")
    with pytest.raises(ValueError, match="not a replica tag"):
        core_client.remove_replica_dirs(tag, [str(tmp_path)])
    assert len(list(tmp_path.iterdir())) == 1


def test_the_directories_are_looked_for_where_they_are_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmpdir"))
    monkeypatch.setattr(core_client, "_SHORT_TMP", str(tmp_path / "short"))
    assert core_client.ipc_dir_parents() == [str(tmp_path / "tmpdir"), str(tmp_path / "short")]
    monkeypatch.setattr(core_client, "_SHORT_TMP", str(tmp_path / "tmpdir"))
    assert core_client.ipc_dir_parents() == [str(tmp_path / "tmpdir")]  # (looked through once)

    def no_temporary_directory() -> str:
        raise FileNotFoundError(2, "No usable temporary directory found")

    monkeypatch.setattr(tempfile, "gettempdir", no_temporary_directory)  # (no directory was made there either)
    assert core_client.ipc_dir_parents() == [str(tmp_path / "tmpdir")]
    monkeypatch.setattr(core_client, "_SHORT_TMP", str(tmp_path / "short"))
    assert core_client.ipc_dir_parents() == [str(tmp_path / "short")]
    assert core_client.remove_replica_dirs("abc") == []  # (neither exists: nothing to do)
