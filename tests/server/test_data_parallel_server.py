"""`kvserve serve --data-parallel-size 2` on CPU (tiny random Llama): two real replicas behind one port.
Requests reach both, /metrics labels each replica's series engine="<i>", the API key is checked, the body limit
is the server's, SIGTERM stops every process. A replica whose API process is SIGKILLed stops the server, and what
it left in the temporary directory (its IPC sockets' and its metrics directories, named with its tag: its engine
core, killed with it, could not remove them) is removed. Two server starts, together: the rest of the lifecycle with failing, dying and signalled replicas
is tested in tests/unit/test_data_parallel_replicas.py with fake replicas."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServerProcess, assert_openai_error, pid_alive, wait_for

API_KEY = "dp-key"
MAX_BODY_BYTES = 100_000


@pytest.fixture(scope="module")
def killed_replica_tmpdir() -> Iterator[str]:
    """The temporary directory (TMPDIR) of the server whose replica is killed: where its replicas' IPC sockets
    and metrics files are. Directly in /tmp: the sockets' paths must stay within a Unix socket's 107 characters."""
    directory = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def server_launches(tiny_llama_dir: str, killed_replica_tmpdir: str) -> dict[str, tuple[list[str], dict[str, object]]]:
    """Each test's command (see `module_servers`)."""
    return {
        # Two API processes per replica: each replica makes a metrics directory too.
        # No --device, and no GPU to be seen: the CPU fallback's warning. With a flag and a variable of vLLM's
        # that kvserve ignores, said once by the parent, not by each replica.
        "test_a_killed_replica_stops_the_server_and_leaves_nothing_in_the_temporary_directory": (
            ["-dp", "2", tiny_llama_dir, "--max-model-len", "256", "--kv-cache-memory", "64MiB",
             "--api-server-count", "2", "--disable-uvicorn-access-log", "--swap-space", "4"],
            {"env": {"TMPDIR": killed_replica_tmpdir, "CUDA_VISIBLE_DEVICES": "", "VLLM_USE_V1": "1"}}),
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
    # The router's series name each replica by its index, as `engine` does, not by its port (picked at each
    # start: a url label began new series at every restart).
    backends = {sample.labels["backend"] for family in text_string_to_metric_families(text)
                if family.name.startswith("kvserve_router:") for sample in family.samples if "backend" in sample.labels}
    assert backends >= {"0", "1"} and backends <= {"0", "1", "none"}, backends

    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit(60) == 0
    for pid in [*replicas.values(), *engines.values()]:
        wait_for(lambda pid=pid: not pid_alive(pid), 10, f"process {pid} to exit")


def _replica_dirs(directory: str) -> list[str]:
    """The directories that kvserve makes in `directory` (the IPC sockets', the metrics files')."""
    return sorted(name for name in os.listdir(directory) if name.startswith(("kvserve-ipc-", "kvserve-metrics-")))


def _tag(pid: int) -> str:
    """The KVSERVE_DP_REPLICA_TAG in process `pid`'s environment."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        tags = [entry.split(b"=", 1)[1].decode() for entry in f.read().split(b"\0")
                if entry.startswith(b"KVSERVE_DP_REPLICA_TAG=")]
    assert len(tags) == 1, tags
    return tags[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_replica_stops_the_server_and_leaves_nothing_in_the_temporary_directory(
        own_server: ServerProcess, killed_replica_tmpdir: str) -> None:
    """A replica's API process SIGKILLed (the OOM killer): the server stops (exit 1), and the killed replica's
    process group, its engine core and its other API process with it, is SIGKILLed at once, so none could
    remove the engine's IPC directory or the metrics directory; the server removes them (the other replica,
    stopped, removes its own). Every death of a replica left them in the temporary directory."""
    server = own_server.wait_ready()  # TMPDIR=killed_replica_tmpdir (server_launches)
    replicas, engines = _replica_pids(server), _engine_pids(server)
    assert set(replicas) == {0, 1} and set(engines) == {0, 1}, server.log()
    for said_once in ("no CUDA GPU (", "--swap-space ignored", "vLLM environment variables kvserve does not read"):
        assert server.log().count(said_once) == 1, said_once
    # An IPC and a metrics directory each, named with the replica's own tag.
    tags = {index: _tag(pid) for index, pid in replicas.items()}
    assert len(set(tags.values())) == 2 and all(re.fullmatch(r"[0-9a-f]{8}", t) for t in tags.values()), tags
    made = _replica_dirs(killed_replica_tmpdir)
    assert sorted(name.rsplit("-", 1)[0] for name in made) == sorted(
        f"kvserve-{kind}-{tag}" for tag in tags.values() for kind in ("ipc", "metrics")), made
    os.kill(replicas[1], signal.SIGKILL)
    assert server.wait_exit(60) == 1
    assert "exited with code -9 while serving" in server.log()
    for pid in [*replicas.values(), *engines.values()]:
        wait_for(lambda pid=pid: not pid_alive(pid), 10, f"process {pid} to exit")
    assert _replica_dirs(killed_replica_tmpdir) == [], server.log()[-3000:]
    assert f"removed what replica 1 (pid {replicas[1]}, exit code -9) left in the temporary directory" in server.log()
