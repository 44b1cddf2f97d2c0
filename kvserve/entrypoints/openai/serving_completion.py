"""POST /v1/completions: prompt(s) -> engine -> one JSON response or an SSE stream of chunks.

The prompt is a string, a list of strings, a list of token ids, or a list of token-id lists. Prompt `p`'s
sample `j` is choice `p * n + j`, as in OpenAI's API; the prompts run concurrently, each an engine request
under the response's id (`AsyncLLM` gives each its own id in the core), so no id a client picks for another
request can collide with one of them, and the id in use is refused while any of them runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from kvserve.engine.input_processor import truncate_prompt
from kvserve.entrypoints.openai.errors import BadRequestError
from kvserve.entrypoints.openai.protocol import CompletionRequest
from kvserve.entrypoints.openai.serving_common import (
    ServingContext,
    check_lengths,
    check_supported,
    check_token_ids,
    closing_updates,
    completion_logprobs,
    delta_logprobs,
    encode_prompt,
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
from kvserve.protocol.outputs import Logprob, RequestOutput
from kvserve.protocol.sampling_params import SamplingParams, SamplingParamsError


class PreparedPrompt:
    def __init__(self, prompt_token_ids: list[int], text: str | None) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.text = text  # the prompt as given (strings) or None (token ids)
        # the request's settings with this prompt's max_tokens (a default length is capped by what the context
        # leaves this prompt), set by `prepare_completion`; None: the request's
        self.params: SamplingParams | None = None

    def settings(self, cmpl: PreparedCompletion) -> SamplingParams:
        return self.params if self.params is not None else cmpl.params


class PreparedCompletion:
    def __init__(self, request_id: str, model: str, prompts: list[PreparedPrompt], params: SamplingParams,
                 echo: bool, cache_salt: str | None = None, echo_only: bool = False,
                 return_token_ids: bool = False, tokens_as_ids: bool = False, priority: int = 0,
                 structure_param: str = "structured_outputs") -> None:
        self.request_id = request_id
        # the field that set the output's structure (an engine-side grammar failure's param)
        self.structure_param = structure_param
        self.priority = priority  # lower first, under the priority scheduling policy
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids: logprobs' tokens as "token_id:<id>"
        self.return_token_ids = return_token_ids  # vLLM's field: token ids beside the text
        self.cache_salt = cache_salt  # the prefix cache's namespace (vLLM's extra field)
        self.model = model
        self.prompts = prompts
        self.params = params
        self.echo = echo
        # echo with max_tokens 0: the prompt (and its logprobs) only; the engine runs the prompt and ends the
        # request with no token (`prompt_only`)
        self.echo_only = echo_only
        self.created = int(time.time())


def prepare_completion(ctx: ServingContext, req: CompletionRequest) -> PreparedCompletion:
    """Validate and tokenize. Raises OpenAIError (400/404/503)."""
    model = ctx.check_model(req.model)
    ctx.check_engine()
    check_supported(req)
    ctx.check_priority(req.priority)
    if req.suffix:
        raise BadRequestError("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise BadRequestError("best_of must equal n (beam-style best-of is not supported)", "best_of")
    if req.stream_options is not None and req.stream_options.model_fields_set and not req.stream:  # {}: taken, as vLLM
        raise BadRequestError("stream_options can only be given when stream is true", "stream_options")
    ctx.check_logprobs(req.logprobs, "logprobs")
    ctx.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = req.logprobs  # the echoed prompt's tokens get logprobs too, as OpenAI's legacy API
    # echo with max_tokens 0 returns the prompt alone (what scoring clients send): the engine runs the prompt
    # and generates nothing (`prompt_only`; SamplingParams' max_tokens is at least 1).
    echo_only = bool(req.echo) and req.max_tokens == 0
    if echo_only and req.min_tokens > 0:  # named as the client sent it, not as the 1 given the engine below
        raise BadRequestError(f"min_tokens ({req.min_tokens}) must be <= max_tokens (0)", "min_tokens")
    params = sampling_params_from(req, 1 if echo_only else req.max_tokens, req.logprobs, None,
                                  ctx.sampling_defaults, prompt_logprobs)

    engine = ctx.engine
    params = with_bad_words(engine, params)
    raw = req.prompt
    items: list[str | list[int]]
    if isinstance(raw, str):
        items = [raw]
    elif raw and isinstance(raw[0], int):
        items = [list(raw)]  # type: ignore[arg-type]
    else:
        items = list(raw)  # type: ignore[arg-type]
    request_id = new_request_id("cmpl", req.request_id)
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = encode_prompt(engine, item, req.add_special_tokens, "prompt")
            check_token_ids(engine, ids, "prompt", tokenized=True)
            text: str | None = item
        else:
            check_token_ids(engine, item, "prompt")
            ids, text = list(item), None
        try:
            kept = truncate_prompt(ids, params, engine.max_model_len)
        except SamplingParamsError as e:
            raise BadRequestError(str(e), e.param) from None
        if len(kept) < len(ids):  # truncate_prompt_tokens: echo shows the tokens kept
            ids, text = kept, None
        check_lengths(engine, len(ids), params.max_tokens, "prompt", "max_tokens")
        prompts.append(PreparedPrompt(ids, text))
    # max_tokens null (left out, it is the API's 16): the model's reply length, capped at what the context
    # leaves each prompt; and the generation config's cap on every request (vLLM's rule).
    for i, p in enumerate(prompts):
        p.params = with_length_limits(params, ctx.sampling_defaults.get("max_tokens"), ctx.max_tokens_cap,
                                      engine.max_model_len - len(p.prompt_token_ids))
        log_request(ctx, request_id if len(prompts) == 1 else f"{request_id} (prompt {i})", len(p.prompt_token_ids),
                    p.params, p.text)
    return PreparedCompletion(request_id, model, prompts, params, bool(req.echo), req.cache_salt, echo_only,
                              bool(req.return_token_ids), ctx.tokens_as_ids(req.return_tokens_as_token_ids),
                              req.priority, structured_outputs_from(req)[1])


def _echo_text(ctx: ServingContext, prompt: PreparedPrompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return ctx.engine.tokenizer.decode(prompt.prompt_token_ids)


def _chain_end(logprobs: dict[str, Any] | None, default: int) -> int:
    """The text offset just past a completions `logprobs` object's last token, or `default` when it has
    none."""
    if logprobs is None or not logprobs["tokens"]:
        return default
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def _echoed_logprobs(ctx: ServingContext, cmpl: PreparedCompletion, prompt: PreparedPrompt,
                     output: RequestOutput) -> dict[str, Any] | None:
    """The completions `logprobs` of an echoed prompt's tokens (offsets from 0), or None when the request
    asked for none."""
    if cmpl.params.logprobs is None or output.prompt_logprobs is None:
        return None
    return completion_logprobs(ctx.engine.tokenizer, prompt.prompt_token_ids, output.prompt_logprobs,
                               cmpl.params.logprobs, 0, cmpl.tokens_as_ids)


async def _run_one(ctx: ServingContext, cmpl: PreparedCompletion, prompt: PreparedPrompt) -> RequestOutput:
    final: RequestOutput | None = None
    async with closing_updates(ctx.engine.generate(cmpl.request_id, prompt.prompt_token_ids, prompt.settings(cmpl),
                                                   prompt.text, cache_salt=cmpl.cache_salt, priority=cmpl.priority,
                                                   prompt_only=cmpl.echo_only)) as updates:
        async for update in updates:
            final = update
    assert final is not None and final.finished
    return final


async def completion_full(ctx: ServingContext, cmpl: PreparedCompletion) -> dict[str, Any]:
    """Run every prompt to completion and build the `text_completion` object."""
    tasks = [asyncio.ensure_future(_run_one(ctx, cmpl, p)) for p in cmpl.prompts]
    try:
        finals = await asyncio.gather(*tasks)
    except Exception as e:
        raise engine_error(e, cmpl.structure_param) from None
    finally:
        for task in tasks:  # one failed or we were cancelled: stop (and thereby abort) the others
            task.cancel()
    n = cmpl.params.n
    num_top = cmpl.params.logprobs
    choices = []
    num_prompt_tokens = num_completion_tokens = num_cached_tokens = 0
    for p_index, (prompt, final) in enumerate(zip(cmpl.prompts, finals, strict=True)):
        num_prompt_tokens += len(prompt.prompt_token_ids)
        num_cached_tokens += final.num_cached_tokens
        prefix = _echo_text(ctx, prompt) if cmpl.echo else ""
        echoed = _echoed_logprobs(ctx, cmpl, prompt, final) if cmpl.echo else None  # the same for every sample
        for completion in final.outputs:
            token_ids, text = completion.token_ids, completion.text
            entries: list[dict[int, Logprob] | None] | None = completion.logprobs
            num_completion_tokens += len(token_ids)
            logprobs = None
            if num_top is not None and entries is not None:
                # One chain of offsets over the echoed prompt's tokens and the generated ones (the tokens'
                # texts need not add up to the prompt as given: a BOS token, byte pieces).
                start = _chain_end(echoed, len(prefix))
                logprobs = completion_logprobs(ctx.engine.tokenizer, token_ids, entries, num_top, start,
                                               cmpl.tokens_as_ids)
                if echoed is not None:
                    logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
            choice = {
                "index": p_index * n + completion.index,
                "text": prefix + text,
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            if final.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
            if cmpl.return_token_ids:
                choice["prompt_token_ids"] = prompt.prompt_token_ids
                choice["token_ids"] = list(token_ids)
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    return {
        "id": cmpl.request_id,
        "object": "text_completion",
        "created": cmpl.created,
        "model": cmpl.model,
        "choices": choices,
        "usage": usage_dict(num_prompt_tokens, num_completion_tokens, num_cached_tokens),
    }


async def completion_stream(ctx: ServingContext, cmpl: PreparedCompletion, include_usage: bool,
                            continuous_usage: bool) -> AsyncIterator[str]:
    """SSE events: text chunks of every choice as they come, each choice's finish, [DONE].
    `continuous_usage` (only with `include_usage`): every chunk's usage is its own choice's, as vLLM's: its
    prompt's tokens and the choice's tokens so far; the last chunk's has every prompt's and choice's."""
    n = cmpl.params.n
    num_top = cmpl.params.logprobs
    usage_field = include_usage
    num_prompt_tokens = sum(len(p.prompt_token_ids) for p in cmpl.prompts)
    num_tokens_by_choice: dict[int, int] = {}  # the tokens each choice has generated so far
    cached: dict[int, int] = {}
    finished_sent: set[int] = set()
    offsets: dict[int, int] = {}
    echoed_of: dict[int, dict[str, Any] | None] = {}  # per prompt: its echoed tokens' logprobs object

    def chunk(choice: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {"id": cmpl.request_id, "object": "text_completion", "created": cmpl.created,
                                "model": cmpl.model, "choices": choice}
        if usage_field:
            body["usage"] = usage
        return sse(body)

    try:
        async with closing_updates(_merge(ctx, cmpl)) as updates:
            async for p_index, update in updates:
                cached[p_index] = update.num_cached_tokens
                for completion in update.outputs:
                    index = p_index * n + completion.index
                    if index in finished_sent:
                        continue
                    delta_ids = completion.token_ids_delta
                    num_tokens_by_choice[index] = num_tokens_by_choice.get(index, 0) + len(delta_ids)
                    text = completion.text_delta
                    first = index not in offsets  # this choice's first chunk (offsets has the choices sent)
                    echo = _echo_text(ctx, cmpl.prompts[p_index]) if cmpl.echo and first else ""
                    want_logprobs = num_top is not None and completion.logprobs is not None
                    # A chunk for every new token, also one whose text is still empty (held back as a partial
                    # character or a possible stop string, or a special token), as vLLM streams: the client sees
                    # the first token when it is generated.
                    if not (echo or text or delta_ids or completion.finished):
                        continue
                    offset = offsets.setdefault(index, 0)
                    logprobs = None
                    offsets[index] = offset + len(echo) + len(text)
                    if want_logprobs:
                        echoed = None
                        if echo:  # the prompt's, the same for every sample of it
                            if p_index not in echoed_of:
                                echoed_of[p_index] = _echoed_logprobs(ctx, cmpl, cmpl.prompts[p_index], update)
                            echoed = echoed_of[p_index]
                        entries = delta_logprobs(completion) if delta_ids else []
                        logprobs = completion_logprobs(ctx.engine.tokenizer, delta_ids, entries, num_top or 0,
                                                       _chain_end(echoed, offset + len(echo)), cmpl.tokens_as_ids)
                        if echoed is not None:
                            logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
                        if logprobs["tokens"]:
                            # Offsets count the tokens' texts, as the non-streamed answer does, not the text sent
                            # so far (which lags while text is held back): the same whichever steps share a chunk.
                            offsets[index] = _chain_end(logprobs, offsets[index])
                    choice: dict[str, Any] = {
                        "index": index, "text": echo + text, "logprobs": logprobs,
                        "finish_reason": completion.finish_reason if completion.finished else None}
                    if first and update.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = prompt_logprobs_json(update.prompt_logprobs)
                    if cmpl.return_token_ids:
                        choice["token_ids"] = list(delta_ids)
                        if first:
                            choice["prompt_token_ids"] = cmpl.prompts[p_index].prompt_token_ids
                    if completion.finished:
                        choice["stop_reason"] = completion.stop_reason
                        finished_sent.add(index)
                    usage = (usage_dict(len(cmpl.prompts[p_index].prompt_token_ids), num_tokens_by_choice[index],
                                        cached[p_index]) if continuous_usage else None)
                    yield chunk([choice], usage)
    except Exception as e:
        yield sse(engine_error(e, cmpl.structure_param).to_body())
        yield SSE_DONE
        return
    if include_usage:
        yield chunk([], usage_dict(num_prompt_tokens, sum(num_tokens_by_choice.values()), sum(cached.values())))
    yield SSE_DONE


async def _merge(ctx: ServingContext, cmpl: PreparedCompletion) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Updates of all prompts, interleaved as they arrive, tagged with the prompt's position."""
    if len(cmpl.prompts) == 1:
        p = cmpl.prompts[0]
        async with closing_updates(ctx.engine.generate(cmpl.request_id, p.prompt_token_ids, p.settings(cmpl), p.text,
                                                       cache_salt=cmpl.cache_salt, priority=cmpl.priority,
                                                       prompt_only=cmpl.echo_only)) as updates:
            async for update in updates:
                yield 0, update
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, prompt: PreparedPrompt) -> None:
        try:
            async with closing_updates(ctx.engine.generate(
                    cmpl.request_id, prompt.prompt_token_ids, prompt.settings(cmpl), prompt.text,
                    cache_salt=cmpl.cache_salt, priority=cmpl.priority, prompt_only=cmpl.echo_only)) as updates:
                async for update in updates:
                    queue.put_nowait((index, update))
        except Exception as e:
            queue.put_nowait((index, e))
            return
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(cmpl.prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        # Disconnect or a failed prompt: stop (and thereby abort) the others. (A failure of the caller's own ends
        # them as aborted too, not failed: `closing_updates` cannot throw into generators the pumps are running.)
        for task in tasks:
            task.cancel()
