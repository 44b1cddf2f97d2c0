"""Tool calls in a model's text: the server's `--tool-call-parser` (vLLM's flag and parser names).

Each parser reads one format:

* `hermes` (Hermes 2 Pro; Qwen2, Qwen2.5 and Qwen3 chat templates): each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``, anywhere in the text;
* `llama3_json` (Llama 3.1, 3.2 and 3.3 JSON tool calling; `llama4_json` is another name for it, as in
  vLLM): the reply is a JSON object ``{"name": ..., "parameters": {...}}``, possibly after the
  ``<|python_tag|>`` token; several calls are separated by ``;``;
* `pythonic` (Llama 3.2 and Llama 4 zero-shot function calling; also named `llama4_pythonic`): the reply is
  a Python list of calls, ``[get_weather(city="Paris", unit="c"), now()]``, keyword arguments only, each
  value a Python literal; Llama 4 may write it between ``<|python_start|>`` and ``<|python_end|>``.

One algorithm per parser serves the full response and the stream, so the two agree whatever the stream's
chunking: a `ToolCallStream` is fed the text as it comes and releases content and tool calls as soon as they
are certain, and `parse_tool_calls` is that stream fed the whole text at once. The rules:

* a JSON call (`hermes`, `llama3_json`) is an object of a non-empty string ``name`` and its arguments (an
  object, or a JSON string of one) under ``arguments`` or ``parameters``, and no other key (`llama3_json`
  also allows ``"type": "function"``); NaN and Infinity are not JSON;
* a pythonic call is ``name(key=value, ...)``: a plain name, no positional or repeated arguments, values
  that are Python literals convertible to JSON (str keys, no NaN, sets or bytes), read with `ast`, never
  evaluated; a list with anything else in it (or an empty list) holds no calls;
* a call the response could not carry is not one: arguments with an integer too long for Python to write,
  or a lone surrogate (which a JSON or Python ``\\ud800`` escape reads as) in the name or arguments;
* whatever is not a call stays in the content as written (tags, ``<|python_tag|>``, separators and all,
  but for the ``;`` below), so nothing the model wrote is lost;
* `hermes`: text outside the tags is content; a block left open at the end (the request ran out of
  tokens) counts as closed there;
* `llama3_json` and `pythonic`: calls are read only where the reply starts and right after each
  ``<|python_tag|>`` (for `pythonic`, also ``<|python_start|>``), where the text (after whitespace) must
  open the call (``{``, ``[``); the call ends at its matching bracket (brackets inside strings, Python's
  triple-quoted ones too, do not count) and what follows is content, except, for `llama3_json`, a ``;``
  followed by another call (a ``;`` followed only by whitespace, the end or ``<|python_tag|>`` is
  dropped), and, after calls opened by ``<|python_start|>``, the ``<|python_end|>`` closing them (dropped);
  a call still open at the end (cut short) is content;
* text after the bracket that no call can start with is content as soon as it shows (not held until its
  bracket closes): for `pythonic` the list must start ``[`` name ``(``; for `llama3_json` the object's first
  key must be one a call has (``name``, ``type``, ``parameters``, ``arguments``); a tag later in such text
  opens calls as anywhere in content;
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
_ARGUMENT_KEYS = ("arguments", "parameters")


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_function(name: str, arguments: dict[str, Any] | str) -> dict[str, str] | None:
    """The OpenAI `function` object of a call, its arguments as a JSON string (a string given is kept as
    written), or None when the response could not carry it: an integer too long for Python to write
    (`sys.set_int_max_str_digits`), or a lone surrogate (a JSON ``\\ud800`` escape reads as one) that no UTF-8
    response can hold. The model's text itself stays encodable: the escape is plain ASCII there."""
    try:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        name.encode("utf-8")
        text.encode("utf-8")
    except ValueError:  # UnicodeEncodeError is one
        return None
    return {"name": name, "arguments": text}


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
    if len(keys) != 1 or not keys <= set(_ARGUMENT_KEYS):
        return None  # no arguments, or more than the call: kept as the model wrote it
    arguments = call[keys.pop()]
    if isinstance(arguments, str):  # a model that writes the arguments as a JSON string: kept as written
        try:
            if not isinstance(strict_json(arguments), dict):
                return None
        except ValueError:
            return None
    elif not isinstance(arguments, dict):
        return None
    return tool_function(call["name"], arguments)


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
        function = tool_function(call.func.id, arguments) if _is_json(arguments) else None
        if function is None:
            return None
        functions.append(function)
    return functions


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _is_partial(text: str, tag: str) -> bool:
    """Whether `text` is a proper prefix of `tag` (more text may complete it)."""
    return len(text) < len(tag) and tag.startswith(text)


