"""`--api-server-count 2`: two API processes share the port and the engine. Both take connections; /metrics,
from either, counts every process's requests (and the engine's counters once); a SIGTERM to the whole process
group drains the streams of both; the engine's death stops both (each sees it); the other process's death
stops the server with exit code 1 and aborts its requests in the engine; a count below 1 is refused."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector

from .conftest import ServerProcess, metric, pid_alive, scrape, wait_for
from .test_lifecycle import StreamReader

FLAGS = ["--max-model-len", "256", "--kv-cache-memory", "64MiB", "--served-model-name", "tiny",
         "--api-server-count", "2", "--timeout-keep-alive", "120", "--disable-uvicorn-access-log"]


@pytest.fixture(scope="module")
def server_launches(tiny_llama_dir: str) -> dict[str, tuple[list[str], dict[str, object]]]:
    """Each test's server (see `module_servers`): three processes each, started together."""
    return {
        # Its own process group: the stop signal goes to every process of it, as a service manager sends it.
        "test_two_api_processes_share_the_port_the_engine_and_the_metrics_and_drain_together":
            ([tiny_llama_dir, *FLAGS], {"new_session": True}),
        "test_a_dead_engine_stops_every_api_process": ([tiny_llama_dir, *FLAGS], {}),
        "test_a_dead_api_process_stops_the_server_and_its_requests": ([tiny_llama_dir, *FLAGS], {}),
    }


def _other_pids(server: ServerProcess) -> list[int]:
    match = re.search(r"started \d+ more API server processes \(pids ([\d, ]+)\)", server.log())
    assert match is not None, server.log()
    return [int(pid) for pid in match.group(1).split(", ")]


