"""Tokenization runs off the server's event loop: while one request's prompt is being tokenized, the loop
serves other requests (other streams' chunks, in a real server). Driven in process with a stub engine whose
tokenizer blocks until the test has seen another request answered."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx

from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.middleware import ServerState
from kvserve.entrypoints.openai.serving_common import ServingContext
from kvserve.protocol.outputs import CompletionOutput, RequestOutput
from kvserve.protocol.sampling_params import SamplingParams

BLOCK_S = 3.0  # how long the stub tokenizer holds the prompt at most (the old code's test fails after it)


def _stub_engine(tokenizer: Any) -> Any:
    async def generate(request_id: str, ids: list[int], params: SamplingParams,
                       prompt: str | None, cache_salt: str | None = None, priority: int = 0,
                       prompt_only: bool = False) -> AsyncIterator[RequestOutput]:
        out = CompletionOutput(index=0, text=" ok", token_ids=[9], finish_reason="length", text_delta=" ok",
                               token_ids_delta=[9])
        yield RequestOutput(request_id, prompt, ids, [out], finished=True)

    # every id in the vocabulary (the server asks before it answers)
    input_processor = SimpleNamespace(first_out_of_vocab=lambda ids: None)
    return SimpleNamespace(is_alive=True, dead_error=None, max_model_len=64, tokenizer=tokenizer,
                           generate=generate, input_processor=input_processor)


def test_other_requests_are_served_while_a_prompt_is_tokenized() -> None:
    entered, release = threading.Event(), threading.Event()
    done = threading.Event()

    def tokenizer(text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        entered.set()
        release.wait(timeout=BLOCK_S)
        done.set()
        return {"input_ids": [5, 6, 7]}

    ctx = ServingContext(engine=_stub_engine(tokenizer), served_model_names=["m"], model_path="m",
                         log_requests=False)
    app = build_app(ctx, ServerState(), SimpleNamespace(), None, 1 << 20)  # type: ignore[arg-type]

    async def scenario() -> tuple[int, bool, dict[str, Any]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            completion = asyncio.ensure_future(
                client.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 1})
            )
            for _ in range(int(BLOCK_S * 100)):
                if entered.is_set():
                    break
                await asyncio.sleep(0.01)
            models = await client.get("/v1/models")
            answered_during_tokenization = not done.is_set()
            release.set()
            response = await completion
            return models.status_code, answered_during_tokenization, response.json()

    try:
        status, answered_during_tokenization, body = asyncio.run(scenario())
    finally:
        release.set()
        ctx.prepare_pool.shutdown()
    assert status == 200
    assert answered_during_tokenization, "the event loop waited for the tokenizer"
    assert body["choices"][0]["text"] == " ok" and body["usage"]["prompt_tokens"] == 3


def test_errors_raised_while_preparing_off_the_loop_reach_the_client() -> None:
    """A prompt that does not fit is still a 400 in the OpenAI error format (raised on the preparation
    thread)."""
    ctx = ServingContext(engine=_stub_engine(lambda text, add_special_tokens=True: {"input_ids": [1] * 80}),
                         served_model_names=["m"], model_path="m", log_requests=False)
    app = build_app(ctx, ServerState(), SimpleNamespace(), None, 1 << 20)  # type: ignore[arg-type]

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/completions", json={"model": "m", "prompt": "long", "max_tokens": 4})

    try:
        response = asyncio.run(scenario())
    finally:
        ctx.prepare_pool.shutdown()
    assert response.status_code == 400
    error = response.json()["error"]
    assert "maximum context length" in error["message"] and error["param"] == "prompt"
