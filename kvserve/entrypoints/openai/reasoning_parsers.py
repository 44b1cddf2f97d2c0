"""Reasoning in a model's text: the server's `--reasoning-parser` (vLLM's flag and parser names).

Thinking models (DeepSeek-R1 and its distills, QwQ, Qwen3) write their reasoning before the answer, between
``<think>`` and ``</think>``. With the flag, a chat reply's reasoning comes back as the message's ``reasoning``
(vLLM's field: it sent it as ``reasoning_content`` until late 2025, then both, and since early 2026 only
``reasoning``) and only the answer as its ``content``.

One algorithm serves the full response and the stream, so the two agree whatever the stream's chunking:
`ReasoningStream` is fed the text as it comes and releases reasoning and content as soon as they are
certain (holding back a possible partial tag), and `parse_reasoning` is that stream fed the whole text at
once. Its rules, those of vLLM 0.2x's ``deepseek_r1`` and ``qwen3`` parsers:

* the output starts in the reasoning: most templates (DeepSeek-R1-0528, QwQ, Qwen3 Thinking-2507, Qwen3.5)
  put ``<think>`` in the prompt, so the model often writes only ``</think>``; a ``<think>`` it does write
  before the end of its reasoning (the first Qwen3 templates) is dropped;
* the first ``</think>`` ends the reasoning; everything after it is content, as written;
* no ``</think>`` at all (a reply cut short by max_tokens while thinking): the whole text is reasoning and
  the content is null;
* only the tags go: the text around them is kept as written (the content of a Qwen3 reply starts with the
  template's "\\n\\n", as in vLLM); an empty part is null.

The parsers differ in one thing: under ``qwen3`` a request whose ``chat_template_kwargs`` turn
``enable_thinking`` off has no reasoning (the template closes the think block in the prompt), so all of its
text is content; ``deepseek_r1`` reads no template argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REASONING_PARSERS = ("deepseek_r1", "qwen3")
_START, _END = "<think>", "</think>"


def reasoning_applies(parser: str, chat_template_kwargs: dict[str, Any] | None) -> bool:
    """Whether a request's reply is read for reasoning: always, except under qwen3 with thinking turned off
    (vLLM reads the flag the same way: any false value, absent = on)."""
    if parser == "qwen3":
        return bool((chat_template_kwargs or {}).get("enable_thinking", True))
    return True


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of either tag."""
    for n in range(min(len(text), len(_END) - 1), 0, -1):
        tail = text[-n:]
        if _START.startswith(tail) or _END.startswith(tail):
            return n
    return 0


@dataclass
class ReasoningDelta:
    """What one `feed` releases."""

    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One choice's text, fed as it is generated (see the module docstring for the rules)."""

    def __init__(self) -> None:
        self._buffer = ""  # reasoning text not released yet: it may end in part of a tag
        self.thinking = True  # no </think> yet

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        out = ReasoningDelta()
        if not self.thinking:
            out.content = text
            return out
        self._buffer += text
        while True:
            start, end = self._buffer.find(_START), self._buffer.find(_END)
            if start >= 0 and (end < 0 or start < end):  # a <think> inside the reasoning: dropped
                out.reasoning += self._buffer[:start]
                self._buffer = self._buffer[start + len(_START):]
                continue
            if end >= 0:
                out.reasoning += self._buffer[:end]
                out.content = self._buffer[end + len(_END):]
                self._buffer = ""
                self.thinking = False
                return out
            break
        keep = 0 if final else _partial_tag(self._buffer)
        out.reasoning += self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return out


@dataclass
class ReasoningMessage:
    reasoning: str | None
    content: str | None


def parse_reasoning(text: str) -> ReasoningMessage:
    """The reasoning and content of a full reply (`ReasoningStream` fed the whole text)."""
    delta = ReasoningStream().feed(text, final=True)
    return ReasoningMessage(delta.reasoning or None, delta.content or None)
