"""`kvserve serve --data-parallel-size N`, its process lifecycle, in this process with fake replicas (a small
HTTP server script per replica instead of `kvserve serve`): a replica that fails or is killed during start-up
fails the command with its exit status and its last output, one that dies while serving stops the others (exit
1), SIGTERM drains them (exit 0), and a second SIGTERM stops them at once (exit 0 too). What a replica that did
not exit 0 left in the temporary directory (the directories carrying its tag) is removed after its process group
is killed, once, and nothing else: not what a replica that exited 0 made, nor another server's."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import aiohttp
import pytest
from helpers.ports import free_port

from kvserve.engine import core_client
from kvserve.entrypoints import data_parallel
from kvserve.entrypoints.cli import build_parser
from kvserve.entrypoints.data_parallel import ReplicaPlan, serve_replicas
from kvserve.entrypoints.openai.api_server import bind_listening

# argv: port, mode, directory. Modes: serve (exit 0 on SIGTERM), drains (exits 0 half a second after a first
# SIGTERM, at once on a second), stubborn (ignores the first SIGTERM, dies of the second), fail (exit 3 at once),
# killed (SIGKILLs itself at once), spawns (serve, with a child process that sleeps for 15 s holding its
# output open, as a replica's engine core does), spawns_fails_at_stop (spawns, and exits 1 on SIGTERM, leaving
# its child running), hangs (a POST gets one event of a stream that then never goes on; SIGTERM is ignored),
# hangs_spawns (both). Every mode first makes the directories a replica makes, named with the tag in its
# environment (KVSERVE_DP_REPLICA_TAG): an IPC directory in <directory>/tmpdir and in <directory>/short, and a
# metrics directory in <directory>/tmpdir, as a replica makes them in the temporary directory or /tmp (see
# `Scenario`); unlike a replica it never removes them itself, so that what the command removes shows. Writes
# <directory>/<port>.pid (and <port>.child: the child's pid); <port>.draining on a first SIGTERM that it does
# not exit on, and (drains) <port>.stopped_at_once on a second.
FAKE_REPLICA = '''
import http.server, json, os, signal, subprocess, sys, threading
port, mode, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
tag = os.environ["KVSERVE_DP_REPLICA_TAG"]
for parent, name in [("tmpdir", "ipc"), ("short", "ipc"), ("tmpdir", "metrics")]:
    os.makedirs(os.path.join(directory, parent, f"kvserve-{name}-{tag}-fake0000", "input-0"))
print(f"fake replica on port {port}", flush=True)
if mode in ("spawns", "hangs_spawns", "spawns_fails_at_stop"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(15)"])
    with open(os.path.join(directory, f"{port}.child"), "w") as f:
        f.write(str(child.pid))
if mode == "fail":
    print("error: the KV cache holds 0 tokens", flush=True)
    sys.exit(3)
if mode == "killed":
    os.kill(os.getpid(), signal.SIGKILL)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "fake"}]}).encode() if self.path == "/v1/models" else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'data: {"i": 0}\\n\\n')
        self.wfile.flush()
        threading.Event().wait()

    def log_message(self, *args):
        pass


terms = 0


def on_term(sig, frame):
    global terms
    terms += 1
    if mode in ("hangs", "hangs_spawns") or (mode in ("stubborn", "drains") and terms == 1):
        open(os.path.join(directory, f"{port}.draining"), "w").close()
        if mode == "drains":
            threading.Timer(0.5, os._exit, (0,)).start()
        return
    if mode == "drains":
        open(os.path.join(directory, f"{port}.stopped_at_once"), "w").close()
    if mode == "spawns_fails_at_stop":
        os._exit(1)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    os._exit(0)


signal.signal(signal.SIGTERM, on_term)
server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
with open(os.path.join(directory, f"{port}.pid"), "w") as f:
    f.write(str(os.getpid()))
server.serve_forever()
'''


# Another server's replica's tag, and the directories in both places of that replica and of a server run alone.
OTHER_TAG = "0ther5erver7a9"
OTHERS = [f"kvserve-ipc-{OTHER_TAG}-other000", f"kvserve-metrics-{OTHER_TAG}-other000", "kvserve-ipc-alone000"]


def _ns(shutdown_s: float = 5) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "/models/m", "-dp", "2", "--device", "cpu",
                                      "--shutdown-timeout", str(shutdown_s)])


def _plans(count: int) -> list[ReplicaPlan]:
    return [ReplicaPlan(i, port, None) for i, port in enumerate(sorted(free_port() for _ in range(count)))]


class Scenario:
    """Fake replicas (one mode each) behind `serve_replicas` on a port of its own. The places where replicas
    make their directories, the temporary directory and /tmp, are <tmp_path>/tmpdir and <tmp_path>/short
    (`core_client.ipc_dir_parents`), which hold at first the directories of another server (`OTHER_TAG`) and
    of a server run alone (no tag). `removals` counts the command's calls of remove_replica_dirs by tag."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, modes: Sequence[str],
                 shutdown_s: float = 5) -> None:
        self.directory = tmp_path
        self.ipc_parents = [tmp_path / "tmpdir", tmp_path / "short"]
        for parent in self.ipc_parents:
            parent.mkdir()
            for name in OTHERS:
                (parent / name).mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(self.ipc_parents[0]))
        monkeypatch.setattr(core_client, "_SHORT_TMP", str(self.ipc_parents[1]))
        self.removals: collections.Counter[str] = collections.Counter()

        def remove_replica_dirs(tag: str) -> list[str]:
            self.removals[tag] += 1
            return core_client.remove_replica_dirs(tag)

        monkeypatch.setattr(data_parallel, "remove_replica_dirs", remove_replica_dirs)
        self.shutdown_s = shutdown_s
        script = tmp_path / "fake_replica.py"
        script.write_text(FAKE_REPLICA)
        self.plans = _plans(len(modes))

        def command(plan: ReplicaPlan, serve_args: Sequence[str]) -> list[str]:
            return [sys.executable, str(script), str(plan.port), modes[plan.index], str(tmp_path)]

        monkeypatch.setattr(data_parallel, "replica_command", command)
        self.sock = bind_listening("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def run(self, while_serving: Callable[[Scenario], object] | None = None) -> int:
        """`while_serving` runs once the command serves; a task it returns is awaited after the command."""
        async def main() -> int:
            serving = asyncio.create_task(serve_replicas(_ns(self.shutdown_s), self.plans, [], self.sock))
            task = None
            if while_serving is not None:
                await self._wait_serving(serving)
                if not serving.done():  # (else it failed to start: nothing to do while it serves)
                    task = while_serving(self)
            code = await asyncio.wait_for(serving, 60)
            if isinstance(task, asyncio.Task):
                await asyncio.wait_for(task, 10)
            return code

        try:
            return asyncio.run(main())
        finally:
            self.sock.close()

    async def _wait_serving(self, serving: asyncio.Task[int]) -> None:
        async with aiohttp.ClientSession() as session:
            while not serving.done():
                try:
                    async with session.get(self.url + "/health") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)

    def pid(self, index: int) -> int:
        return int((self.directory / f"{self.plans[index].port}.pid").read_text())

    def ipc_dirs(self) -> list[str]:
        """The directories in both places (`ipc_parents`), as <place>/<name>."""
        return sorted(f"{parent.name}/{d.name}" for parent in self.ipc_parents for d in parent.iterdir())

    def made_by(self, *indices: int) -> list[str]:
        """The directories that the replicas `indices` make (`FAKE_REPLICA`), as `ipc_dirs` lists them."""
        return [f"{place}/kvserve-{name}-{self.plans[i].tag}-fake0000"
                for i in indices for place, name in [("tmpdir", "ipc"), ("short", "ipc"), ("tmpdir", "metrics")]]

    def left(self, *indices: int) -> list[str]:
        """What `ipc_dirs` holds when only the directories of the replicas `indices` are left beside the other
        servers' (`OTHERS`)."""
        return sorted([*self.made_by(*indices), *(f"{place}/{name}" for place in ("short", "tmpdir") for name in OTHERS)])

    def removed_once(self, *indices: int) -> dict[str, int]:
        """`removals` when the command removed the directories of the replicas `indices` once each, and no
        other's."""
        return {self.plans[i].tag: 1 for i in indices}

    def wait_file(self, name: str) -> None:
        deadline = time.monotonic() + 10
        while not (self.directory / name).exists():
            assert time.monotonic() < deadline, f"{name} never appeared"
            time.sleep(0.02)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("mode, status, code", [("fail", 3, 3), ("killed", 128 + 9, -9)])
