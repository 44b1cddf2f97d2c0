"""Tool calling (`--enable-auto-tool-choice --tool-call-parser hermes`): the parser's rules, the same message
whatever the stream's chunking, and the chat endpoint's requests, responses and streams. The endpoint runs in
process with a stub engine whose model writes scripted text, a token of text at a time."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from kvserve.engine.input_processor import InputProcessor, ProcessedPrompt
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.cli_args import make_arg_parser, server_engine_args
from kvserve.entrypoints.openai.middleware import ServerState
from kvserve.entrypoints.openai.serving_common import ServingContext
from kvserve.entrypoints.openai.tool_parsers import (
    HermesStream,
    ParsedMessage,
    joined_calls,
    parse_tool_calls,
    tool_call_stream,
)
from kvserve.protocol.chat_messages import arguments_as_objects, for_chat_template
from kvserve.protocol.outputs import CompletionOutput, RequestOutput
from kvserve.protocol.sampling_params import SamplingParams

from .conftest import assert_openai_error

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}
TWO_CALLS = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n')
# an argument that writes the end tag: the string's text, not the block's end; the next call reads as usual
TAG_IN_ARGUMENT = ('<tool_call>\n{"name": "write_doc", "arguments": {"text": "End a call with </tool_call>.", "n": 1}}'
                   '\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>')
TEXTS = [
    TWO_CALLS,
    "Just text, with  spaces \n and a trailing newline\n",
    '<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}',  # left open: the request ran out of tokens
    'a <tool_call>{not json}</tool_call> b <tool_call>{"name": "g", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',  # arguments as a JSON string
    "ends with a partial tag <tool_c",
    "   ",
    'Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call> Done.',
    TAG_IN_ARGUMENT,
    '<tool_call>{"arguments": {"s": "a</tool_call>b"}, "name": "f"}</tool_call> c',  # a call read whole
    '<tool_call>{"name": "f", "arguments": {"x": NaN, "s": "a</tool_call>b"}}</tool_call>',  # not JSON: ends there
]


def _functions(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["function"] for c in calls]


# ------------------------------------------------------------------------------------------ the parser


def test_parse_two_calls_after_content():
    parsed = parse_tool_calls(TWO_CALLS, "hermes")
    assert parsed.content == "Let me look that up."
    assert _functions(parsed.tool_calls) == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
    ]
    ids = [c["id"] for c in parsed.tool_calls]
    assert all(i.startswith("chatcmpl-tool-") for i in ids) and len(set(ids)) == 2
    assert all(c["type"] == "function" for c in parsed.tool_calls)


@pytest.mark.parametrize(("text", "content", "functions"), [
    ("Just text <b>", "Just text <b>", []),
    ("", "", []),
    ("Just text, with  spaces \n and a trailing newline\n", "Just text, with  spaces \n and a trailing newline\n", []),
    ("ends with a partial tag <tool_c", "ends with a partial tag <tool_c", []),
    # the whitespace before a call goes with it; text after a call is content
    ('Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call> Done.', "Sure. Done.",
     [{"name": "f", "arguments": "{}"}]),
    ('Sure.\t\r\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\r\n', "Sure.", [{"name": "f", "arguments": "{}"}]),
    # a call that names itself first and opens its arguments object streams from there: keys after its arguments
    # are dropped, and arguments that stop being JSON go on as written (the model's, to be checked by the client)
    ('<tool_call>{"name": "f", "arguments": {}, "parameters": {}}</tool_call>', None, [{"name": "f", "arguments": "{}"}]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1} , "id": 3}</tool_call>', None,
     [{"name": "f", "arguments": '{"a": 1}'}]),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN, "y": [1]}} after}</tool_call>', " after}",
     [{"name": "f", "arguments": '{"x": NaN, "y": [1]}'}]),
    # the spacing before the first character that is not JSON is kept: two values apart do not read as one
    ('<tool_call>{"name": "f", "arguments": {"a": 1 2}}</tool_call>', None, [{"name": "f", "arguments": '{"a": 1 2}'}]),
    ('<tool_call>{"name": "f", "arguments": {"a": [1.0\n5]}}</tool_call>', None,
     [{"name": "f", "arguments": '{"a": [1.0\n5]}'}]),
    ('<tool_call>\n{"name": "f", "arguments": {"s": "a\\u00e9\\ud83d\\ude00\\/\\n", "n": -0, "m": 1.50E1, "t": true}}\n',
     None, [{"name": "f", "arguments": '{"s": "aé😀/\\n", "n": 0, "m": 15.0, "t": true}'}]),
    ('<tool_call>{"name": "f", "arguments": {"a": [1, 2], "b": "x', None, [{"name": "f", "arguments": '{"a": [1, 2], "b": "x'}]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', None, [{"name": "f", "arguments": '{"a": 1}'}]),
    # a call read whole (its keys in another order, its arguments a string): by the rules of a whole call
    ('<tool_call>{"arguments": {}, "name": "f", "id": 3}</tool_call>', '<tool_call>{"arguments": {}, "name": "f", "id": 3}</tool_call>', []),
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [{"name": "f", "arguments": '{"a": 1}'}]),
    ("   ", "   ", []),  # no tool calls: the whole text, as generated
    ('<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}', None, [{"name": "f", "arguments": '{"a": [1, 2]}'}]),
    # a block that is not a call stays in the content, tags and all; the one that is, is a call
    ('a <tool_call>{not json}</tool_call> b <tool_call>{"name": "g", "arguments": {}}</tool_call>',
     "a <tool_call>{not json}</tool_call> b", [{"name": "g", "arguments": "{}"}]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [{"name": "f", "arguments": '{"x": 1}'}]),
    ('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>', []),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', '<tool_call>{"name": "", "arguments": {}}</tool_call>', []),
    ('<tool_call>[1, 2]</tool_call>', "<tool_call>[1, 2]</tool_call>", []),
    # Llama-style "parameters" read as the arguments; no arguments or other keys: not a call (nothing dropped)
    ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', None, [{"name": "f", "arguments": '{"a": 1}'}]),
    ('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": null}</tool_call>', '<tool_call>{"name": "f", "arguments": null}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>', '<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>', []),
    # NaN and Infinity are not JSON: arguments given as a string must be
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": Infinity}"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "{\\"x\\": Infinity}"}</tool_call>', []),
    ("Sure.\xa0<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", "Sure.\xa0", [{"name": "f", "arguments": "{}"}]),
    ("<tool_call>", "<tool_call>", []),
    # an end tag within a string of the call's JSON is the string's text; outside one, or once the text is not
    # JSON, it ends the block
    (TAG_IN_ARGUMENT, None, [{"name": "write_doc", "arguments": '{"text": "End a call with </tool_call>.", "n": 1}'},
                             {"name": "g", "arguments": "{}"}]),
    ('<tool_call>{"arguments": {"s": "a</tool_call>b"}, "name": "f"}</tool_call> c', " c",
     [{"name": "f", "arguments": '{"s": "a</tool_call>b"}'}]),
    ('<tool_call>{"name": "f", "arguments": {"a</tool_call>": "\\"</tool_call>"}}</tool_call>', None,
     [{"name": "f", "arguments": '{"a</tool_call>": "\\"</tool_call>"}'}]),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN, "s": "a</tool_call>b"}}</tool_call>', 'b"}}</tool_call>',
     [{"name": "f", "arguments": '{"x": NaN, "s": "a'}]),
    ('<tool_call>{"name": "f", "arguments": {"s": "a\\</tool_call> b', " b", [{"name": "f", "arguments": '{"s": "a\\'}]),
    ('<tool_call>{"name": "f", "arguments": {"s": "a"} </tool_call>"}}</tool_call>', '"}}</tool_call>',
     [{"name": "f", "arguments": '{"s": "a"}'}]),
    ('<tool_call>{"name": "f"} "</tool_call>" x', '<tool_call>{"name": "f"} "</tool_call>" x', []),
])
def test_parse_rules(text, content, functions):
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.content == content
    assert _functions(parsed.tool_calls) == functions


@pytest.mark.parametrize("text", TEXTS)
def test_any_chunking_streams_the_full_parse(text):
    """Fed in random pieces (one character at a time among them), the stream releases the content and the
    calls of the full parse, and never releases content it would later have to take back (what it has
    released is always a prefix of the full parse's content)."""
    expected = parse_tool_calls(text, "hermes")
    rng = random.Random(text)
    for trial in range(30):
        stream, content, pieces = HermesStream(), "", []
        position = 0
        while position < len(text):
            size = 1 if trial == 0 else rng.randint(1, 6)
            delta = stream.feed(text[position:position + size])
            position += size
            content += delta.content
            pieces += delta.tool_calls
            assert (expected.content or "").startswith(content), (trial, content)
        delta = stream.feed("", final=True)
        content += delta.content
        pieces += delta.tool_calls
        assert (content or None if pieces else content) == expected.content
        assert joined_calls(pieces) == _functions(expected.tool_calls)
        assert stream.last_call_cut == expected.last_call_cut


def test_deeply_nested_output_stays_content():
    """A degenerate reply (a repetition loop inside a call) is too deep for json to read: content, not a 500."""
    text = '<tool_call>{"name": "f", "arguments": ' + "[" * 5000
    assert parse_tool_calls(text, "hermes") == ParsedMessage(text, [])


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_long_call_start_is_read_whole_however_it_comes(parser):
    """A call whose arguments open past its first 512 characters is read whole, in one piece or in many (fed in
    pieces, its start was once looked at up to 512 characters past the pieces before, and so streamed)."""
    call = '{"name": "f",' + " " * 600 + '"arguments": {"a": 1}, "id": 3}'
    text = "<tool_call>" + call + "</tool_call>" if parser == "hermes" else call
    expected = parse_tool_calls(text, parser)
    assert expected == ParsedMessage(text, [])
    stream = tool_call_stream(parser)
    first, second = stream.feed(text[:300]), stream.feed(text[300:], final=True)
    assert first.content + second.content == text and not first.tool_calls + second.tool_calls


def test_stream_holds_back_a_partial_start_tag():
    stream = HermesStream()
    assert stream.feed("Hello <tool").content == "Hello"
    assert stream.feed("_c").content == ""
    released = stream.feed('all>{"name": "f", "arguments": {}}</tool_call>')
    assert released.content == "" and joined_calls(released.tool_calls) == [{"name": "f", "arguments": "{}"}]
    stream = HermesStream()
    assert stream.feed("x <tool").content == "x"
    assert stream.feed("box").content == " <toolbox"  # not a tag after all: released


# ------------------------------------------------------------------------------------------ the endpoint


def _context(outputs: list[list[str]], parser: str | None = "hermes",
             finish_reason: str = "stop") -> tuple[ServingContext, list[dict]]:
    """A server whose model writes each `outputs` sample's pieces, one a step, and ends it with `finish_reason`;
    the template's calls are recorded (their messages and keyword arguments)."""
    rendered: list[dict] = []

    def apply_chat_template(messages: list[dict], chat_template: str | None, add_generation_prompt: bool,
                            kwargs: dict[str, Any], add_special_tokens: bool = False) -> ProcessedPrompt:
        rendered.append({"messages": messages, "kwargs": kwargs, "add_special_tokens": add_special_tokens,
                         "add_generation_prompt": add_generation_prompt})
        return ProcessedPrompt("prompt", [1, 2, 3])

    async def generate(request_id: str, ids: list[int], params: SamplingParams, prompt: str | None,
                       cache_salt: str | None = None, priority: int = 0,
                       prompt_only: bool = False) -> AsyncIterator[RequestOutput]:
        steps = max(len(pieces) for pieces in outputs)
        for step in range(steps):
            samples = []
            for index, pieces in enumerate(outputs[: params.n]):
                done = step >= len(pieces) - 1
                text = "".join(pieces[: step + 1])
                delta = pieces[step] if step < len(pieces) else ""
                samples.append(CompletionOutput(
                    index, text, list(range(min(step, len(pieces) - 1) + 1)),
                    finish_reason=finish_reason if done else None,
                    text_delta=delta, token_ids_delta=[step] if step < len(pieces) else []))
            yield RequestOutput(request_id, prompt, ids, samples, finished=step == steps - 1)

    engine = SimpleNamespace(is_alive=True, dead_error=None, max_model_len=4096, tokenizer=None, generate=generate,
                             input_processor=SimpleNamespace(apply_chat_template=apply_chat_template,
                                                             first_out_of_vocab=lambda token_ids: None))
    ctx = ServingContext(engine=engine, served_model_names=["m"], model_path="m",  # type: ignore[arg-type]
                         log_requests=False, tool_call_parser=parser)
    return ctx, rendered


def _post(ctx: ServingContext, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    app = build_app(ctx, ServerState(), SimpleNamespace(), None, 1 << 20)  # type: ignore[arg-type]

    async def scenario() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            response = await client.post(path, json=body)
            await response.aread()
            return response

    return asyncio.run(scenario())


def _tokens(text: str) -> list[str]:
    """The text in pieces of 1-4 characters, as a model's tokens would come."""
    rng = random.Random(len(text))
    pieces, position = [], 0
    while position < len(text):
        size = rng.randint(1, 4)
        pieces.append(text[position:position + size])
        position += size
    return pieces


def _stream_messages(response: httpx.Response) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """Each choice's message put together from its deltas, and its finish reason."""
    messages: dict[int, dict[str, Any]] = {}
    finish: dict[int, str] = {}
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[len("data: "):])["choices"]:
            message = messages.setdefault(choice["index"], {"content": None, "tool_calls": []})
            delta = choice["delta"]
            if delta.get("content"):
                message["content"] = (message["content"] or "") + delta["content"]
            for call in delta.get("tool_calls", []):
                if "id" not in call:  # more of the last call's arguments
                    assert call["index"] == len(message["tool_calls"]) - 1 and set(call) == {"index", "function"}
                    assert set(call["function"]) == {"arguments"}
                    message["tool_calls"][-1]["function"]["arguments"] += call["function"]["arguments"]
                    continue
                assert call["index"] == len(message["tool_calls"])  # calls in order, each begun once
                assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
                assert call["id"] not in {c["id"] for m in messages.values() for c in m["tool_calls"]}
                message["tool_calls"].append(json.loads(json.dumps(call)))
            if choice["finish_reason"] is not None:
                finish[choice["index"]] = choice["finish_reason"]
    return messages, finish


def _empty_chunks(response: httpx.Response) -> int:
    """How many choices of a stream's chunks carried nothing: no delta and no finish."""
    return sum(1 for line in response.text.splitlines() if line.startswith("data: {")
               for choice in json.loads(line[len("data: "):])["choices"]
               if not choice["delta"] and choice["finish_reason"] is None)


def test_chat_returns_tool_calls_and_the_stream_says_the_same():
    plain = "It is sunny.\n"
    ctx, rendered = _context([_tokens(TWO_CALLS), _tokens(plain)])
    messages = [{"role": "user", "content": "Weather in Paris and Zürich?"}]
    body = {"messages": messages, "tools": [WEATHER], "n": 2, "max_tokens": 100}  # tool_choice: "auto" by default
    response = _post(ctx, body)
    assert response.status_code == 200, response.text
    first, second = response.json()["choices"]
    assert first["finish_reason"] == "tool_calls" and second["finish_reason"] == "stop"
    assert first["message"]["content"] == "Let me look that up."
    assert [json.loads(c["function"]["arguments"]) for c in first["message"]["tool_calls"]] == [
        {"city": "Paris"}, {"city": "Zürich"}]
    assert second["message"] == {"role": "assistant", "content": plain, "tool_calls": []}
    assert rendered[0]["kwargs"]["tools"] == [WEATHER]

    stream = _post(ctx, {**body, "stream": True})
    streamed, finish = _stream_messages(stream)
    assert finish == {0: "tool_calls", 1: "stop"}
    for index, choice in enumerate((first, second)):
        assert streamed[index]["content"] == choice["message"]["content"]
        assert [c["function"] for c in streamed[index]["tool_calls"]] == _functions(choice["message"]["tool_calls"])
    assert _empty_chunks(stream) == 0  # the tokens of a call held back send nothing until it is parsed


def test_a_calls_arguments_stream_as_they_are_written():
    """Once a call has written its name and opened its arguments, the stream sends the call (id, type, name)
    and then its arguments as they come, re-written as the full response writes them; joined, the stream's
    message is the full response's."""
    note = "a long note, " * 12
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris",\n "note": "' + note
            + '", "days": [1,2,3]}}\n</tool_call>')
    ctx, _ = _context([_tokens(text)])
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    message = _post(ctx, body).json()["choices"][0]["message"]
    assert message["content"] == "Checking."
    assert _functions(message["tool_calls"]) == [{"name": "get_weather", "arguments": json.dumps(
        {"city": "Paris", "note": note, "days": [1, 2, 3]})}]
    stream = _post(ctx, {**body, "stream": True})
    calls = [call for line in stream.text.splitlines() if line.startswith("data: {")
             for choice in json.loads(line[len("data: "):])["choices"] for call in choice["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and len(calls) > 10  # one token of arguments at a time
    assert "".join(c["function"]["arguments"] for c in calls) == message["tool_calls"][0]["function"]["arguments"]
    streamed, finish = _stream_messages(stream)
    assert streamed[0]["content"] == message["content"] and finish == {0: "tool_calls"}
    assert _functions(streamed[0]["tool_calls"]) == _functions(message["tool_calls"])
    assert _empty_chunks(stream) == 0


def test_an_end_tag_within_an_argument_is_the_arguments_text():
    """A call whose argument writes ``</tool_call>`` keeps its whole arguments, in the response and in the
    stream, and the call after it is read as usual."""
    ctx, _ = _context([_tokens(TAG_IN_ARGUMENT)])
    body = {"messages": [{"role": "user", "content": "Document the format."}], "tools": [WEATHER]}
    expected = [{"name": "write_doc", "arguments": '{"text": "End a call with </tool_call>.", "n": 1}'},
                {"name": "g", "arguments": "{}"}]
    choice = _post(ctx, body).json()["choices"][0]
    assert choice["message"]["content"] is None and _functions(choice["message"]["tool_calls"]) == expected
    streamed, finish = _stream_messages(_post(ctx, {**body, "stream": True}))
    assert finish == {0: "tool_calls"} and streamed[0]["content"] is None
    assert _functions(streamed[0]["tool_calls"]) == expected


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_call_cut_short_keeps_the_engines_finish_reason(parser):
    """A call whose arguments the token limit cut off is still the call it began as (streamed, it was sent):
    its arguments are what was written, and the finish reason stays "length", as OpenAI's, so the client
    knows they are cut."""
    start = {"hermes": "<tool_call>\n", "llama3_json": ""}[parser]
    text = start + '{"name": "get_weather", "arguments": {"city": "Par'
    ctx, _ = _context([_tokens(text)], parser=parser, finish_reason="length")
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    choice = _post(ctx, body).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert _functions(choice["message"]["tool_calls"]) == [{"name": "get_weather", "arguments": '{"city": "Par'}]
    streamed, finish = _stream_messages(_post(ctx, {**body, "stream": True}))
    assert finish == {0: "length"} and _functions(streamed[0]["tool_calls"]) == _functions(choice["message"]["tool_calls"])
    # a whole call before the limit: "tool_calls"
    ctx, _ = _context([_tokens(start + '{"name": "get_weather", "arguments": {"city": "Paris"}}')], parser=parser,
                      finish_reason="length")
    assert _post(ctx, body).json()["choices"][0]["finish_reason"] == "tool_calls"
    # a call cut short past the calls returned (parallel_tool_calls false): the calls returned are whole
    separator = {"hermes": "</tool_call>\n", "llama3_json": ";"}[parser]
    text = start + '{"name": "get_weather", "arguments": {}}' + separator + start + '{"name": "f", "arguments": {"a'
    ctx, _ = _context([_tokens(text)], parser=parser, finish_reason="length")
    body = {**body, "parallel_tool_calls": False}
    choice = _post(ctx, body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert _functions(choice["message"]["tool_calls"]) == [{"name": "get_weather", "arguments": "{}"}]
    streamed, finish = _stream_messages(_post(ctx, {**body, "stream": True}))
    assert finish == {0: "tool_calls"} and _functions(streamed[0]["tool_calls"]) == _functions(choice["message"]["tool_calls"])


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice(["int", "float", "str", "bool", "null"] + (["list", "dict"] * 2 if depth < 4 else []))
    if kind == "int":
        return rng.choice([0, -1, 7, 10**20, -(10**12)])
    if kind == "float":
        return rng.choice([0.5, -2.25, 1e-7, 3e20, 1.0, -0.0])
    if kind == "str":
        return "".join(rng.choice(['a', ' ', '"', "\\", "/", "\n", "\t", "\x01", "\x7f", "é", "\u2028", "😀", "}", "{", "]"])
                       for _ in range(rng.randint(0, 6)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {_random_json_key(rng): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _random_json_key(rng: random.Random) -> str:
    return rng.choice(["a", "b c", "ключ", 'q"', "k\\", ""])


def _random_writing(value: Any, rng: random.Random) -> str:
    """JSON text of `value` as a model might write it: any spacing, escaped or not, numbers in other forms."""
    space = lambda: rng.choice(["", "", " ", "\n  ", "\t"])  # noqa: E731
    if isinstance(value, dict):
        items = [f"{space()}{_random_writing(k, rng)}{space()}:{space()}{_random_writing(v, rng)}{space()}"
                 for k, v in value.items()]
        return "{" + ",".join(items) + "}" if items else "{" + space() + "}"
    if isinstance(value, list):
        return "[" + ",".join(space() + _random_writing(v, rng) + space() for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=rng.random() < 0.5).replace("/", rng.choice(["/", "\\/"]))
    if isinstance(value, float) and value == 1.0:
        return rng.choice(["1.0", "1.00", "1e0", "10E-1"])
    return json.dumps(value)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_streamed_arguments_are_written_as_the_full_json(parser):
    """Property: arguments of any JSON, written with any spacing and escaping and fed in any chunks, stream as
    `json.dumps` writes the object (the message a full response has always had)."""
    rng = random.Random(parser)
    start, end = {"hermes": ("<tool_call>\n", "\n</tool_call>"), "llama3_json": ("", "")}[parser]
    for _ in range(300):
        arguments = {_random_json_key(rng): _random_json(rng) for _ in range(rng.randint(0, 4))}
        text = start + '{"name": "f", "arguments": ' + _random_writing(arguments, rng) + "}" + end
        expected = json.dumps(arguments, ensure_ascii=False)
        parsed = parse_tool_calls(text, parser)
        assert _functions(parsed.tool_calls) == [{"name": "f", "arguments": expected}], text
        stream, pieces, position = tool_call_stream(parser), [], 0
        while position < len(text):
            size = rng.randint(1, 5)
            pieces += stream.feed(text[position:position + size]).tool_calls
            position += size
        pieces += stream.feed("", final=True).tool_calls
        assert joined_calls(pieces) == [{"name": "f", "arguments": expected}], text


def test_parallel_tool_calls_false_returns_the_first_call_only():
    ctx, _ = _context([_tokens(TWO_CALLS)])
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "parallel_tool_calls": False}
    message = _post(ctx, body).json()["choices"][0]["message"]
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris"}]
    streamed, finish = _stream_messages(_post(ctx, {**body, "stream": True}))
    assert [c["function"] for c in streamed[0]["tool_calls"]] == _functions(message["tool_calls"])
    assert finish == {0: "tool_calls"}


def test_tool_choice_none_renders_the_tools_and_leaves_the_text_alone():
    ctx, rendered = _context([_tokens(TWO_CALLS)], parser=None)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": "none"}
    response = _post(ctx, body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": TWO_CALLS} and choice["finish_reason"] == "stop"
    assert rendered[0]["kwargs"]["tools"] == [WEATHER]


def test_tokenize_renders_the_tools_as_chat_does():
    ctx, rendered = _context([["ok"]])
    messages = [{"role": "user", "content": "hi"}]
    assert _post(ctx, {"messages": messages, "tools": [WEATHER]}, "/tokenize").json()["tokens"] == [1, 2, 3]
    _post(ctx, {"messages": messages, "tools": [WEATHER], "max_tokens": 1})
    assert rendered[0] == rendered[1] and rendered[0]["kwargs"]["tools"] == [WEATHER]


def test_assistant_tool_calls_get_object_arguments():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    odd = {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    deep = {"id": "call_3", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}
    message = {"role": "assistant", "content": None, "tool_calls": [call, odd, deep, "not a dict"]}
    converted = arguments_as_objects(message)
    assert converted["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert converted["tool_calls"][1:] == [odd, deep, "not a dict"]  # left as sent
    assert call["function"]["arguments"] == '{"city": "Paris"}'  # the caller's objects are not changed
    assert arguments_as_objects({"role": "assistant", "content": "hi", "tool_calls": []}) == {
        "role": "assistant", "content": "hi"}  # no calls: the template's plain assistant path
    other = {"role": "user", "content": "x", "tool_calls": [call]}
    assert arguments_as_objects(other) is other  # only assistant messages


THINKING_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{% if m.reasoning %}(r:{{ m.reasoning }}){% endif %}{{ m.content }}\n{% endfor %}")


def test_assistant_reasoning_reaches_the_template_under_both_names(smollm_tokenizer):
    """An assistant turn's thinking sent back (vLLM's `reasoning`, or the older `reasoning_content`) is given to
    the template under both names, as vLLM does, so Qwen3's template (which reads reasoning_content) renders it
    in tool loops; `reasoning` wins when both are sent. (Transformers 5 also aliases the names for every role,
    preferring reasoning_content; older releases do not, hence our own rule for assistant turns.)"""
    processor = InputProcessor(smollm_tokenizer, 4096, [], len(smollm_tokenizer))

    def render(assistant: dict[str, Any]) -> str:
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", **assistant}]
        rendered = processor.apply_chat_template(messages, THINKING_TEMPLATE, add_generation_prompt=False).prompt
        assert rendered is not None
        return rendered

    assert render({"reasoning": "why"}) == "[user]q\n[assistant]<think>why</think>(r:why)a\n"
    assert render({"reasoning_content": "old"}) == "[user]q\n[assistant]<think>old</think>(r:old)a\n"
    assert render({"reasoning": "new", "reasoning_content": "old"}) == "[user]q\n[assistant]<think>new</think>(r:new)a\n"
    assert render({}) == "[user]q\n[assistant]a\n"
    message = {"role": "assistant", "content": "a", "reasoning": "why"}
    assert for_chat_template(message) is not message and message == {"role": "assistant", "content": "a", "reasoning": "why"}
    user = {"role": "user", "content": "q", "reasoning": "x"}
    assert for_chat_template(user) is user


def test_the_server_passes_the_reasoning_sent_back_to_the_template():
    ctx, rendered = _context([["ok"]])
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning": "why"},
                {"role": "assistant", "content": "b", "reasoning_content": "old"},
                {"role": "user", "content": "again"}]
    assert _post(ctx, {"messages": messages, "max_tokens": 1}).status_code == 200
    sent = rendered[0]["messages"]
    assert sent[1]["reasoning"] == "why" and "reasoning_content" not in sent[1]
    assert sent[2]["reasoning_content"] == "old" and "reasoning" not in sent[2]
    bad = {"messages": [{"role": "assistant", "content": "a", "reasoning": ["x"]}], "max_tokens": 1}
    assert_openai_error(_post(ctx, bad), 400, "messages")


DOCUMENTS_TEMPLATE = (
    "{% for d in documents or [] %}<doc {{ d.title }}>{{ d.text }}</doc>{% endfor %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")


def test_documents_reach_the_chat_template(smollm_tokenizer):
    """vLLM's chat field `documents` (RAG: a list of {"title", "text"}) is given to the chat template, as vLLM's
    `_preprocess_chat` gives it (Command-R's and Granite's templates render it); a `documents` in
    chat_template_kwargs wins, as there. It was dropped (an unknown field), the model never seeing them."""
    ctx, rendered = _context([["ok"]])
    docs = [{"title": "Paris", "text": "Paris is the capital of France."}]
    body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 1}
    assert _post(ctx, {**body, "documents": docs}).status_code == 200
    assert rendered[-1]["kwargs"]["documents"] == docs
    assert _post(ctx, body).status_code == 200
    assert "documents" not in rendered[-1]["kwargs"]
    other = [{"title": "Rome", "text": "Rome is the capital of Italy."}]
    assert _post(ctx, {**body, "documents": docs, "chat_template_kwargs": {"documents": other}}).status_code == 200
    assert rendered[-1]["kwargs"]["documents"] == other
    assert_openai_error(_post(ctx, {**body, "documents": "not a list"}), 400, "documents")
    # what the template makes of them: the kwargs reach transformers' apply_chat_template
    processor = InputProcessor(smollm_tokenizer, 4096, [], len(smollm_tokenizer))
    prompt = processor.apply_chat_template(body["messages"], DOCUMENTS_TEMPLATE, False,
                                           rendered[0]["kwargs"]).prompt
    assert prompt == "<doc Paris>Paris is the capital of France.</doc>[user]q"


def test_add_special_tokens_reaches_the_chat_tokenization(smollm_tokenizer, tmp_path):
    """vLLM's chat field `add_special_tokens` (default false: the template writes BOS and role markers) lets the
    tokenizer add its own specials to the rendered conversation; /tokenize with messages follows it, with a
    prompt it stays true by default. The field was dropped (an unknown field), the prompt never getting them."""
    ctx, rendered = _context([["ok"]])
    body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 1}
    assert _post(ctx, body).status_code == 200
    assert rendered[-1]["add_special_tokens"] is False
    assert _post(ctx, {**body, "add_special_tokens": True}).status_code == 200
    assert rendered[-1]["add_special_tokens"] is True
    assert_openai_error(_post(ctx, {**body, "add_special_tokens": "yes"}), 400, "add_special_tokens")
    tokenize = {"messages": body["messages"]}
    assert _post(ctx, tokenize, "/tokenize").status_code == 200
    assert rendered[-1]["add_special_tokens"] is False
    assert _post(ctx, {**tokenize, "add_special_tokens": True}, "/tokenize").status_code == 200
    assert rendered[-1]["add_special_tokens"] is True
    # with a tokenizer that adds a BOS, the rendered text's ids start with it only when asked
    smollm_tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    bos_adding = AutoTokenizer.from_pretrained(tmp_path, add_bos_token=True)
    processor = InputProcessor(bos_adding, 4096, [], len(bos_adding))
    plain = processor.apply_chat_template(body["messages"], DOCUMENTS_TEMPLATE, False).prompt_token_ids
    with_bos = processor.apply_chat_template(body["messages"], DOCUMENTS_TEMPLATE, False, None, True).prompt_token_ids
    assert with_bos == [bos_adding.bos_token_id, *plain] and plain[0] != bos_adding.bos_token_id


def _recorded(ctx: ServingContext) -> list[SamplingParams]:
    """The SamplingParams of each request the stub engine is given, in order."""
    seen: list[SamplingParams] = []
    generate = ctx.engine.generate

    async def recording(request_id, ids, params, prompt, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.append(params)
        async for update in generate(request_id, ids, params, prompt, **kwargs):
            yield update

    ctx.engine.generate = recording
    return seen


def test_tool_call_parsing_keeps_special_tokens():
    """Some checkpoints mark <tool_call> as a special token: with tools the text keeps special tokens."""
    ctx, _ = _context([["ok"]])
    seen = _recorded(ctx)
    _post(ctx, {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]})
    _post(ctx, {"messages": [{"role": "user", "content": "hi"}]})
    assert [p.skip_special_tokens for p in seen] == [False, True]


def test_priority_and_bad_words_reach_the_engine():
    """Under the priority policy a request's priority reaches the engine (chat and completions, streamed or
    not); bad words are tokenized in the request's preparation, before the engine is called."""
    from kvserve.protocol.sampling_params import SamplingParams as Params

    calls: list[tuple[int, Params]] = []
    ctx, _ = _context([["ok"]])
    generate = ctx.engine.generate

    async def recording(request_id, ids, params, prompt, cache_salt=None, priority=0, prompt_only=False):  # noqa: ANN001, ANN202
        calls.append((priority, params))
        async for update in generate(request_id, ids, params, prompt, cache_salt):
            yield update

    def resolve_bad_words(params: Params) -> Params:
        return Params(**{**params.__dict__, "bad_words_token_ids": [[5]]})

    ctx.engine.generate = recording
    ctx.engine.input_processor.resolve_bad_words = resolve_bad_words
    ctx.engine.tokenizer = lambda text, add_special_tokens=True: {"input_ids": [1, 2]}
    ctx.scheduling_policy = "priority"
    chat = {"messages": [{"role": "user", "content": "hi"}], "priority": -3, "bad_words": ["no"]}
    completion = {"prompt": "hi", "priority": 7, "bad_words": ["no"]}
    for stream in (False, True):
        assert _post(ctx, {**chat, "stream": stream}).status_code == 200
        assert _post(ctx, {**completion, "stream": stream}, "/v1/completions").status_code == 200
    assert [p for p, _ in calls] == [-3, 7, -3, 7]
    assert all(params.bad_words_token_ids == [[5]] for _, params in calls)


def test_tool_definitions_as_vllm_reads_them():
    """`type` left out means "function", `parameters` may be null, and an empty tools list with "auto" is a
    plain request."""
    ctx, _ = _context([["ok"]])
    for tools, parsed in (([{"function": {"name": "f", "parameters": None}}], True), ([], False)):
        response = _post(ctx, {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "auto"})
        assert response.status_code == 200, response.text
        assert ("tool_calls" in response.json()["choices"][0]["message"]) == parsed
    bad = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}
    response = _post(ctx, bad, "/tokenize")
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


@pytest.mark.parametrize(("extra", "parser", "param", "words"), [
    ({"tools": [WEATHER]}, None, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, None, "tool_choice", "--tool-call-parser"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "hermes",
     "tool_choice", "not one of the tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, None,
     "tool_choice", "cannot be combined"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "hermes", "tool_choice", "sometimes"),
    ({"tool_choice": "required"}, "hermes", "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "hermes", "tools", "tools[0]"),
    ({"tools": [{"type": "code_interpreter"}]}, "hermes", "tools", "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "hermes", "tools", "parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function"}}, "hermes",
     "tool_choice", "named tool_choice"),
])
def test_tool_requests_refused_with_a_400(extra, parser, param, words):
    ctx, rendered = _context([["ok"]], parser=parser)
    response = _post(ctx, {"messages": [{"role": "user", "content": "hi"}], **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert not rendered  # refused before the template ran


def test_required_tool_choice_with_an_empty_tools_list_is_none():
    """tool_choice "required" with `"tools": []` is served as "none" (vLLM's check_tool_usage: 'to align with
    OpenAI's behavior'), a plain reply; without a tools field at all it stays a 400 (as in vLLM)."""
    ctx, rendered = _context([["plain ", "text"]])
    response = _post(ctx, {"messages": [{"role": "user", "content": "hi"}], "tools": [], "tool_choice": "required"})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == "plain text" and not choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "stop" and not rendered[-1]["kwargs"].get("tools")
    ctx, _ = _context([["x"]])
    named = {"type": "function", "function": {"name": "f"}}
    assert_openai_error(_post(ctx, {"messages": [{"role": "user", "content": "hi"}], "tools": [], "tool_choice": named}),
                        400, "tool_choice")


def test_auto_tool_choice_flag_needs_a_parser():
    parser = make_arg_parser()
    ns = parser.parse_args(["model-dir", "--enable-auto-tool-choice"])
    with pytest.raises(ValueError, match="--tool-call-parser"):
        server_engine_args(ns)
    ns = parser.parse_args(["model-dir", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert server_engine_args(ns)["model"] == "model-dir"
    with pytest.raises(SystemExit):
        parser.parse_args(["model-dir", "--tool-call-parser", "unknown"])


def test_chat_template_kwargs_set_the_template_switches():
    """add_generation_prompt and continue_final_message in chat_template_kwargs override the request's own
    fields, as vLLM's do (the server dropped the first silently, so a client's `false` there still got the
    assistant header; and passed the second to the template unchecked); a chat_template there is refused as the
    request's own is."""
    ctx, rendered = _context([["ok"]])
    body = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}],
            "max_tokens": 1}
    assert _post(ctx, body).status_code == 200
    assert rendered[-1]["add_generation_prompt"] is True and "continue_final_message" not in rendered[-1]["kwargs"]
    reply = _post(ctx, {**body, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert reply.status_code == 200 and rendered[-1]["add_generation_prompt"] is False
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"  # the last message's role
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    assert _post(ctx, {**body, "chat_template_kwargs": continued}).status_code == 200
    assert rendered[-1]["add_generation_prompt"] is False and rendered[-1]["kwargs"]["continue_final_message"] is True
    # the request's own field, turned off by the kwargs
    off = {**body, "continue_final_message": True, "add_generation_prompt": False,
           "chat_template_kwargs": {"continue_final_message": False}}
    assert _post(ctx, off).status_code == 200 and "continue_final_message" not in rendered[-1]["kwargs"]
    count = len(rendered)
    assert_openai_error(_post(ctx, {**body, "chat_template_kwargs": {"continue_final_message": True}}), 400,
                        "continue_final_message")
    assert_openai_error(_post(ctx, {**body, "chat_template_kwargs": {"add_generation_prompt": "no"}}), 400,
                        "chat_template_kwargs")
    assert_openai_error(_post(ctx, {**body, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}), 400,
                        "chat_template_kwargs")
    assert len(rendered) == count  # refused before rendering
    assert _post(ctx, {"messages": body["messages"], "chat_template_kwargs": {"add_generation_prompt": False}},
                 "/tokenize").status_code == 200
    assert rendered[-1]["add_generation_prompt"] is False
