"""Real servers for the server tests: `python -m kvserve.entrypoints.openai.api_server` on 127.0.0.1, on a
free port, in its own process (plus the engine-core process it spawns). Every wait is bounded.

* `ServerProcess` starts one, waits for /health 200, and stops it (SIGTERM, then SIGKILL of the server
  and of its engine process, by pid).
* `tiny_server` (session): the tiny random Llama checkpoint, `--metrics-compat vllm`, served as "tiny".
* `strict_server` (session): API key, small limits, `--chat-template`; started as
  `python -m kvserve.entrypoints.openai.api_server --model ...` (the others use `kvserve serve MODEL`).
  Shared by the API, load and metrics tests: tests that read metrics measure differences.
* `module_servers` / `own_server`: a server per test for tests that stop theirs, the module's all launched
  together (a module lists them in a `server_launches` fixture).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from helpers.ports import free_port
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_NAME = "tiny"
# Start-up includes importing torch/transformers twice (API and engine processes) on a 2-core machine that
# may be busy with other work; generous, but bounded.
STARTUP_TIMEOUT_S = 180.0


def _environment(changes: dict[str, str | None] | None) -> dict[str, str]:
    """This process's environment with `changes` applied (None: the variable unset)."""
    merged: dict[str, str | None] = {**os.environ, **(changes or {})}
    return {name: value for name, value in merged.items() if value is not None}


class ServerProcess:
    """One `kvserve serve` process (`python -m kvserve serve`, whose spawned engine process skips re-importing
    the main module). `argv` are the flags after the program name (no --host/--port)."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str | None] | None = None,
                 cwd: Path | None = None, program: list[str] | None = None, port: int | None = None,
                 add_address: bool = True, new_session: bool = False) -> None:
        """`program` replaces `python -m kvserve.entrypoints.openai.api_server`; `env` is added to this
        process's environment (a None value removes that variable); `add_address=False` leaves out
        --host/--port; `new_session` puts it in its own process group, signalled as a whole (make)."""
        self.port = port if port is not None else free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = (program or [sys.executable, "-m", "kvserve", "serve"]) + argv
        if add_address:
            command += ["--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.new_session = new_session
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd or REPO_ROOT,
                                     env=_environment(env), start_new_session=new_session)
        self.engine_pid: int | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    self.engine_pid = self._find_engine_pid()
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"server not healthy within {timeout_s:.0f} s:\n{self.log()}")

    def _find_engine_pid(self) -> int | None:
        match = re.search(r"engine core process started \(pid (\d+)\)", self.log())
        return int(match.group(1)) if match else None

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server still running after {timeout_s} s:\n{self.log()[-3000:]}") from None

    def stop(self) -> None:
        self.terminate()
        self.finish()

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM: drain and exit); `finish()` waits."""
        if self.proc.poll() is None:
            if self.new_session:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the group this object started
            else:
                self.proc.send_signal(signal.SIGTERM)

    def finish(self) -> None:
        """Wait for the exit (SIGKILL after 30 s), make sure its engine process is gone, close the log."""
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.engine_pid is not None and pid_alive(self.engine_pid):
            # The engine exits by itself within a second of losing its parent; don't leave it if it hangs.
            deadline = time.monotonic() + 5
            while pid_alive(self.engine_pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if pid_alive(self.engine_pid):
                os.kill(self.engine_pid, signal.SIGKILL)
        if not self._log.closed:
            self._log.close()


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


@pytest.fixture(scope="session")
def launch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """`launch_server(argv, **kwargs)` -> a started ServerProcess, stopped at the end of the session
    (tests that stop it themselves may)."""
    started: list[ServerProcess] = []
    logs = tmp_path_factory.mktemp("server-logs")

    def launch(argv: list[str], wait: bool = True, **kwargs: object) -> ServerProcess:
        server = ServerProcess(argv, logs / f"server-{len(started)}.log", **kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server.wait_ready() if wait else server

    yield launch
    for server in started:  # all at once: each takes seconds to drain and exit
        server.terminate()
    for server in started:
        server.finish()


@pytest.fixture(scope="module")
def module_servers(request: pytest.FixtureRequest, launch_server: Callable[..., ServerProcess],
                   server_launches: dict[str, tuple[list[str], dict[str, object]]]) -> dict[str, ServerProcess]:
    """For a module whose tests each stop a server of their own (kill its engine, SIGTERM it, ...): the servers
    of the module's `server_launches` fixture ({test name: (argv, launch_server keyword arguments)}) whose
    tests this session runs, all launched (not waited for) when the first is asked for, so that their
    start-ups (torch imported in two processes or more each) overlap instead of adding up. `own_server` gives
    a test its own."""
    selected = {getattr(item, "originalname", item.name) for item in request.session.items
                if getattr(item, "module", None) is request.module}
    return {name: launch_server(argv, wait=False, **kwargs)
            for name, (argv, kwargs) in server_launches.items() if name in selected}


@pytest.fixture
def own_server(request: pytest.FixtureRequest, module_servers: dict[str, ServerProcess]) -> ServerProcess:
    """The running test's server from `module_servers`: launched, maybe not ready yet (`wait_ready()` or
    `wait_exit()` it)."""
    return module_servers[request.node.originalname]  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir: Callable[..., str]) -> str:
    return tiny_model_dir("llama")


TINY_SERVER_FLAGS = ["--served-model-name", TINY_NAME, "--max-model-len", "256", "--kv-cache-memory", "64MiB",
                     "--metrics-compat", "vllm", "--disable-uvicorn-access-log",
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


@pytest.fixture(scope="session")
def tiny_server(launch_server: Callable[..., ServerProcess], tiny_llama_dir: str) -> ServerProcess:
    return launch_server([tiny_llama_dir, *TINY_SERVER_FLAGS])


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


# ------------------------------------------------------------------------------------------ metrics


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}, parsed with prometheus_client's parser."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": TINY_NAME, **labels}.items())))
    assert key in samples, f"{name}{labels} missing from /metrics"
    return samples[key]


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def read_sse(response: httpx.Response) -> list[dict | str]:
    """The data payloads of an SSE response, JSON-decoded ("[DONE]" kept as the string)."""
    import json

    events: list[dict | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---------------------------------------------------------------------------------- strict server

STRICT_NAME = "strict"
STRICT_ALIAS = "strict-alias"
API_KEY = "test-secret-key"
STRICT_MAX_MODEL_LEN = 32
STRICT_MAX_BODY_BYTES = 65536
# A short template: chat prompts of a few tokens leave room for output under max_model_len=32.
STRICT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="session")
def strict_server(launch_server: Callable[..., ServerProcess], tiny_llama_dir: str,
                  tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """API key, a small body limit, max_model_len 32 and a --chat-template file: the error and fuzz tests."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(STRICT_CHAT_TEMPLATE)
    # The other documented entry point: python -m kvserve.entrypoints.openai.api_server --model ...
    return launch_server(program=[sys.executable, "-m", "kvserve.entrypoints.openai.api_server"], argv=[
        "--model", tiny_llama_dir, "--served-model-name", STRICT_NAME, STRICT_ALIAS,
        "--max-model-len", str(STRICT_MAX_MODEL_LEN), "--kv-cache-memory", "64MiB",
        "--api-key", API_KEY, "--max-request-body-bytes", str(STRICT_MAX_BODY_BYTES),
        "--chat-template", str(template), "--disable-uvicorn-access-log",
    ])


def assert_openai_error(response: httpx.Response, status: int, param: str | None = "<any>") -> dict:
    """The response has `status` and OpenAI's error body; returns the error object."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    if param != "<any>":
        assert error["param"] == param, error
    return error
