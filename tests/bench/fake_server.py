"""A small OpenAI-compatible streaming server for the bench client's tests, on 127.0.0.1 in a thread.

Each answer streams `max_tokens` words (one per chunk, `itl_s` apart, the first after `ttft_s`), so the
expected token counts and texts are known exactly. `FakeBehavior` makes chosen requests fail: the k-th
request (1-based, in arrival order) gets an HTTP error when k % fail_every == 0, a cut stream when
k % cut_every == 0, an error object inside the stream when k % stream_error_every == 0, a chunk that is not
JSON when k % garbage_every == 0. `/metrics` serves
kvserve-named gauges: running = requests in flight; prefix hits = half the prompt words seen.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "fake-model"
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


def answer_text(num_tokens: int) -> str:
    """The text the fake streams for `num_tokens` tokens (" alpha bravo ...")."""
    return "".join(" " + WORDS[i % len(WORDS)] for i in range(num_tokens))


@dataclass
class FakeBehavior:
    ttft_s: float = 0.005
    itl_s: float = 0.002
    fail_every: int = 0
    fail_status: int = 500
    cut_every: int = 0
    cut_after_tokens: int = 2
    stream_error_every: int = 0
    garbage_every: int = 0
    include_usage: bool = True
    send_done: bool = True
    # Ends every answer with finish_reason "stop" after this many tokens (an EOS before max_tokens).
    stop_after_tokens: int | None = None
    # The first this many tokens stream with empty text (as a partial character or a special token does).
    empty_text_tokens: int = 0
    # The last token streams with empty text (an EOS left out of the text), its chunk carrying the finish.
    empty_text_last: bool = False
    # Chat: the finish comes in a chunk of its own after the last token, with an empty delta.
    finish_only_chunk: bool = False
    # Chat: the first this many tokens are a reasoning model's thinking, streamed in each field of
    # `reasoning_fields` of the delta (the same text in each, as vLLM's backward-compatible deltas do).
    reasoning_tokens: int = 0
    reasoning_fields: tuple[str, ...] = ("reasoning",)
    # Every event goes out in two writes split inside its JSON, with CRLF line ends.
    ragged: bool = False
    # The body stays open this long after `[DONE]` before it ends.
    hold_after_done_s: float = 0.0
    # `/metrics` answers this long after it is asked (a server busy with the run's requests).
    metrics_delay_s: float = 0.0
    # The model names requests may send (a 404 with OpenAI's error body for another, as vLLM answers); None: any.
    served_models: tuple[str, ...] | None = None
    # The server stops listening once this many requests have arrived (it goes away mid-run).
    exit_after: int | None = None
    # The Content-Type of the streamed answers (a proxy may send an event stream as text/plain).
    content_type: str = "text/event-stream"


@dataclass
class FakeState:
    num_requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    prompt_words: int = 0
    bodies: list[dict] = field(default_factory=list)
    arrival_times: list[float] = field(default_factory=list)
    # The client ends (host, port) requests came from: one per TCP connection.
    connections: set[tuple[str, int]] = field(default_factory=set)
    # The Authorization header of each request (None: none sent).
    authorizations: list[str | None] = field(default_factory=list)
    # The x-request-id header of each request (None: none sent).
    request_ids: list[str | None] = field(default_factory=list)


class _CutStream(Exception):
    """Raised inside a streaming body: the server drops the connection mid-response."""


class FakeOpenAIServer:
    def __init__(self, behavior: FakeBehavior | None = None) -> None:
        self.behavior = behavior or FakeBehavior()
        self.state = FakeState()
        app = Starlette(routes=[
            Route("/v1/chat/completions", self._completions, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/redirect/completions", self._redirect, methods=["POST"]),
            Route("/v1/models", self._models),
            Route("/metrics", self._metrics),
        ])
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="critical", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> FakeOpenAIServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise AssertionError("fake server did not start within 10 s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    async def _redirect(self, request: Request) -> Response:
        return Response(status_code=307, headers={"Location": "/v1/completions"})

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _metrics(self, request: Request) -> Response:
        await asyncio.sleep(self.behavior.metrics_delay_s)
        s = self.state
        labels = f'{{model_name="{MODEL}"}}'
        lines = [
            "# TYPE kvserve:num_requests_running gauge", f"kvserve:num_requests_running{labels} {s.in_flight}",
            "# TYPE kvserve:num_requests_waiting gauge", f"kvserve:num_requests_waiting{labels} 0",
            "# TYPE kvserve:kv_cache_usage_perc gauge", f"kvserve:kv_cache_usage_perc{labels} {s.in_flight / 100}",
            "# TYPE kvserve:prefix_cache_queries counter",
            f"kvserve:prefix_cache_queries_total{labels} {2 * s.prompt_words}",
            "# TYPE kvserve:prefix_cache_hits counter", f"kvserve:prefix_cache_hits_total{labels} {s.prompt_words}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def _completions(self, request: Request) -> Response:
        b, s = self.behavior, self.state
        body = await request.json()
        s.num_requests += 1
        k = s.num_requests
        if b.exit_after is not None and k >= b.exit_after:
            self._server.should_exit = True  # uvicorn closes the listening socket: later connections are refused
        s.bodies.append(body)
        s.arrival_times.append(time.perf_counter())
        if request.client is not None:
            s.connections.add((request.client.host, request.client.port))
        s.authorizations.append(request.headers.get("authorization"))
        s.request_ids.append(request.headers.get("x-request-id"))
        chat = "messages" in body
        text = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        num_prompt = len(text.split())
        if b.served_models is not None and body.get("model") not in b.served_models:
            return JSONResponse({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                           "type": "NotFoundError", "param": None, "code": 404}}, status_code=404)
        if b.fail_every and k % b.fail_every == 0:
            return JSONResponse({"error": {"message": f"injected failure of request {k}", "type": "server_error",
                                           "param": None, "code": b.fail_status}}, status_code=b.fail_status)
        s.prompt_words += num_prompt
        max_tokens = int(body.get("max_tokens") or 16)
        num_tokens = min(max_tokens, b.stop_after_tokens) if b.stop_after_tokens else max_tokens
        finish = "stop" if num_tokens < max_tokens else "length"
        usage_wanted = b.include_usage and (body.get("stream_options") or {}).get("include_usage")
        cut = bool(b.cut_every and k % b.cut_every == 0)
        stream_error = bool(b.stream_error_every and k % b.stream_error_every == 0)
        garbage = bool(b.garbage_every and k % b.garbage_every == 0)

        def chunk(piece: str | None, finish_reason: str | None = None, empty_delta: bool = False,
                  thinking: bool = False) -> str:
            if chat:
                delta = {"content": piece} if piece is not None else {"role": "assistant", "content": ""}
                if empty_delta:
                    delta = {}
                elif thinking:
                    delta = dict.fromkeys(b.reasoning_fields, piece)
                choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish_reason}
            payload = {"id": f"req-{k}", "object": "chunk", "model": MODEL, "choices": [choice]}
            if usage_wanted:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        async def events():
            s.in_flight += 1
            s.max_in_flight = max(s.max_in_flight, s.in_flight)
            try:
                if chat:
                    yield chunk(None)
                await asyncio.sleep(b.ttft_s)
                for i in range(num_tokens):
                    if i:
                        await asyncio.sleep(b.itl_s)
                    if cut and i == b.cut_after_tokens:
                        raise _CutStream(f"request {k} cut after {i} tokens")
                    if garbage and i == 1:
                        yield "data: this is not json\n\n"
                    if stream_error and i == 1:
                        yield 'data: {"error": {"message": "injected in-stream error", "code": 500}}\n\n'
                        return
                    last = i == num_tokens - 1
                    empty = i < b.empty_text_tokens or (last and b.empty_text_last)
                    piece = "" if empty else " " + WORDS[i % len(WORDS)]
                    separate_finish = chat and b.finish_only_chunk
                    yield chunk(piece, finish if last and not separate_finish else None,
                                thinking=i < b.reasoning_tokens)
                    if last and separate_finish:
                        yield chunk(None, finish, empty_delta=True)
                if usage_wanted:
                    usage = {"prompt_tokens": num_prompt, "completion_tokens": num_tokens,
                             "total_tokens": num_prompt + num_tokens,
                             "prompt_tokens_details": {"cached_tokens": num_prompt // 2}}
                    yield f"data: {json.dumps({'id': f'req-{k}', 'choices': [], 'usage': usage})}\n\n"
                if b.send_done:
                    yield "data: [DONE]\n\n"
                if b.hold_after_done_s:
                    await asyncio.sleep(b.hold_after_done_s)
            finally:
                s.in_flight -= 1

        async def ragged(source):
            async for event in source:
                event = event.replace("\n", "\r\n")
                half = len(event) // 2
                yield event[:half]
                await asyncio.sleep(0.002)  # a separate read for the client
                yield event[half:]

        return StreamingResponse(ragged(events()) if b.ragged else events(), media_type=b.content_type)
