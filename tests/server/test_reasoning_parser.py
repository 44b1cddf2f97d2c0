"""Reasoning (`--reasoning-parser deepseek_r1|qwen3`): the parser's rules, the same split whatever the stream's
chunking, and the chat endpoint's messages and streams with the scripted engine of test_tool_calls (its model
writes scripted text, a piece at a time): both parsers, n=2, tool calls after the reasoning, the rule for
structured output, usage and logprobs, and the flag."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest

from kvserve.entrypoints.openai.cli_args import make_arg_parser
from kvserve.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningMessage,
    ReasoningStream,
    parse_reasoning,
    reasoning_applies,
)
from kvserve.entrypoints.openai.serving_common import ServingContext
from kvserve.protocol.outputs import Logprob

from .test_tool_calls import TWO_CALLS, WEATHER, _context, _post, _tokens

THOUGHT = "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4."
TEXTS = [
    THOUGHT,
    "Reasoning with no start tag (the template opened it).\n</think>\n\nAnswer.",
    "Cut short while thinking",
    "<think>cut short after the start tag",
    "<think>x</think>",
    "</think>Answer right away",
    "a</think>b</think>c <think>d",
    "a<think>b</think>c",
    "ends in part of a tag </thi",
    "</<think>think>not a tag",
    "<thinking> is not a tag</think>x",
    "",
]


# ------------------------------------------------------------------------------------------ the parser


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    # only the tags go: the whitespace around them stays, as vLLM returns it
    (THOUGHT, "\nThe user wants 2+2.\n", "\n\nIt is 4."),
    ("I think.</think>Answer", "I think.", "Answer"),
    # no </think>: all reasoning (cut short while thinking), the content null
    ("Cut short while thinking", "Cut short while thinking", None),
    ("<think>cut short", "cut short", None),
    ("<think>x</think>", "x", None),
    ("</think>Answer", None, "Answer"),
    ("", None, None),
    # the first </think> ends the reasoning; the rest is content as written
    ("a</think>b</think>c <think>d", "a", "b</think>c <think>d"),
    # a <think> inside the reasoning is dropped, and never makes a tag of what surrounds it
    ("a<think>b</think>c", "ab", "c"),
    ("</<think>think>not a tag", "</think>not a tag", None),
    ("ends in part of a tag </thi", "ends in part of a tag </thi", None),
    ("<thinking> is not a tag</think>x", "<thinking> is not a tag", "x"),
])
def test_parse_rules(text, reasoning, content):
    assert parse_reasoning(text) == ReasoningMessage(reasoning, content)


@pytest.mark.parametrize("text", TEXTS)
def test_any_chunking_streams_the_full_parse(text):
    """Fed in random pieces (one character at a time among them), the stream releases the reasoning and the
    content of the full parse, and never releases text it would later have to take back."""
    expected = parse_reasoning(text)
    rng = random.Random(text)
    for trial in range(30):
        stream, reasoning, content = ReasoningStream(), "", ""
        position = 0
        while position < len(text):
            size = 1 if trial == 0 else rng.randint(1, 9)
            delta = stream.feed(text[position:position + size])
            position += size
            reasoning += delta.reasoning
            content += delta.content
            assert (expected.reasoning or "").startswith(reasoning), (trial, reasoning)
            assert (expected.content or "").startswith(content), (trial, content)
        delta = stream.feed("", final=True)
        assert (reasoning + delta.reasoning or None, content + delta.content or None) == (
            expected.reasoning, expected.content)


def test_stream_holds_back_a_partial_tag():
    stream = ReasoningStream()
    assert stream.feed("Hmm </th").reasoning == "Hmm "
    released = stream.feed("ink>\n\nHi")
    assert (released.reasoning, released.content) == ("", "\n\nHi")
    stream = ReasoningStream()
    assert stream.feed("x <thi").reasoning == "x "
    assert stream.feed("s").reasoning == "<this"  # not a tag after all: released


def test_qwen3_reads_enable_thinking_and_deepseek_r1_does_not():
    assert reasoning_applies("qwen3", None) and reasoning_applies("qwen3", {"enable_thinking": True})
    assert not reasoning_applies("qwen3", {"enable_thinking": False})
    assert not reasoning_applies("qwen3", {"enable_thinking": 0})  # any false value, as vLLM reads it
    assert reasoning_applies("deepseek_r1", {"enable_thinking": False})


# ------------------------------------------------------------------------------------------ the endpoint


def _reasoning_context(outputs: list[list[str]], reasoning: str | None = "deepseek_r1",
                       tools: str | None = None) -> ServingContext:
    ctx, _ = _context(outputs, parser=tools)
    ctx.reasoning_parser = reasoning
    return ctx


def _streamed(response: httpx.Response) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """Each choice's message put together from its deltas (and its finish reason), and every chunk; checks
    that no delta holds a tag and that a choice's reasoning all comes before its content."""
    assert response.status_code == 200, response.text
    messages: dict[int, dict[str, Any]] = {}
    chunks = []
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[len("data: "):])
        chunks.append(chunk)
        for choice in chunk["choices"]:
            message = messages.setdefault(choice["index"], {"reasoning": None, "content": None, "tool_calls": []})
            delta = choice["delta"]
            for key in ("reasoning", "content"):
                piece = delta.get(key)
                if piece:
                    assert "<think>" not in piece and "</think>" not in piece
                    message[key] = (message[key] or "") + piece
            if delta.get("reasoning"):
                assert message["content"] is None, "reasoning after content"
            for call in delta.get("tool_calls", []):  # a call's first piece has its id; the rest, more arguments
                if "id" in call:
                    message["tool_calls"].append(json.loads(json.dumps(call)))
                else:
                    message["tool_calls"][call["index"]]["function"]["arguments"] += call["function"]["arguments"]
            if choice["finish_reason"] is not None:
                message["finish_reason"] = choice["finish_reason"]
    return messages, chunks


