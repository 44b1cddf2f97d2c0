"""Llama's tool-call formats (`--tool-call-parser llama3_json|pythonic`): each parser's rules, what is not a
call kept as content, the same message whatever the stream's chunking (every split point, for hermes too),
and the chat endpoint's responses and streams with the scripted engine of test_tool_calls."""

from __future__ import annotations

import json
import random
import tracemalloc
from typing import Any

import pytest

from kvserve.entrypoints.openai.cli_args import make_arg_parser, server_engine_args
from kvserve.entrypoints.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    joined_calls,
    parse_tool_calls,
    tool_call_stream,
)

from .test_tool_calls import TEXTS as HERMES_TEXTS
from .test_tool_calls import WEATHER, _context, _post, _stream_messages, _tokens

TAG = "<|python_tag|>"
START, END = "<|python_start|>", "<|python_end|>"  # Llama 4's wrapping of its pythonic calls
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
    '{"name": "f", "parameters": {}} ; <|python_tag|>{"name": "g", "parameters": {}}',
    '{"answer": "a long JSON reply"} and more',
    '{"parameters": {"a": 1}, "name": "f"}',
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
    START + "[f(a=1)]" + END + "\nDone.",
    "[Note: don't do that] and more",
    '[f(a="""x"y""", b=' + "'''it's ] here''', c=\"\", d='')]",
    '[f(a="""cut short"")]',
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
    ('{"type": "tool", "name": "f", "parameters": {}}', '{"type": "tool", "name": "f", "parameters": {}}', []),
    ('{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),
    (TAG + 'brave_search.call(query="x")', TAG + 'brave_search.call(query="x")', []),
    (TAG, TAG, []),
    # a call that names itself first and opens its arguments object streams from there: it is a call however it
    # goes on (keys after the arguments dropped; arguments that stop being JSON, or are cut short, as written)
    ('{"name": "f", "parameters": {}, "id": 1}', None, [{"name": "f", "arguments": "{}"}]),
    ('{"name": "f", "parameters": {"x": NaN, "s": "}"}} Done.', " Done.", [{"name": "f", "arguments": '{"x": NaN, "s": "}"}'}]),
    ('{"name": "f", "parameters": {"a": 1', None, [{"name": "f", "arguments": '{"a": 1'}]),  # cut short
    ('{"name": "f", "type": "function", "parameters": {"a" :1.0e2}}', None, [{"name": "f", "arguments": '{"a": 100.0}'}]),
    # read whole when it does not start so: the rules of a whole call
    ('{"parameters": {}, "name": "f", "id": 1}', '{"parameters": {}, "name": "f", "id": 1}', []),
    ('{"name": "f", "parameters": "{}", "id": 1}', '{"name": "f", "parameters": "{}", "id": 1}', []),
    # a bad call ends the calls: it and what follows are content, and a later tag starts them again
    ('{"name": "f", "parameters": {}}; {bad}; {"name": "g", "parameters": {}}',
     '; {bad}; {"name": "g", "parameters": {}}', [{"name": "f", "arguments": "{}"}]),
    ('{bad} <|python_tag|>{"name": "g", "parameters": {}}', "{bad}", [{"name": "g", "arguments": "{}"}]),
    # a separator followed by no call, only by whitespace, the end or the tag, is dropped; before text it stays
    ('{"name": "f", "parameters": {}};', None, [{"name": "f", "arguments": "{}"}]),
    ('{"name": "f", "parameters": {}}; \n', None, [{"name": "f", "arguments": "{}"}]),
    ('{"name": "f", "parameters": {}} ; <|python_tag|>{"name": "g", "parameters": {}}', None,
     [{"name": "f", "arguments": "{}"}, {"name": "g", "arguments": "{}"}]),
    ('{"name": "f", "parameters": {}}; Done.', "; Done.", [{"name": "f", "arguments": "{}"}]),
    ('{"name": "f", "parameters": {}}; <|python_tag|>', TAG, [{"name": "f", "arguments": "{}"}]),
    # the keys in any order: the first must be one a call has
    ('{"parameters": {"a": 1}, "name": "f"}', None, [{"name": "f", "arguments": '{"a": 1}'}]),
    ('{"\\u006eame": "f", "parameters": {}}', None, [{"name": "f", "arguments": "{}"}]),  # an escaped key
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
    """Read whole (its arguments first), a call too deep for json to read is content; streamed, its arguments are
    written as they come, whatever the depth."""
    text = '{"parameters": ' + "{" * 5000 + "}" * 5000 + ', "name": "f"}'
    assert parse_tool_calls(text, "llama3_json").content == text
    text = '{"name": "f", "parameters": ' + '{"a": ' * 5000 + "1" + "}" * 5001
    parsed = parse_tool_calls(text, "llama3_json")
    assert parsed.content is None
    assert _functions(parsed.tool_calls) == [{"name": "f", "arguments": '{"a": ' * 5000 + "1" + "}" * 5000}]


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
    # triple-quoted strings: quotes and brackets inside them are the string's
    ('[f(a="""x"y""")]', None, [{"name": "f", "arguments": '{"a": "x\\"y"}'}]),
    ("[f(a='''it's ] here''', b='')]", None, [{"name": "f", "arguments": '{"a": "it\'s ] here", "b": ""}'}]),
    ('[f(a="""x""""")]', None, [{"name": "f", "arguments": '{"a": "x"}'}]),  # """x""" then "": one string, as Python reads them
    # what cannot start a call is content at once; a tag after it reads as usual
    ("[Note: don't do that] and more", "[Note: don't do that] and more", []),
    ("[1, '<|python_tag|>[f()]'] x", "[1, ''] x", [{"name": "f", "arguments": "{}"}]),
    ("[ # a comment\n f(a=1)]", None, [{"name": "f", "arguments": '{"a": 1}'}]),  # what ast reads is read
    ("[(f)(a=1), g\n()]", None, [{"name": "f", "arguments": '{"a": 1}'}, {"name": "g", "arguments": "{}"}]),
    # Llama 4 wraps the list in <|python_start|> ... <|python_end|>: the tags go with the calls
    (START + "[f(a=1)]" + END, None, [{"name": "f", "arguments": '{"a": 1}'}]),
    ("Let me check.\n" + START + "\n[f()]\n" + END + "\nDone.", "Let me check.\nDone.",
     [{"name": "f", "arguments": "{}"}]),
    (START + "[f()]", None, [{"name": "f", "arguments": "{}"}]),
    (START + "print(1)" + END, START + "print(1)" + END, []),  # not a call: kept as written
    ("[f()]" + END, END, [{"name": "f", "arguments": "{}"}]),  # no start tag: the end tag is content
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
    return content + delta.content, joined_calls(functions + delta.tool_calls)


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
             ")", '"', "'", "\\", "a=2", ",", START, END, '"""', "Note:", '{"answer": 1}']


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