def test_a_replica_that_fails_to_start_fails_the_command_with_its_status_and_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, mode: str, status: int,
        code: int) -> None:
    scenario = Scenario(tmp_path, monkeypatch, ["serve", mode])
    with caplog.at_level(logging.INFO):
        assert scenario.run() == status
    failure = f"replica 1 on CPU at http://127.0.0.1:{scenario.plans[1].port} (pid "
    assert failure in caplog.text and f"exited with code {code} during start-up; its last output:\n" in caplog.text
    if mode == "fail":
        assert caplog.text.split("its last output:\n")[1].startswith(
            f"fake replica on port {scenario.plans[1].port}\nerror: the KV cache holds 0 tokens")
    if (tmp_path / f"{scenario.plans[0].port}.pid").exists():  # replica 0 was stopped with the command
        assert _gone(scenario.pid(0))
    # Replica 1's directories are removed, once; replica 0's (made, or not yet, when it was stopped) only if it
    # did not exit 0 (a SIGTERM before its handler was set).
    assert not set(scenario.made_by(1)) & set(scenario.ipc_dirs())
    assert scenario.removals[scenario.plans[1].tag] == 1 and set(scenario.removals) <= {p.tag for p in scenario.plans}
    assert set(scenario.left()) <= set(scenario.ipc_dirs())


