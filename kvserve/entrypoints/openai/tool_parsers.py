"""Tool calls in a model's text: the server's `--tool-call-parser` (vLLM's flag and parser names).

`hermes` reads the format of Hermes 2 Pro and Qwen2 / Qwen2.5 / Qwen3 chat templates: each call is a JSON
object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``.

One algorithm serves the full response and the stream, so the two agree whatever the stream's chunking:
`ToolCallStream` is fed the text as it comes and releases content and tool calls as soon as they are
certain, and `parse_tool_calls` is that stream fed the whole text at once. Its rules:

* text outside the tags is the message's content;
* a block whose body is a JSON object of a non-empty string ``name`` and its ``arguments`` (an object, or a
  JSON string of one; ``parameters`` is read as ``arguments``) is a tool call; any other block (bad JSON,
  NaN, no name, no arguments, other keys) stays in the content, tags and all, so nothing the model wrote is
  lost;
* a block left open at the end (the request ran out of tokens) counts as closed there;
* whitespace right before a tool call, and at the end of a response that made tool calls, is dropped
  (the newlines templates put around the tags); a response with tool calls and no other text has no
  content (``null``); one without tool calls has its whole text as content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.protocol.chat_messages import strict_json

TOOL_CALL_PARSERS = ("hermes",)
_START, _END = "<tool_call>", "</tool_call>"
_WHITESPACE = " \t\n\r"  # what templates put around the tags (JSON's whitespace)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _tool_call(body: str) -> dict[str, Any] | None:
    """The OpenAI `function` object of one block's body, or None when it is not a call: a JSON object with a
    non-empty string ``name`` and its arguments (an object, or a JSON string of one) under ``arguments`` or,
    as Llama-style models write them, ``parameters``, and no other key."""
    try:
        call = strict_json(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    keys = set(call) - {"name"}
    if len(keys) != 1 or not keys <= {"arguments", "parameters"}:
        return None  # no arguments, or more than the call: kept as the model wrote it
    arguments = call[keys.pop()]
    if isinstance(arguments, str):  # a model that writes the arguments as a JSON string: kept as written
        try:
            return {"name": call["name"], "arguments": arguments} if isinstance(strict_json(arguments), dict) else None
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of the start tag."""
    for n in range(min(len(text), len(_START) - 1), 0, -1):
        if _START.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCallDelta:
    """What one `feed` releases: content text and complete tool calls (OpenAI `function` objects)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallStream:
    """One choice's text, fed as it is generated (see the module docstring for the rules)."""

    def __init__(self) -> None:
        self._buffer = ""  # text not decided yet
        self._inside = False  # within a <tool_call> block (the buffer holds its body)
        self._held_space = ""  # whitespace released only if content, not a tool call, follows it
        self.num_tool_calls = 0

    def feed(self, text: str, final: bool = False) -> ToolCallDelta:
        out = ToolCallDelta()
        self._buffer += text
        while True:
            if self._inside:
                end = self._buffer.find(_END)
                if end < 0 and not final:
                    break
                body = self._buffer if end < 0 else self._buffer[:end]
                self._buffer = "" if end < 0 else self._buffer[end + len(_END):]
                self._inside = False
                call = _tool_call(body.strip())
                if call is not None:
                    self._held_space = ""
                    out.tool_calls.append(call)
                    self.num_tool_calls += 1
                else:
                    self._content(out, _START + body + ("" if end < 0 else _END))
                continue
            start = self._buffer.find(_START)
            if start >= 0:
                self._content(out, self._buffer[:start])
                self._buffer = self._buffer[start + len(_START):]
                self._inside = True
                continue
            keep = 0 if final else _partial_tag(self._buffer)
            self._content(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        if final and self._held_space and not self.num_tool_calls:
            out.content += self._held_space
        if final:
            self._held_space = ""
        return out

    def _content(self, out: ToolCallDelta, text: str) -> None:
        """Release text as content, holding back its trailing whitespace."""
        if not text:
            return
        text = self._held_space + text
        stripped = text.rstrip(_WHITESPACE)
        self._held_space = text[len(stripped):]
        if stripped:
            out.content += stripped


@dataclass
class ParsedMessage:
    content: str | None
    tool_calls: list[dict[str, Any]]  # OpenAI tool_call objects (id, type, function)


def parse_tool_calls(text: str) -> ParsedMessage:
    """The assistant message of a full response (`ToolCallStream` fed the whole text)."""
    delta = ToolCallStream().feed(text, final=True)
    calls = [{"id": tool_call_id(), "type": "function", "function": f} for f in delta.tool_calls]
    return ParsedMessage(delta.content if delta.content or not calls else None, calls)