def _ask(ctx: ServingContext, stream_options: dict[str, Any] | None = None,
         **extra: Any) -> tuple[dict[str, Any], dict[int, dict[str, Any]], list[dict]]:
    """The non-streamed response and the streamed messages (and chunks) of one request."""
    body = {"messages": [{"role": "user", "content": "2+2?"}], **extra}
    response = _post(ctx, body)
    assert response.status_code == 200, response.text
    messages, chunks = _streamed(_post(ctx, {**body, "stream": True, "stream_options": stream_options}))
    return response.json(), messages, chunks


def test_deepseek_r1_splits_each_choice_streamed_or_not():
    """n=2, each choice parsed on its own: one with its answer, one cut short while thinking (all reasoning,
    no content). The stream puts together the same messages, and usage counts every generated token."""
    thinking_only = "The user wants 2+2. Let me count"
    ctx = _reasoning_context([_tokens(THOUGHT), _tokens(thinking_only)])
    body, streamed, chunks = _ask(ctx, n=2, stream_options={"include_usage": True})
    first, second = body["choices"]
    assert first["message"] == {"role": "assistant", "content": "\n\nIt is 4.", "reasoning": "\nThe user wants 2+2.\n"}
    assert second["message"] == {"role": "assistant", "content": None, "reasoning": thinking_only}
    assert first["finish_reason"] == second["finish_reason"] == "stop"
    for index, choice in enumerate((first, second)):
        assert streamed[index]["reasoning"] == choice["message"]["reasoning"]
        assert streamed[index]["content"] == choice["message"]["content"]
        assert streamed[index]["finish_reason"] == "stop"
    generated = len(_tokens(THOUGHT)) + len(_tokens(thinking_only))
    assert body["usage"]["completion_tokens"] == chunks[-1]["usage"]["completion_tokens"] == generated
    assert body["usage"] == _post(_reasoning_context([_tokens(THOUGHT), _tokens(thinking_only)], None),
                                  {"messages": [{"role": "user", "content": "2+2?"}], "n": 2}).json()["usage"]


def test_a_tag_split_across_tokens_never_shows():
    pieces = ["Hmm", " <", "th", "ink>", "\nok\n<", "/", "think", ">\n", "\nDone", "."]
    ctx = _reasoning_context([pieces])
    body, streamed, chunks = _ask(ctx)
    assert body["choices"][0]["message"]["reasoning"] == "Hmm \nok\n"
    assert body["choices"][0]["message"]["content"] == "\n\nDone."
    assert {k: streamed[0][k] for k in ("reasoning", "content")} == {"reasoning": "Hmm \nok\n",
                                                                     "content": "\n\nDone."}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(d) <= {"reasoning", "content"} for d in deltas[1:])