def test_a_replica_that_dies_while_serving_stops_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    scenario = Scenario(tmp_path, monkeypatch, ["serve", "serve"])
    pids: list[int] = []

    def kill_replica_1(s: Scenario) -> None:
        pids.extend([s.pid(0), s.pid(1)])
        os.kill(s.pid(1), signal.SIGKILL)

    with caplog.at_level(logging.INFO):
        assert scenario.run(kill_replica_1) == 1
    assert "exited with code -9 while serving: stopping the other replicas and exiting 1" in caplog.text
    assert all(_gone(pid) for pid in pids)
    # Replica 1's directories are removed (once, though the replicas are stopped twice: serve_replicas' finally);
    # replica 0 exited 0 (it removes its own: the command leaves them alone).
    assert scenario.ipc_dirs() == scenario.left(0)
    assert scenario.removals == scenario.removed_once(1)


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not reaped yet by whoever adopted it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _assert_gone_soon(child: int) -> None:
    """The replica's child stops running within a second (adopted once killed, it is reaped by init)."""
    for _ in range(50):
        if not _running(child):
            return
        time.sleep(0.02)
    raise AssertionError("the replica's child still runs")


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_replica_is_noticed_at_once_and_what_it_started_is_killed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A SIGKILLed replica's process is gone at once, but not its output pipe: what it started (its engine core)
    holds that until it leaves by itself, seconds later. The command goes by the process's exit (not by its
    output's end): it stops at once, and kills what the replica left running (its GPUs are then free for the
    server's restart)."""
    scenario = Scenario(tmp_path, monkeypatch, ["serve", "spawns"])
    children: list[int] = []
    killed_at: list[float] = []

    def kill_replica_1(s: Scenario) -> None:
        s.wait_file(f"{s.plans[1].port}.child")
        children.append(int((s.directory / f"{s.plans[1].port}.child").read_text()))
        killed_at.append(time.monotonic())
        os.kill(s.pid(1), signal.SIGKILL)

    try:
        with caplog.at_level(logging.INFO):
            assert scenario.run(kill_replica_1) == 1
        stopped_in = time.monotonic() - killed_at[0]
        assert "exited with code -9 while serving: stopping the other replicas and exiting 1" in caplog.text
        assert stopped_in < 5, f"stopped {stopped_in:.1f} s after the kill (its child holds the pipe for 15 s)"
        _assert_gone_soon(children[0])
    finally:
        _kill(children)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_what_a_killed_replica_left_in_the_temporary_directory_is_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A replica's API process SIGKILLed (the OOM killer): the command kills its process group, its engine core
    included, which would otherwise have removed the IPC directory on its way out; the command removes what
    carries the replica's tag instead, in the temporary directory and in /tmp, its metrics directory too, after
    the kill and once; nothing of the other replica (it exited 0), of another server (another tag), or of a
    server run alone."""
    scenario = Scenario(tmp_path, monkeypatch, ["serve", "spawns"])
    children: list[int] = []
    before: list[str] = []

    def kill_replica_1(s: Scenario) -> None:
        s.wait_file(f"{s.plans[1].port}.child")
        children.append(int((s.directory / f"{s.plans[1].port}.child").read_text()))
        before.extend(s.ipc_dirs())
        os.kill(s.pid(1), signal.SIGKILL)

    try:
        with caplog.at_level(logging.INFO):
            assert scenario.run(kill_replica_1) == 1
        assert scenario.plans[0].tag != scenario.plans[1].tag
        assert before == scenario.left(0, 1)
        assert scenario.ipc_dirs() == scenario.left(0)
        assert scenario.removals == scenario.removed_once(1)
        assert (f"removed what replica 1 (pid {scenario.pid(1)}, exit code -9) left in the temporary directory: "
                in caplog.text)
        _assert_gone_soon(children[0])
    finally:
        _kill(children)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_replica_that_fails_while_stopping_has_its_group_killed_and_what_it_left_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A replica that exits 1 by itself when stopped, its engine core (here its child) still running: the command
    kills its process group, then removes what carries its tag; the replica that drained (exit 0) keeps its
    directories (it removes its own)."""
    scenario = Scenario(tmp_path, monkeypatch, ["drains", "spawns_fails_at_stop"])
    children: list[int] = []

    def stop(s: Scenario) -> None:
        s.wait_file(f"{s.plans[1].port}.child")
        children.append(int((s.directory / f"{s.plans[1].port}.child").read_text()))
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        with caplog.at_level(logging.INFO):
            assert scenario.run(stop) == 1
        assert "replicas exited with codes {1: 1}" in caplog.text
        _assert_gone_soon(children[0])
        assert scenario.ipc_dirs() == scenario.left(0)
        assert scenario.removals == scenario.removed_once(1)
    finally:
        _kill(children)


