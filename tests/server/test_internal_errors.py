"""A failure of the server itself (an exception that is no request error) still answers in the OpenAI error
format with status 500: a plain request gets the JSON body, a stream gets an error event and [DONE] after
what it had sent. Driven in process with a stub engine."""

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
    fails with one (`fail_in` "tokenizer": an exception the request's preparation does not expect)."""

    def tokenizer(text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        if fail_in == "tokenizer":
            raise RuntimeError("tokenizer broke")
        return {"input_ids": [5, 6, 7]}

    async def generate(request_id: str, ids: list[int], params: SamplingParams, prompt: str | None,
                       cache_salt: str | None = None, priority: int = 0,
                       prompt_only: bool = False) -> AsyncIterator[RequestOutput]:
        out = CompletionOutput(index=0, text=" ok", token_ids=[9], text_delta=" ok", token_ids_delta=[9])
        yield RequestOutput(request_id, prompt, ids, [out])
        raise RuntimeError("engine broke")

    engine = SimpleNamespace(is_alive=True, dead_error=None, max_model_len=64, tokenizer=tokenizer,
                             generate=generate, has_request=lambda request_id: False)
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