def test_qwen3_thinking_on_off_and_left_open():
    """qwen3: <think>...</think> split as deepseek_r1; with enable_thinking false the whole text is content
    (null reasoning); a reply without </think> while thinking is on is all reasoning (vLLM 0.2x's rule)."""
    ctx = _reasoning_context([_tokens(THOUGHT)], "qwen3")
    body, streamed, _ = _ask(ctx)
    assert body["choices"][0]["message"]["reasoning"] == "\nThe user wants 2+2.\n"
    assert body["choices"][0]["message"]["content"] == streamed[0]["content"] == "\n\nIt is 4."

    plain = "It is 4, no thinking asked."
    for kwargs, reasoning, content in (({"enable_thinking": False}, None, plain), (None, plain, None)):
        ctx = _reasoning_context([_tokens(plain)], "qwen3")
        body, streamed, _ = _ask(ctx, chat_template_kwargs=kwargs)
        message = body["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (reasoning, content)
        assert (streamed[0]["reasoning"], streamed[0]["content"]) == (reasoning, content)

    ctx = _reasoning_context([_tokens(plain)], "deepseek_r1")  # reads no template argument
    body, _, _ = _ask(ctx, chat_template_kwargs={"enable_thinking": False})
    assert body["choices"][0]["message"]["reasoning"] == plain


def test_tool_calls_are_read_from_the_content_only():
    """With the hermes tool parser, a call written while thinking stays in the reasoning; the calls after
    </think> are the message's, and the content is the text between them and the reasoning."""
    thinking = 'Maybe <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>? No: both.\n'
    ctx = _reasoning_context([_tokens(thinking + "</think>\n\n" + TWO_CALLS), _tokens(thinking + "</think>\n\nNo call.")],
                             tools="hermes")
    body, streamed, _ = _ask(ctx, tools=[WEATHER], n=2)
    first, second = body["choices"]
    assert first["message"]["reasoning"] == thinking
    assert first["message"]["content"] == "\n\nLet me look that up."
    assert [json.loads(c["function"]["arguments"]) for c in first["message"]["tool_calls"]] == [
        {"city": "Paris"}, {"city": "Zürich"}]
    assert first["finish_reason"] == "tool_calls"
    assert second["message"] == {"role": "assistant", "content": "\n\nNo call.", "tool_calls": [],
                                 "reasoning": thinking}
    assert second["finish_reason"] == "stop"
    for index, choice in enumerate((first, second)):
        assert streamed[index]["reasoning"] == choice["message"]["reasoning"]
        assert streamed[index]["content"] == choice["message"]["content"]
        assert [c["function"] for c in streamed[index]["tool_calls"]] == [
            c["function"] for c in choice["message"]["tool_calls"]]
        assert streamed[index]["finish_reason"] == choice["finish_reason"]

    ctx = _reasoning_context([_tokens("Call it.</think>\n\n" + TWO_CALLS.split("\n", 1)[1])], tools="hermes")
    body, streamed, _ = _ask(ctx, tools=[WEATHER])
    message = body["choices"][0]["message"]
    assert message["content"] is None and streamed[0]["content"] is None  # only whitespace around the calls
    assert len(message["tool_calls"]) == len(streamed[0]["tool_calls"]) == 2


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"regex": ".*"}},
    {"guided_choice": ["a", "b"]},
])
def test_structured_output_replies_are_not_read_for_reasoning(extra):
    """A grammar shapes the whole reply from its first token, so it is returned as without the parser: all
    content (the same text unconstrained is reasoning under deepseek_r1), `reasoning` null."""
    text = '{"answer": 4}'
    ctx = _reasoning_context([_tokens(text)])
    body, streamed, _ = _ask(ctx, **extra)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text, "reasoning": None}
    assert (streamed[0]["reasoning"], streamed[0]["content"]) == (None, text)
    assert _ask(ctx)[0]["choices"][0]["message"]["reasoning"] == text


