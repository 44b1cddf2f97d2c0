"""Client-chosen request ids cannot collide inside the engine: a two-prompt completion with id "x" and a
one-prompt completion with id "x-0" (the id the first one's prompt 0 used to run under) both succeed, in
either order, streamed or not, and keep the ids the clients see. An id in use is taken again, as current vLLM
takes it (a gateway's one trace id on several requests): each runs, and a client that leaves ends only its own.
Driven in process: the real `AsyncLLM` over a fake engine core that answers every request with one token when
the test says so."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest

from kvserve.config import EngineConfig
from kvserve.core.outputs import EngineCoreOutput, SchedulerStats
from kvserve.engine import async_llm
from kvserve.engine.async_llm import AsyncLLM
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.middleware import ServerState
from kvserve.entrypoints.openai.serving_common import ServingContext
from kvserve.protocol.core_messages import EngineOutputs, EngineReady

TOKEN_ID = 42  # what the fake core answers every request with


class _HeldCore:
    """What AsyncLLM needs of EngineCoreClient: requests are held until `release()` answers each one with
    TOKEN_ID, finished on length."""

    def __init__(self, config: Any, handler: AsyncLLM, *args: Any) -> None:
        self.handler = handler
        self.index = 0
        self.dead_error = None
        self.is_alive = True
        self.held: list[str] = []
        self.added: list[str] = []
        self.aborted: list[str] = []

    async def start(self) -> EngineReady:
        return EngineReady(pid=0, num_blocks=64, block_size=16, max_model_len=256, eos_token_ids=[],
                           vocab_size=49152, startup_s=0.0, capacity_description="")

    async def add_requests(self, requests: list[Any]) -> None:
        self.added += [r.req_id for r in requests]
        self.held += [r.req_id for r in requests]

    def release(self) -> None:
        outputs = [EngineCoreOutput(req_id, [TOKEN_ID], finish_reason="length") for req_id in self.held]
        self.held = []
        self.handler.on_engine_outputs(EngineOutputs(outputs=outputs, stats=SchedulerStats(), timestamp=0.0))

    def abort_requests(self, req_ids: list[str]) -> None:
        self.aborted += req_ids

    async def shutdown(self) -> None:
        pass


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


def _scenario(monkeypatch: pytest.MonkeyPatch, tokenizer: Any,
              script: Callable[[httpx.AsyncClient, _HeldCore], Awaitable[Any]]) -> Any:
    monkeypatch.setattr(async_llm, "EngineCoreClient", _HeldCore)

    async def run() -> Any:
        llm = AsyncLLM(cast(EngineConfig, None), tokenizer)
        await llm.start()
        ctx = ServingContext(engine=llm, served_model_names=["m"], model_path="m", log_requests=False)
        app = build_app(ctx, ServerState(), SimpleNamespace(), None, 1 << 20)  # type: ignore[arg-type]
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
                return await script(client, cast(_HeldCore, llm.client))
        finally:
            ctx.prepare_pool.shutdown()

    return asyncio.run(run())


def _body(prompt: str | list[str], request_id: str, stream: bool = False) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": 1, "request_id": request_id, "stream": stream}


def _streamed(response: httpx.Response) -> tuple[set[str], list[int]]:
    """A stream's chunk ids and its choices' indexes, in order."""
    assert response.status_code == 200, response.text
    ids: set[str] = set()
    indexes: list[int] = []
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            ids.add(chunk["id"])
            indexes += [c["index"] for c in chunk["choices"]]
    return ids, indexes


@pytest.mark.parametrize("multi_first", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_a_multi_prompt_completion_and_a_client_id_like_its_prompts_both_run(
        monkeypatch: pytest.MonkeyPatch, smollm_tokenizer: Any, multi_first: bool, stream: bool) -> None:
    async def script(client: httpx.AsyncClient, core: _HeldCore) -> tuple[httpx.Response, httpx.Response]:
        bodies = [_body(["one", "two"], "x", stream), _body("three", "x-0", stream)]
        if not multi_first:
            bodies.reverse()
        first = asyncio.ensure_future(client.post("/v1/completions", json=bodies[0]))
        num_first = 2 if multi_first else 1
        await _until(lambda: len(core.held) == num_first)
        second = asyncio.ensure_future(client.post("/v1/completions", json=bodies[1]))
        await _until(lambda: len(core.held) == 3 or second.done())
        core.release()
        responses = await asyncio.gather(first, second)
        assert len(set(core.added)) == len(core.added) == 3  # each prompt its own id in the core
        return responses if multi_first else (responses[1], responses[0])

    multi, single = _scenario(monkeypatch, smollm_tokenizer, script)
    if stream:
        ids, indexes = _streamed(multi)
        assert ids == {"cmpl-x"} and sorted(indexes) == [0, 1]
        assert _streamed(single) == ({"cmpl-x-0"}, [0])
        return
    assert multi.status_code == 200, multi.text
    assert single.status_code == 200, single.text
    assert multi.json()["id"] == "cmpl-x" and [c["index"] for c in multi.json()["choices"]] == [0, 1]
    assert single.json()["id"] == "cmpl-x-0" and len(single.json()["choices"]) == 1


def test_an_id_in_use_is_taken_again_and_a_client_that_leaves_ends_only_its_own(
        monkeypatch: pytest.MonkeyPatch, smollm_tokenizer: Any) -> None:
    """While a two-prompt completion "x" runs, three more requests with id "x" come (one of them streamed, one
    whose client leaves before its answer): the others are answered with the client's id, every prompt ran
    under a core id of its own, and the one that left was aborted alone."""
    async def script(client: httpx.AsyncClient, core: _HeldCore) -> tuple[list[httpx.Response], bool, bool]:
        first = asyncio.ensure_future(client.post("/v1/completions", json=_body(["one", "two"], "x")))
        await _until(lambda: len(core.held) == 2)
        leaving = asyncio.ensure_future(client.post("/v1/completions", json=_body("three", "x")))
        await _until(lambda: len(core.held) == 3)
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        others = [asyncio.ensure_future(client.post("/v1/completions", json=body))
                  for body in (_body(["four", "five"], "x"), _body("six", "x", stream=True))]
        await _until(lambda: len(core.held) == 6)
        core.release()
        responses = [await first, *await asyncio.gather(*others)]
        assert len(set(core.added)) == len(core.added) == 6
        # The core was told to abort the leaving request's prompt, and only it.
        return responses, core.aborted == [core.added[2]], core.handler.has_request("cmpl-x")

    (first, multi, streamed), left_alone, still_in_use = _scenario(monkeypatch, smollm_tokenizer, script)
    assert left_alone
    for response in (first, multi):
        assert response.status_code == 200 and response.json()["id"] == "cmpl-x", response.text
        assert [c["index"] for c in response.json()["choices"]] == [0, 1]
        assert all(c["finish_reason"] == "length" for c in response.json()["choices"])
    assert _streamed(streamed) == ({"cmpl-x"}, [0])
    assert not still_in_use
