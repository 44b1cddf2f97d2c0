"""POST /v1/responses: OpenAI's Responses API, served over the chat path as vLLM serves it.

A request's input items (after the stored conversation of its `previous_response_id`) become chat messages,
its `instructions` a system message first; `tools`, `tool_choice`, `text.format` and `max_output_tokens`
become the chat request's fields, and the chat path validates, renders and generates (`prepare_chat`). Its
deltas (`_choice_deltas`: the reasoning split off by --reasoning-parser, tool calls read by --tool-call-parser
or forced by tool_choice) become the Responses API's output items: a `reasoning` item, a `message` with one
`output_text` part, `function_call` items. A stream sends the API's events (response.created, ...,
response.completed); a response that is not streamed is the one its stream would end with, so the two agree.

Stored responses are off by default, as in vLLM: a request's `store: true` (OpenAI's default) is served without
storing, and the response says `store: false`. KVSERVE_ENABLE_RESPONSES_API_STORE=1 (or vLLM's
VLLM_ENABLE_RESPONSES_API_STORE=1) keeps the last KVSERVE_RESPONSES_API_STORE_SIZE responses in the API process's
memory, for GET and DELETE /v1/responses/{id} and for `previous_response_id`. A response is stored from its
start: `in_progress` while it generates, then `completed` or `incomplete`, `failed` when it fails, `cancelled`
when its client leaves first; only a completed or incomplete one continues a conversation.

Not served, each refused with a 400 naming its field: built-in tools (web_search, file_search, ...), images,
files and audio in the input, item references, reusable prompts (`prompt`), `conversation`, background mode,
`truncation: "auto"`, `n`.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvserve.entrypoints.openai.errors import BadRequestError, NotFoundError, OpenAIError
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest, SamplingFields
from kvserve.entrypoints.openai.reasoning_parsers import ReasoningStream
from kvserve.entrypoints.openai.serving_chat import PreparedChat, _choice_deltas, prepare_chat
from kvserve.entrypoints.openai.serving_common import ServingContext, closing_updates, engine_error
from kvserve.entrypoints.openai.tool_parsers import ToolCallStream

# The chat request's field names that the Responses API names otherwise (in errors' params and messages).
_RESPONSES_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "response_format": "text.format"}
# SamplingFields the Responses API does not take: refused when set (n, response_format) or read otherwise.
# (`model` goes on: the chat path answers a model this server does not serve with vLLM's 404.)
_NOT_PASSED = {"n", "response_format", "stream", "stream_options"}
_UNSERVED_FIELDS = {  # OpenAI request fields kvserve does not implement -> why
    "prompt": "reusable prompts are not stored here; send the input itself",
    "conversation": "conversations are not stored here; use previous_response_id (with the store on) or send "
                    "the whole input",
}


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object, as returned
    items: list[dict[str, Any]]  # the conversation as input items (instructions not included), its output last


class ResponseStore:
    """The last `capacity` responses created with `store` (oldest dropped first), in this API process."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the responses store needs room for at least one response, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        assert entry.body["id"] == response_id, (response_id, entry.body["id"])
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        assert len(self._entries) <= self.capacity  # (check() walks every entry: for tests)

    def reserve(self, response_id: str, entry: StoredResponse) -> bool:
        """Stores `entry` (a response just started) unless the id is taken; False when it is."""
        if response_id in self._entries:
            return False
        self.put(response_id, entry)
        return True

    def settle(self, response_id: str, reserved: StoredResponse, entry: StoredResponse) -> None:
        """Replaces the `reserved` entry with `entry` (the response's end) where it is still stored: a response
        deleted (or dropped for room) while it ran stays gone."""
        if self._entries.get(response_id) is reserved:
            self._entries[response_id] = entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def check(self) -> None:
        """Invariants: within capacity; every entry's body carries its own id."""
        assert len(self._entries) <= self.capacity, (len(self._entries), self.capacity)
        for response_id, entry in self._entries.items():
            assert entry.body["id"] == response_id, (response_id, entry.body["id"])


def _not_stored(ctx: ServingContext, response_id: str, param: str) -> NotFoundError:
    why = "" if ctx.responses_store is not None else (
        " (this server stores no responses: start it with KVSERVE_ENABLE_RESPONSES_API_STORE=1 to keep them)")
    return NotFoundError(f"no response with id {response_id!r} is stored on this server{why}", param)