def test_sigterm_drains_the_replicas_and_exits_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    scenario = Scenario(tmp_path, monkeypatch, ["drains", "drains"])
    with caplog.at_level(logging.INFO):
        assert scenario.run(lambda _: os.kill(os.getpid(), signal.SIGTERM)) == 0
    assert "stopping the 2 replicas (each drains its requests)" in caplog.text
    # Each got one SIGTERM and drained: a second one would have stopped it at once.
    assert sorted(p.name for p in tmp_path.glob("*.draining")) == [f"{plan.port}.draining" for plan in scenario.plans]
    assert not list(tmp_path.glob("*.stopped_at_once"))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    # Both exited 0: what they made is theirs to remove (a replica removes its own), not the command's.
    assert scenario.ipc_dirs() == scenario.left(0, 1) and not scenario.removals


def test_what_a_hung_replica_leaves_in_flight_ends_in_the_openai_format(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A replica that neither finishes nor ends its answers when stopped: --shutdown-timeout + DRAIN_ABORT_GRACE_S
    after the stop, the router ends what it still forwards as the server ends what it stops (a stream: an error
    event, then [DONE]), rather than aiohttp cutting it when its own wait runs out."""
    monkeypatch.setattr(data_parallel, "DRAIN_ABORT_GRACE_S", 0.5)
    monkeypatch.setattr(data_parallel, "EXIT_GRACE_S", 0.5)
    scenario = Scenario(tmp_path, monkeypatch, ["hangs"], shutdown_s=1)
    received: list[bytes] = []

    def stream_then_stop(s: Scenario) -> asyncio.Task[None]:
        async def client() -> None:
            async with aiohttp.ClientSession() as session:
                async with session.post(s.url + "/v1/completions", json={"prompt": "x", "stream": True}) as response:
                    received.append(await response.content.readuntil(b"\n\n"))
                    os.kill(os.getpid(), signal.SIGTERM)
                    received.append(await response.content.read())

        return asyncio.get_running_loop().create_task(client())

    with caplog.at_level(logging.INFO):
        assert scenario.run(stream_then_stop) == 1  # (the replica, killed at last, did not stop as told)
    events = [e.removeprefix("data: ") for e in b"".join(received).decode().split("\n\n") if e]
    assert events[0] == '{"i": 0}' and events[2:] == ["[DONE]"], events
    error = json.loads(events[1])["error"]
    assert error["code"] == 503 and error["message"] == "the router is shutting down", error
    assert "1 requests still in flight 2 s after the replicas were stopped: ending them" in caplog.text
    assert scenario.ipc_dirs() == scenario.left() and scenario.removals == scenario.removed_once(0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_replica_that_does_not_stop_is_killed_with_what_it_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A replica that ignores its SIGTERM is SIGKILLed when the stop's time is over, and so is what it started
    (its engine core would otherwise hold its GPUs after the command exits)."""
    monkeypatch.setattr(data_parallel, "DRAIN_ABORT_GRACE_S", 0.5)
    monkeypatch.setattr(data_parallel, "EXIT_GRACE_S", 0.5)
    scenario = Scenario(tmp_path, monkeypatch, ["hangs_spawns"], shutdown_s=1)
    children: list[int] = []

    def stop(s: Scenario) -> None:
        s.wait_file(f"{s.plans[0].port}.child")
        children.append(int((s.directory / f"{s.plans[0].port}.child").read_text()))
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        with caplog.at_level(logging.INFO):
            assert scenario.run(stop) == 1
        assert "replica 0 did not stop within" in caplog.text
        _assert_gone_soon(children[0])
        assert scenario.ipc_dirs() == scenario.left()  # what it made, as a killed replica left it
        assert scenario.removals == scenario.removed_once(0)
    finally:
        _kill(children)


def test_a_second_sigterm_stops_the_replicas_at_once_and_exits_0(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A replica's second SIGTERM ends it at once, however it ends: that was asked for, not a failure."""
    scenario = Scenario(tmp_path, monkeypatch, ["stubborn", "stubborn"])
    tasks: list[asyncio.Task[None]] = []

    def signal_twice(s: Scenario) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

        async def then_again() -> None:  # once both replicas got the first (they keep serving: draining)
            await asyncio.get_running_loop().run_in_executor(None, lambda: [
                s.wait_file(f"{plan.port}.draining") for plan in s.plans])
            os.kill(os.getpid(), signal.SIGTERM)

        tasks.append(asyncio.get_running_loop().create_task(then_again()))

    with caplog.at_level(logging.INFO):
        assert scenario.run(signal_twice) == 0
    assert "again: the replicas stop now" in caplog.text
    assert "stopped at once: replicas exited with codes {0: -15, 1: -15}" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    # Not 0: their groups are killed (whatever they did not stop yet) and what they made is removed.
    assert scenario.ipc_dirs() == scenario.left() and scenario.removals == scenario.removed_once(0, 1)
