"""`kvserve serve --data-parallel-size 2` on CPU (tiny random Llama): two real replicas behind one port.
Requests reach both, /metrics labels each replica's series engine="<i>", the API key is checked, the body limit
is the server's, SIGTERM stops every process. One server start: the lifecycle with failing, dying and signalled
replicas is tested in tests/unit/test_data_parallel_replicas.py with fake replicas."""

from __future__ import annotations

import re
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServerProcess, assert_openai_error, pid_alive, wait_for

API_KEY = "dp-key"
MAX_BODY_BYTES = 100_000


@pytest.fixture(scope="module")
def server_launches(tiny_llama_dir: str) -> dict[str, tuple[list[str], dict[str, object]]]:
    """Each test's command (see `module_servers`)."""
    return {
        # Spelled as a vLLM user might: `-d 2` is argparse's abbreviation of -dp, and the model comes after it
        # (each replica must still parse one replica, and MODEL as the model, not as a second served name).
        "test_two_replicas_serve_behind_one_port_and_stop_together": (
            ["--served-model-name", "tiny", "-d", "2", tiny_llama_dir, "--device", "cpu", "--max-model-len", "256",
             "--kv-cache-memory", "64MiB", "--disable-uvicorn-access-log", "--disable-log-requests",
             "--api-key", API_KEY, "--max-request-body-bytes", str(MAX_BODY_BYTES)], {}),
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
    assert server.log().count("started replica ") == 2  # the replicas started none of their own
    assert "--data-parallel-size 1 ignored" not in server.log()

    # The key is checked (by the replicas; the router passes the header on), and the model is listed once.
    assert_openai_error(httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30), 401)
    models = httpx.get(base + "/v1/models", headers=auth, timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]

    # The router's answers: /ping goes to a replica; a body over --max-request-body-bytes is a 413 with
    # OpenAI's error body, as one server answers.
    assert httpx.get(base + "/ping", timeout=10).status_code == 200
    too_big = httpx.post(base + "/v1/completions", headers=auth, timeout=30,
                         json={"model": "tiny", "prompt": "x" * MAX_BODY_BYTES, "max_tokens": 1})
    assert_openai_error(too_big, 413)

    # Prompts that start differently spread over the replicas (the prefix policy hashes their starts).
    # Counted from here: the requests above (the 401, /ping) reached a replica too.
    before = [b["served"] for b in httpx.get(base + "/router/backends", timeout=10).json()["backends"]]
    completed = 0
    for i in range(40):
        response = httpx.post(base + "/v1/completions", headers=auth, timeout=60,
                              json={"model": "tiny", "prompt": f"{i} is where this prompt starts", "max_tokens": 2,
                                    "ignore_eos": True})
        assert response.status_code == 200, response.text
        completed += 1
        served = [b["served"] - earlier for b, earlier in
                  zip(httpx.get(base + "/router/backends", timeout=10).json()["backends"], before, strict=True)]
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