@pytest.mark.parametrize(("parser", "before", "char"), [
    ("llama3_json", "", "\n"),  # where a call may open: the reply's start
    ("llama3_json", TAG, "\n"),
    ("llama3_json", '{"name": "f", "parameters": {}}', "\n"),  # after a call, where a separator may come
    ("llama3_json", '{"name": "f", "parameters": {}};', "\n"),  # after a separator
    ("llama3_json", "Some text.", "\n"),  # content
    ("llama3_json", '{"name": "f", "parameters": {"a": "', "x"),  # within a call
    ("llama3_json", "{", "\n"),  # before the call's first key
    ("pythonic", "", "\n"),
    ("pythonic", START + "[f()]", "\n"),  # after a call, where its closing tag may come
    ("pythonic", "Some text.", "\n"),
    ("pythonic", "[f", " "),  # between the name and its parenthesis
    ("pythonic", '[f(a="""', "x"),
    ("hermes", "", "\n"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', "\n"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "', "x"),
    # streamed arguments: a number, whitespace between values, arguments no longer JSON, text after the call
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ', "1"),
    ("llama3_json", '{"name": "f", "parameters": {"a": [', "\n"),
    ("llama3_json", '{"name": "f", "parameters": {"a": NaN', " "),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}', " "),
])
def test_a_long_run_costs_each_feed_only_its_own_text(parser, before, char):
    """A model may write tens of thousands of newlines (or a call's long argument) a token at a time, and
    each feed runs on the server's event loop: after 200k characters, a feed of one more allocates a few
    bytes, not a copy of the run (which rescanning or re-joining what is held would make: quadratic work
    over the run). What is held still comes out whole."""
    run = char * 200_000
    stream = tool_call_stream(parser)
    content, functions = "", []
    for piece in (before, run):
        delta = stream.feed(piece)
        content, functions = content + delta.content, functions + delta.tool_calls
    tracemalloc.start()
    try:
        for _ in range(10):
            delta = stream.feed(char)
            content, functions = content + delta.content, functions + delta.tool_calls
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak_bytes < 20_000
    delta = stream.feed("x", final=True)
    expected = parse_tool_calls(before + run + char * 10 + "x", parser)
    content += delta.content
    assert (content or None if expected.tool_calls else content) == expected.content
    assert joined_calls(functions + delta.tool_calls) == _functions(expected.tool_calls)


