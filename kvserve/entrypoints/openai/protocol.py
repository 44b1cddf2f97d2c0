"""Request and response bodies of the OpenAI-compatible API (pydantic), as OpenAI and vLLM name them.

Request models check types and the ranges that `SamplingParams` cannot (sizes that could exhaust memory,
integers that must fit 64 bits, finite floats); the sampling ranges themselves are checked once, by
`SamplingParams`, whose `SamplingParamsError.param` becomes the error's `param`. Unknown fields are
ignored, as OpenAI's API does, except vLLM's that kvserve does not implement (`UNSUPPORTED_FIELDS`).
Response models document the shapes (OpenAPI); handlers build the JSON directly for speed.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

# Largest n accepted: each sample is a sequence in the batch.
MAX_N = 128
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

Int64 = Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=_INT64_MAX)]
# A token id of a prompt (or of /detokenize's tokens): any 64-bit integer here, so that one out of the vocabulary,
# negative ones included, gets the handler's message naming it and the vocabulary's range (check_token_ids)
# rather than the union's list of every form the prompt failed to match.
PromptTokenId = Int64


class OpenAIBaseModel(BaseModel):
    # NaN/inf are not JSON, but Python's json module accepts them; refuse them rather than sample with them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool | None = False
    # vLLM: usage on every chunk
    continuous_usage_stats: StrictBool | None = False


MAX_REQUEST_ID_LEN = 256

# vLLM (and legacy OpenAI) request fields that change what a request gets and that kvserve does not implement:
# a request that sets one is refused with a 400 naming it, instead of served without it. Not set: null, false,
# empty, or the value listed here (the field's neutral value).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "prompt_embeds": (),
    "use_beam_search": (0,),
    "logits_processors": (), "functions": (), "function_call": ("none",),
}


def _sets(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether a field's value asks for something: not null, false, empty or `neutral` (0 does ask, unless
    listed: use_beam_search 0 is off)."""
    if value is None or value is False or any(type(value) is type(n) and value == n for n in neutral):
        return False
    return not (isinstance(value, (list, dict, str)) and len(value) == 0)


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: str  # "text" | "json_object" | "json_schema"
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIBaseModel):
    """Sampling parameters shared by chat and completions (OpenAI names, then vLLM's extras). Other fields
    are kept (`model_extra`) so that the handlers can refuse the vLLM ones kvserve does not implement."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Annotated[int, Field(ge=0, le=_INT64_MAX)] = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # each prompt token's logprob and the top N at its position (the first token has none)
    prompt_logprobs: Annotated[int, Field(ge=0)] | None = None  # at most --max-logprobs (the handler checks)
    # keep the prompt's last N tokens (-1: as many as max_model_len leaves room for)
    truncate_prompt_tokens: Int64 | None = None
    allowed_token_ids: list[TokenId] | None = None  # sample only these
    bad_words: list[str] | None = None  # never generate these words
    priority: Int64 = 0  # lower first, under --scheduling-policy priority
    # the prompt's and the output's token ids in the response, beside the text
    return_token_ids: bool | None = None  # (not strict: vLLM clients send 0 for off)
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:<id>"
    request_id: str | None = Field(default=None, max_length=MAX_REQUEST_ID_LEN)
    # Structured output: OpenAI's response_format, vLLM's structured_outputs (StructuredOutputsParams' fields)
    # and its older guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    @field_validator("n", mode="before")
    @classmethod
    def _n_null_is_one(cls, value: Any) -> Any:
        return 1 if value is None else value  # vLLM accepts "n": null

    def unsupported_field(self) -> str | None:
        """The first vLLM field in UNSUPPORTED_FIELDS this request sets, or None."""
        extra = self.model_extra or {}
        return next((name for name, neutral in UNSUPPORTED_FIELDS.items() if _sets(extra.get(name), neutral)), None)


# --------------------------------------------------------------------------------------------- chat


class TextContentPart(OpenAIBaseModel):
    type: Literal["text", "input_text", "output_text"]  # the last two: the Responses API's names, as vLLM
    text: str


class RefusalContentPart(OpenAIBaseModel):
    """An assistant message's refusal, as OpenAI's clients send it back: read as text."""

    type: Literal["refusal"]
    refusal: str


class OtherContentPart(BaseModel):
    """Any non-text part (image_url, input_audio, ...): accepted by the schema, refused with a 400."""

    model_config = ConfigDict(extra="allow")
    type: str


class ChatMessage(OpenAIBaseModel):
    role: Annotated[str, Field(min_length=1)]  # any role the chat template knows (e.g. Llama 3.1's ipython)
    content: str | list[TextContentPart | RefusalContentPart | OtherContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # An assistant turn's thinking, sent back for templates that render it (vLLM's field; the older name too)
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: StrictBool | None = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None  # at most --max-logprobs (the handler checks)
    max_tokens: Int64 | None = Field(default=None, description="Deprecated by OpenAI; max_completion_tokens.")
    max_completion_tokens: Int64 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM extras
    echo: StrictBool = False
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # RAG documents (each {"title": ..., "text": ...} as vLLM recommends), given to the chat template as its
    # `documents` (Command-R's and Granite's templates render them; others ignore them)
    documents: list[dict[str, Any]] | None = None
    # the tokenizer's own special tokens (a BOS) added to the rendered template, which usually writes them itself
    add_special_tokens: StrictBool = False
    # with --reasoning-parser: false leaves the reasoning out of the reply (and, as in vLLM, the logprobs and
    # token ids that would tell it)
    include_reasoning: StrictBool = True


# ---------------------------------------------------------------------------------------- completions


class CompletionRequest(SamplingFields):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[PromptTokenId], Field(min_length=1)] | \
        Annotated[list[Annotated[list[PromptTokenId], Field(min_length=1)]], Field(min_length=1)]
    max_tokens: Int64 | None = 16
    logprobs: Annotated[int, Field(ge=0)] | None = None  # at most --max-logprobs (the handler checks)
    echo: StrictBool | None = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    add_special_tokens: StrictBool = True


# ---------------------------------------------------------------------------------------- tokenizer


class ResponsesRequest(SamplingFields):
    """POST /v1/responses: OpenAI's Responses API (create), with vLLM's sampling extras (SamplingFields).
    Input items, tools, `text` and `reasoning` are kept as JSON and read by the handler, whose errors name the
    item or field at fault; `n`, `response_format` and `stream_options` other than OpenAI's are refused there."""

    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=_INT64_MAX)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_tool_calls: Annotated[int, Field(ge=1, le=_INT64_MAX)] | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict[str, Any] | None = None  # {"effort": ..., "summary": ...}
    store: StrictBool | None = True
    background: StrictBool | None = False
    previous_response_id: str | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    metadata: dict[str, str] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # unset: true for a prompt, false for messages (vLLM's defaults)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # with messages: rendered as the chat request renders them
    return_token_strs: StrictBool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[PromptTokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# ------------------------------------------------------------------------------------------ responses


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobEntry] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None  # with --reasoning-parser (vLLM's field)


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
