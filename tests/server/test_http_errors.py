"""Starlette's own HTTP errors (a method a route does not take) answered in the OpenAI error format keep the
headers the protocol needs: a 405 says which methods the route takes (RFC 9110 requires Allow). Driven in
process with a stub engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx

from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.middleware import ServerState
from kvserve.entrypoints.openai.serving_common import ServingContext


def test_a_405_keeps_its_allow_header() -> None:
    engine = SimpleNamespace(is_alive=True, dead_error=None, max_model_len=64, tokenizer=None)
    ctx = ServingContext(engine=engine, served_model_names=["m"], model_path="m",  # type: ignore[arg-type]
                         log_requests=False)
    app = build_app(ctx, ServerState(), SimpleNamespace(), None, 1 << 20)  # type: ignore[arg-type]

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return [await client.get("/v1/chat/completions"), await client.delete("/v1/models/m")]

    try:
        chat, model = asyncio.run(scenario())
    finally:
        ctx.prepare_pool.shutdown()
    for response, allowed in ((chat, {"POST"}), (model, {"GET", "HEAD"})):
        assert response.status_code == 405, response.text
        error = response.json()["error"]
        assert error["code"] == 405 and error["message"] == "Method Not Allowed"
        assert set(response.headers.get("allow", "").replace(" ", "").split(",")) >= allowed - {"HEAD"}, \
            response.headers
