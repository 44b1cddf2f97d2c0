"""`kvserve run-batch`: OpenAI Batch files answered offline as the server would answer them.

One real run (`python -m kvserve run-batch ... -o -`, the tiny model, the tiny server's flags) is shared by
the tests of its output; it is compared with the answers of the real server (`tiny_server`). The writer's
order and progress lines are tested on a stand-in app; the refusals of unusable paths through `main()`
(before any engine starts)."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve.entrypoints.cli import main
from kvserve.entrypoints.run_batch import BatchRequest, LineResult, Progress, answer_lines, parse_line

from .conftest import REPO_ROOT, TINY_NAME, TINY_SERVER_FLAGS, ServerProcess

CHAT_BODY = {"model": TINY_NAME, "messages": [{"role": "user", "content": "run-batch: name three rivers"}],
             "max_tokens": 8, "temperature": 0}
COMPLETION_BODY = {"model": TINY_NAME, "prompt": "run-batch: the rivers of Europe are", "max_tokens": 8,
                   "temperature": 0, "logprobs": 2}


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


# (custom_id, the input line, the status its output line must have); None: the line is not JSON
INPUT: list[tuple[str | None, str, int]] = [
    ("chat", _line("chat", "/v1/chat/completions", CHAT_BODY), 200),
    (None, "{not json", 400),
    ("cmpl", _line("cmpl", "/v1/completions", COMPLETION_BODY), 200),
    ("embed", _line("embed", "/v1/embeddings", {"model": TINY_NAME, "input": "x"}), 404),
    ("nourl", _line("nourl", "/v1/nothing", {"model": TINY_NAME}), 404),
    ("negative", _line("negative", "/v1/completions", {**COMPLETION_BODY, "max_tokens": -1}), 400),
    ("badfield", _line("badfield", "/v1/chat/completions", {**CHAT_BODY, "messages": "hi"}), 400),
    ("stream", _line("stream", "/v1/chat/completions", {**CHAT_BODY, "stream": True}), 400),
    ("second", _line("second", "/v1/completions", {**COMPLETION_BODY, "prompt": "run-batch: one more",
                                                   "max_tokens": 3}), 200),
]


@pytest.fixture(scope="module")
def batch_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              tiny_llama_dir: str) -> subprocess.CompletedProcess[str]:
    directory = tmp_path_factory.mktemp("run-batch")
    path = directory / "input.jsonl"
    # A blank line among them: skipped, as vLLM's reader skips it.
    lines = [text for _, text, _ in INPUT]
    path.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")
    command = [sys.executable, "-m", "kvserve", "run-batch", "-i", str(path), "-o", "-", "--output-tmp-dir",
               str(directory), tiny_llama_dir, *TINY_SERVER_FLAGS]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=REPO_ROOT) as proc:
        try:
            request.getfixturevalue("tiny_server")  # its start-up (if still to come) beside this run's
            stdout, stderr = proc.communicate(timeout=300)
        except BaseException:
            proc.kill()
            raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _outputs(run: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines()]  # stdout holds only the output lines


def test_lines_in_input_order_with_status_and_error(batch_run: subprocess.CompletedProcess[str]) -> None:
    outputs = _outputs(batch_run)
    assert [o["custom_id"] for o in outputs] == [custom_id for custom_id, _, _ in INPUT]
    assert len({o["id"] for o in outputs}) == len(outputs)
    for output, (_, _, status) in zip(outputs, INPUT, strict=True):
        assert set(output) == {"id", "custom_id", "response", "error"}
        response = output["response"]
        assert response["status_code"] == status, output
        assert isinstance(response["request_id"], str) and response["request_id"]
        if status == 200:
            assert output["error"] is None
            assert response["body"]["object"] in ("chat.completion", "text_completion")
            assert response["request_id"] == response["body"]["id"]
        else:  # the server's error body, and the batch's error object
            error = response["body"]["error"]
            assert error["code"] == status and error["message"]
            assert output["error"] == {"code": error["type"], "message": error["message"]}
    by_id = {o["custom_id"]: o for o in outputs}
    assert by_id["negative"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert by_id["stream"]["response"]["body"]["error"]["param"] == "stream"
    assert "embeddings" in by_id["embed"]["error"]["message"]
    assert by_id["second"]["response"]["body"]["usage"]["completion_tokens"] <= 3
    # The summary, on standard error
    assert "9/9 lines done (6 failed)" in batch_run.stderr and "3 succeeded" in batch_run.stderr


def _comparable(body: dict[str, Any]) -> dict[str, Any]:
    """A response body without what differs between two answers: the id, the time, the cached prompt tokens (the
    shared server may hold the chat template's opening in its prefix cache)."""
    body = {k: v for k, v in body.items() if k not in ("id", "created")}
    body["usage"] = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return body


def _assert_same(batch: Any, served: Any, where: str = "body") -> None:
    """Equal, except that logprobs may differ in the last digits (the batch ran its requests together, the
    server alone: other matrix shapes)."""
    if isinstance(batch, float) and isinstance(served, float):
        assert batch == pytest.approx(served, abs=1e-4), where
    elif isinstance(batch, dict) and isinstance(served, dict):
        assert batch.keys() == served.keys(), where
        for key in batch:
            _assert_same(batch[key], served[key], f"{where}.{key}")
    elif isinstance(batch, list) and isinstance(served, list):
        assert len(batch) == len(served), where
        for i, (b, s) in enumerate(zip(batch, served, strict=True)):
            _assert_same(b, s, f"{where}[{i}]")
    else:
        assert batch == served, where


@pytest.mark.parametrize(("custom_id", "url", "body"), [("chat", "/v1/chat/completions", CHAT_BODY),
                                                        ("cmpl", "/v1/completions", COMPLETION_BODY)])
def test_bodies_equal_the_servers(batch_run: subprocess.CompletedProcess[str], tiny_server: ServerProcess,
                                  custom_id: str, url: str, body: dict[str, Any]) -> None:
    batch = next(o for o in _outputs(batch_run) if o["custom_id"] == custom_id)["response"]["body"]
    served = httpx.post(tiny_server.base_url + url, json=body, timeout=60)
    assert served.status_code == 200, served.text
    _assert_same(_comparable(batch), _comparable(served.json()))


def test_refused_bodies_equal_the_servers(batch_run: subprocess.CompletedProcess[str],
                                          tiny_server: ServerProcess) -> None:
    """A body the server refuses gets the server's own error in the batch."""
    outputs = {o["custom_id"]: o for o in _outputs(batch_run)}
    for custom_id, url, body in (("negative", "/v1/completions", {**COMPLETION_BODY, "max_tokens": -1}),
                                 ("badfield", "/v1/chat/completions", {**CHAT_BODY, "messages": "hi"})):
        served = httpx.post(tiny_server.base_url + url, json=body, timeout=60)
        assert served.status_code == 400
        assert outputs[custom_id]["response"]["body"] == served.json()


def test_parse_line_refusals() -> None:
    assert isinstance(parse_line(b'{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}'),
                      BatchRequest)
    for raw, status in ((b"[1, 2]", 400), (b"\xff\xfe", 400), (b'{"custom_id": "a", "body": {}}', 400),
                        (b'{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', 405),
                        (b'{"custom_id": "a", "url": "/v1/completions", "body": "text"}', 400),
                        (b'{"custom_id": "a", "url": "/score", "body": {}}', 404)):
        result = parse_line(raw)
        assert isinstance(result, LineResult) and not result.ok, raw
        assert result.line["response"]["status_code"] == status, raw
        assert result.line["error"]["message"], raw


def test_writes_in_input_order_as_lines_finish(capsys: pytest.CaptureFixture[str]) -> None:
    """Lines finishing in reverse order are still written in input order, each as soon as those before it are
    done; progress lines go to standard error."""
    written_when: list[int] = []
    finished: list[int] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        index = json.loads((await receive())["body"])["n"]
        await asyncio.sleep(0.02 * (5 - index))
        finished.append(index)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps({"n": index}).encode()})

    class Out(io.StringIO):
        def write(self, text: str) -> int:
            written_when.append(len(finished))
            return super().write(text)

    out = Out()
    lines = [json.dumps({"custom_id": str(n), "url": "/v1/completions", "body": {"n": n}}).encode()
             for n in range(5)]
    progress = Progress(len(lines))
    asyncio.run(answer_lines(app, lines, out, 10, progress, progress_interval_s=0.01))
    assert finished == [4, 3, 2, 1, 0]
    outputs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [o["custom_id"] for o in outputs] == ["0", "1", "2", "3", "4"]
    assert [o["response"]["body"]["n"] for o in outputs] == [0, 1, 2, 3, 4]
    assert written_when == [5] * 5  # line 0 finished last: nothing could be written before it
    assert progress.done == 5 and progress.failed == 0
    assert "lines done" in capsys.readouterr().err

    # with at most 2 at once, the same order
    out = Out()
    finished.clear()
    asyncio.run(answer_lines(app, lines, out, 2, Progress(len(lines)), progress_interval_s=60))
    assert [json.loads(line)["custom_id"] for line in out.getvalue().splitlines()] == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize(("flags", "message"), [
    (["-i", "/nonexistent/input.jsonl", "-o", "-"], "cannot read --input-file /nonexistent/input.jsonl: no such file"),
    (["-i", "https://example.com/in.jsonl", "-o", "-"], "not URLs"),
    (["-i", "-", "-o", "/nonexistent/dir/out.jsonl"], "no directory /nonexistent/dir"),
])
def test_unusable_paths_refused_before_the_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  flags: list[str], message: str) -> None:
    assert main(["run-batch", *flags, "--model", str(tmp_path / "no-model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve run-batch: error: ") and message in err, err


def test_a_failed_write_stops_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    """Standard output closed early (`| head -1`) or a full disk: the run stops with the write's OSError (no line
    is started after it), and `output_failed` makes that one stderr line and exit 1. The failed write raised out
    of the line's task while the loop went on answering every other line for nobody, then ended in a traceback."""
    started: list[int] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        started.append(json.loads((await receive())["body"])["n"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    class Closed(io.StringIO):
        def write(self, text: str) -> int:
            if self.getvalue().count("\n") == 2:
                raise OSError(28, "No space left on device")
            return super().write(text)

    out = Closed()
    lines = [json.dumps({"custom_id": str(n), "url": "/v1/completions", "body": {"n": n}}).encode()
             for n in range(50)]
    with pytest.raises(OSError, match="No space left"):
        asyncio.run(answer_lines(app, lines, out, 2, Progress(len(lines)), progress_interval_s=60))
    assert [json.loads(line)["custom_id"] for line in out.getvalue().splitlines()] == ["0", "1"]
    assert len(started) <= 5, started

    from kvserve.entrypoints.run_batch import output_failed

    assert output_failed("out.jsonl", OSError(28, "No space left on device")) == 1
    assert capsys.readouterr().err == ("kvserve run-batch: error: cannot write the output to out.jsonl: No space "
                                       "left on device; stopped\n")


def test_ctrl_c_exits_130_and_says_how_far_the_output_got(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C during a run: exit 130 without a traceback (asyncio.run's KeyboardInterrupt escaped with one); the
    lines written so far are counted (`Progress.written`, which the interrupted line on stderr gives)."""
    import os
    import signal
    from types import SimpleNamespace

    import kvserve.config
    from kvserve.entrypoints import run_batch

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        index = json.loads((await receive())["body"])["n"]
        if index >= 3:
            await asyncio.Event().wait()  # (never done)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    lines = [json.dumps({"custom_id": str(n), "url": "/v1/completions", "body": {"n": n}}).encode()
             for n in range(6)]
    progress, out = Progress(len(lines)), io.StringIO()

    async def interrupted_run(ns: Any, config: Any) -> int:
        running = asyncio.ensure_future(answer_lines(app, lines, out, 6, progress, progress_interval_s=60))
        await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # (asyncio.run cancels this task, then raises KeyboardInterrupt)
        await running
        return 0

    class Args:
        def __init__(self, **kwargs: Any) -> None:
            pass

        def create_engine_config(self) -> Any:
            return SimpleNamespace()

    monkeypatch.setattr(kvserve.config, "EngineArgs", Args)
    monkeypatch.setattr(run_batch, "run", interrupted_run)
    monkeypatch.setattr(run_batch.logging, "basicConfig", lambda **kwargs: None)
    (tmp_path / "in.jsonl").write_text("")
    try:
        code: int | None = main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", "-", "--model", "m"])
    except KeyboardInterrupt:
        code = None
    assert code == 130
    assert progress.written == 3 and len(out.getvalue().splitlines()) == 3


def test_a_named_pipe_is_an_input(tmp_path: Path) -> None:
    """`-i <(jq -c ... requests.json)` (a pipe, /dev/fd/N) or a named pipe is read as a file is: it was refused
    before the engine started as 'no such file', since it is not a regular file."""
    import os
    from types import SimpleNamespace

    from kvserve.entrypoints.run_batch import _check_paths

    fifo = tmp_path / "requests.jsonl"
    os.mkfifo(fifo)
    _check_paths(SimpleNamespace(input_file=str(fifo), output_file="-", data_parallel_size=1))  # (no error)
    with pytest.raises(ValueError, match="no such file"):
        _check_paths(SimpleNamespace(input_file=str(tmp_path / "none.jsonl"), output_file="-", data_parallel_size=1))
