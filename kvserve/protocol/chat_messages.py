"""Chat messages as chat templates read them (shared by the server and the offline API)."""

from __future__ import annotations

import json
from typing import Any


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str) -> Any:
    """`json.loads` of real JSON only: NaN and Infinity (which Python's json reads) and nesting too deep to
    read raise ValueError."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message for a chat template: its tool calls' arguments, JSON strings in OpenAI's format,
    as the objects templates render (Qwen's ``arguments | tojson``; vLLM passes them so); arguments that are
    not a JSON object are left as sent; an empty ``tool_calls`` list is dropped, so that a template takes
    its plain assistant path. A new dict: the caller's objects are not changed."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    if not calls:
        return {k: v for k, v in message.items() if k != "tool_calls"}
    converted = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = strict_json(function["arguments"])
            except ValueError:
                arguments = None
            if isinstance(arguments, dict):
                call = {**call, "function": {**function, "arguments": arguments}}
        converted.append(call)
    return {**message, "tool_calls": converted}


def for_chat_template(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it: an assistant's tool-call arguments as objects
    (`arguments_as_objects`), and its earlier thinking under both names templates use: vLLM's ``reasoning``
    and ``reasoning_content`` (Qwen3's and DeepSeek-R1's templates read the latter). A client may send
    either; ``reasoning`` wins when both are sent, as vLLM reads only it. Other roles' messages are left
    as sent. A new dict when anything changes."""
    message = arguments_as_objects(message)
    if message.get("role") != "assistant":
        return message
    reasoning = message.get("reasoning")
    if not isinstance(reasoning, str):
        reasoning = message.get("reasoning_content")
    if not isinstance(reasoning, str):
        return message
    return {**message, "reasoning": reasoning, "reasoning_content": reasoning}
