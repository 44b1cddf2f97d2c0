"""POST /v1/responses (OpenAI's Responses API): input items to chat messages, output items and events, the
store, errors under the API's names; driven by the official `openai` client against scripted model outputs,
then against a real server, where the response's text must be what chat completions return for the same
conversation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from kvserve.engine.async_llm import RequestFailedError
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.errors import BadRequestError
from kvserve.entrypoints.openai.middleware import ServerState
from kvserve.entrypoints.openai.protocol import ResponsesRequest
from kvserve.entrypoints.openai.serving_common import ServingContext
from kvserve.entrypoints.openai.serving_responses import (
    ResponseRun,
    ResponseStore,
    input_messages,
    prepare_response,
    response_full,
    response_stream,
)

from .conftest import TINY_NAME, ServerProcess
from .test_tool_calls import TWO_CALLS, WEATHER, _context, _post, _tokens

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": WEATHER["function"]["parameters"]}
THOUGHT = "The user asks for 2+2. That is 4.</think>\n\nIt is 4."


def _sdk(ctx: ServingContext, scenario: Callable[[openai.AsyncOpenAI], Any]) -> Any:
    """Run `scenario(client)` with the openai client talking to `ctx`'s app in this process."""
    app = build_app(ctx, ServerState(), SimpleNamespace(), None, 1 << 20)  # type: ignore[arg-type]

    async def run() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
            return await scenario(client)

    return asyncio.run(run())


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    """A stream's events, checked: each `event:` line names its data's type, sequence numbers count from 0."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        event = json.loads(lines[1][len("data: "):])
        assert event["type"] == lines[0][len("event: "):]
        assert event["sequence_number"] == len(events)
        events.append(event)
    return events


def _finish(ctx: ServingContext, reason: str) -> ServingContext:
    """`ctx` whose scripted outputs end with `reason` (e.g. "length") instead of "stop"."""
    inner = ctx.engine.generate

    async def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async for update in inner(*args, **kwargs):
            for completion in update.outputs:
                if completion.finish_reason is not None:
                    completion.finish_reason = reason
            yield update

    ctx.engine.generate = generate  # type: ignore[method-assign]
    return ctx


# ------------------------------------------------------------------------------------------ output


def test_text_streamed_or_not_is_one_message_and_the_client_reads_both():
    ctx, rendered = _context([_tokens("Hello there, friend.")])

    async def scenario(client: openai.AsyncOpenAI) -> tuple[Any, Any, list[str]]:
        full = await client.responses.create(model="m", input="hi", instructions="Be brief.")
        async with client.responses.stream(model="m", input="hi", instructions="Be brief.") as stream:
            types = [event.type async for event in stream]
            streamed = await stream.get_final_response()
        return full, streamed, types

    full, streamed, types = _sdk(ctx, scenario)
    assert rendered[0]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    for response in (full, streamed):
        assert response.status == "completed" and response.output_text == "Hello there, friend."
        assert [item.type for item in response.output] == ["message"]
        assert response.output[0].status == "completed" and response.output[0].role == "assistant"
        assert response.usage.input_tokens == 3 and response.usage.output_tokens == len(_tokens("Hello there, friend."))
        assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
        assert response.id.startswith("resp_") and response.store is False  # the store is off by default
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert types.count("response.output_text.delta") == len(_tokens("Hello there, friend."))


def test_tool_calls_become_function_call_items_streamed_or_not():
    ctx, rendered = _context([_tokens(TWO_CALLS)])
    body = {"input": "Weather in Paris and Zürich?", "tools": [TOOL]}
    full = _post(ctx, body, "/v1/responses").json()
    events = _events(_post(ctx, {**body, "stream": True}, "/v1/responses"))
    # The tool reached the template in chat's shape.
    assert rendered[0]["kwargs"]["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": TOOL["parameters"]}}]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    for output in (full["output"], final["output"]):
        assert [item["type"] for item in output] == ["message", "function_call", "function_call"]
        assert output[0]["content"][0]["text"] == "Let me look that up."  # as chat's content
        assert [json.loads(item["arguments"]) for item in output[1:]] == [{"city": "Paris"}, {"city": "Zürich"}]
        assert {item["name"] for item in output[1:]} == {"get_weather"}
        assert all(item["status"] == "completed" for item in output)
        assert output[1]["call_id"] != output[2]["call_id"]
    # Each item's events: added, its deltas, done; the arguments' deltas put together are the arguments.
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [item["id"] for item in final["output"]]
    # each item is done before the next is added (a call's arguments are whole before the next call begins)
    lifecycle = [(e["type"], e["item"]["id"]) for e in events if e["type"].startswith("response.output_item.")]
    assert lifecycle == [(kind, item["id"]) for item in final["output"]
                         for kind in ("response.output_item.added", "response.output_item.done")]
    for item in final["output"][1:]:
        deltas = "".join(e["delta"] for e in events
                         if e["type"] == "response.function_call_arguments.delta" and e["item_id"] == item["id"])
        assert deltas == item["arguments"]


def test_a_calls_last_arguments_and_the_text_after_it_in_one_chunk():
    """A chunk that ends a call's streamed arguments and goes on with text: the arguments go to the call before
    the message after it is opened (which closes the call), streamed or not."""
    pieces = ['<tool_call>{"name": "get_weather", "arguments": {"city": ', '"Paris"}}</tool_call>\nDone.']
    ctx, _ = _context([pieces])
    body = {"input": "Weather in Paris?", "tools": [TOOL]}
    for output in (_post(ctx, body, "/v1/responses").json()["output"],
                   _events(_post(ctx, {**body, "stream": True}, "/v1/responses"))[-1]["response"]["output"]):
        assert [item["type"] for item in output] == ["function_call", "message"]
        assert json.loads(output[0]["arguments"]) == {"city": "Paris"}
        assert output[1]["content"][0]["text"] == "\nDone."


def test_output_items_follow_the_text_however_it_is_chunked():
    """Calls and the text around them become items in the order the model wrote them, whether a chunk carries
    whole calls and text together or the text comes a character at a time, streamed or not."""
    call = '<tool_call>{{"name": "get_weather", "arguments": {{"city": "{}"}}}}</tool_call>'
    text = call.format("Paris") + "\nChecking Zürich too. " + call.format("Zürich") + " Done."
    body = {"input": "Weather in Paris and Zürich?", "tools": [TOOL]}
    outputs = []
    for pieces in ([text], list(text)):
        ctx, _ = _context([pieces])
        events = _events(_post(ctx, {**body, "stream": True}, "/v1/responses"))
        added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
        assert added == [item["id"] for item in events[-1]["response"]["output"]]
        outputs += [_post(ctx, body, "/v1/responses").json()["output"], events[-1]["response"]["output"]]
    for output in outputs:
        assert [item["type"] for item in output] == ["function_call", "message", "function_call", "message"]
        assert [json.loads(output[i]["arguments"])["city"] for i in (0, 2)] == ["Paris", "Zürich"]
        assert [output[i]["content"][0]["text"] for i in (1, 3)] == ["\nChecking Zürich too.", " Done."]


def test_max_tool_calls_and_parallel_tool_calls_false_keep_the_first_call():
    for extra in ({"max_tool_calls": 1}, {"parallel_tool_calls": False}):
        ctx, _ = _context([_tokens(TWO_CALLS)])
        body = {"input": "Weather?", "tools": [TOOL], **extra}
        for output in (_post(ctx, body, "/v1/responses").json()["output"],
                       _events(_post(ctx, {**body, "stream": True}, "/v1/responses"))[-1]["response"]["output"]):
            calls = [item for item in output if item["type"] == "function_call"]
            assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris"}], extra


def test_a_named_tool_choice_streams_its_arguments():
    arguments = '{"city": "Oslo"}'
    ctx, _ = _context([_tokens(arguments)])
    body = {"input": "Weather in Oslo?", "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"}}
    events = _events(_post(ctx, {**body, "stream": True}, "/v1/responses"))
    output = events[-1]["response"]["output"]
    assert [(i["type"], i["name"], i["arguments"]) for i in output] == [("function_call", "get_weather", arguments)]
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == arguments
    assert _post(ctx, body, "/v1/responses").json()["output"][0]["arguments"] == arguments


def test_reasoning_is_its_own_item_and_its_tokens_are_counted():
    ctx, _ = _context([_tokens(THOUGHT)])
    ctx.reasoning_parser = "deepseek_r1"
    full = _post(ctx, {"input": "2+2?"}, "/v1/responses").json()
    events = _events(_post(ctx, {"input": "2+2?", "stream": True}, "/v1/responses"))
    pieces = _tokens(THOUGHT)
    # the tokens up to the one that completes </think>
    thinking = next(k + 1 for k in range(len(pieces)) if "</think>" in "".join(pieces[: k + 1]))
    for response in (full, events[-1]["response"]):
        reasoning, message = response["output"]
        assert reasoning["type"] == "reasoning" and message["type"] == "message"
        assert reasoning["content"] == [{"type": "reasoning_text", "text": "The user asks for 2+2. That is 4."}]
        assert message["content"][0]["text"] == "\n\nIt is 4."
        assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == thinking
        assert response["usage"]["output_tokens"] == len(pieces)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == "The user asks for 2+2. That is 4."


def test_a_reply_cut_by_max_output_tokens_is_incomplete():
    ctx = _finish(_context([_tokens("Hello there")])[0], "length")
    full = _post(ctx, {"input": "hi", "max_output_tokens": 5}, "/v1/responses").json()
    events = _events(_post(ctx, {"input": "hi", "max_output_tokens": 5, "stream": True}, "/v1/responses"))
    assert events[-1]["type"] == "response.incomplete"
    for response in (full, events[-1]["response"]):
        assert response["status"] == "incomplete"
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        assert response["output"][0]["status"] == "incomplete"
        assert response["max_output_tokens"] == 5


def test_a_reply_the_server_aborted_is_incomplete_not_completed():
    # (the drain at shutdown aborts what still runs: finish reason "abort", its text cut short)
    ctx = _finish(_context([_tokens("Hello there, half")])[0], "abort")
    ctx.responses_store = ResponseStore(capacity=4)
    full = _post(ctx, {"input": "hi"}, "/v1/responses").json()
    events = _events(_post(ctx, {"input": "hi", "stream": True}, "/v1/responses"))
    assert events[-1]["type"] == "response.incomplete"
    for response in (full, events[-1]["response"], ctx.responses_store.get(full["id"]).body):
        assert response["status"] == "incomplete"
        assert response["incomplete_details"] == {"reason": "abort"}
        assert response["output"][0]["status"] == "incomplete"


def test_a_grammar_failure_mid_way_ends_the_stream_with_response_failed():
    """The engine fails the request after some text (a grammar it cannot follow): the stream ends with an
    `error` event and response.failed holding what was written; not streamed, the same failure is a 400 naming
    text.format (the field that set the grammar), under the Responses API's name."""
    ctx, _ = _context([_tokens("Hello there")])
    inner = ctx.engine.generate

    async def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        count = 0
        async for update in inner(*args, **kwargs):
            if count == 2:
                raise RequestFailedError("the grammar could not be followed", "structured_outputs")
            count += 1
            yield update

    ctx.engine.generate = generate  # type: ignore[method-assign]
    body = {"input": "json", "text": {"format": {"type": "json_object"}}}
    events = _events(_post(ctx, {**body, "stream": True}, "/v1/responses"))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["param"] == "text.format" and "could not be followed" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "could not be followed" in failed["error"]["message"]
    assert failed["output"][0]["content"][0]["text"] == "".join(_tokens("Hello there")[:2])
    response = _post(ctx, body, "/v1/responses")
    assert response.status_code == 400 and response.json()["error"]["param"] == "text.format", response.text