def _with_id(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as the store keeps it: with an id (the client's, or a new one, as OpenAI gives input items
    one) and a message's string content as a text part, so GET .../input_items lists it as the API types it."""
    kind = item.get("type", "message" if "role" in item else None)
    needs_id = not isinstance(item.get("id"), str)
    if not needs_id and (kind != "message" or ("type" in item and not isinstance(item.get("content"), str))):
        return item
    item = dict(item)
    if needs_id:
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}.get(
            str(kind), "item")
        item["id"] = _item_id(prefix)
    if kind == "message":
        item.setdefault("type", "message")
        if isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
    return item


def input_items_page(entry: StoredResponse, after: str | None, limit: int, order: str) -> dict[str, Any]:
    """GET /v1/responses/{id}/input_items: the items the response was generated from (those of its
    previous_response_id's conversation first), `order` "asc" (oldest first) or "desc", `limit` of them after
    the item `after`, as OpenAI's list object."""
    items = entry.items[: len(entry.items) - len(entry.body["output"])]
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise NotFoundError(f"no input item with id {after!r} in response {entry.body['id']!r}", "after")
        items = items[ids.index(after) + 1:]
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}


def stored_response(ctx: ServingContext, response_id: str) -> StoredResponse:
    """GET / DELETE /v1/responses/{id}: the stored response, or a 404."""
    entry = ctx.responses_store.get(response_id) if ctx.responses_store is not None else None
    if entry is None:
        raise _not_stored(ctx, response_id, "response_id")
    return entry


# ------------------------------------------------------------------------------------------ the request


@dataclass
class PreparedResponse:
    # the chat path's request: its request_id is the response's id, and its model, created and max_tool_calls
    # are the response's
    chat: PreparedChat
    request: ResponsesRequest
    items: list[dict[str, Any]]  # the conversation's input items (stored ones first), for the store
    store: bool  # whether the response is stored (the request's `store` with the store on)
    logprobs: bool  # output_text parts carry their tokens' logprobs

    @property
    def response_id(self) -> str:
        return self.chat.request_id


def _content_text(content: Any, where: str) -> str:
    """A message item's content (a string, or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequestError(f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise BadRequestError(f"{where}.content[{k}] is {kind!r}: this server takes text only", "input")
        else:
            raise BadRequestError(f"{where}.content[{k}] must be an input_text or output_text part with its text "
                                  f"as a string", "input")
    return "\n".join(texts)


def _string_field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise BadRequestError(f"{where} needs {name} as a string", "input")
    return value


def input_messages(items: list[Any], first_new: int = 0) -> list[dict[str, Any]]:
    """The chat messages of a conversation's input items: messages (developer as system), function calls (one
    assistant turn for the calls that follow its text), their outputs (tool messages) and reasoning (the next
    assistant turn's `reasoning`, which templates such as Qwen3's show in tool loops; a reasoning item with no
    assistant message or call after it, as a response cut while thinking, is an assistant turn of its own).
    Items before `first_new` come from the store; errors name the request's items by their index in `input`."""
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    open_turn: dict[str, Any] | None = None  # the assistant turn that the next function calls join

    def assistant(content: str | None) -> dict[str, Any]:
        nonlocal reasoning
        turn: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            turn["reasoning"] = reasoning
            reasoning = None
        messages.append(turn)
        return turn

    def flush_reasoning() -> None:
        """A reasoning item no assistant message or call followed: its own assistant turn (none if empty, as
        one whose reasoning is only encrypted, from another server)."""
        nonlocal reasoning
        if reasoning:
            assistant("")
        reasoning = None

    for position, item in enumerate(items):
        where = f"input[{position - first_new}]" if position >= first_new else "the stored conversation"
        if not isinstance(item, dict):
            raise BadRequestError(f"{where} must be an object (a message or an item)", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            text = _content_text(item.get("content"), where)
            if role == "assistant":
                open_turn = assistant(text)
                continue
            if role not in ("user", "system", "developer"):
                raise BadRequestError(f"{where} has role {role!r}: a message's role is user, assistant, system or "
                                      f"developer", "input")
            flush_reasoning()  # a turn that only reasoned (cut while thinking) is its own turn
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": _string_field(item, "call_id", where), "type": "function",
                    "function": {"name": _string_field(item, "name", where),
                                 "arguments": _string_field(item, "arguments", where)}}
            if open_turn is None or reasoning is not None:
                open_turn = assistant(None)
            open_turn.setdefault("tool_calls", []).append(call)
            continue
        elif kind == "function_call_output":
            flush_reasoning()
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, where)
            messages.append({"role": "tool", "tool_call_id": _string_field(item, "call_id", where),
                             "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise BadRequestError(f"{where} (reasoning) needs its content as a list of parts with text",
                                      "input")
            reasoning = "\n".join(p["text"] for p in parts)
            continue  # the assistant turn after it is a new one
        else:
            raise BadRequestError(f"{where} is of type {kind!r}: this server takes message, function_call, "
                                  f"function_call_output and reasoning items", "input")
        open_turn = None
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({"type": "function", "name", "parameters", ...}) as chat tools; chat's own
    shape ({"type": "function", "function": {...}}) is taken too. Built-in tools are refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "function")
        if kind != "function":
            raise BadRequestError(f"tools[{i}] is of type {kind!r}: only function tools are served here (no "
                                  f"built-in tools such as web_search or file_search)", "tools")
        if isinstance(tool.get("function"), dict) and "name" not in tool:
            out.append(tool)
            continue
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                    if tool.get(key) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return choice
    raise BadRequestError(f"tool_choice {json.dumps(choice)[:200]} is not served here: send \"none\", \"auto\", "
                          f"\"required\" or {{\"type\": \"function\", \"name\": ...}}", "tool_choice")


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise BadRequestError('text.format "json_schema" needs its schema (a JSON Schema object)', "text.format")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": schema,
                                                       "strict": fmt.get("strict")}}
    raise BadRequestError(f'text.format type must be "text", "json_object" or "json_schema", got {kind!r}',
                          "text.format")


