"""`kvserve serve --tensor-parallel-size 2` on the CPU: the server answers as a one-rank server does, stops
with every rank on SIGTERM, and stops (exit 1) when a rank dies, instead of hanging in its collectives."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from .conftest import TINY_SERVER_FLAGS, ServerProcess, pid_alive, wait_for

SPLIT_FLAGS = [*TINY_SERVER_FLAGS, "--tensor-parallel-size", "2", "--dtype", "float32"]


@pytest.fixture(scope="module")
def server_launches(tiny_llama_dir: str) -> dict[str, tuple[list[str], dict[str, object]]]:
    """Each test's two-rank server (see `module_servers`), started together."""
    return {
        "test_two_ranks_answer_as_one_and_stop_together": ([tiny_llama_dir, *SPLIT_FLAGS], {}),
        "test_a_dead_rank_stops_the_server": ([tiny_llama_dir, *SPLIT_FLAGS], {}),
    }


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _complete(server: ServerProcess, prompt: str) -> dict:
    response = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 2,
    })
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _split_server(launched: ServerProcess) -> tuple[ServerProcess, int]:
    server = launched.wait_ready()
    assert server.engine_pid is not None
    (rank1,) = _children(server.engine_pid)  # the engine's one child: rank 1
    return server, rank1


def test_two_ranks_answer_as_one_and_stop_together(own_server: ServerProcess, tiny_server: ServerProcess) -> None:
    server, rank1 = _split_server(own_server)
    for prompt in ["Hello, my name is", "The capital of France is"]:
        split, one = _complete(server, prompt), _complete(tiny_server, prompt)
        assert split["text"] == one["text"]
        assert split["logprobs"]["tokens"] == one["logprobs"]["tokens"]
    server.terminate()
    assert server.wait_exit(60) == 0
    assert server.engine_pid is not None
    wait_for(lambda: not pid_alive(server.engine_pid), 15, "the engine process to exit")  # type: ignore[arg-type]
    wait_for(lambda: not pid_alive(rank1), 15, "rank 1 to exit")


def test_a_dead_rank_stops_the_server(own_server: ServerProcess) -> None:
    server, rank1 = _split_server(own_server)
    os.kill(rank1, signal.SIGKILL)
    assert server.wait_exit(60) == 1
    assert server.engine_pid is not None
    wait_for(lambda: not pid_alive(server.engine_pid), 15, "the engine process to exit")  # type: ignore[arg-type]
    log = server.log()
    assert "tensor-parallel rank 1 exited (code -9); the engine cannot continue without it" in log, log[-3000:]
    assert "engine core is dead" in log