def test_structured_output_from_text_format():
    ctx, _ = _context([_tokens('{"a": 1}')])
    captured: list[Any] = []
    inner = ctx.engine.generate

    def generate(request_id: str, ids: list[int], params: Any, *args: Any, **kwargs: Any) -> Any:
        captured.append(params)
        return inner(request_id, ids, params, *args, **kwargs)

    ctx.engine.generate = generate  # type: ignore[method-assign]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"input": "json please", "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}},
            "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "top_k": 5}
    response = _post(ctx, body, "/v1/responses").json()
    params = captured[0]
    assert params.structured_outputs is not None and params.structured_outputs.json == schema
    assert (params.max_tokens, params.temperature, params.top_p, params.seed, params.top_k) == (7, 0.5, 0.9, 3, 5)
    assert response["text"]["format"]["type"] == "json_schema" and response["temperature"] == 0.5
    _post(ctx, {"input": "json", "text": {"format": {"type": "json_object"}}}, "/v1/responses")
    assert captured[1].structured_outputs.json_object is True


def test_a_body_echoing_what_utf8_cannot_carry_is_escaped():
    """instructions holding a lone surrogate (JSON's "\\ud800" escape) come back escaped, streamed, not streamed
    and retrieved, instead of the answer failing as it encodes."""
    ctx, _ = _context([_tokens("ok")])
    ctx.responses_store = ResponseStore(capacity=2)
    app = build_app(ctx, ServerState(), SimpleNamespace(), None, 1 << 20)  # type: ignore[arg-type]

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            post = {"url": "/v1/responses", "headers": {"content-type": "application/json"}}
            full = await client.post(content=json.dumps({"input": "hi", "instructions": "\ud800 x"}), **post)
            stream = await client.post(content=json.dumps({"input": "hi", "instructions": "\ud800 x",
                                                           "stream": True}), **post)
            return full, stream, await client.get(f"/v1/responses/{full.json()['id']}")

    full, stream, fetched = asyncio.run(scenario())
    assert full.status_code == 200 and full.json()["instructions"] == "\ud800 x", full.text
    assert _events(stream)[-1]["response"]["instructions"] == "\ud800 x"
    assert fetched.status_code == 200 and fetched.json()["instructions"] == "\ud800 x"


