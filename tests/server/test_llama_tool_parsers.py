"""Llama's tool-call formats (`--tool-call-parser llama3_json|pythonic`): each parser's rules, what is not a
call kept as content, the same message whatever the stream's chunking (every split point, for hermes too),
and the chat endpoint's responses and streams with the scripted engine of test_tool_calls."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from kvserve.entrypoints.openai.cli_args import make_arg_parser, server_engine_args
from kvserve.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS, parse_tool_calls, tool_call_stream

from .test_tool_calls import TEXTS as HERMES_TEXTS
from .test_tool_calls import WEATHER, _context, _post, _stream_messages, _tokens

TAG = "<|python_tag|>"
LLAMA_CALLS = (TAG + '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
               '{"name": "get_weather", "parameters": {"city": "Zürich"}}')
PYTHONIC_CALLS = '[get_weather(city="Paris"), get_weather(city=\'Zürich\')]'
PARIS_ZURICH = [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                {"name": "get_weather", "arguments": '{"city": "Zürich"}'}]

LLAMA_TEXTS = [
    LLAMA_CALLS,
    '\n\n{"name": "f", "parameters": {"s": "a } b; c \\" {"}}\n',
    'Let me check. <|python_tag|>{"name": "f", "arguments": {}} Done.',
    '{"name": "f", "parameters": {}}; {not json}; {"name": "g", "parameters": {}}',
    '{"answer": 42}',
    '{"name": "f", "parameters": {"a": [1, 2',  # cut short
    "Plain text with a brace { and a tag <|python_ta",
    '{"name": "f", "parameters": {}};',
    "   ",
]
PYTHONIC_TEXTS = [
    PYTHONIC_CALLS,
    "\n[f(s='a ] b \\' [', n=[1, (2, 3)], d={'k': None, 'b': True})]\nHere you are.",
    "[f(a=1), g(1)]",
    "[1] See the reference.",
    '[f(a="cut short',
    "Text first [f()]",
    TAG + " [now()]",
    "[]",
]


def _functions(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["function"] for c in calls]


# ------------------------------------------------------------------------------------------ llama3_json


@pytest.mark.parametrize(("text", "content", "functions"), [
    (LLAMA_CALLS, None, PARIS_ZURICH),
    # the reply is the call, with or without the tag, whitespace around it dropped; "arguments" read too
    ('{"name": "f", "parameters": {"a": 1}}', None, [{"name": "f", "arguments": '{"a": 1}'}]),
    ('\n {"name": "f", "arguments": {"a": 1}} \n', None, [{"name": "f", "arguments": '{"a": 1}'}]),
    (TAG + '\n{"name": "f", "parameters": {}}', None, [{"name": "f", "arguments": "{}"}]),
    ('{"type": "function", "name": "f", "parameters": {}}', None, [{"name": "f", "arguments": "{}"}]),
    ('{"name": "f", "parameters": "{\\"x\\": 1}"}', None, [{"name": "f", "arguments": '{"x": 1}'}]),
    # brackets and separators inside strings are not the call's
    ('{"name": "f", "parameters": {"s": "} ; {"}}', None, [{"name": "f", "arguments": '{"s": "} ; {"}'}]),
    # text before the tag is content; text after a call is content
    ('Let me check.\n<|python_tag|>{"name": "f", "parameters": {}}', "Let me check.", [{"name": "f", "arguments": "{}"}]),
    ('{"name": "f", "parameters": {}}\nDone.', "\nDone.", [{"name": "f", "arguments": "{}"}]),
    # without the tag, JSON is read only where the reply starts
    ('Call: {"name": "f", "parameters": {}}', 'Call: {"name": "f", "parameters": {}}', []),
    # not calls: kept as written, tag and separators too
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "f"}', '{"name": "f"}', []),
    ('{"name": "f", "parameters": {}, "id": 1}', '{"name": "f", "parameters": {}, "id": 1}', []),
    ('{"type": "tool", "name": "f", "parameters": {}}', '{"type": "tool", "name": "f", "parameters": {}}', []),
    ('{"name": "f", "parameters": {"x": NaN}}', '{"name": "f", "parameters": {"x": NaN}}', []),
    ('{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),
    (TAG + 'brave_search.call(query="x")', TAG + 'brave_search.call(query="x")', []),
    (TAG, TAG, []),
    ('{"name": "f", "parameters": {"a": 1', '{"name": "f", "parameters": {"a": 1', []),  # cut short
    # a bad call ends the calls: it and what follows are content, and a later tag starts them again
    ('{"name": "f", "parameters": {}}; {bad}; {"name": "g", "parameters": {}}',
     '; {bad}; {"name": "g", "parameters": {}}', [{"name": "f", "arguments": "{}"}]),
    ('{bad} <|python_tag|>{"name": "g", "parameters": {}}', "{bad}", [{"name": "g", "arguments": "{}"}]),
    # a separator with no call after it stays
    ('{"name": "f", "parameters": {}};', ";", [{"name": "f", "arguments": "{}"}]),
    ('{"name": "f", "parameters": {}} {"name": "g", "parameters": {}}', ' {"name": "g", "parameters": {}}',
     [{"name": "f", "arguments": "{}"}]),
    ("", "", []),
    ("  \n", "  \n", []),
])
def test_llama3_json_rules(text, content, functions):
    parsed = parse_tool_calls(text, "llama3_json")
    assert parsed.content == content
    assert _functions(parsed.tool_calls) == functions


def test_llama3_json_deep_nesting_stays_content():
    text = '{"name": "f", "parameters": ' + "{" * 5000 + "}" * 5001
    assert parse_tool_calls(text, "llama3_json").content == text


# ------------------------------------------------------------------------------------------ pythonic


@pytest.mark.parametrize(("text", "content", "functions"), [
    (PYTHONIC_CALLS, None, PARIS_ZURICH),
    ('[get_weather(city="San Francisco", unit="c"), now()]', None,
     [{"name": "get_weather", "arguments": '{"city": "San Francisco", "unit": "c"}'}, {"name": "now", "arguments": "{}"}]),
    # Python literals become JSON: tuples are arrays, None/True/False null/true/false
    ("[f(t=(1, 2.5), d={'k': None, 'b': True, 'n': [-1]}, s='x')]", None,
     [{"name": "f", "arguments": '{"t": [1, 2.5], "d": {"k": null, "b": true, "n": [-1]}, "s": "x"}'}]),
    ('[f(path="C:\\dir")]', None, [{"name": "f", "arguments": '{"path": "C:\\\\dir"}'}]),  # read as written
    ("\n[f(s='a]b')]\nDone.", "\nDone.", [{"name": "f", "arguments": '{"s": "a]b"}'}]),
    (TAG + "[f()]", None, [{"name": "f", "arguments": "{}"}]),
    # not calls: the whole list stays, as written
    ("[f(1)]", "[f(1)]", []),  # positional
    ("[f(a=1, a=2)]", "[f(a=1, a=2)]", []),  # repeated
    ("[f(**kw)]", "[f(**kw)]", []),
    ("[f(a=1), 2]", "[f(a=1), 2]", []),  # all or nothing
    ("[os.system(cmd='ls')]", "[os.system(cmd='ls')]", []),  # not a plain name
    ("[f(a=g())]", "[f(a=g())]", []),  # not a literal: nothing is evaluated
    ("[f(a=x)]", "[f(a=x)]", []),
    ("[f(a={1, 2})]", "[f(a={1, 2})]", []),  # a set is not JSON
    ("[f(a=b'x')]", "[f(a=b'x')]", []),
    ("[f(a=1e999)]", "[f(a=1e999)]", []),  # infinity
    ("[f(a={1: 2})]", "[f(a={1: 2})]", []),  # a key that is not a string
    ("[]", "[]", []),
    ("[1] See the reference.", "[1] See the reference.", []),
    ("Text first [f()]", "Text first [f()]", []),
    ("[f(a='cut short", "[f(a='cut short", []),
    ("[f(a=" + "[" * 300 + "]" * 300 + ")]", "[f(a=" + "[" * 300 + "]" * 300 + ")]", []),  # too deep for ast
])
def test_pythonic_rules(text, content, functions):
    parsed = parse_tool_calls(text, "pythonic")
    assert parsed.content == content
    assert _functions(parsed.tool_calls) == functions


# ------------------------------------------------------------------------------------------ every parser


EXAMPLES = ([("hermes", t) for t in HERMES_TEXTS] + [("llama3_json", t) for t in LLAMA_TEXTS]
            + [("pythonic", t) for t in PYTHONIC_TEXTS])


def _streamed(parser: str, pieces: list[str], expected_content: str) -> tuple[str, list[dict[str, Any]]]:
    """The content and calls a stream releases fed `pieces`, checking as it goes that released content is
    never taken back (it is always a prefix of the full parse's)."""
    stream, content, functions = tool_call_stream(parser), "", []
    for piece in pieces:
        delta = stream.feed(piece)
        content += delta.content
        functions += delta.tool_calls
        assert expected_content.startswith(content), (pieces, content)
    delta = stream.feed("", final=True)
    return content + delta.content, functions + delta.tool_calls


@pytest.mark.parametrize(("parser", "text"), EXAMPLES)
def test_every_split_streams_the_full_parse(parser, text):
    """Split at every point, one character at a time, and in random pieces, the stream releases the full
    parse's content and calls."""
    expected = parse_tool_calls(text, parser)
    rng = random.Random(text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 5))) if len(text) > 1 else []
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in splits:
        content, functions = _streamed(parser, pieces, expected.content or "")
        assert (content or None if functions else content) == expected.content, pieces
        assert functions == _functions(expected.tool_calls), pieces


