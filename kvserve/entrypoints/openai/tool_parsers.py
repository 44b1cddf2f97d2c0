"""Tool calls in a model's text: the server's `--tool-call-parser` (vLLM's flag and parser names).

Each parser reads one format:

* `hermes` (Hermes 2 Pro; Qwen2, Qwen2.5 and Qwen3 chat templates): each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``, anywhere in the text;
* `llama3_json` (Llama 3.1, 3.2 and 3.3 JSON tool calling): the reply is a JSON object
  ``{"name": ..., "parameters": {...}}``, possibly after the ``<|python_tag|>`` token; several calls are
  separated by ``;``;
* `pythonic` (Llama 3.2 and Llama 4 zero-shot function calling): the reply is a Python list of calls,
  ``[get_weather(city="Paris", unit="c"), now()]``, keyword arguments only, each value a Python literal.

One algorithm per parser serves the full response and the stream, so the two agree whatever the stream's
chunking: a `ToolCallStream` is fed the text as it comes and releases content and tool calls as soon as they
are certain, and `parse_tool_calls` is that stream fed the whole text at once. The rules:

* a JSON call (`hermes`, `llama3_json`) is an object of a non-empty string ``name`` and its arguments (an
  object, or a JSON string of one) under ``arguments`` or ``parameters``, and no other key (`llama3_json`
  also allows ``"type": "function"``); NaN and Infinity are not JSON;
* a pythonic call is ``name(key=value, ...)``: a plain name, no positional or repeated arguments, values
  that are Python literals convertible to JSON (str keys, no NaN, sets or bytes), read with `ast`, never
  evaluated; a list with anything else in it (or an empty list) holds no calls;
* whatever is not a call stays in the content as written (tags, ``<|python_tag|>``, separators and all),
  so nothing the model wrote is lost;
* `hermes`: text outside the tags is content; a block left open at the end (the request ran out of
  tokens) counts as closed there;
* `llama3_json` and `pythonic`: calls are read only where the reply starts and right after each
  ``<|python_tag|>``, where the text (after whitespace) must open the call (``{``, ``[``); the call ends at
  its matching bracket (brackets inside strings do not count) and what follows is content, except, for
  `llama3_json`, a ``;`` followed by another call; a call still open at the end (cut short) is content;
* whitespace right before a tool call, and at the end of a response that made tool calls, is dropped
  (the newlines templates put around calls); a response with tool calls and no other text has no content
  (``null``); one without tool calls has its whole text as content.
"""

from __future__ import annotations

import ast
import json
import math
import uuid
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.protocol.chat_messages import strict_json

