"""`kvserve run-batch -i input.jsonl -o output.jsonl --model M`: an offline batch in the OpenAI Batch file format
(vLLM's `vllm run-batch`).

Each input line is `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}` (also
/v1/completions and /v1/responses). Every body is answered by the server's own app, called in this process
through ASGI (no socket), so a line gets exactly what `kvserve serve` with the same flags would answer: the
same validation, defaults and JSON. The lines run concurrently through one engine (continuous batching);
the output has one line per non-blank input line, in input order, written as soon as the lines before it
are done:

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200, "request_id": ..., "body": {...}},
     "error": null}

A failed line (not JSON, no such url, `"stream": true`, a body the server refuses) has `response` with the
status code and the server's OpenAI error body (`{"error": {"message", "type", "param", "code"}}`), as
OpenAI's batch output carries failed requests, and `error` set to `{"code": <the error type>, "message": ...}`
(vLLM's run-batch sets `error` for every failed line): `error` is null exactly when the line succeeded. The
command exits 0 once every line has its output line, failed lines included; 2 for bad flags or an input it
cannot read; 1 when the engine fails or the output cannot be written (a full disk, a closed pipe: the run
stops); 130 after Ctrl-C (the output lines written so far are kept, and stderr says how many).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import IO, Any

logger = logging.getLogger("kvserve.run_batch")

# The urls a line may name: the server's generation endpoints.
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# Urls of vLLM's batch runner that kvserve does not serve (a per-line error says so).
_NOT_SERVED = {"/v1/embeddings": "embeddings", "/v1/score": "scoring", "/score": "scoring",
               "/v1/rerank": "reranking", "/rerank": "reranking"}
# How often a long run says how far it has got (stderr).
PROGRESS_INTERVAL_S = 10.0
# The exit status after Ctrl-C (128 + SIGINT).
INTERRUPTED = 130


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    """-i / -o / --output-tmp-dir, then every flag of `kvserve serve` (its engine flags and the flags that shape
    answers: --served-model-name, --chat-template, --generation-config, ...; those of the HTTP listener are
    accepted and change nothing)."""
    from kvserve.entrypoints.openai.cli_args import add_server_args
    from kvserve.entrypoints.vllm_compat import positive_int

    g = parser.add_argument_group("batch")
    g.add_argument("-i", "--input-file", required=True, metavar="PATH",
                   help="the requests, one JSON object a line in the OpenAI Batch format; - reads standard input")
    g.add_argument("-o", "--output-file", required=True, metavar="PATH",
                   help="where the answers go, one line per request in input order; - writes standard output")
    g.add_argument("--output-tmp-dir", default=None, metavar="DIR",
                   help="accepted for vLLM command lines (vLLM stages uploads there); kvserve writes the output "
                   "file directly, so this changes nothing")
    g.add_argument("--max-concurrency", type=positive_int, default=None, metavar="N",
                   help="the most lines in flight at once (default: twice --max-num-seqs); the engine batches "
                   "those it holds continuously")
    g.add_argument("--enable-metrics", action="store_true",
                   help="accepted for vLLM command lines (vLLM serves Prometheus metrics during the run); "
                   "run-batch serves none, and says so")
    g.add_argument("--url", default=None, help="accepted for vLLM command lines (the address of those metrics)")
    add_server_args(parser)
    # One log line per request is noise in a batch of thousands: off unless --enable-log-requests.
    parser.set_defaults(disable_log_requests=True, func=run_batch_command)


# ------------------------------------------------------------------------------------------ one line


@dataclass
class LineResult:
    """One output line, and whether it succeeded."""

    line: dict[str, Any]
    ok: bool


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def answered(custom_id: Any, status: int, body: Any) -> LineResult:
    """The output line of a body the server answered with `status`."""
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    ok = 200 <= status < 300
    error = None
    if not ok:
        detail = body.get("error") if isinstance(body, dict) else None
        if isinstance(detail, dict):
            error = {"code": detail.get("type") or str(status), "message": detail.get("message")}
        else:
            error = {"code": str(status), "message": json.dumps(body) if body is not None else ""}
    return LineResult({
        "id": _new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id or _new_id("kvserve-batch-"), "body": body},
        "error": error,
    }, ok)


def refused(custom_id: Any, message: str, status: int = 400, param: str | None = None) -> LineResult:
    """The output line of a line refused before it reached the server (its body in the server's error format)."""
    from kvserve.entrypoints.openai.errors import error_body

    return answered(custom_id, status, error_body(status, message, param=param))


@dataclass
class BatchRequest:
    custom_id: Any
    url: str
    body: bytes


def parse_line(raw: bytes) -> BatchRequest | LineResult:
    """A line's request, or the error line that answers it without the server."""
    try:
        obj = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError included
        return refused(None, f"the line is not a JSON object: {exc}")
    if not isinstance(obj, dict):
        return refused(None, f"the line is not a JSON object but {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    method = obj.get("method", "POST")
    url = obj.get("url")
    body = obj.get("body")
    if not isinstance(url, str):
        return refused(custom_id, f'the line needs a "url", one of: {", ".join(BATCH_URLS)}', param="url")
    if url in _NOT_SERVED:
        return refused(custom_id, f"kvserve serves no {_NOT_SERVED[url]} ({url}): the urls served are "
                       f"{', '.join(BATCH_URLS)}", 404, "url")
    if url not in BATCH_URLS:
        return refused(custom_id, f"url {url!r} is not served in a batch: use one of {', '.join(BATCH_URLS)}",
                       404, "url")
    if not isinstance(method, str) or method.upper() != "POST":
        return refused(custom_id, f"method must be POST, got {method!r}", 405, "method")
    if not isinstance(body, dict):
        return refused(custom_id, 'the line needs a "body", the request as a JSON object', param="body")
    if body.get("stream"):
        return refused(custom_id, 'a batch line cannot stream: leave out "stream" or set it false', param="stream")
    try:
        encoded = json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError) as exc:  # NaN or a lone surrogate: no JSON an HTTP client could send
        return refused(custom_id, f"the body cannot be sent as JSON: {exc}", param="body")
    return BatchRequest(custom_id, url, encoded)


async def call_app(app: Any, path: str, body: bytes) -> tuple[int, Any]:
    """POST `body` (JSON) to `path` of the ASGI `app` in this process: (status, the decoded JSON answer). The
    client "disconnects" only once the answer is complete, as a patient HTTP client."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }
    sent_body = False
    complete = asyncio.Event()
    status = 500
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                complete.set()

    try:
        await app(scope, receive, send)
    finally:
        complete.set()
    data = b"".join(chunks)
    try:
        return status, json.loads(data) if data else None
    except ValueError:
        return status, {"error": {"message": data.decode("utf-8", "replace"), "type": "InternalServerError",
                                  "param": None, "code": status}}


# ------------------------------------------------------------------------------------------ the run


@dataclass
class Progress:
    total: int
    done: int = 0
    failed: int = 0
    written: int = 0  # the output lines written: those of the first `written` input lines
    started: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return (f"kvserve run-batch: {self.done}/{self.total} lines done ({self.failed} failed) in {elapsed:.1f} s, "
                f"{rate:.2f} lines/s")


def read_lines(path: str) -> list[bytes]:
    """The non-blank lines of the input (bytes: a line that is not UTF-8 fails alone). OSError when unreadable."""
    if path == "-":
        data = sys.stdin.buffer.read()
    else:
        with open(path, "rb") as f:
            data = f.read()
    return [line for line in (raw.strip() for raw in data.split(b"\n")) if line]


def _check_paths(ns: argparse.Namespace) -> None:
    """ValueError for an input or output the run could not use, before the engine starts."""
    for flag, path in (("--input-file", ns.input_file), ("--output-file", ns.output_file)):
        if path.startswith(("http://", "https://")):
            raise ValueError(f"{flag} {path}: kvserve run-batch reads and writes local files or - (standard input "
                             "/ output), not URLs; download the file first")
    # (not a regular file alone: a named pipe or a shell's <(...) is read as well)
    if ns.input_file != "-" and (os.path.isdir(ns.input_file) or not os.path.exists(ns.input_file)):
        why = "is a directory" if os.path.isdir(ns.input_file) else "no such file"
        raise ValueError(f"cannot read --input-file {ns.input_file}: {why}")
    if ns.input_file != "-" and not os.access(ns.input_file, os.R_OK):
        raise ValueError(f"cannot read --input-file {ns.input_file}: permission denied")
    if ns.output_file != "-":
        directory = os.path.dirname(os.path.abspath(ns.output_file))
        if not os.path.isdir(directory):
            raise ValueError(f"cannot write --output-file {ns.output_file}: no directory {directory}")
        if os.path.isdir(ns.output_file):
            raise ValueError(f"cannot write --output-file {ns.output_file}: it is a directory")
    if (getattr(ns, "data_parallel_size", None) or 1) > 1:
        raise ValueError("--data-parallel-size is not served by run-batch: it runs one engine (--tensor-parallel-size "
                         "spreads it over GPUs)")


async def answer_lines(app: Any, lines: list[bytes], out: IO[str], max_concurrency: int,
                       progress: Progress, progress_interval_s: float = PROGRESS_INTERVAL_S) -> None:
    """Answer every line through `app`, at most `max_concurrency` at once, writing each output line to `out`
    in input order as soon as those before it are written. OSError when writing fails: the lines still running
    are cancelled and no more are started."""
    results: dict[int, LineResult] = {}
    next_to_write = 0
    slots = asyncio.Semaphore(max_concurrency)
    # A failed write (a full disk; standard output closed, `| head`) stops the run: no more lines are answered with nowhere to go.
    write_error: OSError | None = None
    write_failed = asyncio.Event()

    def write_ready() -> None:
        nonlocal next_to_write, write_error
        if write_error is not None:
            return
        try:
            while next_to_write in results:
                out.write(json.dumps(results[next_to_write].line, ensure_ascii=False) + "\n")
                del results[next_to_write]
                next_to_write += 1
                progress.written = next_to_write
            out.flush()
        except OSError as exc:
            write_error = exc
            write_failed.set()

    async def one(index: int, request: BatchRequest) -> None:
        try:
            status, body = await call_app(app, request.url, request.body)
            result = answered(request.custom_id, status, body)
        except Exception as exc:  # noqa: BLE001 - a bug answers this line only, as the server's 500 would
            logger.exception("line %d failed", index + 1)
            result = refused(request.custom_id, f"internal error: {type(exc).__name__}: {exc}", 500)
        finally:
            slots.release()
        finish(index, result)

    def finish(index: int, result: LineResult) -> None:
        results[index] = result
        progress.done += 1
        progress.failed += not result.ok
        write_ready()

    async def report() -> None:
        while True:
            await asyncio.sleep(progress_interval_s)
            print(progress.line(), file=sys.stderr, flush=True)

    reporter = asyncio.ensure_future(report())
    stopper = asyncio.ensure_future(write_failed.wait())
    tasks: set[asyncio.Task[None]] = set()
    try:
        for index, raw in enumerate(lines):
            if write_error is not None:
                break
            parsed = parse_line(raw)
            if isinstance(parsed, LineResult):
                finish(index, parsed)
                continue
            await slots.acquire()
            if write_error is not None:
                break
            task = asyncio.ensure_future(one(index, parsed))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks and write_error is None:
            done, _ = await asyncio.wait({*tasks, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopper}:
                task.result()  # (a line's own failure is its output line: this raises only a bug)
    finally:
        reporter.cancel()
        stopper.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(reporter, stopper, *tasks, return_exceptions=True)
    if write_error is not None:
        raise write_error


async def run(ns: argparse.Namespace, config: Any) -> int:
    """Start the engine, answer the input file, stop the engine; the exit code."""
    from kvserve import envs
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.engine.core_client import EngineDeadError
    from kvserve.entrypoints.openai.api_server import _make_metrics, build_app, serving_context, stat_loggers
    from kvserve.entrypoints.openai.middleware import ServerState

    try:
        lines = await asyncio.to_thread(read_lines, ns.input_file)
    except OSError as exc:
        print(f"kvserve run-batch: error: cannot read --input-file {ns.input_file}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    engine = AsyncLLM(config, log_level=envs.KVSERVE_LOGGING_LEVEL)
    try:
        try:
            ready = await engine.start()
        except EngineDeadError as exc:
            print(f"kvserve run-batch: error: the engine failed to start: {exc}", file=sys.stderr)
            return 1
        except ValueError as exc:  # ModelLoadError: the tokenizer
            print(f"kvserve run-batch: error: {exc}", file=sys.stderr)
            return 2
        ctx = serving_context(ns, config, engine, int(time.time()))
        metrics = _make_metrics(ns, config, ready, ctx.served_model_names, None, first=True)
        engine.stat_loggers += stat_loggers(ns, metrics, "")
        app = build_app(ctx, ServerState(), metrics, None, ns.max_request_body_bytes,
                        force_include_usage=ns.enable_force_include_usage)
        progress = Progress(len(lines))
        where = "standard output" if ns.output_file == "-" else ns.output_file
        try:
            out: IO[str] = (sys.stdout if ns.output_file == "-"
                            else open(ns.output_file, "w", encoding="utf-8"))  # noqa: SIM115 - closed below
            try:
                await answer_lines(app, lines, out, ns.max_concurrency or 2 * config.scheduler_config.max_num_seqs,
                                   progress)
            finally:
                if out is not sys.stdout:
                    out.close()
        except OSError as exc:
            return output_failed(where, exc)
        except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels this task (run_batch_command exits 130)
            print(f"kvserve run-batch: interrupted: the output of the first {progress.written} of {len(lines)} "
                  f"lines is in {where}", file=sys.stderr, flush=True)
            raise
        finally:
            ctx.prepare_pool.shutdown(wait=False, cancel_futures=True)
        print(f"{progress.line()}; {progress.done - progress.failed} succeeded, output in {where}",
              file=sys.stderr, flush=True)
        if engine.dead_error is not None:
            print(f"kvserve run-batch: error: the engine died during the run: {engine.dead_error}", file=sys.stderr)
            return 1
        return 0
    finally:
        await engine.shutdown()


def output_failed(where: str, exc: OSError) -> int:
    """The exit code (1) and stderr line of a run whose output could not be written. Standard output closed
    early (`| head`) is also kept from the interpreter's last flush, which would fail again on exit."""
    if isinstance(exc, BrokenPipeError) and where == "standard output":
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        print("kvserve run-batch: error: standard output was closed before every line was written; stopped",
              file=sys.stderr, flush=True)
    else:
        print(f"kvserve run-batch: error: cannot write the output to {where}: {exc.strerror or exc}; stopped",
              file=sys.stderr, flush=True)
    return 1


def run_batch_command(ns: argparse.Namespace) -> int:
    """`kvserve run-batch`: check the flags and paths, build the engine config, run."""
    from kvserve import envs
    from kvserve.config import EngineArgs
    from kvserve.entrypoints.cli import log_ignored_flags
    from kvserve.entrypoints.openai.cli_args import server_engine_args

    try:
        _check_paths(ns)
        config = EngineArgs(**server_engine_args(ns)).create_engine_config()  # type: ignore[arg-type]
    except ValueError as exc:  # ConfigError, ModelLoadError, conflicting flags, paths
        print(f"kvserve run-batch: error: {exc}", file=sys.stderr)
        return 2
    # (as the server logs: standard error, KVSERVE_LOGGING_LEVEL)
    logging.basicConfig(level=envs.KVSERVE_LOGGING_LEVEL.upper(),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", force=True)
    log_ignored_flags(ns)
    if ns.enable_metrics:
        logger.warning("--enable-metrics: run-batch serves no metrics (the summary at the end gives the counts)")
    try:
        return asyncio.run(run(ns, config))
    except KeyboardInterrupt:  # (the engine was shut down as run() unwound; what was written is kept)
        return INTERRUPTED
