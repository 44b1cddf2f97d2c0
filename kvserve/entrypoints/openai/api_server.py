"""The OpenAI-compatible server: `kvserve serve` and `python -m kvserve.entrypoints.openai.api_server`.

Start-up: resolve the engine config, bind the listening socket (a busy port fails fast, before the model
loads), start the engine-core process and load the tokenizer meanwhile, wait for the engine's ready
message, log the KV capacity, then serve.

Lifecycle:
* SIGTERM / SIGINT drain: new requests get 503, in-flight ones finish (up to --shutdown-timeout; those still
  running or still being prepared then are aborted, their responses ending with finish reason "abort"), then
  the engine core is shut down and the process exits 0. A second signal exits at once: the responses still
  under way end with a 503 error in the OpenAI format (a stream's as an error event and [DONE]) first, then
  the engine core is shut down.
* If the engine-core process dies, /health turns 503, in-flight requests fail, and the server exits 1
  shortly after (so an orchestrator restarts it).
* `--api-server-count N`: this process starts the engine, then N - 1 more API processes on the same socket
  (`run_api_process`), and serves as well; see `_Server` for how signals and deaths are shared.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Annotated, Any, Literal

import jinja2
import uvicorn
from fastapi import FastAPI, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve import __version__, envs
from kvserve.config import EngineArgs, EngineConfig
from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.core_client import (
    METRICS_DIR_PREFIX,
    EngineAttachment,
    EngineCoreClient,
    EngineDeadError,
    IpcPathError,
    tagged_prefix,
)
from kvserve.engine.heap import freeze_startup_heap
from kvserve.entrypoints.cli import log_ignored_flags
from kvserve.entrypoints.openai.cli_args import (
    DEFAULT_HOST,
    api_key_from,
    make_arg_parser,
    server_engine_args,
)
from kvserve.entrypoints.openai.errors import (
    BadRequestError,
    EchoingJSONResponse,
    NotFoundError,
    OpenAIError,
    error_response,
)
from kvserve.entrypoints.openai.middleware import END_CANCELLED_S, GuardMiddleware, ServerState
from kvserve.entrypoints.openai.protocol import (
    MAX_REQUEST_ID_LEN,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponsesRequest,
    StreamOptions,
    TokenizeRequest,
    TokenizeResponse,
)
from kvserve.entrypoints.openai.serving_chat import (
    chat_full,
    chat_stream,
    check_tool_definitions,
    message_dict,
    prepare_chat,
    template_kwargs,
    template_switches,
)
from kvserve.entrypoints.openai.serving_common import (
    ClientDisconnected,
    ServingContext,
    encode_prompt,
    run_unless_disconnected,
    wait_for_disconnect,
)
from kvserve.entrypoints.openai.serving_completion import (
    completion_full,
    completion_stream,
    prepare_completion,
)
from kvserve.entrypoints.openai.serving_responses import (
    ResponseRun,
    ResponseStore,
    input_items_page,
    prepare_response,
    response_full,
    response_stream,
    stored_response,
)
from kvserve.entrypoints.vllm_compat import parse_args_or_refuse
from kvserve.metrics.log_stats import LoggingStatLogger
from kvserve.metrics.prometheus import PrometheusStatLogger, enable_multiprocess
from kvserve.model.generation_defaults import describe as describe_sampling_defaults
from kvserve.protocol.core_messages import EngineReady

logger = logging.getLogger("kvserve.server")

# After the engine died: keep answering (503) this long so health checks see it, then exit 1.
ENGINE_DEAD_EXIT_DELAY_S = 1.0
# Once --shutdown-timeout has run out and the requests still in flight are aborted: how long their responses
# (now ending, finish reason "abort") may take to go out before uvicorn cancels what is left and the process exits.
DRAIN_ABORT_GRACE_S = 5.0
# When the server stops with requests still running (a second signal, or DRAIN_ABORT_GRACE_S over): how long
# it waits for them to end their responses (the middleware ends each within END_CANCELLED_S of its
# cancellation) before it goes on to stop the engine anyway.
REQUESTS_END_WAIT_S = END_CANCELLED_S + 1.0
# A connection closed at shutdown with nothing left to send, still open this long after (a TLS connection waits
# for the client's close_notify, which an idle kept-alive client never sends, up to asyncio's 30 s): dropped.
CLOSED_CONNECTION_GRACE_S = 1.0

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)
}


# ------------------------------------------------------------------------------------------ the app


class SSEResponse(Response):
    """A server-sent-events stream that stops (and so aborts the request) when the client disconnects.

    Starlette's StreamingResponse only notices a disconnect when a send fails, and uvicorn's h11 server
    drops sends to a closed connection silently, so a request would run to the end for nobody. Here a
    second task listens for `http.disconnect` and cancels the stream.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[str]) -> None:
        self.body_iterator = body
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        listen = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream, listen}, return_when=asyncio.FIRST_COMPLETED)
            if stream.done() and not stream.cancelled() and stream.exception() is not None:
                exc = stream.exception()
                if not isinstance(exc, OSError):  # OSError: the client went away mid-send
                    raise exc  # type: ignore[misc]
        finally:
            for task in (stream, listen):
                task.cancel()
            await asyncio.gather(stream, listen, return_exceptions=True)
            # Runs the generators' cleanup now (it aborts the request in the engine if it is unfinished).
            await self.body_iterator.aclose()  # type: ignore[attr-defined]

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self.body_iterator:
            await send({"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def build_app(ctx: ServingContext, state: ServerState, metrics: PrometheusStatLogger, api_key: str | None,
              max_body_bytes: int, cors: dict[str, Any] | None = None, force_include_usage: bool = False,
              docs: bool = True, request_id_headers: bool = False) -> ASGIApp:
    """The FastAPI app wrapped in the guard middleware (413 / 401 / 503 while draining) and, with `cors`
    (CORSMiddleware's settings), in CORS outermost: browsers' preflight requests are answered before the
    API key is asked for, and the guard's errors carry the CORS headers too. `force_include_usage`: every
    stream ends with a usage chunk (--enable-force-include-usage); `docs=False`: no /docs, /redoc,
    /openapi.json (--disable-fastapi-docs); `request_id_headers`: every response carries X-Request-Id
    (--enable-request-id-headers)."""
    hidden: dict[str, Any] = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="kvserve OpenAI-compatible API", version=__version__, **hidden)
    _add_error_handlers(app)
    engine = ctx.engine

    @app.get("/health")
    async def health() -> Response:
        if state.draining or not engine.is_alive:
            return error_response(503, "the engine is not running" if not engine.is_alive else
                                  "the server is shutting down")
        return Response(status_code=200)

    # One operation per method in the OpenAPI document (a shared one is a duplicate operation id there).
    @app.get("/ping", operation_id="ping_get")
    @app.post("/ping", operation_id="ping_post")
    async def ping() -> Response:  # vLLM's (SageMaker's) name for the health check
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.generate_latest(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": ctx.created, "owned_by": "kvserve", "root": ctx.model_path,
                "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in ctx.served_model_names]}

    # OpenAI's "retrieve model" (the openai client's models.retrieve); a name may hold slashes (Qwen/Qwen2-7B).
    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERROR_RESPONSES)
    async def retrieve_model(model: str) -> dict[str, Any]:
        if model not in ctx.served_model_names:
            raise NotFoundError(f"The model `{model}` does not exist.", "model")
        return model_card(model)

    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **_ERROR_RESPONSES})
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        body.request_id = _header_request_id(raw, body.request_id)
        chat = await ctx.off_loop(prepare_chat, ctx, body)
        if body.stream:
            options = body.stream_options
            include_usage = force_include_usage or bool(options and options.include_usage)
            return SSEResponse(chat_stream(ctx, chat, include_usage, _continuous_usage(options, include_usage)))
        return JSONResponse(await run_unless_disconnected(raw, chat_full(ctx, chat)))

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **_ERROR_RESPONSES})
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        body.request_id = _header_request_id(raw, body.request_id)
        cmpl = await ctx.off_loop(prepare_completion, ctx, body)
        if body.stream:
            options = body.stream_options
            include_usage = force_include_usage or bool(options and options.include_usage)
            return SSEResponse(completion_stream(ctx, cmpl, include_usage, _continuous_usage(options, include_usage)))
        return JSONResponse(await run_unless_disconnected(raw, completion_full(ctx, cmpl)))

    @app.post("/v1/responses", responses=_ERROR_RESPONSES)
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        body.request_id = _header_request_id(raw, body.request_id)
        prep = await ctx.off_loop(prepare_response, ctx, body)
        run = ResponseRun(ctx, prep)
        if body.stream:
            return SSEResponse(response_stream(run))
        # (the body echoes the request's instructions, metadata, tools)
        return EchoingJSONResponse(await run_unless_disconnected(raw, response_full(run)))

    @app.get("/v1/responses/{response_id}", responses=_ERROR_RESPONSES)
    async def retrieve_response(response_id: str) -> Response:
        return EchoingJSONResponse(stored_response(ctx, response_id).body)

    @app.get("/v1/responses/{response_id}/input_items", responses=_ERROR_RESPONSES)
    async def list_input_items(response_id: str, after: str | None = None,
                               limit: Annotated[int, Query(ge=1, le=100)] = 20,
                               order: Literal["asc", "desc"] = "desc") -> Response:
        # (OpenAI's `include` only adds what this server does not serve: taken and ignored)
        return EchoingJSONResponse(input_items_page(stored_response(ctx, response_id), after, limit, order))

    @app.delete("/v1/responses/{response_id}", responses=_ERROR_RESPONSES)
    async def delete_response(response_id: str) -> dict[str, Any]:
        stored_response(ctx, response_id)
        ctx.responses_store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel", responses=_ERROR_RESPONSES)
    async def cancel_response(response_id: str) -> dict[str, Any]:
        stored_response(ctx, response_id)
        raise BadRequestError("only background responses can be cancelled, and this server runs none: a "
                              "response ends when its client closes its request", "response_id")

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await ctx.off_loop(tokenize_request, body)

    def tokenize_request(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequestError("give exactly one of prompt and messages", "prompt")
        if body.chat_template is not None:
            raise BadRequestError("a per-request chat_template is not accepted", "chat_template")
        if body.messages is not None:
            check_tool_definitions(body.tools)
            add_generation_prompt, continue_final_message = template_switches(
                body.chat_template_kwargs, body.add_generation_prompt, body.continue_final_message)
            try:
                ids = engine.input_processor.apply_chat_template(
                    [message_dict(m) for m in body.messages], None, add_generation_prompt,
                    template_kwargs(body.chat_template_kwargs, continue_final_message, body.tools),
                    bool(body.add_special_tokens),
                ).prompt_token_ids
            except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
                raise BadRequestError(f"cannot apply the chat template to these messages: {e}", "messages") from None
        else:
            ids = encode_prompt(engine, body.prompt, body.add_special_tokens is not False, "prompt")
        token_strs = engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": token_strs}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        vocab = len(engine.tokenizer)  # the tokenizer's ids: decoding does not need the model's
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequestError(f"token id {bad} is out of range [0, {vocab})", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    guarded: ASGIApp = GuardMiddleware(app, state, api_key, max_body_bytes, request_id_headers)
    return CORSMiddleware(guarded, **cors) if cors is not None else guarded


def _continuous_usage(options: StreamOptions | None, include_usage: bool) -> bool:
    """Whether every chunk carries usage: continuous_usage_stats counts only together with usage itself (the
    request's include_usage or --enable-force-include-usage), as vLLM's `should_include_usage` reads it."""
    return include_usage and bool(options and options.continuous_usage_stats)


def _header_request_id(raw: Request, requested: str | None) -> str | None:
    """The X-Request-Id header, which vLLM takes over the body's request_id; 400 when it is too long."""
    header = raw.headers.get("x-request-id")
    if header is None:
        return requested
    if len(header) > MAX_REQUEST_ID_LEN:
        raise BadRequestError(f"X-Request-Id is longer than {MAX_REQUEST_ID_LEN} characters", "X-Request-Id")
    return header or requested


# What a request for a route this server lacks (OpenAI's /v1/embeddings, /v1/responses, ...) is told.
SERVED_ROUTES = ("kvserve serves text generation: POST /v1/chat/completions, /v1/completions and /v1/responses (GET "
                 "and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items with the store on); also GET "
                 "/v1/models and /v1/models/{model}, POST /tokenize and /detokenize, GET /health, /ping, /metrics "
                 "and /version")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> Response:
        return exc.to_response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        content_type = request.headers.get("content-type")
        if not _is_json_type(content_type or "") and any(
                tuple(e.get("loc", ())) == ("body",) and isinstance(e.get("input"), bytes | bytearray)
                for e in exc.errors()):
            # FastAPI reads a body as JSON only when its Content-Type says so (as in vLLM; recent FastAPI also
            # needs the header present), and hands the model the raw bytes otherwise: curl's -d alone sends a
            # form type. Say so instead of "not an object".
            got = repr(content_type) if content_type else "none"
            return error_response(400, f"the request body must be a JSON object sent with Content-Type: "
                                       f"application/json (Content-Type given: {got})", "BadRequestError")
        message, param = _describe_validation_error(exc)
        return error_response(400, message, "BadRequestError", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404 and exc.detail == "Not Found":  # no such route
            return error_response(404, f"{request.method} {request.url.path} is not served here: {SERVED_ROUTES}")
        # its headers too: a 405's Allow (which RFC 9110 requires) names the methods the route takes
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        # A bug (Starlette logs its traceback after this answer): the client still gets an OpenAI error body.
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}", "InternalServerError")

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"


def _is_json_type(content_type: str) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON (application/json or application/*+json)."""
    media = content_type.split(";", 1)[0].strip().lower()
    main, _, sub = media.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def _describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message and the offending top-level field from pydantic's error list."""
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None
    parts = []
    param = None
    for error in errors[:3]:
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        if error.get("type") == "json_invalid":
            return f"invalid JSON body: {error.get('msg', '')}", None
        if param is None and loc:
            param = loc[0]
        where = ".".join(loc) if loc else "body"
        parts.append(f"{where}: {error.get('msg', 'invalid value')}")
    more = f" (and {len(errors) - 3} more errors)" if len(errors) > 3 else ""
    return "; ".join(parts) + more, param


# --------------------------------------------------------------------------------------- the server


class _Server(uvicorn.Server):
    """uvicorn with a draining shutdown and an exit when the engine dies.

    With several API processes the first one watches the others (`others`): it passes its signals on to
    them (the first one drains them too, a second one stops them), finishes its drain only once they have
    exited, and drains and exits 1 when one of them exits by itself. The others (`controlled`) take orders
    from the first process only (`DRAIN_SIGNAL`, `STOP_SIGNAL`) and ignore SIGINT and SIGTERM: a terminal's
    Ctrl-C or a service manager's SIGTERM reaches every process of the group at once, and would otherwise
    count twice."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout_s: float,
                 others: ApiProcesses | None = None, controlled: bool = False,
                 abort_in_flight: Callable[[], int] | None = None) -> None:
        """`abort_in_flight` (the engine's `abort_all`) ends the requests still in flight when the drain's
        --shutdown-timeout runs out."""
        super().__init__(config)
        self.state = state
        self.shutdown_timeout_s = shutdown_timeout_s
        self.abort_in_flight = abort_in_flight
        self.others = others if others is not None else ApiProcesses()
        self.controlled = controlled
        self.exit_code = 0
        self._drain_deadline: float | None = None
        self._exit_at: float | None = None
        self._shutting_down = False  # `shutdown` has begun
        self._ending: asyncio.Task[None] | None = None  # `_end_now`, started by a second signal during shutdown

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: the signal is not recorded in _captured_signals as uvicorn does: uvicorn re-raises recorded
        # signals after shutting down, and the process would then die of SIGTERM instead of exiting 0.
        if self.controlled:
            if sig == STOP_SIGNAL or (sig == DRAIN_SIGNAL and not self.state.draining):
                self._act_on_signal(sig)
            return
        self._act_on_signal(sig)

    def _act_on_signal(self, sig: int) -> None:
        if self.state.draining or sig == STOP_SIGNAL:  # second signal: stop now
            self.others.stop_now()
            self.force_exit = True
            self.should_exit = True
            if self._shutting_down and self._ending is None:
                # uvicorn's shutdown is under way, waiting out the drain's grace (on Python 3.12+ its wait for the
                # connections to close does not look at force_exit): end what still runs now.
                self._ending = asyncio.get_running_loop().create_task(self._end_now())
            return
        logger.info("signal %d: draining (new requests get 503; %d in flight)", sig, self.state.num_inflight)
        self._start_drain()

    def _start_drain(self) -> None:
        self.others.drain()
        self.state.draining = True
        self._drain_deadline = time.monotonic() + self.shutdown_timeout_s

    def on_engine_dead(self, error: EngineDeadError) -> None:
        self.exit_code = 1
        self._exit_at = time.monotonic() + ENGINE_DEAD_EXIT_DELAY_S

    async def on_tick(self, counter: int) -> bool:
        now = time.monotonic()
        if self._exit_at is not None and now >= self._exit_at:
            logger.error("exiting because the engine core is dead")
            self.should_exit = True
        self.others.report_exits()
        if not self.state.draining and self.others.any_exited():
            for process in self.others.processes:
                if process.exitcode is not None:
                    logger.error("API server process %s (pid %s) exited with code %s; shutting down", process.name,
                                 process.pid, process.exitcode)
            self.exit_code = 1
            self._start_drain()
        if self._drain_deadline is not None:
            if self.state.num_inflight == 0 and not self.others.any_alive():
                logger.info("drained; shutting down")
                self.should_exit = True
            elif now >= self._drain_deadline and not self.should_exit:
                # uvicorn's shutdown waits for every open response to end: abort the requests behind them (each
                # response then ends, finish reason "abort"), and bound that wait in case one does not.
                aborted = self.abort_in_flight() if self.abort_in_flight is not None else 0
                logger.warning("shutdown timeout: %d requests still in flight; %d aborted", self.state.num_inflight,
                               aborted)
                self.config.timeout_graceful_shutdown = DRAIN_ABORT_GRACE_S
                self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, with the requests still running ended before it returns (and `serve` stops the
        engine core). On a second signal (`force_exit`) uvicorn stops waiting for them and leaves them running:
        they were cancelled, and their responses ended with the 503 or a stream's error event and [DONE]
        (`GuardMiddleware`), only once asyncio.run returned, after the engine core had been shut down (a
        second; 10 more if it hangs). They are cancelled here and their responses end first (each within
        END_CANCELLED_S), before uvicorn closes the connections (whose close it waits for on Python 3.12+);
        once more after it, for a second signal that came while it waited for the drain's last responses; and
        those it cancelled itself when DRAIN_ABORT_GRACE_S was over are waited for as well."""
        self._shutting_down = True
        if self.force_exit:
            await self._end_now()
        dropper = asyncio.get_running_loop().create_task(self._drop_lingering_connections())
        try:
            await super().shutdown(sockets)
        finally:
            dropper.cancel()
        await self._end_requests(cancel=self.force_exit)
        if self._ending is not None:
            await self._ending

    async def _end_now(self) -> None:
        """A forced exit: end the requests still running, then drop the connections whose clients do not take
        what is left to send (uvicorn would wait for them to close, on Python 3.12+ without end)."""
        await self._end_requests()
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None and _unsent_bytes(transport) > 0:
                transport.abort()

    async def _drop_lingering_connections(self) -> None:
        """Until cancelled: abort each connection that uvicorn's shutdown closed, that has nothing left to send,
        and that is still open CLOSED_CONNECTION_GRACE_S later. uvicorn waits for every connection to go; over
        HTTPS an idle kept-alive one waits for the client's close_notify, and stopped the server 30 s late."""
        closing_since: dict[int, float] = {}
        while True:
            now = time.monotonic()
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is None or not transport.is_closing() or _unsent_bytes(transport) > 0:
                    closing_since.pop(id(connection), None)
                    continue
                since = closing_since.setdefault(id(connection), now)
                if now - since >= CLOSED_CONNECTION_GRACE_S:
                    transport.abort()
            await asyncio.sleep(0.1)

    async def _end_requests(self, cancel: bool = True) -> None:
        """Wait (within REQUESTS_END_WAIT_S) for the requests still running to end; `cancel`: cancel them first,
        those not being cancelled already (a second cancellation would cut the end of a response short)."""
        running = set(self.server_state.tasks)
        if cancel:
            for task in running:
                if not _cancel_requested(task):
                    task.cancel()
        if running:
            await asyncio.wait(running, timeout=REQUESTS_END_WAIT_S)


def _unsent_bytes(transport: Any) -> int:
    """The bytes `transport` still holds for its peer. A TLS transport's own count is only what is not yet
    encrypted: what is encrypted waits in the TCP transport under it (asyncio's sslproto keeps it as
    `_ssl_protocol._transport`), up to its high-water mark (64 KiB) before the TLS layer stops handing it more,
    and for a slow client that is the end of the response (and the close_notify after it): counted too."""
    unsent: int = transport.get_write_buffer_size()
    under = getattr(getattr(transport, "_ssl_protocol", None), "_transport", None)
    if under is not None and under is not transport:
        unsent += _unsent_bytes(under)
    return unsent


def _cancel_requested(task: asyncio.Task[Any]) -> bool:
    """Whether `task` is being cancelled (Task.cancelling: Python 3.11+). Before Python 3.12 the answer is not
    needed: a second signal ends uvicorn's wait for the drain's last responses at once, before it cancels any."""
    cancelling: Callable[[], int] | None = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() > 0


# Connections waiting to be accepted, kept by the kernel (while the server starts, or is busy).
LISTEN_BACKLOG = 2048


def bind_listening(host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket bound to host:port and listening (OSError when it cannot be): connections
    wait in its backlog until something serves it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections of a socket that names TCP. With
    # Nagle's algorithm on, a response's second small write (the first SSE chunk after the headers, each
    # chunk after the last) waits for the client's delayed ACK, up to 40 ms on a kept-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


def _make_metrics(ns: argparse.Namespace, config: EngineConfig, ready: EngineReady, served_names: list[str],
                  multiprocess_dir: str | None, first: bool) -> PrometheusStatLogger:
    return PrometheusStatLogger(
        served_names[0],
        ready.max_model_len,
        None if ns.metrics_compat == "none" else ns.metrics_compat,
        cache_info={
            "block_size": str(ready.block_size),
            "num_gpu_blocks": str(ready.num_blocks),
            "enable_prefix_caching": str(config.cache_config.enable_prefix_caching),
            "cache_dtype": config.cache_config.kv_cache_dtype,  # vLLM's label: the --kv-cache-dtype value
        },
        multiprocess_dir=multiprocess_dir,
        record_scheduler=first,
    )


def stat_loggers(ns: argparse.Namespace, metrics: PrometheusStatLogger, label: str) -> list[Any]:
    """/metrics' logger, and the periodic log lines unless --disable-log-stats."""
    return [metrics] if ns.disable_log_stats else [metrics, LoggingStatLogger(label=label)]


def serving_context(ns: argparse.Namespace, config: EngineConfig, engine: AsyncLLM, created: int) -> ServingContext:
    """What the handlers need, from the server's flags (also `kvserve run-batch`'s, which answers as the server)."""
    return ServingContext(
        engine=engine,
        served_model_names=list(ns.served_model_name or [config.model_config.served_model_name]),
        model_path=config.model_config.model,
        log_requests=not ns.disable_log_requests,
        created=created,
        sampling_defaults=dict(config.model_config.sampling_defaults),
        max_tokens_cap=config.model_config.max_tokens_cap,
        max_logprobs=ns.max_logprobs,
        tool_call_parser=ns.tool_call_parser if ns.enable_auto_tool_choice else None,
        reasoning_parser=ns.reasoning_parser,
        scheduling_policy=config.scheduler_config.scheduling_policy,
        return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
        response_role=ns.response_role,
        responses_store=ResponseStore(envs.KVSERVE_RESPONSES_API_STORE_SIZE)
        if envs.KVSERVE_ENABLE_RESPONSES_API_STORE else None,
    )


async def _serve_app(ns: argparse.Namespace, config: EngineConfig, engine: AsyncLLM, ready: EngineReady,
                     sock: socket.socket, created: int, multiprocess_dir: str | None, index: int,
                     others: ApiProcesses | None = None, on_ready: Callable[[], None] | None = None) -> int:
    """Serve on `sock` until drained or the engine dies (API process `index`); returns the exit code."""
    served_names = list(ns.served_model_name or [config.model_config.served_model_name])
    metrics = _make_metrics(ns, config, ready, served_names, multiprocess_dir, first=index == 0)
    count = ns.api_server_count
    label = f"API server {index}: " if count > 1 else ""
    engine.stat_loggers += stat_loggers(ns, metrics, label)
    ctx = serving_context(ns, config, engine, created)
    try:
        state = ServerState()
        api_key, key_source = api_key_from(ns.api_key, envs.KVSERVE_API_KEY, envs.VLLM_API_KEY)
        if index == 0:
            logger.info("%s", key_source)
        cors = {"allow_origins": ns.allowed_origins, "allow_methods": ns.allowed_methods,
                "allow_headers": ns.allowed_headers, "allow_credentials": ns.allow_credentials}
        if ns.allow_credentials and "*" in ns.allowed_origins and index == 0:
            logger.warning("--allow-credentials with --allowed-origins '[\"*\"]': every web site may send credentialed "
                           "requests (cookies) and read the answers; list the origins you trust")
        app = build_app(ctx, state, metrics, api_key, ns.max_request_body_bytes, cors,
                        force_include_usage=ns.enable_force_include_usage, docs=not ns.disable_fastapi_docs,
                        request_id_headers=ns.enable_request_id_headers)
        uv_config = uvicorn.Config(
            app,
            ssl_keyfile=ns.ssl_keyfile,
            ssl_certfile=ns.ssl_certfile,
            ssl_ca_certs=ns.ssl_ca_certs,
            ssl_cert_reqs=ns.ssl_cert_reqs,
            root_path=ns.root_path,
            log_level=ns.uvicorn_log_level,
            access_log=not ns.disable_uvicorn_access_log,
            timeout_keep_alive=ns.timeout_keep_alive,
            lifespan="off",
        )
        server = _Server(uv_config, state, ns.shutdown_timeout, others, controlled=index > 0,
                         abort_in_flight=engine.abort_all)
        if index > 0:
            for sig in (DRAIN_SIGNAL, STOP_SIGNAL):
                signal.signal(sig, server.handle_exit)
        engine.add_dead_callback(server.on_engine_dead)
        host, port = sock.getsockname()[:2]
        freeze_startup_heap("API server")
        if on_ready is not None:
            on_ready()
        if index == 0:
            processes = f" ({count} API server processes)" if count > 1 else ""
            logger.info("%s", serving_line(served_names[0], ns, host, port, processes))
            if ctx.sampling_defaults:
                logger.info("%s", describe_sampling_defaults(ctx.sampling_defaults, ctx.max_tokens_cap))
        await server.serve(sockets=[sock])
        if engine.dead_error is not None:
            server.exit_code = 1
        return server.exit_code
    finally:
        ctx.prepare_pool.shutdown(wait=False, cancel_futures=True)


def serving_line(name: str, ns: argparse.Namespace, host: str, port: int, processes: str = "") -> str:
    """The start-up line that says where the server listens; at the default host it says that only this
    machine reaches it (vLLM's default listens on every interface)."""
    scheme = "https" if ns.ssl_certfile else "http"
    local = " (this machine only; --host 0.0.0.0 to accept others)" if ns.host == DEFAULT_HOST else ""
    return f"serving {name} on {scheme}://{host}:{port}{local} (OpenAI API under /v1){processes}"


async def serve(ns: argparse.Namespace, config: EngineConfig) -> int:
    """Run the server until drained or the engine dies; returns the process exit code."""
    try:
        sock = bind_listening(ns.host, ns.port)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", ns.host, ns.port, e)
        return 1
    count = ns.api_server_count
    # (In a data-parallel replica its name carries the replica's tag: see core_client.remove_replica_dirs.)
    multiprocess_dir = tempfile.mkdtemp(prefix=tagged_prefix(METRICS_DIR_PREFIX)) if count > 1 else None
    if multiprocess_dir is not None:
        enable_multiprocess(multiprocess_dir)
    try:
        engine = AsyncLLM(config, log_level=envs.KVSERVE_LOGGING_LEVEL, api_server_count=count)
    except IpcPathError as e:
        logger.error("%s", e)
        if multiprocess_dir is not None:
            shutil.rmtree(multiprocess_dir, ignore_errors=True)
        sock.close()
        return 1
    others = ApiProcesses()
    try:
        try:
            ready = await engine.start()
        except EngineDeadError as e:
            logger.error("the engine failed to start: %s", e)
            return 1
        except ValueError as e:  # ModelLoadError: the tokenizer
            logger.error("%s", e)
            return 2
        logger.info("%s (engine ready in %.1f s)", ready.capacity_description, ready.startup_s)
        created = int(time.time())
        if count > 1:
            assert multiprocess_dir is not None
            others = _start_api_processes(ns, config, engine, sock, created, multiprocess_dir)
            if not await others.wait_serving():
                return 1
        code = await _serve_app(ns, config, engine, ready, sock, created, multiprocess_dir, 0, others)
    finally:
        await others.stop(ns.shutdown_timeout)
        await engine.shutdown()
        sock.close()
        if multiprocess_dir is not None:
            shutil.rmtree(multiprocess_dir, ignore_errors=True)
        gc.unfreeze()  # the process's exit collects its start-up objects as usual
    return 1 if any(p.exitcode != 0 for p in others.processes) else code


# ------------------------------------------------------------------------- more than one API process


# How the first API process tells the others to drain and to stop now (two signals: two of one kind sent
# close together may arrive as one).
DRAIN_SIGNAL = signal.SIGUSR1
STOP_SIGNAL = signal.SIGUSR2


@dataclass
class _ApiProcess:
    index: int
    process: multiprocessing.process.BaseProcess
    ready_pipe: multiprocessing.connection.Connection  # one message once it serves; EOF if it exits first


class ApiProcesses:
    """API processes 1 .. N-1, seen from the first one (which tells the engine when one has exited)."""

    def __init__(self, engine_client: EngineCoreClient | None = None) -> None:
        self.engine_client = engine_client
        self._members: list[_ApiProcess] = []
        self._reported: set[int] = set()
        self._drained = self._stopped = False

    @property
    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        return [m.process for m in self._members]

    def add(self, index: int, process: multiprocessing.process.BaseProcess,
            ready_pipe: multiprocessing.connection.Connection) -> None:
        self._members.append(_ApiProcess(index, process, ready_pipe))

    def report_exits(self) -> None:
        """Tell the engine about each process that has exited since the last call."""
        for m in self._members:
            if m.process.exitcode is not None and m.index not in self._reported and self.engine_client is not None:
                self._reported.add(m.index)
                self.engine_client.client_gone(m.index)

    def any_alive(self) -> bool:
        return any(p.is_alive() for p in self.processes)

    def any_exited(self) -> bool:
        return any(p.exitcode is not None for p in self.processes)

    def drain(self) -> None:
        """Stop taking requests, finish those in flight, exit (idempotent)."""
        if not self._drained:
            self._drained = True
            self._signal(DRAIN_SIGNAL)

    def stop_now(self) -> None:
        """Exit now (idempotent)."""
        if not self._stopped:
            self._stopped = True
            self._signal(STOP_SIGNAL)

    def _signal(self, sig: int) -> None:
        for process in self.processes:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, sig)

    async def wait_serving(self) -> bool:
        """Until every process serves (True) or one exited first (False)."""
        waiting = list(self._members)
        while waiting:
            objects: list[Any] = [m.ready_pipe for m in waiting] + [m.process.sentinel for m in waiting]
            done = await asyncio.to_thread(multiprocessing.connection.wait, objects, 1.0)
            for m in list(waiting):
                if m.ready_pipe in done:
                    try:
                        m.ready_pipe.recv()
                    except EOFError:  # it exited before it served
                        pass
                    else:
                        waiting.remove(m)
                        continue
                if m.ready_pipe in done or m.process.sentinel in done:
                    m.process.join(timeout=5)
                    logger.error("API server process %s exited during start-up (exit code %s)", m.process.name,
                                 m.process.exitcode)
                    return False
        return True

    async def stop(self, shutdown_timeout_s: float) -> None:
        """Drain the processes (if not ordered yet) and wait for their exit; stop, then kill, those that hang."""
        if not self._members:
            return
        self.drain()
        steps = [(shutdown_timeout_s + 5.0, self.stop_now), (5.0, self._kill)]
        for wait_s, last_resort in steps[1:] if self._stopped else steps:
            deadline = time.monotonic() + wait_s
            while self.any_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if not self.any_alive():
                break
            last_resort()
        for process in self.processes:
            process.join(timeout=5)
        self.report_exits()

    def _kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                logger.warning("API server process %s did not exit; killing it", process.name)
                process.kill()


def _start_api_processes(ns: argparse.Namespace, config: EngineConfig, engine: AsyncLLM, sock: socket.socket,
                         created: int, multiprocess_dir: str) -> ApiProcesses:
    """Spawn API processes 1 .. N-1 on the same listening socket; each reports on its pipe once it serves."""
    mp = multiprocessing.get_context("spawn")
    others = ApiProcesses(engine.client)
    for index in range(1, ns.api_server_count):
        receive, send = mp.Pipe(duplex=False)
        process = mp.Process(
            target=run_api_process,
            args=(ns, config, engine.client.attachment(index), sock, created, multiprocess_dir, send),
            name=f"kvserve-api-{index}",
            daemon=False,
        )
        process.start()
        send.close()
        others.add(index, process, receive)
    logger.info("started %d more API server processes (pids %s)", len(others.processes),
                ", ".join(str(p.pid) for p in others.processes))
    return others


def run_api_process(ns: argparse.Namespace, config: EngineConfig, attach: EngineAttachment, sock: socket.socket,
                    created: int, multiprocess_dir: str, ready_pipe: multiprocessing.connection.Connection) -> None:
    """Entry point of API processes 1 .. N-1 (spawned: importable by name). Exits with the server's code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the first process decides (see `_Server`)
    logging.basicConfig(level=envs.KVSERVE_LOGGING_LEVEL.upper(),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", force=True)
    sys.exit(asyncio.run(_serve_attached(ns, config, attach, sock, created, multiprocess_dir, ready_pipe)))


async def _serve_attached(ns: argparse.Namespace, config: EngineConfig, attach: EngineAttachment,
                          sock: socket.socket, created: int, multiprocess_dir: str,
                          ready_pipe: multiprocessing.connection.Connection) -> int:
    engine = AsyncLLM(config, log_level=envs.KVSERVE_LOGGING_LEVEL, attach=attach)
    try:
        try:
            ready = await engine.start()
        except EngineDeadError as e:
            logger.error("API server %d cannot attach to the engine: %s", attach.index, e)
            return 1
        except ValueError as e:  # ModelLoadError: the tokenizer
            logger.error("%s", e)
            return 2

        def report_ready() -> None:
            ready_pipe.send(True)
            ready_pipe.close()

        return await _serve_app(ns, config, engine, ready, sock, created, multiprocess_dir, attach.index,
                                on_ready=report_ready)
    finally:
        await engine.shutdown()
        sock.close()


def cpu_fallback_warning(flag: str | None, device: str) -> str | None:
    """The start-up warning when no --device was given and the engine runs on the CPU because torch has no usable
    CUDA GPU (a CPU build of torch, a driver or CUDA mismatch, a container started without its GPUs): a vLLM
    user expects such a server to fail at start, not to serve far more slowly. None otherwise."""
    if flag is not None or device != "cpu":
        return None
    import torch

    why = ("this torch was built without CUDA" if torch.version.cuda is None else
           f"torch (CUDA {torch.version.cuda}) sees no usable GPU: the driver, CUDA_VISIBLE_DEVICES, or a container "
           "started without its GPUs")
    return (f"no CUDA GPU ({why}): serving on the CPU, far slower than on a GPU; --device cuda makes a missing GPU "
            "an error, --device cpu chooses the CPU (and silences this)")


def run_server(ns: argparse.Namespace) -> int:
    """Entry point shared by `kvserve serve` and `python -m kvserve.entrypoints.openai.api_server`."""
    logging.basicConfig(level=envs.KVSERVE_LOGGING_LEVEL.upper(),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", force=True)
    if envs.KVSERVE_DP_REPLICA:  # started by `kvserve serve --data-parallel-size N`
        if (ns.data_parallel_size or 1) > 1:
            print(f"kvserve serve: error: this is a replica of `kvserve serve --data-parallel-size` (KVSERVE_DP_REPLICA "
                  f"is set), so it does not start replicas of its own (--data-parallel-size {ns.data_parallel_size})",
                  file=sys.stderr)
            return 2
        ns.data_parallel_size = None  # the parent's `--data-parallel-size 1`: no "ignored" note for it
    try:
        config = EngineArgs(**server_engine_args(ns)).create_engine_config()  # type: ignore[arg-type]
    except ValueError as e:  # ConfigError, ModelLoadError, conflicting flags
        print(f"kvserve serve: error: {e}", file=sys.stderr)
        return 2
    if not envs.KVSERVE_DP_REPLICA:  # a replica's parent said these once for all its replicas
        log_ignored_flags(ns)
        warning = cpu_fallback_warning(ns.device, config.device_config.device)
        if warning is not None:
            logger.warning("%s", warning)
        unread = envs.unread_vllm_env_vars()
        if unread:
            logger.warning("vLLM environment variables kvserve does not read: %s", ", ".join(unread))
    if (ns.data_parallel_size or 1) > 1:  # replicas of this server behind a router
        from kvserve.entrypoints.data_parallel import run_data_parallel

        return run_data_parallel(ns)
    return asyncio.run(serve(ns, config))


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_arg_parser(prog="python -m kvserve.entrypoints.openai.api_server")
    ns = parse_args_or_refuse(parser, argv)
    ns.serve_args = list(sys.argv[1:] if argv is None else argv)  # the replicas' flags (--data-parallel-size)
    return run_server(ns)


if __name__ == "__main__":
    sys.exit(main())
