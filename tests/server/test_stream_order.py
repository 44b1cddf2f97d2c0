"""The chat stream's role chunk goes out with the first token (as vLLM sends it), not before the prompt
runs: a client's time to the first chunk is its time to the first token. Driven with a stub engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

from kvserve.entrypoints.openai.serving_chat import PreparedChat, chat_stream
from kvserve.protocol.outputs import CompletionOutput, RequestOutput
from kvserve.protocol.sampling_params import SamplingParams


def test_chat_role_chunk_waits_for_the_first_token() -> None:
    async def scenario() -> list[dict]:
        first_token = asyncio.Event()

        async def generate(request_id: str, ids: list[int], params: SamplingParams,
                           prompt: str | None, cache_salt: str | None = None, priority: int = 0,
                       prompt_only: bool = False) -> AsyncIterator[RequestOutput]:
            await first_token.wait()  # the prompt is running
            out = CompletionOutput(index=0, text="Hi", token_ids=[7], finish_reason="length", text_delta="Hi",
                                   token_ids_delta=[7])
            yield RequestOutput(request_id, prompt, ids, [out], finished=True)

        ctx = SimpleNamespace(engine=SimpleNamespace(generate=generate, tokenizer=None))
        chat = PreparedChat("chatcmpl-1", "m", "prompt", [1, 2, 3], SamplingParams(max_tokens=1), None)
        stream = chat_stream(ctx, chat, include_usage=False, continuous_usage=False)  # type: ignore[arg-type]
        pending = asyncio.ensure_future(stream.__anext__())
        for _ in range(20):  # let the stream run as far as it can without a token
            await asyncio.sleep(0)
        assert not pending.done(), "a chunk went out before the first token"
        first_token.set()
        events = [await pending] + [event async for event in stream]
        return [json.loads(e[len("data: "):]) for e in events if e.startswith("data: {")]

    chunks = asyncio.run(scenario())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"] == {"content": "Hi"}
    assert chunks[1]["choices"][0]["finish_reason"] == "length"


def test_completion_stream_sends_prompt_logprobs_with_each_choices_first_chunk() -> None:
    """n=2 with prompt_logprobs, sample 1's first token an update after sample 0's (as when the engine runs
    them in different steps): each choice's first chunk carries prompt_logprobs, also sample 1's."""
    from kvserve.entrypoints.openai.serving_completion import (
        PreparedCompletion,
        PreparedPrompt,
        completion_stream,
    )
    from kvserve.protocol.outputs import Logprob

    table = [None, {5: Logprob(-1.0, 1, "x")}]

    async def generate(request_id: str, ids: list[int], params: SamplingParams, prompt: str | None,
                       cache_salt: str | None = None, priority: int = 0,
                       prompt_only: bool = False) -> AsyncIterator[RequestOutput]:
        s0 = CompletionOutput(0, "a", [7], finish_reason="length", text_delta="a", token_ids_delta=[7])
        s1 = CompletionOutput(1)
        yield RequestOutput(request_id, prompt, ids, [s0, s1], prompt_logprobs=table)
        s0 = CompletionOutput(0, "a", [7], finish_reason="length")
        s1 = CompletionOutput(1, "b", [8], finish_reason="length", text_delta="b", token_ids_delta=[8])
        yield RequestOutput(request_id, prompt, ids, [s0, s1], finished=True, prompt_logprobs=table)

    async def scenario() -> list[dict]:
        ctx = SimpleNamespace(engine=SimpleNamespace(generate=generate, tokenizer=None))
        params = SamplingParams(n=2, max_tokens=1, prompt_logprobs=1)
        cmpl = PreparedCompletion("cmpl-1", "m", [PreparedPrompt([3, 5], None)], params, echo=False)
        stream = completion_stream(ctx, cmpl, include_usage=False, continuous_usage=False)  # type: ignore[arg-type]
        return [json.loads(e[len("data: "):]) async for e in stream if e.startswith("data: {")]

    chunks = [c["choices"][0] for c in asyncio.run(scenario())]
    firsts = {}
    for choice in chunks:
        firsts.setdefault(choice["index"], choice)
    assert sorted(firsts) == [0, 1]
    for choice in firsts.values():
        assert choice["prompt_logprobs"] == [None, {"5": {"logprob": -1.0, "rank": 1, "decoded_token": "x"}}]
    assert sum("prompt_logprobs" in c for c in chunks) == 2
