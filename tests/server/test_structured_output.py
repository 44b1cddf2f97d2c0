"""Structured output through the API: each request field that sets a grammar (response_format, vLLM's
structured_outputs and guided_*) reaches the engine as one spec, bad ones are 400s naming their field, and
tool_choice "required" / a named function come back as tool calls, streamed or not. The endpoint checks run
in process with a scripted engine (tests/server/test_tool_calls.py's); the real tiny server checks that the
output follows the grammar."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from kvserve.protocol.sampling_params import StructuredOutputsParams

from .conftest import TINY_NAME, ServerProcess, read_sse
from .test_tool_calls import WEATHER, _context, _empty_chunks, _post, _recorded, _stream_messages, _tokens

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
USER = [{"role": "user", "content": "hi"}]


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(("extra", "spec"), [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=["a", "b"])),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
     StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?")),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
    ({"guided_regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
    ({"guided_choice": ["x", "y z"]}, StructuredOutputsParams(choice=["x", "y z"])),
    ({"guided_grammar": 'root ::= "a"+'}, StructuredOutputsParams(grammar='root ::= "a"+')),
    ({"structured_outputs": None, "guided_regex": None}, None),
    ({"structured_outputs": {"regex": "a+", "disable_fallback": True}},
     StructuredOutputsParams(regex="a+", disable_fallback=True)),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_each_field_reaches_the_engine_as_one_spec(extra, spec, path):
    ctx, _ = _context([["ok"]])
    seen = _recorded(ctx)
    body = {"messages": USER} if path == "/v1/chat/completions" else {"prompt": "hi"}
    ctx.engine.tokenizer = lambda text, add_special_tokens=True: {"input_ids": [1, 2]}
    response = _post(ctx, {**body, **extra, "max_tokens": 4}, path)
    assert response.status_code == 200, response.text
    assert seen[0].structured_outputs == spec


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"guided_regex": "[0-"}, "guided_regex", "invalid regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format", "invalid json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "response_format", "schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "a", "backend": "x"}}, "structured_outputs", "backend"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_grammar": "start: missing"}, "guided_grammar", "invalid grammar"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_json": "{not json"}, "guided_json", "invalid json"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs", "choice must be a list"),
    ({"structured_outputs": {"choice": 5}}, "structured_outputs", "choice must be a list"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "false"}}, "structured_outputs", "boolean"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "x", "function": {"name": "get_weather"}}}, "tool_choice",
     "named tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools", "not a schema"),
])
def test_bad_structure_requests_are_400s_naming_the_field(extra, param, words):
    ctx, _ = _context([["ok"]])
    response = _post(ctx, {"messages": USER, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_tool_choice_required_returns_the_listed_calls_streamed_or_not():
    text = ('[{"name": "get_weather", "parameters": {"city": "Zürich"}}, '
            '{"name": "get_time", "parameters": {"zone": "CET"}}]')
    ctx, rendered = _context([_tokens(text), _tokens(text[:30])], parser=None)
    seen = _recorded(ctx)
    body = {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required", "n": 2}
    response = _post(ctx, body)
    assert response.status_code == 200, response.text
    whole, cut = response.json()["choices"]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert [c["function"] for c in whole["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Zürich"}'}, {"name": "get_time", "arguments": '{"zone": "CET"}'}]
    assert cut["message"] == {"role": "assistant", "content": text[:30]}  # cut short: kept as text
    assert rendered[0]["kwargs"]["tools"] == [WEATHER, TIME]
    schema = seen[0].structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"$ref": "#/$defs/tool_1"}
    assert schema["$defs"]["tool_1"] == TIME["function"]["parameters"]
    assert all(item["required"] == ["name", "parameters"] for item in schema["items"]["anyOf"])

    stream = _post(ctx, {**body, "stream": True})
    streamed, finish = _stream_messages(stream)
    assert finish == {0: "tool_calls", 1: "stop"}
    assert [c["function"] for c in streamed[0]["tool_calls"]] == [c["function"] for c in whole["message"]["tool_calls"]]
    assert _empty_chunks(stream) == 0  # the list is read whole at the end: no empty chunk for each token before
    assert streamed[0]["content"] is None and streamed[1] == {"content": text[:30], "tool_calls": []}

    _post(ctx, {**body, "parallel_tool_calls": False})
    assert seen[-1].structured_outputs.json["maxItems"] == 1


def test_tool_choice_required_keeps_a_call_the_response_cannot_carry_as_text():
    """A lone surrogate (the JSON escape \\ud800, which the grammar allows in a string) cannot be written in a
    UTF-8 response: the reply stays the text as written (ASCII), not a server error."""
    text = '[{"name": "get_weather", "parameters": {"city": "\\ud800"}}]'
    ctx, _ = _context([_tokens(text)], parser=None)
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": "required"}
    response = _post(ctx, body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"] == {"role": "assistant", "content": text}
    streamed = _post(ctx, {**body, "stream": True})
    assert streamed.status_code == 200 and '"error"' not in streamed.text, streamed.text
    messages, finish = _stream_messages(streamed)
    assert messages[0] == {"content": text, "tool_calls": []} and finish == {0: "stop"}


def test_a_named_tool_choice_streams_its_arguments():
    arguments = '{"zone": "Europe/Zürich"}'
    ctx, _ = _context([_tokens(arguments)], parser=None)
    seen = _recorded(ctx)
    body = {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    choice = _post(ctx, body).json()["choices"][0]
    assert seen[0].structured_outputs == StructuredOutputsParams(json=TIME["function"]["parameters"])
    assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": arguments} and call["type"] == "function"

    response = _post(ctx, {**body, "stream": True})
    calls = [c for line in response.text.splitlines() if line.startswith("data: {")
             for ch in json.loads(line[6:])["choices"] for c in ch["delta"].get("tool_calls", [])]
    assert len(calls) > 2 and {c["index"] for c in calls} == {0}
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["function"]["name"] == "get_time"
    assert all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == arguments


def test_a_named_tool_choice_streams_each_samples_call_on_its_own_choice():
    """n=2: each choice streams one call of its own (index 0 within the choice, its own id, `type` with the
    name in its first delta), the arguments being that sample's."""
    arguments = ['{"zone": "CET"}', '{"zone": "Asia/Tokyo"}']
    ctx, _ = _context([_tokens(a) for a in arguments], parser=None)
    body = {"messages": USER, "tools": [WEATHER, TIME], "n": 2, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    response = _post(ctx, body)
    calls: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    finish: dict[int, str] = {}
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                calls[choice["index"]] += choice["delta"].get("tool_calls", [])
                if choice["finish_reason"] is not None:
                    finish[choice["index"]] = choice["finish_reason"]
    assert finish == {0: "stop", 1: "stop"}
    for index, streamed in calls.items():
        assert streamed and {c["index"] for c in streamed} == {0}
        first = streamed[0]
        assert first["type"] == "function" and first["function"]["name"] == "get_time"
        assert first["id"].startswith("chatcmpl-tool-")
        assert all("id" not in c and "name" not in c["function"] for c in streamed[1:])
        assert "".join(c["function"]["arguments"] for c in streamed) == arguments[index]
    assert calls[0][0]["id"] != calls[1][0]["id"]


# ------------------------------------------------------------------------------------------ the real server


def _complete(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": TINY_NAME, **body}, timeout=120)


def test_the_server_follows_a_schema_a_choice_and_a_regex(tiny_server: ServerProcess):
    schema = {"type": "object", "required": ["n", "ok"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}
    chat = {"messages": USER, "max_tokens": 40, "temperature": 0.8, "seed": 7,
            "structured_outputs": {"json": schema, "disable_any_whitespace": True}}
    response = _complete(tiny_server, "/v1/chat/completions", chat)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    assert set(value) == {"n", "ok"} and type(value["n"]) is int and 0 <= value["n"] <= 99
    assert type(value["ok"]) is bool

    streamed = _complete(tiny_server, "/v1/chat/completions", {**chat, "stream": True})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in read_sse(streamed) if isinstance(c, dict) and c["choices"])
    assert text == choice["message"]["content"]

    picked = _complete(tiny_server, "/v1/completions", {"prompt": "Answer:", "max_tokens": 10, "n": 3, "seed": 1,
                                                        "guided_choice": ["left", "right", "up"]})
    assert [c["text"] in ("left", "right", "up") for c in picked.json()["choices"]] == [True] * 3
    code = _complete(tiny_server, "/v1/completions", {"prompt": "Code:", "max_tokens": 20, "temperature": 0,
                                                      "guided_regex": "[A-Z]{2}-[0-9]{4}"})
    assert re.fullmatch("[A-Z]{2}-[0-9]{4}", code.json()["choices"][0]["text"])
    bad = _complete(tiny_server, "/v1/completions", {"prompt": "x", "guided_regex": "(("})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"
    # A grammar that fails only against the tokenizer (in the engine) names the field that was sent too.
    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "x"})):
        for field, value in (("guided_grammar", "start: <[99999999]>"),
                             ("structured_outputs", {"grammar": "start: <[99999999]>"})):
            failed = _complete(tiny_server, path, {**body, "max_tokens": 4, field: value})
            assert failed.status_code == 400 and failed.json()["error"]["param"] == field, (path, failed.text)
            streamed = read_sse(_complete(tiny_server, path, {**body, "max_tokens": 4, field: value, "stream": True}))
            assert streamed[0]["error"]["param"] == field, streamed


