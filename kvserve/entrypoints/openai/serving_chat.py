"""POST /v1/chat/completions: chat template -> engine -> one JSON response or an SSE stream of chunks."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import jinja2

from kvserve.engine.input_processor import truncate_prompt
from kvserve.entrypoints.openai.errors import BadRequestError
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    OtherContentPart,
    RefusalContentPart,
)
from kvserve.entrypoints.openai.reasoning_parsers import ReasoningStream, parse_reasoning, reasoning_applies
from kvserve.entrypoints.openai.serving_common import (
    ServingContext,
    chat_logprobs,
    check_lengths,
    check_supported,
    check_token_ids,
    closing_updates,
    delta_logprobs,
    engine_error,
    log_request,
    new_request_id,
    prompt_logprobs_json,
    sampling_params_from,
    structured_outputs_from,
    usage_dict,
    with_bad_words,
    with_length_limits,
)
from kvserve.entrypoints.openai.sse import SSE_DONE, sse
from kvserve.entrypoints.openai.tool_parsers import (
    ToolCallPiece,
    ToolCallStream,
    parse_tool_calls,
    tool_call_id,
    tool_call_stream,
    tool_function,
)
from kvserve.protocol.chat_messages import strict_json
from kvserve.protocol.outputs import RequestOutput
from kvserve.protocol.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from kvserve.structured_output import rebase_refs

# apply_chat_template arguments a request's chat_template_kwargs must not override.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tokenize", "chat_template", "add_generation_prompt",
                             "return_dict", "return_tensors", "padding", "truncation", "max_length"}


def template_switches(requested: dict[str, Any] | None, add_generation_prompt: bool,
                      continue_final_message: bool) -> tuple[bool, bool]:
    """A request's add_generation_prompt and continue_final_message, where its chat_template_kwargs may set
    either (they override the request's own fields there, as vLLM's do); 400 for a chat_template given there
    (per-request templates are not accepted), a non-boolean switch, or both switches on."""
    requested = requested or {}
    if "chat_template" in requested:
        raise BadRequestError("a per-request chat_template is not accepted (in chat_template_kwargs either); start "
                              "the server with --chat-template", "chat_template_kwargs")
    switches = []
    for name, own in (("add_generation_prompt", add_generation_prompt),
                      ("continue_final_message", continue_final_message)):
        value = requested.get(name, own)
        if not isinstance(value, bool):
            raise BadRequestError(f"chat_template_kwargs' {name} must be true or false, got {value!r}",
                                  "chat_template_kwargs")
        switches.append(value)
    if switches[0] and switches[1]:
        raise BadRequestError("continue_final_message needs add_generation_prompt set to false",
                              "continue_final_message")
    return switches[0], switches[1]


def template_kwargs(requested: dict[str, Any] | None, continue_final_message: bool,
                    tools: list[dict[str, Any]] | None = None,
                    documents: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat template's extra arguments from a request (chat, or /tokenize with messages). Tools go in
    whatever the tool_choice (as vLLM): with "none" the model still sees what it may not call. The chat
    request's `documents` go in as `documents`, unless chat_template_kwargs names its own (as vLLM, whose
    chat_template_kwargs update the arguments it sets)."""
    kwargs = {k: v for k, v in (requested or {}).items()
              if k not in _RESERVED_TEMPLATE_KWARGS and k != "continue_final_message"}
    if documents is not None:
        kwargs.setdefault("documents", documents)
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools:
        kwargs["tools"] = tools
    return kwargs