def _metrics_dir(pid: int) -> Path:
    """The processes' shared metrics directory (given to the others at spawn, so in their environment)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    for entry in environ:
        if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
            return Path(entry.split(b"=", 1)[1].decode())
    raise AssertionError(f"no PROMETHEUS_MULTIPROC_DIR in process {pid}'s environment")


def _finished_by_process(directory: Path) -> dict[int, float]:
    """Requests each API process finished, from its own metrics file."""
    counts = {}
    for path in directory.glob("counter_*.db"):
        pid = int(path.stem.rsplit("_", 1)[1])
        total = 0.0
        for family in MultiProcessCollector.merge([str(path)], accumulate=False):
            if family.name == "kvserve:request_success":
                total += sum(s.value for s in family.samples if s.name.endswith("_total"))
        counts[pid] = total
    return counts


def _completion(client: httpx.Client, base_url: str) -> dict:
    response = client.post(base_url + "/v1/completions", timeout=60,
                           json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def _connections_to_each_process(server: ServerProcess, directory: Path) -> tuple[dict[int, httpx.Client], list[httpx.Client]]:
    """Fresh kept-alive connections until each API process has answered one: {pid: a client connected to it},
    and every client opened (each answered one greedy 3-token request)."""
    owners: dict[int, httpx.Client] = {}
    clients: list[httpx.Client] = []
    texts = set()
    for _ in range(60):
        client = httpx.Client()
        clients.append(client)
        counts = _finished_by_process(directory)
        texts.add(_completion(client, server.base_url)["choices"][0]["text"])
        after = _finished_by_process(directory)
        (pid,) = [p for p in after if after[p] != counts.get(p, 0.0)]
        owners.setdefault(pid, client)
        if len(owners) == 2:
            break
    assert len(texts) == 1  # the same greedy answer from either process
    return owners, clients


def test_two_api_processes_share_the_port_the_engine_and_the_metrics_and_drain_together(own_server: ServerProcess):
    server = own_server.wait_ready()  # in its own process group (server_launches)
    (other,) = _other_pids(server)
    main = server.proc.pid
    assert server.log().count("engine core process started") == 1  # one engine for both
    directory = _metrics_dir(other)
    before = scrape(server.base_url)

    owners, clients = _connections_to_each_process(server, directory)
    assert set(owners) == {main, other}, f"connections reached only {set(owners)}"
    requests = len(clients)

    # /metrics from either process counts both processes' requests, once each.
    samples = scrape(server.base_url)
    finished = metric(samples, "kvserve:request_success_total", finished_reason="length") - metric(
        before, "kvserve:request_success_total", finished_reason="length")
    generated = metric(samples, "kvserve:generation_tokens_total") - metric(before, "kvserve:generation_tokens_total")
    assert (finished, generated) == (requests, 3 * requests)
    assert sum(_finished_by_process(directory).values()) == finished
    # The engine's counters are recorded by one process: every prompt token was looked up in the prefix
    # cache once, not once per process.
    prompt = metric(samples, "kvserve:prompt_tokens_total") - metric(before, "kvserve:prompt_tokens_total")
    queries = metric(samples, "kvserve:prefix_cache_queries_total") - metric(
        before, "kvserve:prefix_cache_queries_total")
    assert prompt > 0 and queries == prompt
    assert metric(samples, "kvserve:num_requests_running") == 0

    # A stream in flight on each process; SIGTERM to the whole group drains both processes and the engine
    # keeps serving them. A busy machine can let a stream (240 tokens at most under max_model_len 256) end
    # before the other has started: then both are read to the end and the pair started again.
    for _ in range(3):
        streams = {pid: StreamReader(server.base_url, max_tokens=240, client=client)
                   for pid, client in owners.items()}
        for stream in streams.values():
            stream.start()
        for stream in streams.values():
            assert stream.first_chunk.wait(60) and stream.error is None
        if not any(stream.finished for stream in streams.values()):
            break
        for stream in streams.values():
            stream.join(120)
    else:
        pytest.fail("in 3 tries a stream ended before the signal")
    server.terminate()
    for pid, stream in streams.items():
        stream.join(120)
        assert stream.error is None and stream.status == 200, (pid, stream.error, stream.status)
        chunks = [e for e in stream.events if isinstance(e, dict)]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and stream.finished, pid
        assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 0
    assert server.wait_exit(60) == 0
    for client in clients:
        client.close()
    assert not pid_alive(other)
    assert server.engine_pid is not None
    wait_for(lambda: not pid_alive(server.engine_pid), 10, "the engine process to exit")
    assert not directory.exists()  # the first process removes the metrics directory


def test_a_dead_engine_stops_every_api_process(own_server: ServerProcess):
    server = own_server.wait_ready()
    (other,) = _other_pids(server)
    assert server.engine_pid is not None
    os.kill(server.engine_pid, signal.SIGKILL)
    assert server.wait_exit(30) == 1
    wait_for(lambda: not pid_alive(other), 15, "the other API process to exit")
    log = server.log()
    # Each process saw the death itself: the first with the exit code of its child, the other (not its
    # parent) through the engine's pidfd, without one.
    assert "engine core is dead: the engine core process exited unexpectedly (exit code -9)" in log
    assert re.search(r"engine core is dead: the engine core process exited unexpectedly$", log, re.MULTILINE), log


def test_a_dead_api_process_stops_the_server_and_its_requests(own_server: ServerProcess):
    server = own_server.wait_ready()
    (other,) = _other_pids(server)
    owners, clients = _connections_to_each_process(server, _metrics_dir(other))
    assert other in owners
    # A request in flight on the process that dies: the engine aborts it instead of running it for nobody.
    stream = StreamReader(server.base_url, max_tokens=240, client=owners[other])
    stream.start()
    assert stream.first_chunk.wait(60) and stream.error is None
    os.kill(other, signal.SIGKILL)
    assert server.wait_exit(60) == 1
    log = server.log()
    assert re.search(r"API server process kvserve-api-1 \(pid \d+\) exited with code -9", log)
    assert "API process 1 exited; aborted its 1 unfinished requests" in log
    assert server.engine_pid is not None
    wait_for(lambda: not pid_alive(server.engine_pid), 15, "the engine process to exit")
    for client in clients:
        client.close()


def test_api_server_count_below_one_is_refused(launch_server: Callable[..., ServerProcess], tiny_llama_dir: str):
    server = launch_server([tiny_llama_dir, "--api-server-count", "0"], wait=False)
    assert server.wait_exit(60) == 2
    assert "argument --api-server-count/-asc: must be at least 1, got 0" in server.log()
