"""`kvserve chat` / `kvserve complete`: the terminal client of a running server (vLLM's `vllm chat` /
`vllm complete`).

Against the real tiny server (through a proxy that records what the server sent, so the printed answer can
be compared with the server's own stream whatever it sampled) and against the bench tests' fake server, whose
answers are known words and which records each request's body and Authorization header.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from bench.fake_server import MODEL, FakeBehavior, FakeOpenAIServer, answer_text
from helpers.ports import free_port
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvserve import envs
from kvserve.entrypoints import chat_cli
from kvserve.entrypoints.cli import main

from .conftest import ServerProcess

REPO_ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ helpers


class ChatFake(FakeOpenAIServer):
    """The bench fake with a chosen model list (its first is the default model) and, optionally, an API key
    that /v1/* requires (a 401 with OpenAI's error body otherwise, as kvserve's)."""

    def __init__(self, behavior: FakeBehavior, models: tuple[str, ...], api_key: str | None) -> None:
        self.models = models
        self.api_key = api_key
        self.models_authorizations: list[str | None] = []
        super().__init__(behavior)

    def _refused(self, request: Request) -> Response | None:
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return JSONResponse({"error": {"message": "Invalid API key.", "type": "AuthenticationError",
                                           "param": None, "code": 401}}, status_code=401)
        return None

    async def _models(self, request: Request) -> Response:
        self.models_authorizations.append(request.headers.get("authorization"))
        return self._refused(request) or JSONResponse(
            {"object": "list", "data": [{"id": name, "object": "model"} for name in self.models]})

    async def _completions(self, request: Request) -> Response:
        return self._refused(request) or await super()._completions(request)


@pytest.fixture
def fake() -> Iterator[Callable[..., ChatFake]]:
    started: list[ChatFake] = []

    def start(models: tuple[str, ...] = (MODEL,), api_key: str | None = None, **behavior: object) -> ChatFake:
        server = ChatFake(FakeBehavior(**behavior), models, api_key).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(autouse=True)
def no_key_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys of this process's environment (read at import by kvserve.envs) left out of these tests."""
    for name in ("OPENAI_API_KEY", "KVSERVE_API_KEY", "VLLM_API_KEY"):
        monkeypatch.setattr(envs, name, None)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`kvserve *argv` in this process: (exit status, stdout, stderr)."""
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def cli_env(**changes: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "KVSERVE_API_KEY", "VLLM_API_KEY")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return {**env, **changes}


def run_interactive(argv: list[str], stdin: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m kvserve *argv` with `stdin` as its input (the interactive loop)."""
    return subprocess.run([sys.executable, "-m", "kvserve", *argv], input=stdin, capture_output=True, text=True,
                          timeout=timeout_s, env=cli_env(), cwd=REPO_ROOT)


class Recorder:
    """A proxy in front of a server that keeps each answer's raw body (the answer read whole, then sent on)."""

    def __init__(self, upstream_port: int) -> None:
        self.bodies: list[bytes] = []
        self.requests: list[dict] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else None
                if body:
                    recorder.requests.append(json.loads(body))
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                conn.close()
                if self.command == "POST":
                    recorder.bodies.append(data)
                self.send_response(response.status)
                self.send_header("Content-Type", response.getheader("content-type") or "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = _forward
            do_POST = _forward

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def streamed_text(body: bytes, chat: bool) -> str:
    """The answer's text as the server streamed it (independently of the CLI's parsing: the data lines)."""
    text = ""
    for line in body.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                text += (choice["delta"].get("content") or "") if chat else choice["text"]
    return text


@pytest.fixture
def recorder(tiny_server: ServerProcess) -> Iterator[Recorder]:
    proxy = Recorder(tiny_server.port)
    yield proxy
    proxy.stop()


# --------------------------------------------------------------------------------- the real server


@pytest.mark.parametrize("command", ["chat", "complete"])
def test_quick_prints_the_real_servers_streamed_answer(capsys: pytest.CaptureFixture[str], recorder: Recorder,
                                                       command: str) -> None:
    chat = command == "chat"
    rc, out, err = run_cli(capsys, command, "--url", recorder.url, "-q", "Hello there", "--max-tokens", "8")
    assert rc == 0, err
    [body] = recorder.bodies
    expected = streamed_text(body, chat)
    assert expected.strip(), body  # the tiny model's 8 tokens decode to some text
    assert out == expected + "\n"
    assert err == ""
    request = recorder.requests[0]
    assert request["model"] == "tiny"  # the first (only) model of GET /v1/models
    assert request["stream"] is True and request["max_tokens"] == 8
    if chat:
        assert request["messages"] == [{"role": "user", "content": "Hello there"}]
    else:
        assert request["prompt"] == "Hello there"


def test_unknown_model_on_the_real_server_is_its_404_message(capsys: pytest.CaptureFixture[str],
                                                               tiny_server: ServerProcess) -> None:
    rc, out, err = run_cli(capsys, "chat", "--url", tiny_server.base_url + "/v1", "--model-name", "nope",
                           "-q", "hi")
    assert rc == 1
    assert "HTTP 404" in err and "nope" in err and "Traceback" not in err, err
    assert out == ""


# ------------------------------------------------------------------------------------ the fake server


def test_interactive_chat_keeps_the_conversation(fake: Callable[..., ChatFake]) -> None:
    server = fake(models=("first-model", "second-model"))
    result = run_interactive(["chat", "--url", server.base_url + "/v1", "--system-prompt", "Be brief.",
                              "--max-tokens", "3"], "first question\nsecond question\n")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "Using model: first-model"
    answer = answer_text(3)
    assert result.stdout.count(answer + "\n") == 2, result.stdout
    first, second = server.state.bodies
    assert first["model"] == second["model"] == "first-model"
    assert first["stream"] is True and first["max_tokens"] == 3
    system = {"role": "system", "content": "Be brief."}
    assert first["messages"] == [system, {"role": "user", "content": "first question"}]
    assert second["messages"] == [system, {"role": "user", "content": "first question"},
                                  {"role": "assistant", "content": answer},
                                  {"role": "user", "content": "second question"}]


def test_interactive_turn_error_is_shown_and_dropped(fake: Callable[..., ChatFake]) -> None:
    server = fake(fail_every=2, fail_status=500)  # the second request fails
    result = run_interactive(["chat", "--url", server.base_url + "/v1", "--max-tokens", "2"],
                             "one\ntwo\nthree\n")
    assert result.returncode == 0, result.stderr
    assert "HTTP 500: injected failure of request 2" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.count(answer_text(2) + "\n") == 2
    third = server.state.bodies[2]["messages"]
    assert [m["content"] for m in third] == ["one", answer_text(2), "three"]  # "two" was not kept


def test_interactive_complete_sends_each_line_alone(fake: Callable[..., ChatFake]) -> None:
    server = fake()
    result = run_interactive(["complete", "--url", server.base_url + "/v1", "--max-tokens", "4"],
                             "Once upon\nIn a galaxy\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Using model: {MODEL}\n")
    assert result.stdout.count(answer_text(4) + "\n") == 2
    assert [b["prompt"] for b in server.state.bodies] == ["Once upon", "In a galaxy"]
    assert all("messages" not in b and b["stream"] is True for b in server.state.bodies)


def test_ctrl_c_stops_the_answer_and_returns_to_the_prompt(fake: Callable[..., ChatFake]) -> None:
    server = fake(itl_s=0.1)  # 16 words over 1.5 s: time to interrupt
    proc = subprocess.Popen([sys.executable, "-m", "kvserve", "chat", "--url", server.base_url + "/v1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(), cwd=REPO_ROOT)
    try:
        assert proc.stdin is not None
        proc.stdin.write("long answer please\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 30
        while server.state.num_requests == 0 or server.state.in_flight == 0:
            assert time.monotonic() < deadline, "the request never came"
            time.sleep(0.02)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate("short one\n", timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "answer stopped" in err and "Traceback" not in err, err
    # The stopped answer's first words, then the next prompt's whole answer, then the prompt at end of input.
    match = re.fullmatch(f"Using model: {MODEL}\nPlease enter a message for the chat model:\n"
                         f"> ((?: \\w+)*)\n?> {answer_text(16)}\n> \n", out)
    assert match, out
    assert answer_text(16).startswith(match.group(1)) and match.group(1) != answer_text(16), out
    first, second = server.state.bodies
    assert second["messages"] == [{"role": "user", "content": "short one"}]  # the stopped turn is dropped


def test_api_key_is_sent_and_a_wrong_one_is_a_clear_401(capsys: pytest.CaptureFixture[str],
                                                        fake: Callable[..., ChatFake]) -> None:
    server = fake(api_key="sesame")
    url = server.base_url + "/v1"
    rc, out, err = run_cli(capsys, "chat", "--url", url, "--api-key", "sesame", "-q", "hi", "--max-tokens", "2")
    assert (rc, out, err) == (0, answer_text(2) + "\n", "")
    assert server.models_authorizations == ["Bearer sesame"] and server.state.authorizations == ["Bearer sesame"]

    rc, out, err = run_cli(capsys, "complete", "--url", url, "--model-name", MODEL, "--api-key", "wrong",
                           "-q", "hi")
    assert rc == 1 and out == ""
    assert err == f"kvserve complete: error: POST {url}/completions: HTTP 401: Invalid API key.\n"

    rc, out, err = run_cli(capsys, "chat", "--url", url, "-q", "hi")  # no key: /models refuses
    assert rc == 1 and "HTTP 401: Invalid API key." in err


@pytest.mark.parametrize("fields", [("reasoning",), ("reasoning_content",), ("reasoning", "reasoning_content")])
def test_a_reasoning_models_thinking_goes_to_stderr_not_into_the_answer(
        capsys: pytest.CaptureFixture[str], fake: Callable[..., ChatFake], fields: tuple[str, ...]) -> None:
    """A server with a reasoning parser streams the thinking in `reasoning` (or the older `reasoning_content`,
    or both with the same text): it showed nothing while the model thought. Now it is shown once on stderr;
    stdout and the conversation keep the answer only."""
    server = fake(reasoning_tokens=2, reasoning_fields=fields)
    rc, out, err = run_cli(capsys, "chat", "--url", server.base_url + "/v1", "-q", "hi", "--max-tokens", "5")
    words = answer_text(5)
    assert rc == 0 and out == words[len(answer_text(2)):] + "\n"
    assert err == "thinking: " + answer_text(2) + "\n"


def test_a_server_that_ignores_stream_and_answers_json_is_read_too(capsys: pytest.CaptureFixture[str]) -> None:
    """Some servers and proxies ignore `stream` and answer one JSON body: that failed as a stream cut short."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send({"object": "list", "data": [{"id": "m", "object": "model"}]})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.path.endswith("/chat/completions"):
                message = {"role": "assistant", "content": "Paris.", "reasoning_content": "The capital."}
                self._send({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})
            else:
                self._send({"choices": [{"index": 0, "text": " there was", "finish_reason": "length"}]})

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        assert run_cli(capsys, "chat", "--url", url, "-q", "capital?") == (0, "Paris.\n", "thinking: The capital.\n")
        assert run_cli(capsys, "complete", "--url", url, "-q", "Once") == (0, " there was\n", "")
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_api_key_sources_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    assert chat_cli.resolve_api_key(None) is None
    monkeypatch.setattr(envs, "VLLM_API_KEY", "vllm")
    assert chat_cli.resolve_api_key(None) == "vllm"
    monkeypatch.setattr(envs, "KVSERVE_API_KEY", "")  # set empty: no key, VLLM_API_KEY not read (as the server)
    assert chat_cli.resolve_api_key(None) is None
    monkeypatch.setattr(envs, "KVSERVE_API_KEY", "kvserve")
    assert chat_cli.resolve_api_key(None) == "kvserve"
    monkeypatch.setattr(envs, "OPENAI_API_KEY", "openai")  # vLLM's client's variable comes first
    assert chat_cli.resolve_api_key(None) == "openai"
    assert chat_cli.resolve_api_key("flag") == "flag"


def test_openai_api_key_from_the_environment_is_sent(fake: Callable[..., ChatFake]) -> None:
    server = fake(api_key="from-env")
    result = subprocess.run([sys.executable, "-m", "kvserve", "complete", "--url", server.base_url + "/v1",
                             "-q", "hi", "--max-tokens", "1"], capture_output=True, text=True, timeout=60,
                            env=cli_env(OPENAI_API_KEY="from-env", KVSERVE_API_KEY="other"), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == answer_text(1) + "\n"
    assert server.state.authorizations == ["Bearer from-env"]


def test_server_errors_are_one_line_and_exit_1(capsys: pytest.CaptureFixture[str],
                                               fake: Callable[..., ChatFake]) -> None:
    url = fake(served_models=(MODEL,)).base_url + "/v1"
    rc, out, err = run_cli(capsys, "chat", "--url", url, "--model-name", "nope", "-q", "hi")
    assert rc == 1 and out == ""
    assert err == f"kvserve chat: error: POST {url}/chat/completions: HTTP 404: The model `nope` does not exist.\n"

    url = fake(models=()).base_url + "/v1"
    rc, out, err = run_cli(capsys, "complete", "--url", url, "-q", "hi")
    assert rc == 1 and out == ""
    assert err == f"kvserve complete: error: the server at {url} lists no models; name one with --model-name\n"

    url = fake(stream_error_every=1).base_url + "/v1"
    rc, out, err = run_cli(capsys, "chat", "--url", url, "-q", "hi")
    assert rc == 1
    assert out == answer_text(1) + "\n"  # what came before the error event, then the error on stderr
    assert err == "kvserve chat: error: the server reported an error in the answer: injected in-stream error\n"

    url = fake(cut_every=1).base_url + "/v1"
    rc, out, err = run_cli(capsys, "complete", "--url", url, "-q", "hi")
    assert rc == 1 and out == answer_text(2) + "\n"
    assert err.startswith("kvserve complete: error: the answer ")


def test_unreachable_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    for command in ("chat", "complete"):
        rc, out, err = run_cli(capsys, command, "--url", url, "-q", "hi")
        assert rc == 1 and out == ""
        assert err.startswith(f"kvserve {command}: error: cannot reach the server at {url} ")
        assert "kvserve serve" in err and err.count("\n") == 1


def test_chat_does_not_import_torch(fake: Callable[..., ChatFake]) -> None:
    server = fake()
    code = ("import sys\nfrom kvserve.entrypoints.cli import main\n"
            f"rc = main(['chat', '--url', {server.base_url + '/v1'!r}, '-q', 'hi', '--max-tokens', '2'])\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'fastapi', 'aiohttp') if m in sys.modules)\n"
            "print('heavy:', heavy)\nsys.exit(rc)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env=cli_env(), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == answer_text(2) + "\nheavy: []\n"