def test_forced_tool_choices_take_a_function_without_parameters():
    bare = {"type": "function", "function": {"name": "ping"}}
    ctx, _ = _context([["{}"]], parser=None)
    seen = _recorded(ctx)
    named = _post(ctx, {"messages": USER, "tools": [bare], "tool_choice": {"type": "function", "function": {"name": "ping"}}})
    assert named.status_code == 200, named.text
    assert seen[0].structured_outputs == StructuredOutputsParams(json={"type": "object"})
    required = _post(ctx, {"messages": USER, "tools": [bare], "tool_choice": "required"})
    assert required.status_code == 200, required.text
    assert seen[1].structured_outputs.json["$defs"] == {"tool_0": {"type": "object"}}


def _allows(tokenizer: Any, schema: dict[str, Any], text: str) -> bool:
    """Whether the schema's grammar takes `text` whole (the tokenizer's tokens of it)."""
    import llguidance
    import llguidance.hf

    from kvserve.structured_output import grammar_for

    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer),
                                   grammar_for(StructuredOutputsParams(json=schema, disable_any_whitespace=True)),
                                   log_level=0)
    return bool(matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting())


def test_tool_choice_required_keeps_each_tools_references(tiny_model_dir):
    """A tool's parameters may refer within themselves ($defs, as pydantic writes them, or "#" for their own
    root): under "required" they still mean what they meant alone."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from kvserve.entrypoints.openai.serving_chat import forced_tool_schema

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    book = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "$defs": {"Date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "properties": {"when": {"$ref": "#/$defs/Date"}}, "required": ["when"], "additionalProperties": False}}}
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["children"],
        "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}}}
    ctx, _ = _context([_tokens('[{"name":"book","parameters":{"when":"2024-01-01"}}]')], parser=None)
    response = _post(ctx, {"messages": USER, "tools": [book, tree], "tool_choice": "required"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "book"
    schema = forced_tool_schema(SimpleNamespace(tools=[book, tree], parallel_tool_calls=None), "required")
    assert _allows(tokenizer, schema, '[{"name":"book","parameters":{"when":"2024-01-01"}}]')
    assert not _allows(tokenizer, schema, '[{"name":"book","parameters":{"when":"soon"}}]')
    assert _allows(tokenizer, schema, '[{"name":"tree","parameters":{"children":[{"children":[]}]}}]')
    assert not _allows(tokenizer, schema, '[{"name":"tree","parameters":{"children":[[{"name":"tree","parameters":{}}]]}}]')


@pytest.mark.parametrize("flag", ["disable_any_whitespace", "disable_additional_properties", "disable_fallback"])
def test_a_null_flag_is_a_400(flag):
    """null is not a boolean: refused here (the engine's decoder would refuse the request, which then never
    got an answer)."""
    ctx, _ = _context([_tokens("{}")], parser=None)
    response = _post(ctx, {"messages": USER, "structured_outputs": {"json": SCHEMA, flag: None}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "structured_outputs" and flag in response.json()["error"]["message"]


@pytest.mark.parametrize("value", [-(2**63) + 1, -(2**63) - 5, 10**30])
def test_integers_a_schema_cannot_carry_are_a_400(value):
    """An integer past 64 bits cannot reach the engine, and llguidance crashed the server on an enum value
    near -2**63."""
    ctx, _ = _context([_tokens("1")], parser=None)
    for schema in ({"type": "integer", "enum": [value]}, {"type": "integer", "maximum": value}):
        response = _post(ctx, {"messages": USER, "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "response_format"
        assert "2**63" in response.json()["error"]["message"]


def test_tool_choice_required_keeps_anchor_references_of_a_tools_parameters():
    """Under "required" each tool's parameters move under the list schema's $defs, and their JSON-pointer
    references ("#", "#/...") follow them; a reference to an $anchor ("#num") names the anchor wherever it sits
    and stays as it is (it became "#/$defs/tool_0num", a 400 that a named tool_choice did not give)."""
    from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
    from kvserve.entrypoints.openai.serving_chat import forced_tool_schema
    from kvserve.protocol.sampling_params import StructuredOutputsParams
    from kvserve.structured_output import grammar_for

    parameters = {"type": "object", "$defs": {"n": {"$anchor": "num", "type": "integer"}},
                  "properties": {"k": {"$ref": "#num"}, "self": {"$ref": "#/$defs/n"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    request = ChatCompletionRequest(messages=USER, tools=[tool], tool_choice="required")
    schema = forced_tool_schema(request, "required")
    assert schema is not None
    moved = schema["$defs"]["tool_0"]["properties"]
    assert moved == {"k": {"$ref": "#num"}, "self": {"$ref": "#/$defs/tool_0/$defs/n"}}
    grammar_for(StructuredOutputsParams(json=schema))  # a valid schema (it raised GrammarError)