@dataclass
class ToolCallDelta:
    """What one `feed` releases: content text and complete tool calls (OpenAI `function` objects)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallStream(ABC):
    """One choice's text, fed as it is generated, read by one parser (see the module docstring for the
    rules). A subclass's `_advance` consumes what is decided of `_buffer`, all of it when `final`, and
    releases it through `_content` and `_call`.

    NOTE: a feed's work is proportional to its text (plus a bounded tail), not to the text before it: a
    model may write tens of thousands of newlines, or a long call, one token at a time, and each feed runs
    on the server's event loop. So nothing is rescanned or copied again: whitespace, a call's text and a
    block's body are kept as lists of the pieces that came, and the buffer holds only what a scan has not
    passed yet (a few characters that could still be a tag's start, or the new text)."""

    def __init__(self) -> None:
        self._buffer = ""  # text not decided yet
        self._held_space: list[str] = []  # whitespace released only if content, not a tool call, follows it
        self.num_tool_calls = 0

    def feed(self, text: str, final: bool = False) -> ToolCallDelta:
        out = ToolCallDelta()
        self._buffer += text
        self._advance(out, final)
        if final:
            assert not self._buffer, "a parser left text undecided at the end"
            if not self.num_tool_calls:
                out.content += "".join(self._held_space)
            self._held_space = []
        return out

    @abstractmethod
    def _advance(self, out: ToolCallDelta, final: bool) -> None: ...

    def _content(self, out: ToolCallDelta, text: str) -> None:
        """Release text as content, holding back its trailing whitespace (only `text` is looked at: what is
        held already is not)."""
        stripped = text.rstrip(_WHITESPACE)
        if not stripped:
            if text:
                self._held_space.append(text)
            return
        out.content += "".join(self._held_space) + stripped
        self._held_space = [text[len(stripped):]] if len(stripped) < len(text) else []

    def _call(self, out: ToolCallDelta, function: dict[str, Any]) -> None:
        """Release a tool call; the whitespace held before it goes with it."""
        self._held_space = []
        out.tool_calls.append(function)
        self.num_tool_calls += 1


class HermesStream(ToolCallStream):
    """`hermes`: ``<tool_call>`` JSON ``</tool_call>`` blocks anywhere in the text."""

    _START, _END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._inside = False  # within a <tool_call> block
        self._body: list[str] = []  # the block's text searched already; the buffer holds the rest

    def _advance(self, out: ToolCallDelta, final: bool) -> None:
        while True:
            if self._inside:
                end = self._buffer.find(self._END)
                if end < 0 and not final:
                    keep = _partial_suffix(self._buffer, self._END)
                    self._body.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return
                body = "".join(self._body) + (self._buffer if end < 0 else self._buffer[:end])
                self._buffer = "" if end < 0 else self._buffer[end + len(self._END):]
                self._inside, self._body = False, []
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
    """Llama's formats: a call opens (after whitespace) where the reply starts or right after an opening tag
    (``<|python_tag|>``), and runs to its matching bracket. A subclass names the opening tags (each with the
    tag that may close its calls, dropped after them), the brackets, the string quotes (brackets inside
    strings do not count), the separator that may join a next call (None: no next call), how the text after
    the bracket must start for a call to be possible (`_head_step`), and how a complete call's text reads
    (`_read`: its `function` objects, or None when it is not a call)."""

    _OPENERS: dict[str, str | None]
    _OPEN: str
    _CLOSE: str
    _QUOTES: str
    _TRIPLE_QUOTES: bool  # whether three quotes open a string that only three close (Python's)
    _SEPARATOR: str | None

    def __init__(self) -> None:
        super().__init__()
        # "opening": a call may open here (the reply's start, after a tag or a separator); "call": within one
        # (its text is `_section` and then the buffer); "after": just after a call (a separator or a closing
        # tag may follow); "text": content
        self._state: Literal["opening", "call", "after", "text"] = "opening"
        self._lead: list[str] = []  # the tag or separator and whitespace before a call: content unless one follows
        self._after_separator = False  # in "opening": the lead ends with a separator, dropped before a tag or the end
        self._closer: str | None = None  # the tag that closes the calls' block, dropped after them
        self._section: list[str] = []  # in "call": the call's text scanned already; the buffer holds the rest
        self._depth = 0  # the call's open brackets, scanned up to `_scanned`
        self._quote: str | None = None  # the quote (one or three characters) of the string the scan is in
        self._escaped = False
        self._scanned = 0
        self._head: bool | None = None  # whether the call's start reads as a call's: None until decided

    @abstractmethod
    def _head_step(self, char: str) -> bool | None:
        """The call's start, one character after the bracket at a time: False when no call starts so (the text
        is released as content, not held to the end), True when one may (the rest is left to `_read`), None
        while undecided. It must be False only where `_read` would find no call."""

    def _reset_head(self) -> None:
        """Called as each call opens: a subclass resets what its `_head_step` keeps."""

    @abstractmethod
    def _read(self, section: str) -> list[dict[str, Any]] | None: ...

    def _find_opener(self) -> tuple[int, str] | None:
        found = [(index, tag) for tag in self._OPENERS if (index := self._buffer.find(tag)) >= 0]
        return min(found) if found else None

    def _advance(self, out: ToolCallDelta, final: bool) -> None:
        while True:
            if self._state == "text":
                found = self._find_opener()
                if found is not None:
                    index, tag = found
                    self._content(out, self._buffer[:index])
                    self._buffer = self._buffer[index + len(tag):]
                    self._state, self._lead, self._after_separator = "opening", [tag], False
                    self._closer = self._OPENERS[tag]
                    continue
                keep = 0 if final else max(_partial_suffix(self._buffer, tag) for tag in self._OPENERS)
                self._content(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return
            if self._state in ("opening", "after"):
                rest = self._buffer.lstrip(_WHITESPACE)
                if len(rest) < len(self._buffer):  # whitespace moves to the lead: it is looked at once
                    self._lead.append(self._buffer[: len(self._buffer) - len(rest)])
                    self._buffer = rest
                if self._state == "after":
                    awaited = [self._closer] if self._closer is not None else []
                elif self._after_separator:
                    awaited = list(self._OPENERS)
                else:
                    awaited = []
                if not final and (not rest or any(_is_partial(rest, tag) for tag in awaited)):
                    return  # what comes next decides
                if self._state == "after":
                    self._after_call(out, rest)
                elif rest.startswith(self._OPEN):
                    self._state, self._section, self._buffer = "call", [self._OPEN], rest[len(self._OPEN):]
                    self._depth, self._quote, self._escaped, self._scanned, self._head = 1, None, False, 0, None
                    self._reset_head()
                elif self._after_separator and (not rest or any(rest.startswith(tag) for tag in self._OPENERS)):
                    self._state, self._lead = "text", []  # a separator with no call after it: dropped
                else:  # no call here: the tag or separator is content, and so is what follows
                    self._content(out, "".join(self._lead))
                    self._state, self._lead, self._closer = "text", [], None
                continue
            end = self._scan(final)  # state "call"
            if self._head is False:  # not a call's start: the lead is content, and so is the text from the bracket
                self._content(out, "".join(self._lead))
                self._buffer = "".join(self._section) + self._buffer
                self._state, self._lead, self._closer, self._section = "text", [], None, []
                continue
            if end is None and not final:  # what is scanned moves out of the buffer, which new text extends
                self._section.append(self._buffer[: self._scanned])
                self._buffer, self._scanned = self._buffer[self._scanned:], 0
                return
            section = "".join(self._section) + (self._buffer if end is None else self._buffer[:end])
            self._buffer, self._section = "" if end is None else self._buffer[end:], []
            functions = None if end is None else self._read(section)
            if functions is None:  # not a call (or cut short): content, as written
                self._content(out, "".join(self._lead) + section)
                self._state, self._closer = "text", None
            else:
                for function in functions:
                    self._call(out, function)
                self._state = "after"
            self._lead = []

    def _after_call(self, out: ToolCallDelta, rest: str) -> None:
        """State "after", `rest` the buffer after the whitespace (in the lead)."""
        if self._closer is not None and rest.startswith(self._closer):  # the block's end: dropped with the space
            self._buffer, self._lead, self._closer = rest[len(self._closer):], [], None
        elif self._SEPARATOR is not None and rest.startswith(self._SEPARATOR):
            self._lead.append(self._SEPARATOR)
            self._buffer = rest[len(self._SEPARATOR):]
            self._state, self._after_separator = "opening", True
        else:
            self._content(out, "".join(self._lead))
            self._state, self._lead, self._closer = "text", [], None

    def _scan(self, final: bool) -> int | None:
        """Where the call ends in the buffer (the index after its closing bracket; the buffer continues
        `_section`, which starts with the opening bracket), or None while it is open or once its start reads as
        no call's (`_head` False); each scan resumes where the one before stopped. Not `final`, it stops before
        a quote that more text could make a triple one."""
        buffer, i = self._buffer, self._scanned
        while i < len(buffer):
            char = buffer[i]
            if self._TRIPLE_QUOTES and not final and char in self._QUOTES and self._quote in (None, char * 3):
                left = len(buffer) - i
                if left < 3 and not self._escaped and buffer[i:] == char * left:
                    self._scanned = i
                    return None  # one or two quotes so far: the next characters decide whether they are three
            if self._head is None:
                self._head = self._head_step(char)
                if self._head is False:
                    return None
            if self._quote is not None:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif buffer.startswith(self._quote, i):
                    i += len(self._quote) - 1
                    self._quote = None
            elif char in self._QUOTES:
                self._quote = char * 3 if self._TRIPLE_QUOTES and buffer.startswith(char * 3, i) else char
                i += len(self._quote) - 1
            elif char == self._OPEN:
                self._depth += 1
            elif char == self._CLOSE:
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
            i += 1
        self._scanned = len(buffer)
        return None


class Llama3JsonStream(_LeadingCallStream):
    """`llama3_json`: ``{"name": ..., "parameters": {...}}`` objects, joined by ``;``."""

    _OPENERS = {_PYTHON_TAG: None}
    _OPEN, _CLOSE, _QUOTES, _TRIPLE_QUOTES, _SEPARATOR = "{", "}", '"', False, ";"
    _FIRST_KEYS = ("name", "type", *_ARGUMENT_KEYS)  # a call has no other key, so it starts with one of these

    def __init__(self) -> None:
        super().__init__()
        self._first_key: str | None = None  # the first key's characters so far (None: before its quote)

    def _reset_head(self) -> None:
        self._first_key = None

    def _head_step(self, char: str) -> bool | None:
        if self._first_key is None:
            if char in _WHITESPACE:
                return None
            if char != '"':
                return False
            self._first_key = ""
            return None
        if char == "\\":
            return True  # an escape in the key: left to the JSON reader
        if char == '"':
            return self._first_key in self._FIRST_KEYS
        self._first_key += char
        return None if any(key.startswith(self._first_key) for key in self._FIRST_KEYS) else False

    def _read(self, section: str) -> list[dict[str, Any]] | None:
        function = _tool_call(section, allow_type=True)
        return None if function is None else [function]


class PythonicStream(_LeadingCallStream):
    """`pythonic`: one Python list of calls, ``[f(a=1), g()]``; Llama 4 may wrap it in ``<|python_start|>``
    and ``<|python_end|>``."""

    _OPENERS = {_PYTHON_TAG: None, "<|python_start|>": "<|python_end|>"}
    _OPEN, _CLOSE, _QUOTES, _TRIPLE_QUOTES, _SEPARATOR = "[", "]", "\"'", True, None
    _SPACE = " \t\n\r\f"  # Python's whitespace within brackets

    def __init__(self) -> None:
        super().__init__()
        self._head_phase: Literal["before name", "name", "after name"] = "before name"

    def _reset_head(self) -> None:
        self._head_phase = "before name"

    def _head_step(self, char: str) -> bool | None:
        """The list must start with a call of a plain name: ``[`` name ``(``, whitespace around the name."""
        if char in "(#\\":  # the call's parenthesis, or a comment, a line continuation, a name in parentheses:
            return True  # the rest is left to `ast`
        if char in self._SPACE:
            if self._head_phase == "name":
                self._head_phase = "after name"
            return None
        if self._head_phase == "before name" and char.isidentifier():
            self._head_phase = "name"
            return None
        return None if self._head_phase == "name" and ("a" + char).isidentifier() else False

    def _read(self, section: str) -> list[dict[str, Any]] | None:
        return _pythonic_calls(section)


_STREAMS: dict[str, type[ToolCallStream]] = {
    "hermes": HermesStream,
    "llama3_json": Llama3JsonStream,
    "llama4_json": Llama3JsonStream,  # vLLM's name for the same format on Llama 4
    "pythonic": PythonicStream,
    "llama4_pythonic": PythonicStream,  # vLLM's name for Llama 4's (the list, maybe within <|python_start|>)
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