def _refuse_unserved(req: ResponsesRequest) -> None:
    extra = req.model_extra or {}
    for name, why in _UNSERVED_FIELDS.items():
        if extra.get(name) is not None:
            raise BadRequestError(f"{name} is not supported by this server: {why}", name)
    if "n" in req.model_fields_set and req.n != 1:
        raise BadRequestError("n is not a Responses API field: a response has one output (use "
                              "/v1/chat/completions for several samples)", "n")
    if req.response_format is not None:
        raise BadRequestError("the Responses API sets the output's format with text.format, not response_format",
                              "response_format")
    if req.background:
        raise BadRequestError("background mode is not supported by this server", "background")
    if req.truncation not in (None, "disabled"):
        raise BadRequestError(f'truncation {req.truncation!r} is not supported: only "disabled" (an input longer '
                              f"than the model's context is refused)", "truncation")


def _responses_error(error: OpenAIError) -> OpenAIError:
    """`error` under the Responses API's field names (input for messages, ...), in its param and message."""
    message = error.message
    for chat_name, name in _RESPONSES_NAMES.items():
        message = re.sub(rf"(?<![\w.]){re.escape(chat_name)}(?!\w|\.\w)", name, message)
    renamed = type(error)(message, _RESPONSES_NAMES.get(error.param or "", error.param))
    return renamed


def prepare_response(ctx: ServingContext, req: ResponsesRequest) -> PreparedResponse:
    """Validate, build the conversation, render and tokenize (on the preparation thread). Raises OpenAIError."""
    _refuse_unserved(req)
    prior: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        entry = ctx.responses_store.get(req.previous_response_id) if ctx.responses_store is not None else None
        if entry is None:
            raise _not_stored(ctx, req.previous_response_id, "previous_response_id")
        if entry.body["status"] not in ("completed", "incomplete"):
            raise BadRequestError(f"response {req.previous_response_id!r} is {entry.body['status']}; only a "
                                  f"completed or incomplete response can be continued", "previous_response_id")
        prior = entry.items
    new_items: list[Any] = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    items = prior + new_items
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + \
        input_messages(items, len(prior))
    if not messages:
        raise BadRequestError("the input has no message to answer", "input")
    wanted_logprobs = "message.output_text.logprobs" in (req.include or []) or bool(req.top_logprobs)
    kwargs = dict(req.chat_template_kwargs or {})
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    # Unknown fields go on (a vLLM field kvserve does not implement is refused by name), but not the chat
    # request's own, which the Responses API does not have.
    fields = {name: value for name, value in (req.model_extra or {}).items()
              if name not in ChatCompletionRequest.model_fields}
    fields.update({name: getattr(req, name) for name in SamplingFields.model_fields
                   if name in req.model_fields_set and name not in _NOT_PASSED})
    fields.update(
        messages=messages, max_completion_tokens=req.max_output_tokens, tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        logprobs=wanted_logprobs, top_logprobs=req.top_logprobs if wanted_logprobs else None,
        response_format=chat_response_format(req.text), chat_template_kwargs=kwargs or None,
    )
    try:
        chat_request = ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise _responses_error(BadRequestError(f"{where}: {first.get('msg')}",
                                               str(first["loc"][0]) if first.get("loc") else None)) from None
    response_id = f"resp_{req.request_id or uuid.uuid4().hex}"
    store = req.store is not False and ctx.responses_store is not None
    if store and ctx.responses_store.get(response_id) is not None:
        raise _duplicate_id(response_id)  # (checked again when the response is stored: `ResponseRun.reserve`)
    try:
        chat = prepare_chat(ctx, chat_request, request_id=response_id)
    except OpenAIError as e:
        raise _responses_error(e) from None
    if req.max_tool_calls is not None:
        chat.max_tool_calls = min(chat.max_tool_calls or req.max_tool_calls, req.max_tool_calls)
    return PreparedResponse(chat, req, items, store=store, logprobs=wanted_logprobs)


