"""Incremental detokenization: token ids in, text deltas out, one request at a time.

Decoding the whole output at every step costs O(length) per token; decoding only the new token alone is
wrong (SentencePiece drops a word-initial space at the start of a string, byte-level BPE splits one
character over several tokens). We keep two offsets into the token list:

* ``prefix_offset``: start of a short window of already-emitted tokens decoded again as context;
* ``read_offset``: end of what has been emitted.

Each call decodes ``ids[prefix_offset:read_offset]`` (the context) and ``ids[prefix_offset:]`` (context plus
new tokens); the delta is the second minus the first. Both decodes start at the same token, so whatever
the tokenizer does at the start of a string (stripping a leading space) happens to both and cancels.
When the new text ends in U+FFFD the last character is an incomplete UTF-8 sequence (its remaining bytes
are in tokens not generated yet): nothing is emitted and the offsets stay, so the next call retries with
more tokens. The window holds the tokens of at most a few characters, so a call costs O(new tokens).

**Invariant** (decodes with the same ``skip_special_tokens``, ``clean_up_tokenization_spaces=False``):

    output_text == decode(prompt + output)[len(decode(prompt)):]

i.e. the output is read in the context of the prompt. For byte-level BPE (GPT-2 style: SmolLM2, Qwen2)
this equals ``decode(output)``. For SentencePiece it equals ``decode(output)`` except that a word-initial
space on the first output token is kept (``decode(output)`` alone strips it as it would at the start of a
text). With an empty prompt there is no context and ``output_text == decode(output)``.

Tokenization-space cleanup is never applied: it rewrites across token boundaries (``" ." -> "."``) and
could change text that was already streamed. ``spaces_between_special_tokens`` is passed to the tokenizer,
which honours it only on the slow (Python) tokenizer path; transformers' tokenizers backend ignores it.

A fast tokenizer whose ``decode`` is transformers' own is decoded by its Rust tokenizer directly, which is
what transformers calls when cleanup is off, without its four Python layers around it (most of a decode's
time for the few tokens here; the API process decodes twice for every streamed token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# How many prompt tokens to decode as context for the first output token. A few are enough to give a
# SentencePiece word-initial space something to follow; the window grows (up to the maximum) while it
# decodes to nothing (only skipped special tokens) or starts inside a character.
_INITIAL_CONTEXT_TOKENS = 5
_MAX_INITIAL_CONTEXT_TOKENS = 24

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output ids into text deltas; see the module docstring for the invariant."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self._backend_decode = backend_decode(tokenizer)
        # Only the tail of the prompt is ever decoded again; keep just that.
        context = self._initial_context(prompt_token_ids)
        self._token_ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._output_text = ""

    @property
    def output_text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        return self._output_text

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; returns the text they complete (may be "" while a character is pending)."""
        self._token_ids.extend(new_token_ids)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if new_text.endswith(_REPLACEMENT_CHAR) or len(new_text) <= len(prefix_text):
            # Incomplete character, or tokens that add no text yet (skipped special tokens): hold.
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._compact()
        self._output_text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back, U+FFFD included (call when the request finishes: a sequence that
        really ends in an invalid byte would otherwise never be shown)."""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._token_ids)
        self._output_text += delta
        return delta

    def _initial_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        num_prompt_tokens = len(prompt_token_ids)
        start = max(0, num_prompt_tokens - _INITIAL_CONTEXT_TOKENS)
        lowest_start = max(0, num_prompt_tokens - _MAX_INITIAL_CONTEXT_TOKENS)
        while start > lowest_start:
            text = self._decode(list(prompt_token_ids[start:]))
            if text and not text.startswith(_REPLACEMENT_CHAR):
                break
            start -= 1
        return list(prompt_token_ids[start:])

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
            spaces_between_special_tokens=self._spaces_between_special_tokens,
        )

    def _compact(self) -> None:
        # Tokens before prefix_offset are never decoded again; drop them so memory stays O(window).
        if self._prefix_offset > 0:
            del self._token_ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0


def backend_decode(tokenizer: PreTrainedTokenizerBase) -> Callable[..., str] | None:
    """The Rust tokenizer's `decode(ids, skip_special_tokens=...)` when it is what `tokenizer.decode` runs
    with cleanup off (a fast tokenizer whose class overrides neither `decode` nor `_decode`), else None.
    Always pass `skip_special_tokens`: its default there is True, transformers' is False."""
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and isinstance(backend, tokenizers.Tokenizer)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is PreTrainedTokenizerFast._decode
    ):
        return backend.decode
    return None