_WHITESPACE = " \t\n\r"  # what templates put around calls (JSON's whitespace)
_PYTHON_TAG = "<|python_tag|>"  # Llama 3's token before code and tool calls, kept in the text while tools are read


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _tool_call(body: str, allow_type: bool = False) -> dict[str, Any] | None:
    """The OpenAI `function` object of a JSON call, or None when `body` is not one: a JSON object with a
    non-empty string ``name`` and its arguments (an object, or a JSON string of one) under ``arguments`` or,
    as Llama-style models write them, ``parameters``, and no other key (with `allow_type`, also
    ``"type": "function"``)."""
    try:
        call = strict_json(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    keys = set(call) - {"name"}
    if allow_type and call.get("type") == "function":
        keys.discard("type")
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


def _is_json(value: Any) -> bool:
    """Whether a Python literal's value is JSON as it stands (tuples read as arrays)."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return False  # sets, bytes, complex numbers


def _pythonic_calls(section: str) -> list[dict[str, Any]] | None:
    """The OpenAI `function` objects of a Python list of calls, or None when `section` is not one (see the
    module docstring). Read with `ast`: nothing is evaluated."""
    try:
        with warnings.catch_warnings():  # a model's "C:\dir" is an invalid escape (a SyntaxWarning), read as written
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(section, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    functions = []
    for call in tree.elts:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            return None
        arguments: dict[str, Any] = {}
        for keyword in call.keywords:
            if keyword.arg is None or keyword.arg in arguments:  # **spread, or an argument given twice
                return None
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        if not _is_json(arguments):
            return None
        functions.append({"name": call.func.id, "arguments": json.dumps(arguments, ensure_ascii=False)})
    return functions


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCallDelta:
    """What one `feed` releases: content text and complete tool calls (OpenAI `function` objects)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallStream(ABC):
    """One choice's text, fed as it is generated, read by one parser (see the module docstring for the
    rules). A subclass's `_advance` consumes what is decided of `_buffer`, all of it when `final`, and
    releases it through `_content` and `_call`."""

    def __init__(self) -> None:
        self._buffer = ""  # text not decided yet
        self._held_space = ""  # whitespace released only if content, not a tool call, follows it
        self.num_tool_calls = 0

    def feed(self, text: str, final: bool = False) -> ToolCallDelta:
        out = ToolCallDelta()
        self._buffer += text
        self._advance(out, final)
        if final:
            assert not self._buffer, "a parser left text undecided at the end"
            if self._held_space and not self.num_tool_calls:
                out.content += self._held_space
            self._held_space = ""
        return out

    @abstractmethod
    def _advance(self, out: ToolCallDelta, final: bool) -> None: ...

    def _content(self, out: ToolCallDelta, text: str) -> None:
        """Release text as content, holding back its trailing whitespace."""
        if not text:
            return
        text = self._held_space + text
        stripped = text.rstrip(_WHITESPACE)
        self._held_space = text[len(stripped):]
        if stripped:
            out.content += stripped

    def _call(self, out: ToolCallDelta, function: dict[str, Any]) -> None:
        """Release a tool call; the whitespace held before it goes with it."""
        self._held_space = ""
        out.tool_calls.append(function)
        self.num_tool_calls += 1


class HermesStream(ToolCallStream):
    """`hermes`: ``<tool_call>`` JSON ``</tool_call>`` blocks anywhere in the text."""

    _START, _END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._inside = False  # within a <tool_call> block (the buffer holds its body)

    def _advance(self, out: ToolCallDelta, final: bool) -> None:
        while True:
            if self._inside:
                end = self._buffer.find(self._END)
                if end < 0 and not final:
                    return
                body = self._buffer if end < 0 else self._buffer[:end]
                self._buffer = "" if end < 0 else self._buffer[end + len(self._END):]
                self._inside = False
                call = _tool_call(body.strip())
                if call is not None:
                    self._call(out, call)
                else:
                    self._content(out, self._START + body + ("" if end < 0 else self._END))
                continue
            start = self._buffer.find(self._START)
            if start >= 0:
                self._content(out, self._buffer[:start])
                self._buffer = self._buffer[start + len(self._START):]
                self._inside = True
                continue
            keep = 0 if final else _partial_suffix(self._buffer, self._START)
            self._content(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return


class _LeadingCallStream(ToolCallStream):
    """Llama's formats: a call opens (after whitespace) where the reply starts or right after
    ``<|python_tag|>``, and runs to its matching bracket. A subclass names the brackets, the string quotes
    (brackets inside strings do not count), the separator that may join a next call (None: no next call), and
    how a complete call's text reads (`_read`: its `function` objects, or None when it is not a call)."""

    _OPEN: str
    _CLOSE: str
    _QUOTES: str
    _SEPARATOR: str | None

    def __init__(self) -> None:
        super().__init__()
        # "opening": a call may open here (the reply's start, after the tag or a separator); "call": within one
        # (the buffer starts with it); "after": just after a call (a separator may follow); "text": content
        self._state: Literal["opening", "call", "after", "text"] = "opening"
        self._lead = ""  # the tag or separator (and whitespace) before the call: content unless a call follows
        self._depth = 0  # the call's open brackets, scanned up to `_scanned`
        self._quote: str | None = None  # the quote of the string the scan is in
        self._escaped = False
        self._scanned = 0

    @abstractmethod
    def _read(self, section: str) -> list[dict[str, Any]] | None: ...

    def _advance(self, out: ToolCallDelta, final: bool) -> None:
        while True:
            if self._state == "text":
                tag = self._buffer.find(_PYTHON_TAG)
                if tag >= 0:
                    self._content(out, self._buffer[:tag])
                    self._buffer = self._buffer[tag + len(_PYTHON_TAG):]
                    self._state, self._lead = "opening", _PYTHON_TAG
                    continue
                keep = 0 if final else _partial_suffix(self._buffer, _PYTHON_TAG)
                self._content(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return
            if self._state in ("opening", "after"):
                rest = self._buffer.lstrip(_WHITESPACE)
                if not rest and not final:
                    return  # only whitespace so far: what comes next decides
                if self._state == "after":
                    if self._SEPARATOR is not None and rest.startswith(self._SEPARATOR):
                        cut = len(self._buffer) - len(rest) + len(self._SEPARATOR)
                        self._state, self._lead, self._buffer = "opening", self._buffer[:cut], self._buffer[cut:]
                    else:
                        self._state = "text"
                elif rest.startswith(self._OPEN):
                    self._lead += self._buffer[: len(self._buffer) - len(rest)]
                    self._buffer = rest
                    self._state, self._depth, self._quote, self._escaped, self._scanned = "call", 0, None, False, 0
                else:  # no call here: the tag or separator is content, and so is what follows
                    self._content(out, self._lead)
                    self._state, self._lead = "text", ""
                continue
            end = self._scan()  # state "call"
            if end < 0 and not final:
                return
            section = self._buffer[:end] if end >= 0 else self._buffer
            self._buffer = self._buffer[len(section):]
            functions = self._read(section) if end >= 0 else None
            if functions is None:  # not a call (or cut short): content, as written
                self._content(out, self._lead + section)
                self._state = "text"
            else:
                for function in functions:
                    self._call(out, function)
                self._state = "after"
            self._lead = ""

    def _scan(self) -> int:
        """Where the call at the buffer's start ends (the index after its closing bracket), or -1 while it is
        open; each scan of a call resumes where the one before stopped."""
        for i in range(self._scanned, len(self._buffer)):
            char = self._buffer[i]
            if self._quote is not None:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == self._quote:
                    self._quote = None
            elif char in self._QUOTES:
                self._quote = char
            elif char == self._OPEN:
                self._depth += 1
            elif char == self._CLOSE:
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        self._scanned = len(self._buffer)
        return -1


class Llama3JsonStream(_LeadingCallStream):
    """`llama3_json`: ``{"name": ..., "parameters": {...}}`` objects, joined by ``;``."""

    _OPEN, _CLOSE, _QUOTES, _SEPARATOR = "{", "}", '"', ";"

    def _read(self, section: str) -> list[dict[str, Any]] | None:
        function = _tool_call(section, allow_type=True)
        return None if function is None else [function]


class PythonicStream(_LeadingCallStream):
    """`pythonic`: one Python list of calls, ``[f(a=1), g()]``."""

    _OPEN, _CLOSE, _QUOTES, _SEPARATOR = "[", "]", "\"'", None

    def _read(self, section: str) -> list[dict[str, Any]] | None:
        return _pythonic_calls(section)


_STREAMS: dict[str, type[ToolCallStream]] = {
    "hermes": HermesStream,
    "llama3_json": Llama3JsonStream,
    "pythonic": PythonicStream,
}
TOOL_CALL_PARSERS = tuple(_STREAMS)


def tool_call_stream(parser: str) -> ToolCallStream:
    """A new stream of the parser named (one of `TOOL_CALL_PARSERS`)."""
    return _STREAMS[parser]()


@dataclass
class ParsedMessage:
    content: str | None
    tool_calls: list[dict[str, Any]]  # OpenAI tool_call objects (id, type, function)


def parse_tool_calls(text: str, parser: str) -> ParsedMessage:
    """The assistant message of a full response (the parser's stream fed the whole text)."""
    delta = tool_call_stream(parser).feed(text, final=True)
    calls = [{"id": tool_call_id(), "type": "function", "function": f} for f in delta.tool_calls]
    return ParsedMessage(delta.content if delta.content or not calls else None, calls)
