"""`--api-server-count 2`: two API processes share the port and the engine. Both take connections; /metrics,
from either, counts every process's requests; SIGTERM drains the streams of both; the engine's death or the
other process's stops the server with exit code 1; a count below 1 is refused."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.multiprocess import MultiProcessCollector

from .conftest import ServerProcess, metric, pid_alive, scrape, wait_for
from .test_lifecycle import StreamReader

FLAGS = ["--max-model-len", "256", "--kv-cache-memory", "64MiB", "--served-model-name", "tiny",
         "--api-server-count", "2", "--timeout-keep-alive", "120", "--disable-uvicorn-access-log"]


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


def test_two_api_processes_share_the_port_the_engine_and_the_metrics_and_drain_together(
        launch_server: Callable[..., ServerProcess], tiny_llama_dir: str):
    server = launch_server([tiny_llama_dir, *FLAGS])
    (other,) = _other_pids(server)
    main = server.proc.pid
    assert pid_alive(other)
    directory = _metrics_dir(other)
    before = scrape(server.base_url)

    # Fresh connections until each process has answered one; each kept-alive client stays with its process.
    owners: dict[int, httpx.Client] = {}
    texts = set()
    clients = []
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
    assert set(owners) == {main, other}, f"connections reached only {set(owners)}"
    assert len(texts) == 1  # one engine: the same greedy answer from either process
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

    # Streams in flight; SIGTERM to the first process drains both processes.
    for client in clients:
        client.close()
    streams = [StreamReader(server.base_url, max_tokens=80) for _ in range(6)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first_chunk.wait(60) and stream.error is None
    in_flight = _finished_by_process(directory)
    server.proc.send_signal(signal.SIGTERM)
    for stream in streams:
        stream.join(120)
        assert stream.error is None and stream.status == 200
        chunks = [e for e in stream.events if isinstance(e, dict)]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and stream.events[-1] == "[DONE]"
    drained = {pid: _finished_by_process(directory)[pid] - in_flight.get(pid, 0.0) for pid in (main, other)}
    assert sum(drained.values()) == len(streams)
    assert server.wait_exit(60) == 0
    assert not pid_alive(other)
    assert server.engine_pid is not None
    wait_for(lambda: not pid_alive(server.engine_pid), 10, "the engine process to exit")
    assert not directory.exists()  # the first process removes the metrics directory


def test_a_dead_engine_stops_every_api_process(launch_server: Callable[..., ServerProcess], tiny_llama_dir: str):
    server = launch_server([tiny_llama_dir, *FLAGS])
    (other,) = _other_pids(server)
    assert server.engine_pid is not None
    os.kill(server.engine_pid, signal.SIGKILL)
    assert server.wait_exit(30) == 1
    wait_for(lambda: not pid_alive(other), 15, "the other API process to exit")
    assert "engine core is dead" in server.log()


def test_a_dead_api_process_stops_the_server(launch_server: Callable[..., ServerProcess], tiny_llama_dir: str):
    server = launch_server([tiny_llama_dir, *FLAGS])
    (other,) = _other_pids(server)
    os.kill(other, signal.SIGKILL)
    assert server.wait_exit(60) == 1
    assert re.search(r"API server process kvserve-api-1 \(pid \d+\) exited with code -9", server.log())
    assert server.engine_pid is not None
    wait_for(lambda: not pid_alive(server.engine_pid), 15, "the engine process to exit")


def test_api_server_count_below_one_is_refused(launch_server: Callable[..., ServerProcess], tiny_llama_dir: str):
    server = launch_server([tiny_llama_dir, "--api-server-count", "0"], wait=False)
    assert server.wait_exit(60) == 2
    assert "argument --api-server-count/-asc: must be at least 1, got 0" in server.log()