class PreparedChat:
    """A validated chat request, ready to generate."""

    def __init__(self, request_id: str, model: str, prompt: str, prompt_token_ids: list[int],
                 params: SamplingParams, num_top_logprobs: int | None, cache_salt: str | None = None,
                 return_token_ids: bool = False, parse_tools: bool = False, parallel_tool_calls: bool = True,
                 tokens_as_ids: bool = False, priority: int = 0, forced_tool: str | None = None,
                 required_tools: bool = False, structure_param: str = "structured_outputs",
                 reasoning_field: bool = False, parse_reasoning: bool = False, include_reasoning: bool = True,
                 role: str = "assistant") -> None:
        self.request_id = request_id
        self.role = role  # the reply's role (--response-role, or the last message's without a generation prompt)
        # --reasoning-parser: each message has `reasoning` (null when there is none), as vLLM's
        self.reasoning_field = reasoning_field
        # the text is read for reasoning (not under a grammar, which shapes the whole text; not with qwen3's
        # thinking turned off); its content part goes on to the tool-call parser
        self.parse_reasoning = parse_reasoning
        # false: the reasoning is left out, and with it the logprobs and token ids that would tell it
        self.hide_reasoning = parse_reasoning and not include_reasoning
        # the field that set the output's structure (an engine-side grammar failure's param)
        self.structure_param = structure_param
        # tool_choice naming a function: the output (its arguments, by a grammar) is that function's call
        self.forced_tool = forced_tool
        # tool_choice "required": the output (by a grammar) is a JSON list of {"name", "parameters"}
        self.required_tools = required_tools
        self.priority = priority  # lower first, under the priority scheduling policy
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids: logprobs' tokens as "token_id:<id>"
        self.parse_tools = parse_tools  # tool_choice "auto": the text is read for tool calls
        self.max_tool_calls = None if parallel_tool_calls else 1  # OpenAI's parallel_tool_calls: false
        self.return_token_ids = return_token_ids  # vLLM's field: token ids beside the text
        self.cache_salt = cache_salt  # the prefix cache's namespace (vLLM's extra field)
        self.model = model
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.num_top_logprobs = num_top_logprobs  # None: no logprobs
        self.created = int(time.time())


def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest, request_id: str | None = None) -> PreparedChat:
    """Validate, render the chat template and tokenize. Raises OpenAIError (400/404/503). `request_id`: the
    engine's id for the request (the Responses API's response id); by default `chatcmpl-<the client's id>`."""
    model = ctx.check_model(req.model)
    ctx.check_engine()
    check_supported(req)
    if req.echo:
        raise BadRequestError("echo is not supported for chat completions", "echo")
    choice = check_tools(ctx, req)
    parse_tools = choice == "auto"
    ctx.check_priority(req.priority)
    if req.chat_template is not None:
        raise BadRequestError("a per-request chat_template is not accepted; start the server with --chat-template",
                              "chat_template")
    if req.stream_options is not None and req.stream_options.model_fields_set and not req.stream:  # {}: taken, as vLLM
        raise BadRequestError("stream_options can only be given when stream is true", "stream_options")
    if req.top_logprobs and not req.logprobs:  # 0 is taken (and changes nothing), as vLLM takes it
        raise BadRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
    add_generation_prompt, continue_final_message = template_switches(
        req.chat_template_kwargs, req.add_generation_prompt, req.continue_final_message)

    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    ctx.check_logprobs(num_top, "top_logprobs")
    ctx.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    params = sampling_params_from(req, max_tokens, num_top,
                                  {"max_tokens": max_tokens_param, "logprobs": "top_logprobs"}, ctx.sampling_defaults,
                                  req.prompt_logprobs)

    forced = forced_tool_schema(req, choice)
    if forced is not None:
        if params.structured_outputs is not None:
            raise BadRequestError(f"tool_choice {json.dumps(choice)} sets the output's structure: it cannot be "
                                  f"combined with response_format, structured_outputs or guided_*", "tool_choice")
        try:
            params = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=forced))
        except SamplingParamsError as e:
            raise BadRequestError(f"the tools' parameters are not a schema the output can follow: {e}",
                                  "tools") from None

    engine = ctx.engine
    assert engine.input_processor is not None
    params = with_bad_words(engine, params)
    if parse_tools and params.skip_special_tokens:
        # Some checkpoints mark <tool_call> as a special token; the parser must see it (as vLLM does).
        params = params.clone()
        params.skip_special_tokens = False
    kwargs = template_kwargs(req.chat_template_kwargs, continue_final_message, req.tools, req.documents)
    try:
        processed = engine.input_processor.apply_chat_template(
            [message_dict(m) for m in req.messages], None, add_generation_prompt, kwargs, req.add_special_tokens
        )
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise BadRequestError(f"cannot apply the chat template to these messages: {e}", "messages") from None
    assert processed.prompt is not None
    check_token_ids(engine, processed.prompt_token_ids, "messages", tokenized=True)
    try:
        processed.prompt_token_ids = truncate_prompt(processed.prompt_token_ids, params, engine.max_model_len)
    except SamplingParamsError as e:
        raise BadRequestError(str(e), e.param) from None
    check_lengths(engine, len(processed.prompt_token_ids), params.max_tokens, "messages", max_tokens_param)
    # The model's reply length when the request sets none; the generation config's cap (vLLM's rule).
    params = with_length_limits(params, ctx.sampling_defaults.get("max_tokens"), ctx.max_tokens_cap,
                                engine.max_model_len - len(processed.prompt_token_ids),
                                {"max_tokens": max_tokens_param})
    request_id = request_id or new_request_id("chatcmpl", req.request_id)
    log_request(ctx, request_id, len(processed.prompt_token_ids), params, processed.prompt)
    # A grammar (response_format, structured_outputs, guided_*, a forced tool_choice) constrains the whole
    # text from its first token, so there is no reasoning to read: such replies are returned as without the
    # parser (vLLM instead starts the grammar after </think>).
    parse_reasoning = ctx.reasoning_parser is not None and params.structured_outputs is None and \
        reasoning_applies(ctx.reasoning_parser, req.chat_template_kwargs)
    return PreparedChat(request_id, model, processed.prompt, processed.prompt_token_ids, params, num_top,
                        req.cache_salt, bool(req.return_token_ids), parse_tools, req.parallel_tool_calls is not False,
                        ctx.tokens_as_ids(req.return_tokens_as_token_ids), req.priority,
                        forced_tool=choice["function"]["name"] if isinstance(choice, dict) else None,
                        required_tools=choice == "required",
                        structure_param="tools" if forced is not None else structured_outputs_from(req)[1],
                        reasoning_field=ctx.reasoning_parser is not None, parse_reasoning=parse_reasoning,
                        include_reasoning=req.include_reasoning,
                        role=ctx.response_role if add_generation_prompt else req.messages[-1].role)