# ------------------------------------------------------------------------------------------ the output


def _duplicate_id(response_id: str) -> BadRequestError:
    # A client's id (X-Request-Id or request_id) names the response: one already stored keeps its id.
    return BadRequestError(f"a stored response already has the id {response_id!r} (from the request's "
                           f"X-Request-Id or request_id): give this one another id, or send store false",
                           "request_id")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """The response's output items as they are written, and the events that write them. Event payloads are
    copies of the items as they stand (the items change after)."""

    def __init__(self, max_tool_calls: int | None) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item being written
        self.calls: dict[int, dict[str, Any]] = {}  # open function_call items by the chat delta's call index
        self.index_of: dict[str, int] = {}  # each item's output index, by its id
        self.dropped_calls: set[int] = set()  # calls past max_tool_calls
        self.closed_calls: set[int] = set()  # calls ended (a later call began)
        self.max_tool_calls = max_tool_calls

    def _add(self, item: dict[str, Any]) -> dict[str, Any]:
        self.index_of[item["id"]] = len(self.items)
        self.items.append(item)
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                "item": copy.deepcopy(item)}

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.index_of[item["id"]]}

    def reasoning(self, delta: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self.close("completed")
            self.open = {"id": _item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                         "status": "in_progress"}
            events.append(self._add(self.open))
            part = {"type": "reasoning_text", "text": ""}
            events.append({"type": "response.content_part.added", **self._where(self.open), "content_index": 0,
                           "part": dict(part)})
            self.open["content"].append(part)
        self.open["content"][0]["text"] += delta
        events.append({"type": "response.reasoning_text.delta", **self._where(self.open), "content_index": 0,
                       "delta": delta})
        return events

    def text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self.close("completed")
            self.open = {"id": _item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                         "content": []}
            events.append(self._add(self.open))
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append({"type": "response.content_part.added", **self._where(self.open), "content_index": 0,
                           "part": copy.deepcopy(part)})
            self.open["content"].append(part)
        part = self.open["content"][0]
        part["text"] += delta
        part["logprobs"] += logprobs
        if delta or logprobs:
            events.append({"type": "response.output_text.delta", **self._where(self.open), "content_index": 0,
                           "delta": delta, "logprobs": logprobs})
        return events

    def call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index = call["index"]
        if index in self.dropped_calls or index in self.closed_calls:
            return []
        events = []
        if index not in self.calls:
            if self.max_tool_calls is not None and sum(i["type"] == "function_call" for i in self.items) >= \
                    self.max_tool_calls:
                self.dropped_calls.add(index)
                return []
            # the item before it is done (a call before this one has all its arguments: calls come one by one)
            events += self._close_open("completed") + self._close_calls("completed")
            function = call.get("function") or {}
            item = {"id": _item_id("fc"), "type": "function_call", "call_id": call.get("id") or _item_id("call"),
                    "name": function.get("name", ""), "arguments": "", "status": "in_progress"}
            self.calls[index] = item
            events.append(self._add(item))
        item = self.calls[index]
        arguments = (call.get("function") or {}).get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append({"type": "response.function_call_arguments.delta", **self._where(item),
                           "delta": arguments})
        return events

    def _close_open(self, status: str) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        part = item["content"][0]
        where = {**self._where(item), "content_index": 0}
        if item["type"] == "reasoning":
            events = [{"type": "response.reasoning_text.done", **where, "text": part["text"]}]
        else:
            events = [{"type": "response.output_text.done", **where, "text": part["text"],
                       "logprobs": part["logprobs"]}]
        events.append({"type": "response.content_part.done", **where, "part": copy.deepcopy(part)})
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                       "item": copy.deepcopy(item)})
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """End the open items (the message or reasoning, then the calls), each with `status`."""
        return self._close_open(status) + self._close_calls(status)

    def _close_calls(self, status: str) -> list[dict[str, Any]]:
        events = []
        for item in self.calls.values():
            item["status"] = status
            events.append({"type": "response.function_call_arguments.done", **self._where(item),
                           "name": item["name"], "arguments": item["arguments"]})
            events.append({"type": "response.output_item.done", "output_index": self.index_of[item["id"]],
                           "item": copy.deepcopy(item)})
        self.closed_calls.update(self.calls)
        self.calls = {}
        return events


