"""Fixtures of the bench tests.

* `fake_server(**behavior)` -> a started `FakeOpenAIServer` on 127.0.0.1 (stopped after the test).
* `prompts_file` -> a JSONL prompt file (the `file` dataset needs no tokenizer).
* `bench(endpoint, *flags)` -> (BenchResult, BenchConfig): `kvserve bench` flags parsed by the real CLI
  parser and run in-process, without a progress bar.
* `kvserve_server` (module) -> base URL of a real `kvserve serve` on a tiny random Llama (max-model-len 512,
  served as "tiny"), started as its own process and stopped after the module; every wait bounded.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.ports import free_port

from bench.fake_server import FakeBehavior, FakeOpenAIServer
from kvserve.bench.cli_args import config_from_args
from kvserve.bench.config import BenchConfig
from kvserve.bench.results import BenchResult
from kvserve.bench.runner import run_benchmark
from kvserve.entrypoints.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_STARTUP_TIMEOUT_S = 180.0
TINY_SERVED_NAME = "tiny"


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeOpenAIServer]]:
    started: list[FakeOpenAIServer] = []

    def start(**behavior: object) -> FakeOpenAIServer:
        server = FakeOpenAIServer(FakeBehavior(**behavior)).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


PROMPTS = [
    {"prompt": "Write a haiku about the sea."},
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Name three rivers in Europe."}]},
    {"prompt": "请用一句话介绍长城。"},
]


@pytest.fixture
def prompts_file(tmp_path: Path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in PROMPTS), encoding="utf-8")
    return str(path)


def parse_bench(endpoint: str, *flags: str) -> BenchConfig:
    ns = build_parser().parse_args(["bench", "--endpoint", endpoint, "--no-progress", *flags])
    return config_from_args(ns)


@pytest.fixture
def bench() -> Callable[..., tuple[BenchResult, BenchConfig]]:
    def run(endpoint: str, *flags: str) -> tuple[BenchResult, BenchConfig]:
        config = parse_bench(endpoint, *flags)
        return run_benchmark(config, log=io.StringIO()), config

    return run


# ------------------------------------------------------------------------------------------ real server


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Callable[..., str]) -> Any:
    """The tiny llama checkpoint's HF tokenizer (the datasets' token counts)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def kvserve_model_dir(tiny_model_dir: Callable[..., str]) -> str:
    # 1024 positions so that the seeds' default 256-token prompts fit under --max-model-len 512.
    return tiny_model_dir("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def kvserve_server(kvserve_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("bench-server") / "server.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve", "serve", kvserve_model_dir, "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "512", "--served-model-name", TINY_SERVED_NAME, "--disable-uvicorn-access-log"],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=dict(os.environ),
    )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_STARTUP_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"kvserve serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"kvserve serve not healthy in {SERVER_STARTUP_TIMEOUT_S:.0f} s:\n"
                            f"{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield base_url
    finally:
        match = re.search(r"engine core process started \(pid (\d+)\)", log_path.read_text(errors="replace"))
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if match:
            engine_pid = int(match.group(1))
            stop_by = time.monotonic() + 5
            while _pid_alive(engine_pid) and time.monotonic() < stop_by:
                time.sleep(0.1)
            if _pid_alive(engine_pid):
                os.kill(engine_pid, signal.SIGKILL)
        log.close()


def scrape_counter(base_url: str, name: str) -> float:
    """Sum of a /metrics sample over its label sets (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total