def test_forced_tool_choices_take_the_whole_reply():
    named = {"type": "function", "function": {"name": "get_weather"}}
    ctx = _reasoning_context([_tokens('{"city": "Paris"}')])
    body, streamed, _ = _ask(ctx, tools=[WEATHER], tool_choice=named)
    message = body["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert "".join(c["function"]["arguments"] for c in streamed[0]["tool_calls"]) == '{"city": "Paris"}'
    assert streamed[0]["reasoning"] is None

    ctx = _reasoning_context([_tokens('[{"name": "get_weather", "parameters": {"city": "Paris"}}]')])
    body, streamed, _ = _ask(ctx, tools=[WEATHER], tool_choice="required")
    assert body["choices"][0]["finish_reason"] == streamed[0]["finish_reason"] == "tool_calls"
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert streamed[0]["reasoning"] is None


def _with_logprobs(ctx: ServingContext) -> None:
    """The scripted engine's samples get a logprob for each token (token t: "t<t>", logprob -t)."""
    generate = ctx.engine.generate

    async def with_logprobs(request_id, ids, params, prompt, **kwargs):  # noqa: ANN001, ANN003, ANN202
        async for update in generate(request_id, ids, params, prompt, **kwargs):
            for sample in update.outputs:
                sample.logprobs = [{t: Logprob(-float(t), 1, f"t{t}")} for t in sample.token_ids]
            yield update

    ctx.engine.generate = with_logprobs


def test_logprobs_and_token_ids_are_those_of_every_token():
    """The reasoning's tokens keep their logprobs and ids (the parser splits the text only)."""
    bodies = []
    for parser in ("deepseek_r1", None):
        ctx = _reasoning_context([_tokens(THOUGHT)], parser)
        _with_logprobs(ctx)
        body, _, chunks = _ask(ctx, logprobs=True, return_token_ids=True)
        bodies.append(body["choices"][0])
        streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
        assert streamed == body["choices"][0]["logprobs"]["content"]
    with_parser, without = bodies
    assert with_parser["logprobs"] == without["logprobs"] and len(with_parser["logprobs"]["content"]) == len(
        _tokens(THOUGHT))
    assert with_parser["token_ids"] == without["token_ids"]


def test_include_reasoning_false_leaves_out_the_reasoning_and_what_tells_it():
    """vLLM's include_reasoning: false drops the reasoning, and the logprobs and token ids that would give it
    away; no chunk goes out for a reasoning token."""
    ctx = _reasoning_context([_tokens(THOUGHT)])
    _with_logprobs(ctx)
    body, streamed, chunks = _ask(ctx, include_reasoning=False, logprobs=True, return_token_ids=True)
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "\n\nIt is 4.", "reasoning": None}
    assert choice["logprobs"] is None and "token_ids" not in choice
    assert (streamed[0]["reasoning"], streamed[0]["content"]) == (None, "\n\nIt is 4.")
    sent = [ch for c in chunks for ch in c["choices"]][1:]  # after the role chunk
    assert all(ch["delta"] or ch["finish_reason"] for ch in sent)
    assert all(ch["logprobs"] is None and "token_ids" not in ch for ch in sent)


def test_without_the_flag_nothing_changes():
    ctx = _reasoning_context([_tokens(THOUGHT)], None)
    body, streamed, _ = _ask(ctx, include_reasoning=False)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": THOUGHT}
    assert (streamed[0]["reasoning"], streamed[0]["content"]) == (None, THOUGHT)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_are_not_read_for_reasoning(stream):
    ctx = _reasoning_context([_tokens(THOUGHT)])
    ctx.engine.tokenizer = lambda text, add_special_tokens=True: {"input_ids": [1, 2]}
    response = _post(ctx, {"prompt": "2+2?", "max_tokens": 50, "stream": stream}, "/v1/completions")
    assert response.status_code == 200, response.text
    if stream:
        choices = [c for line in response.text.splitlines() if line.startswith("data: {")
                   for c in json.loads(line[len("data: "):])["choices"]]
        assert "".join(c["text"] for c in choices) == THOUGHT
    else:
        choices = response.json()["choices"]
        assert choices[0]["text"] == THOUGHT
    assert not any("reasoning" in c for c in choices)


# ------------------------------------------------------------------------------------------ the flag


def test_the_flag_takes_vllms_parser_names():
    parser = make_arg_parser()
    assert parser.parse_args(["model-dir"]).reasoning_parser is None
    for name in REASONING_PARSERS:
        assert parser.parse_args(["model-dir", "--reasoning-parser", name]).reasoning_parser == name
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(SystemExit):
        parser.parse_args(["model-dir", "--reasoning-parser", "granite"])
    assert "--reasoning-parser" in parser.format_help()


def test_a_server_started_with_the_flag_reads_replies_for_reasoning(launch_server, tiny_llama_dir, tiny_server):
    """The flag reaches the chat endpoint of a real server: the tiny model writes no </think>, so under
    deepseek_r1 its whole reply (the default server's content) is the reasoning, streamed or not."""
    from .conftest import TINY_NAME, TINY_SERVER_FLAGS, read_sse

    server = launch_server([tiny_llama_dir, *TINY_SERVER_FLAGS, "--reasoning-parser", "deepseek_r1"])
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    plain = httpx.post(tiny_server.base_url + "/v1/chat/completions", json=body, timeout=120).json()
    text = plain["choices"][0]["message"]["content"]
    assert text and "</think>" not in text and "reasoning" not in plain["choices"][0]["message"]
    message = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0][
        "message"]
    assert (message["reasoning"], message["content"]) == (text, None)
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as response:
        deltas = [c["choices"][0]["delta"] for c in read_sse(response) if isinstance(c, dict) and c["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == text
    assert not any(d.get("content") for d in deltas)
