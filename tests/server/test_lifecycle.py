"""Process lifecycle: engine death, SIGTERM drain, losing the API process, start-up failures."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from .conftest import ServerProcess, assert_openai_error, pid_alive, scrape, wait_for

FLAGS = ["--max-model-len", "256", "--kv-cache-memory", "64MiB", "--served-model-name", "tiny"]


def _short_tmpdir() -> Iterator[str]:
    # Directly in /tmp: the IPC sockets' paths must stay within a Unix socket's 107 characters, which pytest's own
    # directories (under xdist, .../pytest-N/popen-gwN/<test name>N/) come close to.
    directory = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def killed_server_tmpdir() -> Iterator[str]:
    """The temporary directory (TMPDIR) of the server whose API process is killed: where its IPC sockets are."""
    yield from _short_tmpdir()


@pytest.fixture
def short_tmpdir() -> Iterator[str]:
    yield from _short_tmpdir()


@pytest.fixture(scope="module")
def deep_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A TMPDIR too deep for the IPC sockets' paths (a Unix socket takes 107 characters)."""
    return str(tmp_path_factory.mktemp("deep-" + "t" * 100))


@pytest.fixture(scope="module")
def server_launches(tiny_llama_dir: str, killed_server_tmpdir: str,
                    deep_tmpdir: str) -> dict[str, tuple[list[str], dict[str, object]]]:
    """Each test's server (see `module_servers`), started together; the busy-port test starts its own."""
    return {
        # (Its TMPDIR is too deep for the IPC sockets: the server still starts, with them in /tmp.)
        "test_engine_death_turns_health_503_and_server_exits_nonzero": (
            [tiny_llama_dir, *FLAGS, "--metrics-compat", "none"], {"env": {"TMPDIR": deep_tmpdir}}),
        "test_sigterm_drains_in_flight_requests_and_exits_0": (
            [tiny_llama_dir, *FLAGS, "--disable-log-requests"], {"env": {"KVSERVE_GC_FREEZE": "1"}}),
        "test_shutdown_timeout_aborts_the_requests_still_in_flight": (
            [tiny_llama_dir, *FLAGS, "--disable-log-requests", "--shutdown-timeout", "1", "--max-num-seqs", "1"], {}),
        "test_engine_exits_when_the_api_process_is_killed": (
            [tiny_llama_dir, *FLAGS], {"env": {"KVSERVE_API_KEY": "from-env", "TMPDIR": killed_server_tmpdir}}),
        # Start-up failures: these exit by themselves.
        "test_engine_start_failure_exits_nonzero_with_its_error": (
            [tiny_llama_dir, "--max-model-len", "256", "--kv-cache-memory", "1KiB"], {}),
        "test_config_error_exits_2_before_starting_the_engine": ([tiny_llama_dir, "--max-model-len", "100000"], {}),
    }


