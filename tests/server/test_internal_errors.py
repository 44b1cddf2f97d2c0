"""A failure of the server itself (an exception that is no request error) still answers in the OpenAI error
format with status 500: a plain request gets the JSON body, a stream gets an error event and [DONE] after
what it had sent. A request the stopping server cancels answers the same way, with status 503. Driven in
process with a stub engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.middleware import ServerState
from kvserve.entrypoints.openai.serving_common import ServingContext
from kvserve.protocol.outputs import CompletionOutput, RequestOutput
from kvserve.protocol.sampling_params import SamplingParams


def _app(fail_in: str) -> tuple[Any, ServingContext]:
    """An app whose engine fails with a RuntimeError after one token (`fail_in` "engine"), or whose tokenizer
    fails with one (`fail_in` "tokenizer": an exception the request's preparation does not expect); `fail_in`
    "hang": the engine gives one token, then nothing more."""

    def tokenizer(text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        if fail_in == "tokenizer":
            raise RuntimeError("tokenizer broke")
        return {"input_ids": [5, 6, 7]}

    async def generate(request_id: str, ids: list[int], params: SamplingParams, prompt: str | None,
                       cache_salt: str | None = None, priority: int = 0,
                       prompt_only: bool = False) -> AsyncIterator[RequestOutput]:
        out = CompletionOutput(index=0, text=" ok", token_ids=[9], text_delta=" ok", token_ids_delta=[9])
        yield RequestOutput(request_id, prompt, ids, [out])
        if fail_in == "hang":
            engine.hanging.append(request_id)
            await asyncio.Event().wait()
        raise RuntimeError("engine broke")

    engine = SimpleNamespace(is_alive=True, dead_error=None, max_model_len=64, tokenizer=tokenizer,
                             generate=generate, hanging=[],
                             input_processor=SimpleNamespace(first_out_of_vocab=lambda ids: None))
    ctx = ServingContext(engine=engine, served_model_names=["m"], model_path="m",  # type: ignore[arg-type]
                         log_requests=False)
    return build_app(ctx, ServerState(), SimpleNamespace(), None, 1 << 20), ctx  # type: ignore[arg-type]


def _post(app: Any, body: dict[str, Any]) -> httpx.Response:
    async def scenario() -> httpx.Response:
        # (Starlette raises a handled bug again after answering, for the server's log: not into the test)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            return await client.post("/v1/completions", json=body)

    return asyncio.run(scenario())


@pytest.mark.parametrize("fail_in", ["engine", "tokenizer"])
def test_a_server_failure_is_an_openai_500(fail_in: str) -> None:
    app, ctx = _app(fail_in)
    try:
        response = _post(app, {"model": "m", "prompt": "hello", "max_tokens": 4})
    finally:
        ctx.prepare_pool.shutdown()
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "InternalServerError" and error["code"] == 500
    assert f"{fail_in} broke" in error["message"]


def test_a_stream_that_fails_in_the_server_ends_with_an_error_event_and_done() -> None:
    app, ctx = _app("engine")
    try:
        response = _post(app, {"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True})
    finally:
        ctx.prepare_pool.shutdown()
    assert response.status_code == 200
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["text"] == " ok"
    assert chunks[-1]["error"]["code"] == 500 and "engine broke" in chunks[-1]["error"]["message"]


def _cancelled_mid_request(app: Any, ctx: ServingContext, body: dict[str, Any]
                           ) -> tuple[list[dict[str, Any]], BaseException | None]:
    """Send `body` to /v1/completions straight to the ASGI app (of `_app("hang")`), in a task that is cancelled
    once the engine has given its token (a stream has sent it) and waits, as uvicorn cancels what still runs
    when it stops (a second signal: exit at once). Returns the ASGI messages the app sent, and what the task
    raised."""

    async def scenario() -> tuple[list[dict[str, Any]], BaseException | None]:
        payload = json.dumps(body).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "",
                 "query_string": b"", "client": ("127.0.0.1", 1), "server": ("test", 80),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]}
        request = [{"type": "http.request", "body": payload, "more_body": False}]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if request:
                return request.pop()
            await asyncio.Event().wait()  # the client stays
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        task = asyncio.ensure_future(app(scope, receive, send))
        for _ in range(1000):
            if ctx.engine.hanging:
                break
            await asyncio.sleep(0.01)
        assert ctx.engine.hanging, "the request never reached the engine"
        task.cancel()
        (outcome,) = await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
        return sent, outcome if isinstance(outcome, BaseException) else None

    return asyncio.run(scenario())


def test_a_request_the_stopping_server_cancels_is_an_openai_503() -> None:
    """uvicorn answered a request it cancelled before its response started with a plain-text 500 ("Internal
    Server Error"), the body no OpenAI client can read as an error."""
    app, ctx = _app("hang")
    try:
        sent, raised = _cancelled_mid_request(app, ctx, {"model": "m", "prompt": "hello", "max_tokens": 4})
    finally:
        ctx.prepare_pool.shutdown()
    assert sent, f"no response (the task raised {raised!r})"
    start, *bodies = sent
    assert start["status"] == 503 and (b"content-type", b"application/json") in start["headers"]
    assert bodies and not bodies[-1].get("more_body", False)
    error = json.loads(b"".join(b["body"] for b in bodies))["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert "shutting down" in error["message"]


def test_a_stream_the_stopping_server_cancels_ends_with_an_error_event_and_done() -> None:
    """It was cut off (uvicorn closed the connection mid-body)."""
    app, ctx = _app("hang")
    try:
        sent, raised = _cancelled_mid_request(app, ctx, {"model": "m", "prompt": "hello", "max_tokens": 4,
                                                         "stream": True})
    finally:
        ctx.prepare_pool.shutdown()
    start, *bodies = sent
    assert start["status"] == 200
    assert bodies and not bodies[-1].get("more_body", False), f"the stream was not ended (raised {raised!r})"
    text = b"".join(b["body"] for b in bodies).decode()
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["text"] == " ok"
    assert chunks[-1]["error"]["code"] == 503 and "shutting down" in chunks[-1]["error"]["message"]


def _cancel_through_the_guard(app: Any, blocks_after: int | None) -> tuple[list[dict[str, Any]], BaseException | None]:
    """Run `app` behind GuardMiddleware, cancel it once it has sent two messages and waits, as the stopping
    server does; `blocks_after`: every send after that many messages waits forever (a client that stopped
    reading: uvicorn's send waits for the transport to drain). Returns the messages sent and what the task
    raised (a 20-s hang guard)."""
    from kvserve.entrypoints.openai.middleware import GuardMiddleware

    async def scenario() -> tuple[list[dict[str, Any]], BaseException | None]:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            if blocks_after is not None and len(sent) >= blocks_after:
                await asyncio.Event().wait()
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "path": "/v1/completions", "root_path": "", "headers": []}
        task = asyncio.ensure_future(GuardMiddleware(app, ServerState(), None, 1 << 20)(scope, receive, send))
        for _ in range(500):
            if len(sent) >= 2:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        (outcome,) = await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 20)
        return sent, outcome if isinstance(outcome, BaseException) else None

    return asyncio.run(scenario())


def _stream_app(last_event: bytes) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": last_event, "more_body": True})
        await asyncio.Event().wait()  # waits for the engine (or, after [DONE], to send its closing body)

    return app


def test_a_cancelled_stream_whose_client_stopped_reading_still_ends_the_task() -> None:
    """Ending the response waits on a send that never returns: the cancellation goes on after a bound. The task
    used to wait forever, so asyncio.run's exit (the second signal's "exit at once") never returned."""
    sent, raised = _cancel_through_the_guard(_stream_app(b'data: {"x": 1}\n\n'), blocks_after=2)
    assert isinstance(raised, asyncio.CancelledError) and len(sent) == 2


def test_a_cancelled_stream_already_done_only_gets_its_closing_body() -> None:
    """A stream cancelled after its [DONE] event (waiting to send its closing empty body) gets no error event
    after [DONE]: only that closing body."""
    sent, raised = _cancel_through_the_guard(_stream_app(b'data: {"x": 1}\n\ndata: [DONE]\n\n'), blocks_after=None)
    assert raised is None
    assert [m.get("body") for m in sent[2:]] == [b""] and not sent[-1].get("more_body", False)