def _content_and_calls(out: _Output, delta: dict[str, Any], content_before_calls: list[int] | None,
                       logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of a chat delta's content and tool calls, in the order the model wrote them, so that the
    items are the same however the text was chunked: each call where `content_before_calls` puts it within
    the content (a call under way first, before any text, where it is not given: the calls of a forced or
    required tool_choice, which come without text). The chunk's logprobs go with its first text, or to the
    message that is open when it has none (they belong to the message, not to a call)."""
    content: str = delta.get("content") or ""
    calls = delta.get("tool_calls", [])
    places = content_before_calls if content_before_calls is not None else [0] * len(calls)
    events: list[dict[str, Any]] = []
    if not content and logprobs and out.open is not None and out.open["type"] == "message":
        events += out.text("", logprobs)
    written = 0
    for call, place in zip(calls, places, strict=True):
        if place > written:
            events += out.text(content[written:place], logprobs if written == 0 else [])
            written = place
        if call["index"] in out.calls or "id" in call:  # more of a call under way, or a call's start
            events += out.call(call)
    if written < len(content):
        events += out.text(content[written:], logprobs if written == 0 else [])
    return events


def _usage(num_prompt: int, num_cached: int, num_output: int, num_reasoning: int) -> dict[str, Any]:
    return {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": num_cached},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": num_reasoning},
            "total_tokens": num_prompt + num_output}


class ResponseRun:
    """One response's generation: `events()` yields the Responses API's events (without sequence numbers), the
    last of them response.completed or response.incomplete with the response object; `failed(error)` is the
    response object of a run that raised."""

    def __init__(self, ctx: ServingContext, prep: PreparedResponse) -> None:
        self.ctx = ctx
        self.prep = prep
        self.output = _Output(prep.chat.max_tool_calls)
        self._reserved: StoredResponse | None = None  # the store's in-progress entry (store on)
        self._items = [_with_id(item) for item in prep.items] if prep.store else []

    def _reserve(self) -> None:
        """With the store on, stores the response as in progress; a 400 when a stored response has its id (two
        requests with one client id: `prepare_response` checked the id before either was stored). Done as the
        run starts, so that a request whose client left before it ever ran stores nothing."""
        if not self.prep.store:
            return
        assert self.ctx.responses_store is not None
        self._reserved = StoredResponse(copy.deepcopy(self.body("in_progress")), self._items)
        if not self.ctx.responses_store.reserve(self.prep.response_id, self._reserved):
            self._reserved = None
            raise _duplicate_id(self.prep.response_id)

    def _keep(self, body: dict[str, Any]) -> None:
        """Stores the response's end (`body`), in place of its in-progress entry."""
        if self._reserved is not None:
            assert self.ctx.responses_store is not None
            self.ctx.responses_store.settle(self.prep.response_id, self._reserved,
                                            StoredResponse(body, self._items + body["output"]))
            self._reserved = None

    def body(self, status: str, usage: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        req, params = self.prep.request, self.prep.chat.params
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.prep.response_id, "object": "response", "created_at": self.prep.chat.created,
            "status": status, "background": False, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "model": self.prep.chat.model, "output": self.output.items,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "service_tier": req.service_tier or "auto", "store": self.prep.store,
            "temperature": params.temperature, "text": {**(req.text or {}), "format": fmt},
            "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
            "tools": req.tools or [], "top_logprobs": req.top_logprobs, "top_p": params.top_p,
            "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {}, **fields,
        }

    def failed(self, error: OpenAIError) -> dict[str, Any]:
        """The response object of a run that raised `error` (stored as such with the store on)."""
        body = copy.deepcopy(self.body("failed", error={"code": error.error_type, "message": error.message}))
        self._keep(body)
        return body

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        self._reserve()
        try:
            async with closing_updates(self._events()) as events:
                async for event in events:
                    yield event
        except Exception:
            raise  # the caller makes its error and stores the response as failed (`failed`)
        except BaseException:  # the client left (the stream closed, or the request's task cancelled)
            self._keep(copy.deepcopy(self.body("cancelled")))
            raise

    async def _events(self) -> AsyncIterator[dict[str, Any]]:
        ctx, prep, chat, out = self.ctx, self.prep, self.prep.chat, self.output
        start = copy.deepcopy(self.body("in_progress"))
        yield {"type": "response.created", "response": start}
        yield {"type": "response.in_progress", "response": start}
        finished_sent: set[int] = set()
        num_tokens: dict[int, int] = {}
        tool_streams: dict[int, ToolCallStream] | None = {} if chat.parse_tools else None
        reasoning_streams: dict[int, ReasoningStream] | None = {} if chat.parse_reasoning else None
        forced_started: set[int] = set()
        num_reasoning = num_cached = 0
        finish_reason = None
        async with closing_updates(ctx.engine.generate(chat.request_id, chat.prompt_token_ids, chat.params, chat.prompt,
                                                       cache_salt=chat.cache_salt, priority=chat.priority)) as updates:
            async for update in updates:
                num_cached = update.num_cached_tokens
                if reasoning_streams is not None and (0 not in reasoning_streams or reasoning_streams[0].thinking):
                    # tokens generated while thinking (the one that ends the reasoning included)
                    num_reasoning += sum(len(c.token_ids_delta) for c in update.outputs)
                for choice in _choice_deltas(ctx, chat, update, finished_sent, num_tokens, tool_streams,
                                             forced_started, reasoning_streams, calls_placed=True):
                    delta = choice["delta"]
                    events: list[dict[str, Any]] = []
                    if delta.get("reasoning"):
                        events += out.reasoning(delta["reasoning"])
                    logprobs = (choice["logprobs"] or {}).get("content") or [] if prep.logprobs else []
                    events += _content_and_calls(out, delta, choice.get("content_before_calls"), logprobs)
                    if choice["finish_reason"] is not None:
                        finish_reason = choice["finish_reason"]
                    for event in events:
                        yield event
        if not out.items:  # nothing written: an empty message, as chat's empty content
            for event in out.text("", []):
                yield event
        # Cut short: by max_output_tokens, or aborted by the server (its drain at shutdown: finish reason
        # "abort", which chat returns as such) -- not a completed answer.
        status = "incomplete" if finish_reason in ("length", "abort") else "completed"
        for event in out.close(status):
            yield event
        usage = _usage(len(chat.prompt_token_ids), num_cached, sum(num_tokens.values()), num_reasoning)
        reason = "max_output_tokens" if finish_reason == "length" else "abort"
        extra = {"incomplete_details": {"reason": reason}} if status == "incomplete" else {}
        final = copy.deepcopy(self.body(status, usage, **extra))
        self._keep(final)
        yield {"type": f"response.{status}", "response": final}


def _engine_error(e: Exception, prep: PreparedResponse) -> OpenAIError:
    if isinstance(e, OpenAIError):  # the run's own (a duplicate id)
        return e
    return _responses_error(engine_error(e, prep.chat.structure_param))


async def response_full(run: ResponseRun) -> dict[str, Any]:
    """The response object (what a stream of this request ends with). Raises OpenAIError."""
    final: dict[str, Any] | None = None
    try:
        async with closing_updates(run.events()) as events:
            async for event in events:
                final = event.get("response", final)
    except Exception as e:
        error = _engine_error(e, run.prep)
        run.failed(error)
        raise error from None
    assert final is not None
    return final


def _event(event: dict[str, Any], sequence_number: int) -> str:
    body = {"type": event["type"], "sequence_number": sequence_number,
            **{k: v for k, v in event.items() if k != "type"}}
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    if "response" in event:  # it echoes the request (instructions, ...): escaped if UTF-8 cannot carry it
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            data = json.dumps(body, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


async def response_stream(run: ResponseRun) -> AsyncIterator[str]:
    """The Responses API's server-sent events (`event:` and `data:` lines, no [DONE]); a failure mid-way ends
    the stream with an `error` event and response.failed."""
    sequence = 0
    try:
        async with closing_updates(run.events()) as events:
            async for event in events:
                yield _event(event, sequence)
                sequence += 1
    except Exception as e:
        error = _engine_error(e, run.prep)
        yield _event({"type": "error", "code": error.error_type, "message": error.message, "param": error.param},
                     sequence)
        yield _event({"type": "response.failed", "response": run.failed(error)}, sequence + 1)
