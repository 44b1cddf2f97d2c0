"""`kvserve serve --data-parallel-size 2` on CPU (tiny random Llama): two replicas behind one port. Requests
reach both, /metrics labels each replica's series engine="<i>", the API key is checked, SIGTERM stops every
process; a replica that dies stops the server (exit 1), and one that fails to start fails the command with
its error."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServerProcess, assert_openai_error, pid_alive, wait_for

API_KEY = "dp-key"
FLAGS = ["--data-parallel-size", "2", "--device", "cpu", "--served-model-name", "tiny", "--max-model-len", "256",
         "--kv-cache-memory", "64MiB", "--disable-uvicorn-access-log", "--disable-log-requests"]


@pytest.fixture(scope="module")
def server_launches(tiny_llama_dir: str) -> dict[str, tuple[list[str], dict[str, object]]]:
    """Each test's command (see `module_servers`), started together."""
    return {
        "test_two_replicas_serve_behind_one_port_and_stop_together": (
            [tiny_llama_dir, *FLAGS, "--api-key", API_KEY], {}),
        "test_a_replica_that_dies_stops_the_server": ([tiny_llama_dir, *FLAGS], {}),
        # --kv-cache-memory 1KiB passes the command's checks, and each replica's engine then refuses it.
        "test_a_replica_that_fails_to_start_fails_the_command": (
            [tiny_llama_dir, "-dp", "2", "--device", "cpu", "--max-model-len", "256", "--kv-cache-memory", "1KiB"],
            {}),
    }


def _replica_pids(server: ServerProcess) -> dict[int, int]:
    """{replica index: pid of its `kvserve serve` process}, from the start-up log."""
    found = re.findall(r"started replica (\d+) on CPU at \S+ \(pid (\d+)\)", server.log())
    return {int(index): int(pid) for index, pid in found}


def _engine_pids(server: ServerProcess) -> dict[int, int]:
    found = re.findall(r"\(replica (\d+)\) .*engine core process started \(pid (\d+)\)", server.log())
    return {int(index): int(pid) for index, pid in found}


def _generated_by_engine(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return {s.labels["engine"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "kvserve:generation_tokens_total"}


def test_two_replicas_serve_behind_one_port_and_stop_together(own_server: ServerProcess) -> None:
    server = own_server.wait_ready()
    base, auth = server.base_url, {"Authorization": f"Bearer {API_KEY}"}
    replicas, engines = _replica_pids(server), _engine_pids(server)
    assert set(replicas) == {0, 1} and set(engines) == {0, 1}, server.log()
    assert "from 2 data-parallel replicas" in server.log()

    # The key is checked (by the replicas; the router passes the header on), and the model is listed once.
    assert_openai_error(httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30), 401)
    models = httpx.get(base + "/v1/models", headers=auth, timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]

    # Prompts that start differently spread over the replicas (the prefix policy hashes their starts).
    completed = 0
    for i in range(40):
        response = httpx.post(base + "/v1/completions", headers=auth, timeout=60,
                              json={"model": "tiny", "prompt": f"{i} is where this prompt starts", "max_tokens": 2,
                                    "ignore_eos": True})
        assert response.status_code == 200, response.text
        completed += 1
        served = [b["served"] for b in httpx.get(base + "/router/backends", timeout=10).json()["backends"]]
        if i >= 3 and min(served) > 0:
            break
    assert len(served) == 2 and min(served) > 0, served

    # /metrics: each replica's series under engine="<i>", in a valid exposition (one TYPE line per family),
    # with the router's own series.
    generated = _generated_by_engine(base)
    assert set(generated) == {"0", "1"} and min(generated.values()) > 0, generated
    assert sum(generated.values()) == 2 * completed  # each once, by the replica that served it
    text = httpx.get(base + "/metrics", timeout=10).text
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)) and "kvserve_router:requests_total" in types

    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit(60) == 0
    for pid in [*replicas.values(), *engines.values()]:
        wait_for(lambda pid=pid: not pid_alive(pid), 10, f"process {pid} to exit")


def test_a_replica_that_dies_stops_the_server(own_server: ServerProcess) -> None:
    server = own_server.wait_ready()
    replicas, engines = _replica_pids(server), _engine_pids(server)
    assert set(replicas) == {0, 1}, server.log()
    httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60)
    os.kill(replicas[1], signal.SIGKILL)
    assert server.wait_exit(60) == 1
    assert re.search(r"replica 1 on CPU .* exited with code -9 while serving: stopping the other replicas",
                     server.log()), server.log()[-3000:]
    for pid in [*replicas.values(), *engines.values()]:
        wait_for(lambda pid=pid: not pid_alive(pid), 10, f"process {pid} to exit")


def test_a_replica_that_fails_to_start_fails_the_command(own_server: ServerProcess) -> None:
    server = own_server
    assert server.wait_exit(180) == 1
    log = server.log()
    # The failing replica's own error is repeated with its index.
    assert re.search(r"replica \d on CPU .* exited with code 1 during start-up; its last output:\n", log), log
    assert "KV cache holds 0 tokens" in log.split("during start-up; its last output:")[1]
    with pytest.raises(httpx.ConnectError):  # the public port never opened
        httpx.get(server.base_url + "/health", timeout=5)
    for pid in _replica_pids(server).values():
        wait_for(lambda pid=pid: not pid_alive(pid), 10, f"process {pid} to exit")