@pytest.mark.parametrize(("parser", "text", "undecided"), [
    ("pythonic", "[Note: don't do that] and more", "[Note"),
    ("pythonic", "[1] See the reference.", "["),
    ("pythonic", "[get_weather is the tool] x", "[get_weather "),
    ("llama3_json", '{"answer": "sunny, and a long reply"}', '{"a'),
    ("llama3_json", '{\n  "result": [1, 2]}', '{\n  "'),
    ("llama3_json", TAG + '{"answer": 1}', TAG + '{"a'),  # "a": "arguments" maybe
])
def test_what_cannot_start_a_call_streams_at_once(parser, text, undecided):
    """Text after the bracket that no call starts with is released as content as soon as it shows (not held
    to the end of the reply, as it was when it had to close first); `undecided` is the longest prefix that
    could still start one."""
    stream = tool_call_stream(parser)
    released = ""
    for i, char in enumerate(text):
        released += stream.feed(char).content
        if i + 1 <= len(undecided):
            assert released == "", text[: i + 1]
        elif i == len(undecided):
            assert released == text[: i + 1]
    assert released == text
    assert stream.feed("", final=True).content == ""


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


@pytest.mark.parametrize("parser", ["llama3_json", "pythonic", "llama4_json", "llama4_pythonic"])
def test_the_server_flag_takes_the_parser(parser):
    ns = make_arg_parser().parse_args(["model-dir", "--enable-auto-tool-choice", "--tool-call-parser", parser])
    assert ns.tool_call_parser == parser and server_engine_args(ns)["model"] == "model-dir"


@pytest.mark.parametrize("parser", ["llama4_json", "llama4_pythonic"])
def test_the_llama4_names_are_their_formats_parsers(parser):
    """vLLM's `llama4_json` reads llama3_json's format and `llama4_pythonic` pythonic's (Llama 4 may put
    <|python_start|> ... <|python_end|> around the list)."""
    text = {"llama4_json": LLAMA_CALLS, "llama4_pythonic": START + PYTHONIC_CALLS + END}[parser]
    parsed = parse_tool_calls(text, parser)
    assert parsed.content is None and _functions(parsed.tool_calls) == PARIS_ZURICH


UNWRITABLE_CALLS = [
    # an integer Python reads but will not write (more than 4300 digits)
    ("pythonic", "[f(a=0x" + "f" * 4000 + ")]"),
    # a lone surrogate, from a JSON or Python escape: no UTF-8 response can hold it
    ("llama3_json", '{"name": "\\udfff", "parameters": {}}'),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"\\ud800\\"}"}</tool_call>'),
    ("pythonic", '[f(a="\\ud800")]'),
]


@pytest.mark.parametrize(("parser", "text"), UNWRITABLE_CALLS)
def test_a_call_the_response_cannot_carry_is_content(parser, text):
    """Not a server error or a 400 blaming the client: the call stays in the content as the model wrote it
    (an ASCII escape there), streamed or not."""
    ctx, _ = _context([_tokens(text)], parser=parser)
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER]}
    response = _post(ctx, body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text, "tool_calls": []}
    assert choice["finish_reason"] == "stop"
    streamed = _post(ctx, {**body, "stream": True})
    assert streamed.status_code == 200 and '"error"' not in streamed.text, streamed.text
    messages, finish = _stream_messages(streamed)
    assert messages[0] == {"content": text, "tool_calls": []} and finish == {0: "stop"}