FRAGMENTS = [TAG, "<|python", '{"name": "f", "parameters": {"a": 1}}', '{"name": "g", "arguments": {}}', "{bad}",
             "[f(a=1)]", '[g(b="]")', "<tool_call>", "</tool_call>", ";", " ", "\n", "x", "{", "}", "[", "]", "(",
             ")", '"', "'", "\\", "a=2", ","]


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_random_texts_stream_as_parsed(parser):
    """Property: texts strung from pieces of every format, fed in random chunks, release the full parse's
    content and calls; a text with no calls is its own content."""
    rng = random.Random(parser)
    for _ in range(2000):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 8)))
        expected = parse_tool_calls(text, parser)
        if not expected.tool_calls:
            assert expected.content == text
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        content, functions = _streamed(parser, pieces, expected.content or "")
        assert (content or None if functions else content) == expected.content, pieces
        assert functions == _functions(expected.tool_calls), pieces


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
@pytest.mark.parametrize("text", ["Just text.\n", "Braces { } and [brackets] and ; and <|python_tag", "  x  "])
def test_text_without_calls_is_the_content_unchanged(parser, text):
    assert parse_tool_calls(text, parser).content == text


# ------------------------------------------------------------------------------------------ the endpoint


@pytest.mark.parametrize(("parser", "calls", "plain"), [
    ("llama3_json", LLAMA_CALLS, '{"answer": "sunny"}'),
    ("pythonic", PYTHONIC_CALLS, "[1] It is sunny.\n"),
])
def test_chat_returns_the_parsers_calls_and_the_stream_says_the_same(parser, calls, plain):
    """n=2: one sample writes two calls, the other text that looks like a call but is not one."""
    ctx, _ = _context([_tokens(calls), _tokens(plain)], parser=parser)
    body = {"messages": [{"role": "user", "content": "Weather in Paris and Zürich?"}], "tools": [WEATHER], "n": 2}
    response = _post(ctx, body)
    assert response.status_code == 200, response.text
    first, second = response.json()["choices"]
    assert first["finish_reason"] == "tool_calls" and second["finish_reason"] == "stop"
    assert first["message"]["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in first["message"]["tool_calls"]] == [
        {"city": "Paris"}, {"city": "Zürich"}]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
               for c in first["message"]["tool_calls"])
    assert second["message"] == {"role": "assistant", "content": plain, "tool_calls": []}

    streamed, finish = _stream_messages(_post(ctx, {**body, "stream": True}))
    assert finish == {0: "tool_calls", 1: "stop"}
    for index, choice in enumerate((first, second)):
        assert streamed[index]["content"] == choice["message"]["content"]
        assert [c["function"] for c in streamed[index]["tool_calls"]] == _functions(choice["message"]["tool_calls"])

    single = {**body, "n": 1, "parallel_tool_calls": False}
    message = _post(ctx, single).json()["choices"][0]["message"]
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris"}]
    streamed, finish = _stream_messages(_post(ctx, {**single, "stream": True}))
    assert _functions(streamed[0]["tool_calls"]) == _functions(message["tool_calls"]) and finish == {0: "tool_calls"}


@pytest.mark.parametrize("parser", ["llama3_json", "pythonic"])
def test_the_server_flag_takes_the_parser(parser):
    ns = make_arg_parser().parse_args(["model-dir", "--enable-auto-tool-choice", "--tool-call-parser", parser])
    assert ns.tool_call_parser == parser and server_engine_args(ns)["model"] == "model-dir"