def check_tool_definitions(tools: list[dict[str, Any]] | None) -> None:
    """400 for a tool that is not a named function (`type` may be left out: "function", as vLLM reads it)."""
    for i, tool in enumerate(tools or []):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not function.get("name") or not isinstance(function["name"], str):
            raise BadRequestError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}',
                                  "tools")
        if not isinstance(function.get("parameters") or {}, dict):
            raise BadRequestError(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")


def check_tools(ctx: ServingContext, req: ChatCompletionRequest) -> str | dict[str, Any]:
    """Validate tools and tool_choice; the choice in effect: "none" (also when there is nothing to call),
    "auto" (the response is read for tool calls; tools make it the default, as in vLLM), "required", or a
    named function ({"type": "function", "function": {"name": ...}}, one of the tools). Raises 400s."""
    check_tool_definitions(req.tools)
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none" or (choice == "auto" and not tools):  # nothing to call
        return "none"
    if choice == "required" and req.tools is not None and not tools:
        return "none"  # an empty tools list: nothing to call, as vLLM reads it (without the field: a 400 below)
    if not tools:
        raise BadRequestError(f"tool_choice {json.dumps(choice)} needs tools", "tool_choice")
    if choice == "auto":
        if ctx.tool_call_parser is None:
            raise BadRequestError('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                                  '--tool-call-parser; send tool_choice "none" to give the model tools it may not call',
                                  "tool_choice")
        return "auto"
    if choice == "required":
        return choice
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise BadRequestError('a named tool_choice is {"type": "function", "function": {"name": ...}}',
                                  "tool_choice")
        if name not in {tool["function"]["name"] for tool in tools}:
            raise BadRequestError(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise BadRequestError(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                          "tool_choice")


def forced_tool_schema(req: ChatCompletionRequest, choice: str | dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema the output follows under a forced tool_choice (as vLLM's): a named function's
    parameters; for "required", a list of at least one {"name", "parameters"} object of any tool (at most one
    with parallel_tool_calls false). None for "none" and "auto"."""
    functions = [tool["function"] for tool in req.tools or []]
    if isinstance(choice, dict):
        function = next(f for f in functions if f["name"] == choice["function"]["name"])
        return function.get("parameters") or {"type": "object"}
    if choice != "required":
        return None
    # Each tool's parameters sit under the root's $defs, their references ("#/$defs/...", "#") rebased there.
    defs = {f"tool_{i}": rebase_refs(f.get("parameters") or {"type": "object"}, f"#/$defs/tool_{i}")
            for i, f in enumerate(functions)}
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [f["name"]]},
                             "parameters": {"$ref": f"#/$defs/tool_{i}"}},
              "required": ["name", "parameters"]} for i, f in enumerate(functions)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def required_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """The calls of a tool_choice "required" output (a JSON list of {"name", "parameters"}) as OpenAI
    `function` objects; None when the text is not such a list (cut short by max_tokens) or a call is one the
    response cannot carry (`tool_function`: a lone surrogate from a ``\\ud800`` escape)."""
    try:
        calls = strict_json(text)
    except ValueError:
        return None
    if not isinstance(calls, list) or not calls or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("parameters"), dict)
            for c in calls):
        return None
    functions: list[dict[str, Any]] = []
    for call in calls:
        function = tool_function(call["name"], call["parameters"])
        if function is None:
            return None
        functions.append(function)
    return functions


def message_dict(message: ChatMessage) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, OtherContentPart):
                if part.type in ("text", "input_text", "output_text", "refusal"):  # the schema's, without its string
                    field = "refusal" if part.type == "refusal" else "text"
                    raise BadRequestError(f"a content part of type {part.type!r} needs its {field} as a string, got "
                                          f"{(part.model_extra or {}).get(field, '(none)')!r}"[:300], "messages")
                raise BadRequestError(f"content parts of type {part.type!r} are not supported (only text, with "
                                      f"its text as a string)", "messages")
            texts.append(part.refusal if isinstance(part, RefusalContentPart) else part.text)
        content = "\n".join(texts)
    out: dict[str, Any] = {"role": message.role, "content": content if content is not None else ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls is not None:
        out["tool_calls"] = message.tool_calls
    for name in ("reasoning", "reasoning_content"):
        if getattr(message, name) is not None:
            out[name] = getattr(message, name)
    return out


async def chat_full(ctx: ServingContext, chat: PreparedChat) -> dict[str, Any]:
    """Run to completion and build the `chat.completion` object."""
    final: RequestOutput | None = None
    try:
        async with closing_updates(ctx.engine.generate(chat.request_id, chat.prompt_token_ids, chat.params,
                                                       chat.prompt, cache_salt=chat.cache_salt,
                                                       priority=chat.priority)) as updates:
            async for update in updates:
                final = update
    except Exception as e:
        raise engine_error(e, chat.structure_param) from None
    assert final is not None and final.finished
    tokenizer = ctx.engine.tokenizer
    choices = []
    for completion in final.outputs:
        logprobs = None
        if chat.num_top_logprobs is not None and completion.logprobs is not None and not chat.hide_reasoning:
            logprobs = chat_logprobs(tokenizer, completion.token_ids, completion.logprobs, chat.num_top_logprobs,
                                     chat.tokens_as_ids)
        text: str | None = completion.text
        reasoning = None
        if chat.parse_reasoning:
            split = parse_reasoning(completion.text)
            reasoning, text = split.reasoning, split.content
        message: dict[str, Any] = {"role": chat.role, "content": text}
        finish_reason = completion.finish_reason
        if chat.parse_tools:  # from the content: tool calls written while thinking are not calls
            assert ctx.tool_call_parser is not None  # check_tools: "auto" needs it
            parsed = parse_tool_calls(text or "", ctx.tool_call_parser)
            content = parsed.content if parsed.content or not chat.parse_reasoning else None
            message = {"role": chat.role, "content": content, "tool_calls": parsed.tool_calls[: chat.max_tool_calls]}
            # cut short: the engine's reason ("length"), unless the cut call is past max_tool_calls (not returned)
            cut = parsed.last_call_cut and (chat.max_tool_calls is None or len(parsed.tool_calls) <= chat.max_tool_calls)
            if parsed.tool_calls and not cut:
                finish_reason = "tool_calls"
        elif chat.forced_tool is not None:  # the text is the arguments
            message = {"role": chat.role, "content": None, "tool_calls": [
                {"id": tool_call_id(), "type": "function",
                 "function": {"name": chat.forced_tool, "arguments": completion.text}}]}
        elif chat.required_tools:
            calls = required_tool_calls(completion.text)
            if calls is not None:  # else (cut short) the text stays the content: nothing is lost
                message = {"role": chat.role, "content": None, "tool_calls": [
                    {"id": tool_call_id(), "type": "function", "function": f} for f in calls]}
                finish_reason = "tool_calls"
        if chat.reasoning_field:
            message["reasoning"] = None if chat.hide_reasoning else reasoning
        choices.append({
            "index": completion.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": completion.stop_reason,
            **({"token_ids": list(completion.token_ids)} if chat.return_token_ids and not chat.hide_reasoning else {}),
        })
    num_completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    body = {
        "id": chat.request_id,
        "object": "chat.completion",
        "created": chat.created,
        "model": chat.model,
        "choices": choices,
        "usage": usage_dict(len(chat.prompt_token_ids), num_completion_tokens, final.num_cached_tokens),
    }
    if final.prompt_logprobs is not None:  # vLLM's field: the rendered prompt's tokens
        body["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
    if chat.return_token_ids:
        body["prompt_token_ids"] = chat.prompt_token_ids
    return body


async def chat_stream(ctx: ServingContext, chat: PreparedChat, include_usage: bool, continuous_usage: bool
                      ) -> AsyncIterator[str]:
    """SSE events: a role chunk per choice, content chunks, the finish chunk of each choice, [DONE].
    `continuous_usage` (only with `include_usage`): every chunk's usage counts its own choice's tokens so far,
    as vLLM's; the last chunk's has every choice's."""
    num_prompt_tokens = len(chat.prompt_token_ids)
    usage_field = include_usage
    num_tokens_by_choice: dict[int, int] = {}  # the tokens each choice has generated so far
    num_cached_tokens = 0

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              extra: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {"id": chat.request_id, "object": "chat.completion.chunk", "created": chat.created,
                                "model": chat.model, "choices": choices}
        if usage_field:
            body["usage"] = usage
        return sse(body | (extra or {}))

    def usage(num_completion_tokens: int) -> dict[str, Any]:
        return usage_dict(num_prompt_tokens, num_completion_tokens, num_cached_tokens)

    finished_sent: set[int] = set()
    tool_streams: dict[int, ToolCallStream] | None = {} if chat.parse_tools else None
    reasoning_streams: dict[int, ReasoningStream] | None = {} if chat.parse_reasoning else None
    forced_started: set[int] = set()
    role_sent = False
    try:
        async with closing_updates(ctx.engine.generate(chat.request_id, chat.prompt_token_ids, chat.params,
                                                       chat.prompt, cache_salt=chat.cache_salt,
                                                       priority=chat.priority)) as updates:
            async for update in updates:
                num_cached_tokens = update.num_cached_tokens
                if not role_sent:  # with the first token, as vLLM: its arrival is the time to first token
                    role_sent = True
                    for index in range(chat.params.n):
                        # vLLM's prompt_logprobs and prompt_token_ids, once: with the first chunk
                        extra: dict[str, Any] = {}
                        if index == 0 and update.prompt_logprobs is not None:
                            extra["prompt_logprobs"] = prompt_logprobs_json(update.prompt_logprobs)
                        if index == 0 and chat.return_token_ids:
                            extra["prompt_token_ids"] = chat.prompt_token_ids
                        yield chunk([{"index": index, "delta": {"role": chat.role, "content": ""},
                                      "logprobs": None, "finish_reason": None}],
                                    usage(0) if continuous_usage else None, extra=extra)
                for choice in _choice_deltas(ctx, chat, update, finished_sent, num_tokens_by_choice, tool_streams,
                                             forced_started, reasoning_streams):
                    yield chunk([choice], usage(num_tokens_by_choice[choice["index"]]) if continuous_usage else None)
    except Exception as e:
        yield sse(engine_error(e, chat.structure_param).to_body())
        yield SSE_DONE
        return
    if include_usage:
        yield chunk([], usage(sum(num_tokens_by_choice.values())))
    yield SSE_DONE


def _call_delta(piece: ToolCallPiece) -> dict[str, Any]:
    """A stream chunk's `tool_calls` entry for a piece of a call: its first with the id, type and name."""
    if piece.name is None:
        return {"index": piece.index, "function": {"arguments": piece.arguments}}
    return {"index": piece.index, "id": tool_call_id(), "type": "function",
            "function": {"name": piece.name, "arguments": piece.arguments}}


def _choice_deltas(ctx: ServingContext, chat: PreparedChat, update: RequestOutput, finished_sent: set[int],
                   num_tokens_by_choice: dict[int, int], tool_streams: dict[int, ToolCallStream] | None = None,
                   forced_started: set[int] | None = None,
                   reasoning_streams: dict[int, ReasoningStream] | None = None,
                   calls_placed: bool = False) -> list[dict[str, Any]]:
    """The chunk choices of one update: text deltas, logprobs, and each choice's finish (sent once). With
    `reasoning_streams` (--reasoning-parser), each choice's text goes through its `ReasoningStream` first,
    and only its content part goes on. With `tool_streams` (tool_choice "auto"), the text goes through each
    choice's `ToolCallStream`; under a forced tool_choice it is a tool call (`forced_started`: the choices
    whose call has been opened). `num_tokens_by_choice` counts each choice's tokens (updated here).
    `calls_placed` (for the Responses API, whose items follow the order of the text; not a chat chunk's
    field): a choice with tool calls read from the text also has `content_before_calls`, for each of its
    delta's calls how much of its content comes before it."""
    choices = []
    forced_started = forced_started if forced_started is not None else set()
    for completion in update.outputs:
        if completion.index in finished_sent:
            continue
        num_tokens_by_choice[completion.index] = (num_tokens_by_choice.get(completion.index, 0)
                                                  + len(completion.token_ids_delta))
        want_logprobs = chat.num_top_logprobs is not None and completion.logprobs is not None
        # A chunk for every new token, also one with no text yet (as completion_stream), except where a tool call
        # holds the text back (below).
        if not (completion.text_delta or completion.token_ids_delta or completion.finished):
            continue
        logprobs = None
        if want_logprobs and not chat.hide_reasoning:
            logprobs = chat_logprobs(ctx.engine.tokenizer, completion.token_ids_delta, delta_logprobs(completion),
                                     chat.num_top_logprobs or 0, chat.tokens_as_ids)
        text_delta, reasoning_delta = completion.text_delta, ""
        delta: dict[str, Any]
        placed: list[int] | None = None
        if reasoning_streams is not None:  # what it holds back (part of a tag) is not sent as an empty content
            released = reasoning_streams.setdefault(completion.index, ReasoningStream()).feed(
                text_delta, final=completion.finished)
            reasoning_delta, text_delta = released.reasoning, released.content
            delta = {"content": text_delta} if text_delta else {}
        else:
            delta = {"content": text_delta} if text_delta or completion.token_ids_delta else {}
        finish_reason = completion.finish_reason
        if chat.forced_tool is not None:
            # The arguments stream as they come; the call's id and name with the first chunk.
            function: dict[str, Any] = {"arguments": completion.text_delta}
            call: dict[str, Any] = {"index": 0, "function": function}
            if completion.index not in forced_started:
                forced_started.add(completion.index)
                call.update(id=tool_call_id(), type="function")
                function["name"] = chat.forced_tool
            delta = {"tool_calls": [call]} if completion.text_delta or len(function) > 1 else {}
        elif chat.required_tools:
            # The list is read whole at the end; cut short, its text is the content.
            delta = {}
            if completion.finished:
                calls = required_tool_calls(completion.text)
                if calls is None:
                    delta = {"content": completion.text} if completion.text else {}
                else:
                    delta = {"tool_calls": [{"index": k, "id": tool_call_id(), "type": "function", "function": f}
                                            for k, f in enumerate(calls)]}
                    finish_reason = "tool_calls"
        elif tool_streams is not None:
            if completion.index not in tool_streams:
                assert ctx.tool_call_parser is not None  # check_tools: "auto" needs it
                tool_streams[completion.index] = tool_call_stream(ctx.tool_call_parser)
            tools = tool_streams[completion.index]
            found = tools.feed(text_delta, final=completion.finished)
            delta = {"content": found.content} if found.content else {}
            pieces = [piece for piece in found.tool_calls
                      if chat.max_tool_calls is None or piece.index < chat.max_tool_calls]
            if pieces:
                delta["tool_calls"] = [_call_delta(piece) for piece in pieces]
                if calls_placed:
                    placed = [piece.content_before for piece in pieces]
            # cut short: the engine's reason ("length"), unless the cut call is past max_tool_calls (not sent)
            cut = tools.last_call_cut and (chat.max_tool_calls is None or tools.num_tool_calls <= chat.max_tool_calls)
            if tools.num_tool_calls and not cut:
                finish_reason = "tool_calls"
        if reasoning_delta and not chat.hide_reasoning:
            delta = {"reasoning": reasoning_delta, **delta}
        if chat.hide_reasoning and not delta and not completion.finished:
            continue  # nothing to send: a chunk per hidden reasoning token would tell its timing
        if (not delta and not completion.finished and logprobs is None and not chat.return_token_ids
                and (chat.forced_tool is not None or chat.required_tools or tool_streams is not None)):
            continue  # text held back for a tool call (all of it under "required"): no empty chunk per token
        choice: dict[str, Any] = {
            "index": completion.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason if completion.finished else None,
        }
        if placed is not None:
            choice["content_before_calls"] = placed
        if chat.return_token_ids and not chat.hide_reasoning:
            choice["token_ids"] = list(completion.token_ids_delta)
        if completion.finished:
            choice["stop_reason"] = completion.stop_reason
            finished_sent.add(completion.index)
        choices.append(choice)
    return choices
