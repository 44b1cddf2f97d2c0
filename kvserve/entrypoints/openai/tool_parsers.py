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
chunking: a `ToolCallStream` is fed the text as it comes and releases content and pieces of tool calls as soon
as they are certain, and `parse_tool_calls` is that stream fed the whole text at once. The rules:

* a JSON call (`hermes`, `llama3_json`) whose text starts ``{"name": "<name>", "arguments": {`` (or
  ``"parameters"``; `llama3_json` also allows ``"type": "function"`` before the arguments; any JSON spacing;
  no escape in those keys and the name) streams: the call (its name) is released there, and its arguments as
  they are written. While they are JSON they are re-written as `json.dumps` writes them (its spacing, its
  escapes, Python's reading of each number), so that a whole object comes out as it always did; from the first
  character that cannot continue JSON (NaN, a lone surrogate's escape, a stray quote) the rest of the arguments
  object is passed on as written, to its closing brace. Keys after the arguments are dropped. A call cut off
  before its arguments close keeps what was written (`last_call_cut`: the response keeps the engine's finish
  reason, "length", as OpenAI's does for arguments cut short). Once sent, a call cannot be taken back: the
  client checks its arguments, as OpenAI's API asks of every client;
* any other JSON call is read whole at its end: an object of a non-empty string ``name`` and its arguments (an
  object, or a JSON string of one) under ``arguments`` or ``parameters``, and no other key (`llama3_json`
  also allows ``"type": "function"``); NaN and Infinity are not JSON;
* a pythonic call is read whole: ``name(key=value, ...)``: a plain name, no positional or repeated
  arguments, values that are Python literals convertible to JSON (str keys, no NaN, sets or bytes), read with
  `ast`, never evaluated; a list with anything else in it (or an empty list) holds no calls;
* a call read whole that the response could not carry is not one: arguments with an integer too long for
  Python to write, or a lone surrogate (which a JSON or Python ``\\ud800`` escape reads as) in the name or
  arguments (streamed arguments keep such an escape or number as written);
* whatever is not a call stays in the content as written (tags, ``<|python_tag|>``, separators and all,
  but for the ``;`` below), so nothing the model wrote is lost;
* `hermes`: text outside the tags is content; a block left open at the end (the request ran out of
  tokens) counts as closed there; text in a block after a streamed call's object is content. A
  ``</tool_call>`` within a string of the block's JSON (a model writing about tool calls in an argument)
  is the string's text, not the block's end: it ends the block only where the block's text before it is
  not the start of a JSON object whose string it continues (outside strings, after the call object's
  closing brace, or once the text is not JSON: a stray character, an unescaped control character or
  quote that breaks it, NaN). A string left open (a model that never closes it) runs to the end of the
  response, the end tags in it included: its block is then cut short, or content, as written;
* `llama3_json` and `pythonic`: calls are read only where the reply starts and right after each
  ``<|python_tag|>`` (for `pythonic`, also ``<|python_start|>``), where the text (after whitespace) must
  open the call (``{``, ``[``); the call ends at its matching bracket (brackets inside strings, Python's
  triple-quoted ones too, do not count) and what follows is content, except, for `llama3_json`, a ``;``
  followed by another call (a ``;`` followed only by whitespace, the end or ``<|python_tag|>`` is
  dropped), and, after calls opened by ``<|python_start|>``, the ``<|python_end|>`` closing them (dropped);
  a call read whole still open at the end (cut short) is content;
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
import re
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


_HEAD_LIMIT = 512  # a call's start longer than this (a long name, whitespace) is read whole at its end
_HEAD_OPEN = re.compile(r"[ \t\n\r]*\{")
_HEAD_PAIR = re.compile(r'[ \t\n\r]*"(name|type)"[ \t\n\r]*:[ \t\n\r]*"([^"\\\x00-\x1f]*)"[ \t\n\r]*,')
_HEAD_ARGUMENTS = re.compile(r'[ \t\n\r]*"(?:arguments|parameters)"[ \t\n\r]*:[ \t\n\r]*\{')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER_LIMIT = 1000  # a longer number (a model's loop) is passed on as written, not held whole
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')  # what ends a run of a string's plain characters
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = ("true", "false", "null")


def _json_char(char: str) -> str:
    """A string's character as `json.dumps(..., ensure_ascii=False)` writes it."""
    return json.dumps(char, ensure_ascii=False)[1:-1]


class _StreamedCall:
    """One JSON call's text (hermes' block body, llama3_json's object), read as it comes so that its arguments
    stream (see the module docstring). Phases: "head" while the call's start is undecided; "whole" when it does
    not start as a streamed call does (its host reads it whole at its end, by the rules before); "arguments"
    while the arguments object is JSON, re-written as `json.dumps` writes it; "raw" from the first character
    that is not JSON, passed on as written; "tail" after the arguments object, through the call object's end
    (dropped); "done" after that end.

    NOTE: work per feed is proportional to its text (plus the bounded head): nothing is kept but the parse's
    state and an unfinished token (a number, a literal, a string escape: a few characters)."""

    def __init__(self, allow_type: bool) -> None:
        self._allow_type = allow_type  # llama3_json's "type": "function" before the arguments
        self.phase: Literal["head", "whole", "arguments", "raw", "tail", "done"] = "head"
        self._head = ""
        self.name = ""
        # "arguments": the open containers ("{" or "["), what may come next, and an unfinished token
        self._stack: list[str] = []
        self._expect: Literal["key", "key or end", "colon", "value", "value or end", "comma or end"] = "key or end"
        self._in_string = False
        self._in_key = False
        self._token = ""
        self._token_kind: Literal["", "number", "literal", "escape"] = ""
        self._space: list[str] = []  # the whitespace after a value, dropped unless "raw" follows it
        # "raw" and "tail": braces outside strings, the call object's own counted (as `_LeadingCallStream._scan`)
        self._depth = 0
        self._quoted = False
        self._escaped = False

    def feed(self, text: str) -> tuple[str, int | None]:
        """The arguments' text released by `text`, and where in `text` the call object ended (the index after
        its closing brace), None while it is open. In "head" and "whole" nothing is released; the phase tells
        whether the call has begun streaming (its `name` then set)."""
        out: list[str] = []
        start = 0
        if self.phase == "head":
            start = self._feed_head(text)
            if start is None:
                return "", None
            out.append("{")
        if self.phase == "whole":
            return "", None
        end = self._feed_body(text, start, out)
        return "".join(out), end

    def finish(self) -> tuple[str, bool]:
        """The call's text ended before its object closed (its block's end, or the reply's): the arguments'
        last text (an unfinished token, as written), and whether the arguments were cut short."""
        if self.phase == "arguments":
            token, self._token = self._token, ""
            return token, True
        return "", self.phase == "raw"

    def _feed_head(self, text: str) -> int | None:
        """Whether the call's start, with `text`, opens its arguments after its name: then the phase moves on
        and the index in `text` after the arguments' brace is returned."""
        head = self._head + text[: _HEAD_LIMIT - len(self._head)]  # the call's first characters, however they came
        opened = _HEAD_OPEN.match(head)
        seen: dict[str, str] | None = {} if opened else None
        position = opened.end() if opened else 0
        while seen is not None:
            arguments = _HEAD_ARGUMENTS.match(head, position)
            if arguments is not None:
                if "name" not in seen:
                    break
                start = arguments.end() - len(self._head)
                self.phase, self.name, self._stack, self._head = "arguments", seen["name"], ["{"], ""
                return start
            pair = _HEAD_PAIR.match(head, position)
            if pair is None or pair[1] in seen or (pair[1] == "name" and not pair[2]) or (
                    pair[1] == "type" and (not self._allow_type or pair[2] != "function")):
                break
            seen[pair[1]] = pair[2]
            position = pair.end()
        if len(head) >= _HEAD_LIMIT or (opened is None and head.lstrip(_WHITESPACE)):
            self.phase, self._head = "whole", ""
        else:
            self._head = head
        return None

    def _feed_body(self, text: str, i: int, out: list[str]) -> int | None:
        while i < len(text):
            if self.phase == "arguments":
                if self._in_string and not self._token_kind:  # a run of plain characters at once
                    stop = _STRING_STOP.search(text, i)
                    j = len(text) if stop is None else stop.start()
                    if j > i:
                        out.append(text[i:j])
                        i = j
                        continue
                if not self._json_step(text[i], out):
                    self._to_raw(text[i], out)
                elif self._space and text[i] not in _WHITESPACE:  # JSON goes on: its spacing is json.dumps'
                    self._space = []
                i += 1
                continue
            if self.phase == "done":
                return i
            char = text[i]
            i += 1
            if self.phase == "raw":
                out.append(char)
            self._raw_step(char)
            if self.phase == "done":
                return i
        return i if self.phase == "done" else None

    def _raw_step(self, char: str) -> None:
        """A brace counted outside strings; the arguments object's close ends "raw", the call's "tail"."""
        if self._quoted:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._quoted = False
        elif char == '"':
            self._quoted = True
        elif char == "{":
            self._depth += 1
        elif char == "}":
            self._depth -= 1
            if self._depth == 1 and self.phase == "raw":
                self.phase = "tail"
            elif self._depth == 0:
                self.phase = "done"

    def _to_raw(self, char: str, out: list[str]) -> None:
        """`char` is not JSON here: the whitespace before it (or the unfinished token) and it are passed on as
        written, and counted from the structure the JSON so far has (each open object a brace, the call's own
        too). The whitespace is kept so that two values written apart do not come out as one (``1 2``, ``12``)."""
        self.phase = "raw"
        out.append("".join(self._space))
        self._space = []
        self._depth = 1 + self._stack.count("{")
        self._quoted, self._escaped = self._in_string, False
        token, self._token, self._token_kind = self._token, "", ""
        for c in token + char:
            out.append(c)
            self._raw_step(c)

    def _json_step(self, char: str, out: list[str]) -> bool:
        """One character of the arguments while they are JSON; False when it cannot continue them."""
        kind = self._token_kind
        if kind == "escape":
            return self._escape_step(char, out)
        if self._in_string:
            if char == "\\":
                self._token, self._token_kind = char, "escape"
                return True
            if char != '"':
                return False  # a control character (the plain ones went in runs)
            out.append(char)
            self._in_string = False
            self._expect = "colon" if self._in_key else "comma or end"
            return True
        if kind == "number":
            if char in _NUMBER_CHARS and len(self._token) < _NUMBER_LIMIT:
                self._token += char
                return True
            if not self._end_number(out):
                return False
        elif kind == "literal":
            self._token += char
            if self._token in _LITERALS:
                out.append(self._token)
                self._token, self._token_kind, self._expect = "", "", "comma or end"
                return True
            if any(literal.startswith(self._token) for literal in _LITERALS):
                return True
            self._token = self._token[:-1]  # `char` goes on raw after the token
            return False
        if char in _WHITESPACE:
            if self._expect == "comma or end":  # after a value: kept until what follows shows it is JSON
                self._space.append(char)
            return True
        expect = self._expect
        if expect in ("key", "key or end") and char == '"':
            out.append(char)
            self._in_string = self._in_key = True
        elif expect == "colon" and char == ":":
            out.append(": ")
            self._expect = "value"
        elif expect == "comma or end" and char == ",":
            out.append(", ")
            self._expect = "key" if self._stack[-1] == "{" else "value"
        elif (expect in ("key or end", "comma or end") and char == "}" and self._stack[-1:] == ["{"]) or (
                expect in ("value or end", "comma or end") and char == "]" and self._stack[-1:] == ["["]):
            out.append(char)
            self._stack.pop()
            self._expect = "comma or end"
            if not self._stack:  # the arguments' object closed: the rest of the call's object is dropped
                self.phase, self._depth, self._quoted, self._escaped = "tail", 1, False, False
        elif expect in ("value", "value or end"):
            if char in "{[":
                out.append(char)
                self._stack.append(char)
                self._expect = "key or end" if char == "{" else "value or end"
            elif char == '"':
                out.append(char)
                self._in_string, self._in_key = True, False
            elif char == "-" or char.isdigit():
                self._token, self._token_kind = char, "number"
            elif char in "tfn":
                self._token, self._token_kind = char, "literal"
            else:
                return False
        else:
            return False
        return True

    def _end_number(self, out: list[str]) -> bool:
        """The number token ends (a character that is not a number's follows): written as `json.dumps` writes
        the number Python reads; False when it is no JSON number or one Python will not write (too many
        digits)."""
        token = self._token
        if _NUMBER.fullmatch(token) is None:
            return False
        try:
            if any(c in token for c in ".eE"):
                value = float(token)
                written = repr(value) if math.isfinite(value) else token
            else:
                written = str(int(token))
        except ValueError:
            return False
        out.append(written)
        self._token, self._token_kind, self._expect = "", "", "comma or end"
        return True

    def _escape_step(self, char: str, out: list[str]) -> bool:
        """A string's escape, ``\\x`` or ``\\uXXXX`` (a surrogate pair two of them), written decoded as
        `json.dumps` writes its character; a lone surrogate is not written (no UTF-8 response holds it)."""
        token = self._token = self._token + char
        if len(token) == 2:
            if char in _SIMPLE_ESCAPES:
                out.append(_json_char(_SIMPLE_ESCAPES[char]))
                self._token, self._token_kind = "", ""
                return True
            return char == "u" or self._bad_token()
        if len(token) == 7 or len(token) == 8:  # the second escape of a pair
            return char == "\\u"[len(token) - 7] or self._bad_token()
        if char not in _HEX:
            return self._bad_token()
        if len(token) == 6:
            code = int(token[2:], 16)
            if 0xD800 <= code < 0xDC00:
                return True  # a high surrogate: its low one must follow
            if 0xDC00 <= code < 0xE000:
                return self._bad_token()
            out.append(_json_char(chr(code)))
            self._token, self._token_kind = "", ""
        elif len(token) == 12:
            low = int(token[8:], 16)
            if not 0xDC00 <= low < 0xE000:
                return self._bad_token()
            high = int(token[2:6], 16)
            out.append(chr(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00)))
            self._token, self._token_kind = "", ""
        return True

    def _bad_token(self) -> bool:
        """The escape token, with its last character, is not JSON: that character goes on raw after the rest."""
        self._token = self._token[:-1]
        return False


class _JsonScan:
    """Whether a hermes block's text, fed as it comes, is so far the start of a JSON object (whitespace, the
    object, whitespace), and whether it ends within one of the object's strings (`in_string`): a
    ``</tool_call>`` there is the string's text. Looser than the streamed arguments' reading (the
    characters a string's escapes write are not looked at), strict about the grammar.

    NOTE: work per feed is proportional to its text: plain runs of a string are skipped at once, and once the
    text is not JSON nothing more is looked at."""

    def __init__(self) -> None:
        self.valid = True
        self._stack: list[str] = []
        self._expect: Literal["object", "key", "key or end", "colon", "value", "value or end", "comma or end",
                              "after"] = "object"
        self._in_string = False
        self._in_key = False
        self._escape = 0  # the characters of an unfinished escape seen (``\`` 1, ``\u`` 2, ``\uXXX`` 5)
        self._token: list[str] = []  # an unfinished number or literal

    @property
    def in_string(self) -> bool:
        """Whether the text so far is JSON and ends within a string (not within an escape)."""
        return self.valid and self._in_string and not self._escape

    def feed(self, text: str) -> None:
        i = 0
        while self.valid and i < len(text):
            if self._in_string and not self._escape:  # a run of plain characters at once
                stop = _STRING_STOP.search(text, i)
                j = len(text) if stop is None else stop.start()
                if j > i:
                    i = j
                    continue
            self.valid = self._step(text[i])
            i += 1

    def _step(self, char: str) -> bool:
        if self._escape:
            if self._escape == 1 and char in _SIMPLE_ESCAPES:
                self._escape = 0
            elif (self._escape == 1 and char == "u") or (2 <= self._escape < 5 and char in _HEX):
                self._escape += 1
            elif self._escape == 5 and char in _HEX:
                self._escape = 0
            else:
                return False
            return True
        if self._in_string:
            if char == "\\":
                self._escape = 1
            elif char == '"':
                self._in_string = False
                self._expect = "colon" if self._in_key else "comma or end"
            else:
                return False  # a control character
            return True
        if self._token:
            if char in _NUMBER_CHARS or char in "aflnrstu":
                if len(self._token) >= _NUMBER_LIMIT:
                    return False
                self._token.append(char)
                return True
            token = "".join(self._token)
            self._token = []
            if token not in _LITERALS and _NUMBER.fullmatch(token) is None:
                return False
            self._expect = "comma or end"
        if char in _WHITESPACE:
            return True
        expect = self._expect
        if expect == "object" and char == "{":
            self._stack.append(char)
            self._expect = "key or end"
        elif expect in ("key", "key or end") and char == '"':
            self._in_string = self._in_key = True
        elif expect == "colon" and char == ":":
            self._expect = "value"
        elif expect == "comma or end" and char == ",":
            self._expect = "key" if self._stack[-1] == "{" else "value"
        elif (expect in ("key or end", "comma or end") and char == "}" and self._stack[-1:] == ["{"]) or (
                expect in ("value or end", "comma or end") and char == "]" and self._stack[-1:] == ["["]):
            self._stack.pop()
            self._expect = "comma or end" if self._stack else "after"
        elif expect in ("value", "value or end"):
            if char in "{[":
                self._stack.append(char)
                self._expect = "key or end" if char == "{" else "value or end"
            elif char == '"':
                self._in_string, self._in_key = True, False
            elif char == "-" or char.isdigit() or char in "tfn":
                self._token = [char]
            else:
                return False
        else:
            return False
        return True


@dataclass
class ToolCallPiece:
    """Part of a tool call: its first piece has its `name` (None on the others); `arguments` is the next text of
    its arguments (a JSON string when all pieces are joined)."""

    index: int  # the call's index among the response's calls
    name: str | None
    arguments: str
    content_before: int = 0  # how much of its delta's content the model wrote before it (the rest, after it)


@dataclass
class ToolCallDelta:
    """What one `feed` releases: content text and pieces of tool calls, in order (one piece per call at most);
    each piece's `content_before` places it within the content, as the model wrote them."""

    content: str = ""
    tool_calls: list[ToolCallPiece] = field(default_factory=list)


def joined_calls(pieces: list[ToolCallPiece]) -> list[dict[str, str]]:
    """The OpenAI `function` objects of the calls that `pieces` (all of them, in order) make."""
    functions: list[dict[str, str]] = []
    for piece in pieces:
        if piece.name is not None:
            functions.append({"name": piece.name, "arguments": piece.arguments})
        else:
            functions[piece.index]["arguments"] += piece.arguments
    return functions


class ToolCallStream(ABC):
    """One choice's text, fed as it is generated, read by one parser (see the module docstring for the
    rules). A subclass's `_advance` consumes what is decided of `_buffer`, all of it when `final`, and
    releases it through `_content`, and `_call` (a whole call) or `_start_call` and `_arguments` (a streamed one).

    NOTE: a feed's work is proportional to its text (plus a bounded tail), not to the text before it: a
    model may write tens of thousands of newlines, or a long call, one token at a time, and each feed runs
    on the server's event loop. So nothing is rescanned or copied again: whitespace, a call's text and a
    block's body are kept as lists of the pieces that came, and the buffer holds only what a scan has not
    passed yet (a few characters that could still be a tag's start, or the new text)."""

    def __init__(self) -> None:
        self._buffer = ""  # text not decided yet
        self._held_space: list[str] = []  # whitespace released only if content, not a tool call, follows it
        self.num_tool_calls = 0
        self.last_call_cut = False  # whether the last call's arguments were cut off by the end of the text

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
        """Release a whole tool call; the whitespace held before it goes with it."""
        self._start_call(out, function["name"])
        self._arguments(out, function["arguments"])

    def _start_call(self, out: ToolCallDelta, name: str) -> None:
        """Release a tool call's start (its arguments follow); the whitespace held before it goes with it."""
        self._held_space = []
        out.tool_calls.append(ToolCallPiece(self.num_tool_calls, name, "", len(out.content)))
        self.num_tool_calls += 1
        self.last_call_cut = False

    def _arguments(self, out: ToolCallDelta, text: str) -> None:
        """Release more of the last call's arguments."""
        if not text:
            return
        if out.tool_calls and out.tool_calls[-1].index == self.num_tool_calls - 1:
            out.tool_calls[-1].arguments += text
        else:
            out.tool_calls.append(ToolCallPiece(self.num_tool_calls - 1, None, text, len(out.content)))

    def _streamed_text(self, out: ToolCallDelta, call: _StreamedCall, text: str) -> int | None:
        """Feed `text` of a call's text to its reader, releasing the call's start when it begins to stream and
        its arguments as they come; where in `text` the call object ended (None while open)."""
        streaming = call.phase not in ("head", "whole")
        arguments, end = call.feed(text)
        if not streaming and call.phase not in ("head", "whole"):
            self._start_call(out, call.name)
        self._arguments(out, arguments)
        return end

    def _end_streamed(self, out: ToolCallDelta, call: _StreamedCall) -> None:
        """A streamed call's text ended before its object closed (its block's end, or the reply's)."""
        arguments, self.last_call_cut = call.finish()
        self._arguments(out, arguments)


class HermesStream(ToolCallStream):
    """`hermes`: ``<tool_call>`` JSON ``</tool_call>`` blocks anywhere in the text."""

    _START, _END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._inside = False  # within a <tool_call> block
        self._body: list[str] = []  # the block's text searched already, while it may be read whole
        self._reader = _StreamedCall(allow_type=False)  # the block's call, streamed once it begins as one
        self._trailing: list[str] = []  # the block's text after a streamed call's object
        self._json = _JsonScan()  # the block's text as JSON: whether an end tag is within a string

    def _advance(self, out: ToolCallDelta, final: bool) -> None:
        while True:
            if self._inside:
                end = self._buffer.find(self._END)
                if end >= 0:  # the text before the tag decides whether it is the block's end
                    self._block_text(out, self._buffer[:end])
                    self._buffer = self._buffer[end + len(self._END):]
                    if self._json.in_string:  # within a string of the call's JSON: the string's text
                        self._block_text(out, self._END)
                    else:
                        self._end_block(out, closed=True)
                    continue
                keep = 0 if final else _partial_suffix(self._buffer, self._END)
                self._block_text(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                if not final:
                    return
                self._end_block(out, closed=False)
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

    def _block_text(self, out: ToolCallDelta, text: str) -> None:
        self._json.feed(text)
        reader = self._reader
        if reader.phase in ("head", "whole"):
            self._body.append(text)
        if reader.phase == "done":
            self._trailing.append(text)
            return
        end = self._streamed_text(out, reader, text)
        if reader.phase not in ("head", "whole"):
            self._body = []
        if end is not None:
            self._trailing.append(text[end:])

    def _end_block(self, out: ToolCallDelta, closed: bool) -> None:
        """The block ended (its closing tag, or the text's end): a call streamed ends; otherwise the body is
        read whole, a call or content."""
        reader = self._reader
        if reader.phase in ("head", "whole"):
            body = "".join(self._body)
            call = _tool_call(body.strip())
            if call is not None:
                self._call(out, call)
            else:
                self._content(out, self._START + body + (self._END if closed else ""))
        else:
            if reader.phase != "done":
                self._end_streamed(out, reader)
            trailing = "".join(self._trailing)
            if trailing.strip(_WHITESPACE):  # text after the call's object, within the block: content
                self._content(out, trailing)
        self._inside, self._body, self._trailing = False, [], []
        self._reader, self._json = _StreamedCall(allow_type=False), _JsonScan()


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
        # tag may follow); "text": content; "streamed": within a call whose arguments stream (`_reader` reads it)
        self._state: Literal["opening", "call", "streamed", "after", "text"] = "opening"
        self._lead: list[str] = []  # the tag or separator and whitespace before a call: content unless one follows
        self._after_separator = False  # in "opening": the lead ends with a separator, dropped before a tag or the end
        self._closer: str | None = None  # the tag that closes the calls' block, dropped after them
        self._section: list[str] = []  # in "call": the call's text scanned already; the buffer holds the rest
        self._depth = 0  # the call's open brackets, scanned up to `_scanned`
        self._quote: str | None = None  # the quote (one or three characters) of the string the scan is in
        self._escaped = False
        self._scanned = 0
        self._head: bool | None = None  # whether the call's start reads as a call's: None until decided
        self._reader: _StreamedCall | None = None  # the call's reader, for a format whose arguments stream

    @abstractmethod
    def _head_step(self, char: str) -> bool | None:
        """The call's start, one character after the bracket at a time: False when no call starts so (the text
        is released as content, not held to the end), True when one may (the rest is left to `_read`), None
        while undecided. It must be False only where `_read` would find no call."""

    def _reset_head(self) -> None:
        """Called as each call opens: a subclass resets what its `_head_step` keeps."""

    def _new_reader(self) -> _StreamedCall | None:
        """A reader for a call opening now, when the format's arguments stream (None: each call is read whole)."""
        return None

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
                    self._reader = self._new_reader()
                    if self._reader is not None:
                        self._reader.feed(self._OPEN)
                elif self._after_separator and (not rest or any(rest.startswith(tag) for tag in self._OPENERS)):
                    self._state, self._lead = "text", []  # a separator with no call after it: dropped
                else:  # no call here: the tag or separator is content, and so is what follows
                    self._content(out, "".join(self._lead))
                    self._state, self._lead, self._closer = "text", [], None
                continue
            if self._state == "streamed":
                assert self._reader is not None
                end = self._streamed_text(out, self._reader, self._buffer)
                if end is not None:
                    self._buffer, self._state = self._buffer[end:], "after"
                    continue
                self._buffer = ""
                if final:
                    self._end_streamed(out, self._reader)
                    self._state, self._closer = "text", None
                    continue
                return
            # state "call"
            reader = self._reader
            if reader is not None and reader.phase == "head":  # the reader sees what the scan has not
                end = self._streamed_text(out, reader, self._buffer[self._scanned:])
                if reader.phase != "whole" and reader.phase != "head":  # the call streams from here
                    self._buffer = "" if end is None else self._buffer[self._scanned + end:]
                    self._lead, self._section, self._scanned = [], [], 0
                    self._state = "streamed" if end is None else "after"
                    continue
            end = self._scan(final)
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

    def _new_reader(self) -> _StreamedCall | None:
        return _StreamedCall(allow_type=True)

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
    last_call_cut: bool = False  # the last call's arguments were cut off by the end of the text


def parse_tool_calls(text: str, parser: str) -> ParsedMessage:
    """The assistant message of a full response (the parser's stream fed the whole text)."""
    stream = tool_call_stream(parser)
    delta = stream.feed(text, final=True)
    calls = [{"id": tool_call_id(), "type": "function", "function": f} for f in joined_calls(delta.tool_calls)]
    return ParsedMessage(delta.content if delta.content or not calls else None, calls, stream.last_call_cut)