class StreamReader(threading.Thread):
    """Reads one streaming completion in the background; `first_chunk` is set when text starts flowing.
    `client`: a kept-alive connection to use (by default a new one)."""

    def __init__(self, base_url: str, max_tokens: int, client: httpx.Client | None = None) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.client = client
        self.body = {"prompt": "Tell me everything:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.first_chunk = threading.Event()
        self.events: list[dict | str] = []
        self.status: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            stream = self.client.stream if self.client is not None else httpx.stream
            with stream("POST", self.base_url + "/v1/completions", json=self.body, timeout=120) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        payload = line[6:]
                        self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                        self.first_chunk.set()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            self.error = e
        finally:
            self.first_chunk.set()

    @property
    def finished(self) -> bool:
        return "[DONE]" in self.events


def test_engine_death_turns_health_503_and_server_exits_nonzero(own_server: ServerProcess):
    server = own_server.wait_ready()
    # (Deep TMPDIR: the sockets went to /tmp.)
    ipc_dir = re.search(r"the IPC sockets go to (/tmp/kvserve-ipc-\S+):", server.log())
    assert ipc_dir is not None, server.log()[-3000:]
    assert server.engine_pid is not None and pid_alive(server.engine_pid)
    # With --metrics-compat none there are no vllm: series (the default exports them: see the next test).
    names = [name for name, _ in scrape(server.base_url)]
    assert [name for name in names if name.startswith("kvserve:")] and not [n for n in names if n.startswith("vllm:")]
    stream = StreamReader(server.base_url, max_tokens=240)
    stream.start()
    assert stream.first_chunk.wait(60) and stream.error is None

    os.kill(server.engine_pid, signal.SIGKILL)
    seen_503 = False
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and server.proc.poll() is None:
        try:
            health = httpx.get(server.base_url + "/health", timeout=2)
        except httpx.HTTPError:
            break  # already gone
        if health.status_code == 503:
            seen_503 = True
            assert_openai_error(health, 503)
            break
        time.sleep(0.05)
    assert seen_503, "/health never answered 503 after the engine died"
    code = server.wait_exit(15)
    assert code != 0
    stream.join(10)
    # The in-flight stream ended with an error event (engine gone), not with a normal finish.
    errors = [e for e in stream.events if isinstance(e, dict) and "error" in e]
    assert errors and errors[0]["error"]["code"] == 503, stream.events[-3:]
    assert "engine core is dead" in server.log()
    assert not os.path.exists(ipc_dir.group(1))  # removed on the way out, from /tmp too


def test_sigterm_drains_in_flight_requests_and_exits_0(own_server: ServerProcess):
    server = own_server.wait_ready()  # --disable-log-requests, KVSERVE_GC_FREEZE=1 (server_launches)
    engine_pid = server.engine_pid
    # Both serving processes froze their start-up heaps once ready (kvserve/engine/heap.py).
    for process in ("engine core", "API server"):
        frozen = re.search(process + r": (\d+) start-up objects left out of the garbage collector", server.log())
        assert frozen is not None and int(frozen.group(1)) > 0, server.log()
    # By default every series is under vLLM's names too (a vLLM user's dashboards and alerts), as under ours.
    names = {name for name, _ in scrape(server.base_url)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"kvserve:{name}" in names and f"vllm:{name}" in names, sorted(names)
    assert "vllm:gpu_cache_usage_perc" in names  # (vLLM's older name, which the articles' queries use)
    # No --device here: on a machine without a usable GPU the server says it serves on the CPU.
    assert ("serving on the CPU, far slower than on a GPU" in server.log()) == (not torch.cuda.is_available())
    # 240 tokens: the drain must outlast the checks below (60 tokens drained in 0.37-0.45 s here, which a
    # stalled 2-core CI machine could miss; the server then closes its port).
    stream = StreamReader(server.base_url, max_tokens=240)
    stream.start()
    assert stream.first_chunk.wait(60) and stream.error is None

    server.proc.send_signal(signal.SIGTERM)
    refused = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and stream.is_alive():
        try:
            response = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                                  timeout=30)
        except httpx.TransportError as e:
            raise AssertionError(f"the server stopped listening before the stream drained: {e!r}") from e
        if response.status_code == 503:
            refused = response
            break
        time.sleep(0.02)
    assert refused is not None, "no 503 for a new request while draining"
    assert_openai_error(refused, 503)
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 503

    stream.join(120)
    assert stream.error is None and stream.status == 200
    assert stream.events[-1] == "[DONE]"
    chunks = [e for e in stream.events if isinstance(e, dict)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.wait_exit(30) == 0
    assert "prompt tokens" not in server.log()  # --disable-log-requests
    assert engine_pid is not None
    wait_for(lambda: not pid_alive(engine_pid), 10, "the engine process to exit")


class FullReader(threading.Thread):
    """One non-streamed completion in the background."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = base_url + "/v1/completions"
        self.body = {"prompt": "Tell me everything:", "max_tokens": max_tokens, "ignore_eos": True}
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.response = httpx.post(self.url, json=self.body, timeout=120)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            self.error = e


def test_shutdown_timeout_aborts_the_requests_still_in_flight(own_server: ServerProcess):
    # --shutdown-timeout 1, --max-num-seqs 1 (server_launches): twelve requests of 240 tokens run one after
    # another (2,880 decode steps), far longer than the drain may last. Once it runs out, those still in flight
    # are aborted: each response ends (finish reason "abort"), and the process exits then, not when the last
    # would have finished.
    server = own_server.wait_ready()
    engine_pid = server.engine_pid
    streams = [StreamReader(server.base_url, max_tokens=240) for _ in range(8)]
    fulls = [FullReader(server.base_url, max_tokens=240) for _ in range(4)]
    for reader in (*streams, *fulls):
        reader.start()
    assert streams[0].first_chunk.wait(60) and streams[0].error is None
    time.sleep(0.3)  # the others reach the engine's queue
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit(60) == 0
    finish_reasons = []
    for stream in streams:
        stream.join(10)
        assert stream.error is None and stream.status == 200, stream.error
        assert stream.events[-1] == "[DONE]", stream.events[-3:]
        chunks = [e for e in stream.events if isinstance(e, dict)]
        assert not [c for c in chunks if "error" in c], chunks[-2:]
        finish_reasons.append(chunks[-1]["choices"][0]["finish_reason"])
    for full in fulls:
        full.join(10)
        assert full.error is None and full.response is not None and full.response.status_code == 200, full.error
        finish_reasons.append(full.response.json()["choices"][0]["finish_reason"])
    assert set(finish_reasons) <= {"length", "abort"} and "abort" in finish_reasons, finish_reasons
    assert "shutdown timeout" in server.log() and "Exception in ASGI application" not in server.log()
    assert engine_pid is not None
    wait_for(lambda: not pid_alive(engine_pid), 10, "the engine process to exit")


def test_engine_exits_when_the_api_process_is_killed(own_server: ServerProcess, killed_server_tmpdir: str):
    server = own_server.wait_ready()  # KVSERVE_API_KEY=from-env, TMPDIR=killed_server_tmpdir (server_launches)
    ipc_dirs = [name for name in os.listdir(killed_server_tmpdir) if name.startswith("kvserve-ipc-")]
    assert len(ipc_dirs) == 1, ipc_dirs
    # (While it is up: the API key can come from the environment.)
    assert_openai_error(httpx.get(server.base_url + "/v1/models", timeout=10), 401)
    ok = httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Bearer from-env"}, timeout=10)
    assert ok.status_code == 200
    assert server.engine_pid is not None
    server.proc.kill()
    server.wait_exit(10)
    wait_for(lambda: not pid_alive(server.engine_pid), 15, "the orphaned engine process to exit")
    # The killed API process could not remove its IPC sockets' directory; the engine did, on its way out.
    assert not os.path.exists(os.path.join(killed_server_tmpdir, ipc_dirs[0]))


def _engine_starting(launch_server: Any, tiny_llama_dir: str, env: dict[str, str] | None = None) -> ServerProcess:
    """A server whose engine process was just spawned (still importing or loading), its pid known."""
    server = launch_server([tiny_llama_dir, *FLAGS], wait=False, env=env)
    wait_for(lambda: "engine core process started" in server.log() or server.proc.poll() is not None, 180,
             "the engine process to be started")
    server.engine_pid = server._find_engine_pid()  # finish() kills it should it still be alive
    assert server.engine_pid is not None, server.log()
    return server


def test_sigterm_while_the_engine_starts_leaves_no_engine_process(launch_server, tiny_llama_dir, short_tmpdir):
    """The API process stopped (SIGTERM to it alone: before serving, Python's default action ends it) right after
    it spawned the engine process, which is still importing: the engine must not outlive it. It read its
    parent's pid only once running, which was init's by then, and so never saw the API process gone. Nor may
    the IPC sockets' directory, which the API process had no chance to remove."""
    server = _engine_starting(launch_server, tiny_llama_dir, env={"TMPDIR": short_tmpdir})
    assert [name for name in os.listdir(short_tmpdir) if name.startswith("kvserve-ipc-")], os.listdir(short_tmpdir)
    server.proc.send_signal(signal.SIGTERM)
    server.wait_exit(30)
    wait_for(lambda: not pid_alive(server.engine_pid), 60, "the engine process of a stopped API process to exit")
    assert not [name for name in os.listdir(short_tmpdir) if name.startswith("kvserve-ipc-")]


def test_ctrl_c_while_the_engine_starts_kills_the_loading_engine(launch_server, tiny_llama_dir):
    """Ctrl-C to the API process while the engine loads: the engine reads no message before it is ready and
    ignores SIGINT / SIGTERM, so asking it to stop (then terminating it) only waited 10 + 5 s before the kill.
    A loading engine has nothing to finish: it is killed at once."""
    server = _engine_starting(launch_server, tiny_llama_dir)
    server.proc.send_signal(signal.SIGINT)
    server.wait_exit(60)
    wait_for(lambda: not pid_alive(server.engine_pid), 30, "the engine process to exit")
    log = server.log()
    assert "engine core still starting; killing it" in log, log[-3000:]
    assert "did not exit" not in log, log[-3000:]


def test_engine_start_failure_exits_nonzero_with_its_error(own_server: ServerProcess):
    server = own_server  # --kv-cache-memory 1KiB (server_launches)
    assert server.wait_exit(180) == 1
    log = server.log()
    assert "engine failed to start" in log and "KV cache holds 0 tokens" in log


def test_config_error_exits_2_before_starting_the_engine(own_server: ServerProcess):
    server = own_server  # --max-model-len 100000 (server_launches)
    assert server.wait_exit(60) == 2
    assert "max_model_len=100000" in server.log() and "engine core process started" not in server.log()


def test_busy_port_exits_nonzero(launch_server, tiny_llama_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        server = launch_server([tiny_llama_dir, *FLAGS], wait=False, port=busy.getsockname()[1])
        assert server.wait_exit(60) == 1
    assert "cannot listen" in server.log() and "engine core process started" not in server.log()