# ------------------------------------------------------------------------------------------ input


def test_input_items_become_the_chat_conversation():
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "I should call the tool."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Looking.", "reasoning": "I should call the tool.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]
    # A call after a tool's output is a new assistant turn.
    later = input_messages(items + [{"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"}])
    assert later[-1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input",
     "text only"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "input[0] is of type 'item_reference'"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role 'tool'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "call_id"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "n": 2}, "n", "one output"),
    ({"input": "x", "response_format": {"type": "json_object"}}, "response_format", "text.format"),
    ({"input": "x", "truncation": "auto"}, "truncation", "disabled"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "reusable prompts"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format", "schema"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format", "'xml'"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "not served"),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs", None),
    ({"input": []}, "input", None),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "KVSERVE_ENABLE_RESPONSES_API_STORE"),
])
def test_what_is_not_served_is_a_400_naming_the_field(body: dict[str, Any], param: str, words: str | None):
    ctx, _ = _context([_tokens("never")])
    response = _post(ctx, body, "/v1/responses")
    error = response.json()["error"]
    assert response.status_code == (404 if param == "previous_response_id" else 400), response.text
    assert error["param"] == param, error
    assert words is None or words in error["message"], error["message"]


# ------------------------------------------------------------------------------------------ the store


def test_the_store_keeps_conversations_for_previous_response_id():
    ctx, rendered = _context([_tokens("Paris is sunny.")])
    ctx.responses_store = ResponseStore(capacity=2)

    async def scenario(client: openai.AsyncOpenAI) -> Any:
        first = await client.responses.create(model="m", input="Weather in Paris?", instructions="Be brief.")
        second = await client.responses.create(model="m", input="And tomorrow?", previous_response_id=first.id)
        fetched = await client.responses.retrieve(first.id)
        unstored = await client.responses.create(model="m", input="x", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.create(model="m", input="x", previous_response_id=first.id)
        return first, second, fetched, unstored, missing.value

    first, second, fetched, unstored, missing = _sdk(ctx, scenario)
    assert first.store and second.store and not unstored.store
    assert fetched.model_dump() == first.model_dump()
    # The second turn saw the first (its input and output; its instructions are not carried over).
    assert rendered[1]["messages"] == [{"role": "user", "content": "Weather in Paris?"},
                                       {"role": "assistant", "content": "Paris is sunny."},
                                       {"role": "user", "content": "And tomorrow?"}]
    assert second.previous_response_id == first.id
    assert missing.body["param"] == "previous_response_id"
    ctx.responses_store.check()


def test_a_client_id_already_naming_a_stored_response_is_refused():
    """A response's id carries the client's request id (as chat's does): a second request with the same id would
    overwrite the stored one, so it is refused while that one is stored; not stored, it is served."""
    ctx, _ = _context([_tokens("ok")])
    ctx.responses_store = ResponseStore(capacity=4)
    first = _post(ctx, {"input": "a", "request_id": "trace-1"}, "/v1/responses").json()
    assert first["id"] == "resp_trace-1" and first["store"]
    again = _post(ctx, {"input": "b", "request_id": "trace-1"}, "/v1/responses")
    assert again.status_code == 400 and again.json()["error"]["param"] == "request_id", again.text
    assert ctx.responses_store.get("resp_trace-1").items[0]["content"] == [{"type": "input_text", "text": "a"}]
    unstored = _post(ctx, {"input": "b", "request_id": "trace-1", "store": False}, "/v1/responses")
    assert unstored.status_code == 200 and unstored.json()["id"] == "resp_trace-1"


def _gated(ctx: ServingContext) -> asyncio.Event:
    """Holds `ctx`'s scripted generation after its first update until the returned event is set."""
    inner = ctx.engine.generate
    gate = asyncio.Event()

    async def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        first = True
        async for update in inner(*args, **kwargs):
            if not first:
                await gate.wait()
            first = False
            yield update

    ctx.engine.generate = generate  # type: ignore[method-assign]
    return gate


def test_a_stored_response_is_in_progress_from_its_start_and_its_end_is_kept():
    """With the store on, a response is stored as it starts (GET answers `in_progress`, as OpenAI's), then
    replaced by its end: completed, failed (a run that raised), cancelled (its client left); only a completed or
    incomplete one continues a conversation. Before, a running response was a 404 and a failed or abandoned one
    was never stored. Two requests with one client id that both passed the id check: the second to start is
    refused, where it overwrote the first."""
    ctx, _ = _context([_tokens("Hello there, friend.")])
    ctx.responses_store = ResponseStore(capacity=8)
    app = build_app(ctx, ServerState(), SimpleNamespace(), None, 1 << 20)  # type: ignore[arg-type]

    def prepared(request_id: str) -> Any:
        return prepare_response(ctx, ResponsesRequest(input="hi", request_id=request_id))

    async def scenario() -> None:
        gate = _gated(ctx)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            # in progress, then completed; a twin prepared beside it is refused when it starts
            first, twin = prepared("a"), prepared("a")
            running = asyncio.create_task(response_full(ResponseRun(ctx, first)))
            while ctx.responses_store.get("resp_a") is None:
                await asyncio.sleep(0)
            fetched = (await http.get("/v1/responses/resp_a")).json()
            assert fetched["status"] == "in_progress" and fetched["output"] == []
            with pytest.raises(BadRequestError) as refused:
                await response_full(ResponseRun(ctx, twin))
            assert refused.value.param == "request_id"
            follow = await http.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_a"})
            assert follow.status_code == 400 and follow.json()["error"]["param"] == "previous_response_id"
            assert "in_progress" in follow.json()["error"]["message"]
            gate.set()
            done = await running
            assert done["status"] == "completed" and ctx.responses_store.get("resp_a").body == done
            assert (await http.get("/v1/responses/resp_a")).json()["status"] == "completed"
            # a client leaving a stream: cancelled, with what was written so far
            gate.clear()
            stream = response_stream(ResponseRun(ctx, prepared("b")))
            events = [await anext(stream) for _ in range(4)]
            assert any("event: response.output_item.added" in event for event in events)
            await stream.aclose()
            cancelled = ctx.responses_store.get("resp_b").body
            assert cancelled["status"] == "cancelled" and cancelled["output"][0]["type"] == "message"
            # a response deleted while it runs stays deleted
            running = asyncio.create_task(response_full(ResponseRun(ctx, prepared("c"))))
            while ctx.responses_store.get("resp_c") is None:
                await asyncio.sleep(0)
            assert (await http.delete("/v1/responses/resp_c")).status_code == 200
            gate.set()
            assert (await running)["status"] == "completed" and ctx.responses_store.get("resp_c") is None
        ctx.responses_store.check()

    asyncio.run(scenario())


def test_a_failed_response_is_stored_as_failed():
    ctx, _ = _context([_tokens("Hello there")])
    ctx.responses_store = ResponseStore(capacity=4)
    inner = ctx.engine.generate

    async def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async for update in inner(*args, **kwargs):
            yield update
            raise RequestFailedError("the grammar could not be followed", "structured_outputs")

    ctx.engine.generate = generate  # type: ignore[method-assign]
    for stream, request_id in ((False, "f1"), (True, "f2")):
        response = _post(ctx, {"input": "json", "request_id": request_id, "stream": stream}, "/v1/responses")
        assert response.status_code == (200 if stream else 400), response.text
        stored = ctx.responses_store.get(f"resp_{request_id}").body
        assert stored["status"] == "failed" and "could not be followed" in stored["error"]["message"]
        follow = _post(ctx, {"input": "x", "previous_response_id": f"resp_{request_id}"}, "/v1/responses")
        assert follow.status_code == 400 and "failed" in follow.json()["error"]["message"]
    ctx.responses_store.check()


def test_the_store_drops_its_oldest_past_its_capacity():
    ctx, _ = _context([_tokens("ok")])
    ctx.responses_store = ResponseStore(capacity=2)
    ids = [_post(ctx, {"input": f"q{i}"}, "/v1/responses").json()["id"] for i in range(3)]
    assert len(ctx.responses_store) == 2
    assert ctx.responses_store.get(ids[0]) is None
    assert all(ctx.responses_store.get(i) is not None for i in ids[1:])
    assert _post(ctx, {"input": "x", "previous_response_id": ids[0]}, "/v1/responses").status_code == 404
    with pytest.raises(ValueError, match="at least one"):
        ResponseStore(0)


def test_the_store_cannot_be_split_across_api_processes(monkeypatch: pytest.MonkeyPatch):
    from kvserve import envs
    from kvserve.entrypoints.openai.cli_args import make_arg_parser, server_engine_args

    monkeypatch.setattr(envs, "KVSERVE_ENABLE_RESPONSES_API_STORE", True)
    ns = make_arg_parser().parse_args(["model-dir", "--api-server-count", "2"])
    with pytest.raises(ValueError, match="api-server-count"):
        server_engine_args(ns)
    server_engine_args(make_arg_parser().parse_args(["model-dir"]))  # one API process: fine


# ------------------------------------------------------------------------------------------ a real server


def test_a_real_server_answers_as_chat_completions_does(tiny_server: ServerProcess):
    """Greedy: the response's text is the chat completion's for the same conversation, streamed or not; the
    logprobs asked for through `include` are those of the text's tokens; usage is chat's."""
    client = openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="x", timeout=120, max_retries=0)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(model=TINY_NAME, messages=messages, temperature=0, max_tokens=12,
                                          logprobs=True, top_logprobs=2)
    response = client.responses.create(model=TINY_NAME, instructions="You are terse.", input="Name a color.",
                                       temperature=0, max_output_tokens=12, top_logprobs=2,
                                       include=["message.output_text.logprobs"])
    events = list(client.responses.create(model=TINY_NAME, instructions="You are terse.", input="Name a color.",
                                          temperature=0, max_output_tokens=12, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")  # (a random model may not stop)
    streamed = events[-1].response
    text = chat.choices[0].message.content
    assert response.output_text == streamed.output_text == text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    got = [(lp.token, round(lp.logprob, 4)) for lp in response.output[0].content[0].logprobs]
    want = [(lp.token, round(lp.logprob, 4)) for lp in chat.choices[0].logprobs.content]
    assert got == want and all(len(lp.top_logprobs) == 2 for lp in response.output[0].content[0].logprobs)
    with pytest.raises(openai.NotFoundError):  # the store is off by default
        client.responses.retrieve(response.id)


def test_a_model_this_server_does_not_serve_is_a_404_as_in_chat():
    ctx, _ = _context([_tokens("never")])

    async def scenario(client: openai.AsyncOpenAI) -> Any:
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.create(model="not-served", input="hi")
        served = await client.responses.create(model="m", input="hi")
        return missing.value, served

    missing, served = _sdk(ctx, scenario)
    assert missing.body["param"] == "model" and "`not-served` does not exist" in missing.body["message"]
    assert served.model == "m"


def test_a_stored_responses_input_items_are_listed_as_the_client_pages_them():
    ctx, _ = _context([_tokens("Paris is sunny.")])
    ctx.responses_store = ResponseStore(capacity=4)

    async def scenario(client: openai.AsyncOpenAI) -> Any:
        first = await client.responses.create(model="m", input="Weather in Paris?")
        second = await client.responses.create(
            model="m", previous_response_id=first.id,
            input=[{"id": "msg_mine", "role": "user", "content": "And tomorrow?"}])
        newest_first = [item async for item in client.responses.input_items.list(second.id)]
        oldest_first = await client.responses.input_items.list(second.id, order="asc", limit=2)
        rest = await client.responses.input_items.list(second.id, order="asc", after=oldest_first.data[-1].id)
        unstored = await client.responses.create(model="m", input="x", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.input_items.list(unstored.id)
        return first, newest_first, oldest_first, rest

    first, newest_first, oldest_first, rest = _sdk(ctx, scenario)
    texts = [item.content[0].text for item in newest_first]
    assert texts == ["And tomorrow?", "Paris is sunny.", "Weather in Paris?"]
    assert [item.role for item in newest_first] == ["user", "assistant", "user"]
    assert all(item.id and item.type == "message" for item in newest_first)
    assert newest_first[0].id == "msg_mine"  # the client's own id is kept
    assert newest_first[1].id == first.output[0].id  # the previous output, as it was returned
    assert [item.id for item in oldest_first.data] == [item.id for item in newest_first[::-1][:2]]
    assert oldest_first.has_more and oldest_first.first_id == oldest_first.data[0].id
    assert [item.id for item in rest.data] == [newest_first[0].id] and not rest.has_more
    ctx.responses_store.check()


def test_a_reasoning_item_with_no_answer_after_it_keeps_its_own_turn():
    # A response cut while thinking is a lone reasoning item; sent back, it is the assistant's turn there, not
    # reasoning for a later, unrelated assistant message (nor two user turns in a row, which some templates
    # refuse).
    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm, 2+2"}]}
    ctx, rendered = _context([_tokens("ok")])
    body = {"input": [{"role": "user", "content": "2+2?"}, thought, {"role": "user", "content": "Go on."},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "Thanks"}]}
    assert _post(ctx, body, "/v1/responses").status_code == 200
    assert rendered[0]["messages"] == [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "", "reasoning": "Hmm, 2+2"},
        {"role": "user", "content": "Go on."}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Thanks"}]
    # An empty one (its reasoning encrypted, from another server) makes no turn, nor goes to a later one.
    empty = {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}
    body = {"input": [{"role": "user", "content": "a"}, empty, {"role": "user", "content": "b"},
                      {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]}
    assert _post(ctx, body, "/v1/responses").status_code == 200
    assert rendered[1]["messages"] == [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                       {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]
