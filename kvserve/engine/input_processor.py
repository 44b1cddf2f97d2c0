"""Prompt -> engine requests: tokenization, chat templates, max_tokens resolution, n>1 fan-out."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvserve.protocol.chat_messages import for_chat_template
from kvserve.protocol.engine import EngineCoreRequest
from kvserve.protocol.sampling_params import SamplingParams, SamplingParamsError

PromptType = str | Sequence[int] | dict[str, Any]


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True) -> list[int]:
    """The token ids of `text`. ValueError for text a tokenizer cannot take (a lone UTF-16 surrogate, which
    JSON's \\ud800 escapes can carry, makes HF tokenizers raise TypeError)."""
    try:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    except (TypeError, UnicodeEncodeError):
        text.encode("utf-8")  # the usual cause: raises UnicodeEncodeError (a ValueError) naming the position
        raise


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


def truncate_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (-1: as many as leave room for one new token), as
    vLLM keeps them; the prompt itself when the setting is off or the prompt is shorter. A setting above
    max_model_len is a SamplingParamsError, as vLLM refuses it (it would keep prompts no request can hold)."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return prompt_token_ids
    if keep == -1:
        keep = max_model_len - 1
    if keep > max_model_len:
        raise SamplingParamsError(f"truncate_prompt_tokens ({keep}) must be at most max_model_len ({max_model_len})",
                                  "truncate_prompt_tokens")
    return prompt_token_ids[-keep:] if len(prompt_token_ids) > keep else prompt_token_ids


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int, eos_token_ids: Sequence[int],
                 model_vocab_size: int) -> None:
        """`model_vocab_size`: the model's vocabulary (the engine core's `vocab_size`, its logits' width)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        eos = list(eos_token_ids)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        self.eos_token_ids = eos
        # The token ids a request may name (in its prompt, logit_bias, allowed_token_ids, bad_words_token_ids):
        # [0, vocab_size), the smaller of the tokenizer's and the model's vocabularies. A tokenizer may hold more
        # ids than the model: the engine core refuses a prompt or allowed_token_ids past the model's, and a
        # logit_bias there would change nothing (vLLM refuses it).
        tokenizer_size = len(tokenizer)
        self.vocab_size = min(tokenizer_size, model_vocab_size)
        self._vocab_note = " (the model's vocabulary size)" if model_vocab_size < tokenizer_size else ""

    def vocab_range(self) -> str:
        """The range token ids must be in, as messages give it: "[0, 48000) (the model's vocabulary size)"."""
        return f"[0, {self.vocab_size}){self._vocab_note}"

    def first_out_of_vocab(self, token_ids: Sequence[int]) -> int | None:
        """The first of `token_ids` outside [0, vocab_size); None when they are all in it."""
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < self.vocab_size):
            return None
        return next(t for t in token_ids if not 0 <= t < self.vocab_size)

    def tokenize(self, prompt: PromptType) -> ProcessedPrompt:
        """A string (tokenized with the tokenizer's special tokens), token ids, or a dict with "prompt" or
        "prompt_token_ids"."""
        if isinstance(prompt, dict):
            # vLLM refuses multimodal data for a text-only model too (ignored, the answer would be about nothing);
            # like vLLM, only data counts: an empty or None value, and the processor kwargs / uuids that go with
            # data, are no data.
            if prompt.get("multi_modal_data"):
                raise ValueError("kvserve serves text-only models: a prompt cannot carry multi_modal_data")
            if "prompt_token_ids" in prompt:
                processed = self.tokenize(prompt["prompt_token_ids"])
                text = prompt.get("prompt")  # the text the ids came from, where the caller has it
                return ProcessedPrompt(text, processed.prompt_token_ids) if isinstance(text, str) else processed
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return ProcessedPrompt(prompt, encode_text(self.tokenizer, prompt))
        ids = [int(t) for t in prompt]
        bad = self.first_out_of_vocab(ids)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range {self.vocab_range()}")
        return ProcessedPrompt(None, ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> ProcessedPrompt:
        """The conversation rendered and tokenized. The template already writes the special tokens (BOS, role
        markers), so the tokenizer adds none unless `add_special_tokens` asks it to (vLLM's chat field)."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass chat_template (--chat-template)")
        text = self.tokenizer.apply_chat_template(
            [for_chat_template(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            **(chat_template_kwargs or {}),
        )
        assert isinstance(text, str)
        return ProcessedPrompt(text, encode_text(self.tokenizer, text, add_special_tokens=add_special_tokens))

    def truncate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        return truncate_prompt(prompt_token_ids, params, self.max_model_len)

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            return max(room, 1)
        return max(min(params.max_tokens, room), 1)

    def check_token_ids(self, params: SamplingParams) -> None:
        """A SamplingParamsError naming the field for a token id of `params` outside [0, vocab_size)."""
        bad = self.first_out_of_vocab(list(params.logit_bias or ()))
        if bad is not None:
            raise SamplingParamsError(f"logit_bias token id {bad} is out of range {self.vocab_range()}", "logit_bias")
        bad = self.first_out_of_vocab(params.allowed_token_ids or ())
        if bad is not None:
            raise SamplingParamsError(f"allowed_token_ids has token id {bad}, out of range {self.vocab_range()}",
                                      "allowed_token_ids")
        for ids in (params.bad_words_token_ids or ()):
            if self.first_out_of_vocab(ids) is not None:
                raise SamplingParamsError(f"bad_words_token_ids has {ids}, out of range {self.vocab_range()}",
                                          "bad_words")

    def resolve_bad_words(self, params: SamplingParams) -> SamplingParams:
        """`params` with its bad words as token sequences (`bad_words_token_ids`), or as given when it has none.
        Each word is tokenized as written (leading spaces dropped) and, to ban it inside a text too, after a
        space, where that gives a different first token and as many tokens (vLLM's rule). A sequence with a
        token past the model's vocabulary is left out: the model never samples that token, so the sequence
        never appears (the tokenizer may hold more ids than the model)."""
        if not params.bad_words:
            return params
        if params.bad_words_token_ids is not None:  # resolved already (the server does it off its event loop)
            return params
        sequences: dict[tuple[int, ...], None] = {}  # in order, each once
        for word in params.bad_words:
            try:
                plain = encode_text(self.tokenizer, word.lstrip(), add_special_tokens=False)
                spaced = encode_text(self.tokenizer, " " + word.lstrip(), add_special_tokens=False)
            except ValueError as e:
                raise SamplingParamsError(f"bad_words: {word!r} cannot be tokenized: {e}", "bad_words") from None
            sequences[tuple(plain)] = None
            if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences[tuple(spaced)] = None
        return replace(params, bad_words_token_ids=[list(ids) for ids in sequences
                                                    if ids and self.first_out_of_vocab(ids) is None])

    def make_engine_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        group_key: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        prompt_only: bool = False,
    ) -> EngineCoreRequest:
        return EngineCoreRequest(
            req_id=req_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            max_tokens=self.resolve_max_tokens(len(prompt_token_ids), params),
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            cache_salt=cache_salt,
            group_key=group_key,
            priority=priority,
            prompt_only=prompt_only,
        )
