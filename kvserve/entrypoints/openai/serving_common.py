"""What the chat and completion handlers share: model names, sampling parameters, length checks, SSE,
logprob formatting and cancellation on client disconnect."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.types import Receive

from kvserve.engine.async_llm import AsyncLLM, RequestFailedError
from kvserve.engine.core_client import EngineDeadError
from kvserve.engine.input_processor import encode_text
from kvserve.entrypoints.openai.errors import (
    BadRequestError,
    InternalServerError,
    NotFoundError,
    OpenAIError,
    ServiceUnavailableError,
)
from kvserve.entrypoints.openai.protocol import SamplingFields
from kvserve.model.generation_defaults import capped_max_tokens
from kvserve.model.tokenizer import token_bytes
from kvserve.protocol.outputs import CompletionOutput, Logprob
from kvserve.protocol.sampling_params import (
    MAX_LOGPROBS,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)

logger = logging.getLogger("kvserve.server")

T = TypeVar("T")


@dataclass
class ServingContext:
    """What every handler needs; built once at start-up."""

    engine: AsyncLLM
    served_model_names: list[str]
    model_path: str
    log_requests: bool = True
    created: int = 0
    # SamplingParams field -> value for what a request leaves out: the model's generation config
    # (ModelConfig.sampling_defaults).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # Every request's max_tokens is lowered to this (ModelConfig.max_tokens_cap; None: no cap).
    max_tokens_cap: int | None = None
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs
    tool_call_parser: str | None = None  # --tool-call-parser with --enable-auto-tool-choice: tool_choice "auto" served
    reasoning_parser: str | None = None  # --reasoning-parser: chat replies' reasoning as the message's `reasoning`
    scheduling_policy: str = "fcfs"  # --scheduling-policy: "priority" serves requests' priority
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: the default of the request field
    response_role: str = "assistant"  # --response-role: chat replies' role under add_generation_prompt
    # The Responses API's stored responses (serving_responses.ResponseStore); None: the store is off
    responses_store: Any = None
    # Tokenization (and a chat template's rendering) runs here, off the event loop: a 1,024-token prompt took
    # 3-6 ms, during which every other stream's chunks would wait. One thread, so two encodes never run at
    # once. The event loop's detokenization may run beside an encode: both only read the tokenizer, and
    # decoding holds the GIL.
    prepare_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tokenize")
    )

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> str:
        """The name to report in the response; 404 for a model this server does not serve."""
        if model is None or model == "":
            return self.model_name
        if model not in self.served_model_names:
            raise NotFoundError(f"The model `{model}` does not exist.", "model")
        return model

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the preparation thread (tokenization, chat templates); its exceptions propagate."""
        return await asyncio.get_running_loop().run_in_executor(self.prepare_pool, fn, *args)

    def tokens_as_ids(self, requested: bool | None) -> bool:
        """A request's return_tokens_as_token_ids, or the server's --return-tokens-as-token-ids when it gives none."""
        return self.return_tokens_as_token_ids if requested is None else bool(requested)

    def check_priority(self, priority: int) -> None:
        """400 for a priority the scheduling policy does not serve (before a stream starts)."""
        if priority != 0 and self.scheduling_policy != "priority":
            raise BadRequestError(f"priority {priority} needs the server started with --scheduling-policy priority",
                                  "priority")

    def check_logprobs(self, count: int | None, param: str) -> None:
        if count is not None and count > self.max_logprobs:
            raise BadRequestError(f"{param} is {count}, more than this server's --max-logprobs ({self.max_logprobs})",
                                  param)

    def check_engine(self) -> None:
        if self.engine.dead_error is not None or not self.engine.is_alive:
            raise ServiceUnavailableError("the engine is not running", None)


def check_supported(req: SamplingFields) -> None:
    """400 for a vLLM field this server does not implement, set to something that would change the answer."""
    name = req.unsupported_field()
    if name is not None:
        raise BadRequestError(f"{name} is not supported by this server", name)


def structured_outputs_from(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str]:
    """The request's grammar, from whichever of response_format, structured_outputs and the guided_* fields
    sets one (400 when more than one does, or for a response_format type that is not served), and the field
    it came from (an invalid grammar's 400 names it)."""
    specs: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None:
        if fmt.type == "json_object":
            specs.append(("response_format", {"json_object": True}))
        elif fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise BadRequestError('response_format "json_schema" needs json_schema.schema', "response_format")
            specs.append(("response_format", {"json": fmt.json_schema.json_schema}))
        elif fmt.type != "text":
            raise BadRequestError(f'response_format type must be "text", "json_object" or "json_schema", got '
                                  f"{fmt.type!r}", "response_format")
    if req.structured_outputs is not None:
        specs.append(("structured_outputs", dict(req.structured_outputs)))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            specs.append((name, {key: value}))
    if not specs:
        return None, "structured_outputs"
    if len(specs) > 1:
        raise BadRequestError(f"only one of {', '.join(n for n, _ in specs)} may set the output's structure",
                              specs[1][0])
    name, fields = specs[0]
    if req.guided_whitespace_pattern is not None and "whitespace_pattern" not in fields:
        fields["whitespace_pattern"] = req.guided_whitespace_pattern
    try:
        return StructuredOutputsParams.from_dict(fields), name
    except SamplingParamsError as e:
        raise BadRequestError(str(e), name) from None


def new_request_id(prefix: str, requested: str | None) -> str:
    """`<prefix>-<base>`, as vLLM names a response: the base is the client's (the X-Request-Id header, else
    the `request_id` field, which the endpoint has merged) when given, else a fresh one. An id in use is taken
    again, as current vLLM takes it: every prompt runs under a core id of its own (`AsyncLLM`) and a client's
    disconnect ends only its own request, so a gateway that sends one trace id with several requests gets each
    of them served (an id refused while in use failed them at random, as their timing fell)."""
    return f"{prefix}-{requested}" if requested else f"{prefix}-{uuid.uuid4().hex}"


def sampling_params_from(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    param_names: dict[str, str] | None = None,
    defaults: dict[str, Any] | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams of an API request; out-of-range values become 400s naming the API's field. `defaults`
    (the model's generation config) fill temperature, top_p, top_k, min_p and repetition_penalty where the
    request leaves them out; then the engine's neutral values. `max_tokens` is resolved by the caller."""
    names = dict(param_names or {})
    given = defaults or {}
    structured, structured_param = structured_outputs_from(req)
    names.setdefault("structured_outputs", structured_param)
    logit_bias: dict[int, float] | None = None
    if req.logit_bias:
        try:
            logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise BadRequestError("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None

    def pick(name: str, neutral: float) -> Any:
        value = getattr(req, name)
        return value if value is not None else given.get(name, neutral)

    try:
        return SamplingParams(
            n=req.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=logit_bias,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words or None,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            structured_outputs=structured,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
        )
    except SamplingParamsError as e:
        raise _renamed(e, names) from None


def _renamed(error: SamplingParamsError, names: dict[str, str]) -> BadRequestError:
    """A 400 for `error` under the API's names of the parameters (max_completion_tokens for max_tokens, ...):
    in its param, and in the message wherever it names one of them as a word ("min_tokens (5) must be <=
    max_tokens (3)" to a request that sent max_completion_tokens)."""
    message = str(error)
    for engine_name, api_name in names.items():
        if api_name != engine_name:
            message = re.sub(rf"(?<![\w.]){re.escape(engine_name)}(?![\w.])", api_name, message)
    return BadRequestError(message, names.get(error.param, error.param))


def with_bad_words(engine: AsyncLLM, params: SamplingParams) -> SamplingParams:
    """`params` with its bad words tokenized (here, off the event loop, rather than in `AsyncLLM.generate`);
    a 400 for a word the tokenizer cannot take, and for a token id past the vocabulary (the tokenizer's or the
    model's, the smaller) in logit_bias or allowed_token_ids: `AsyncLLM.generate` refuses those too, but only
    once a stream's 200 has gone out."""
    try:
        if params.bad_words:  # (tokenized here: the sequences kept are in the vocabulary)
            params = engine.input_processor.resolve_bad_words(params)
        if params.logit_bias or params.allowed_token_ids:
            engine.input_processor.check_token_ids(params)
    except SamplingParamsError as e:
        raise BadRequestError(str(e), e.param) from None
    return params


def encode_prompt(engine: AsyncLLM, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """A prompt's token ids; a 400 naming `param` for text the tokenizer cannot take (a lone surrogate)."""
    try:
        return encode_text(engine.tokenizer, text, add_special_tokens)
    except ValueError as e:
        raise BadRequestError(f"the {param} is not valid text: {e}", param) from None


def with_length_limits(params: SamplingParams, default_max: int | None, cap: int | None, room: int,
                       param_names: dict[str, str] | None = None) -> SamplingParams:
    """`params` with max_tokens as vLLM resolves it: the request's own (None: the generation config's reply
    length `default_max`), lowered to the generation config's `cap` (silently, as vLLM) and, for a default,
    to `room` (what the context leaves, so that a default never refuses a prompt that fits; a request's own
    value above it was refused by check_lengths). Unchanged when neither the request nor the generation
    config sets a length (the engine then stops where the context ends). A 400 when the request's own
    settings do not fit (min_tokens above the result, or above what the context leaves: vLLM's max_tokens is
    then that room, and refuses a min_tokens beyond it rather than serving fewer tokens than it asks for)."""
    limit = capped_max_tokens(params.max_tokens, default_max, cap)
    if limit is None:
        if params.min_tokens > room:
            raise BadRequestError(f"min_tokens ({params.min_tokens}) must be <= max_tokens ({room}: max_tokens is "
                                  f"not set, and the context leaves room for {room} tokens)", "min_tokens")
        return params
    limit = min(limit, room)
    if limit == params.max_tokens:
        return params
    try:
        return dataclasses.replace(params, max_tokens=limit)
    except SamplingParamsError as e:
        names = param_names or {}
        why = f"the server caps max_tokens at {cap} (its generation config's max_new_tokens)" \
            if cap is not None and limit == cap else "max_tokens is the model's default reply length, or what " \
            "the context leaves"
        raise BadRequestError(f"{e} ({why})", names.get(e.param, e.param)) from None


def check_lengths(
    engine: AsyncLLM,
    num_prompt_tokens: int,
    max_tokens: int | None,
    prompt_param: str,
    max_tokens_param: str,
) -> None:
    """Refuse (400) what cannot fit in max_model_len instead of truncating it, as vLLM does."""
    max_model_len = engine.max_model_len
    if num_prompt_tokens == 0:
        raise BadRequestError("the prompt is empty (it must have at least one token)", prompt_param)
    if num_prompt_tokens >= max_model_len:
        raise BadRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, and it must be shorter than the maximum context length to leave "
            f"room for at least one output token. Please reduce the length of the prompt.",
            prompt_param,
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise BadRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
            f"completion). Please reduce the length of the prompt or {max_tokens_param}.",
            max_tokens_param,
        )


def check_token_ids(engine: AsyncLLM, token_ids: list[int], param: str, tokenized: bool = False) -> None:
    """A 400 naming `param` for a prompt's token id outside the input processor's [0, vocab_size) (the smaller of
    the tokenizer's and the model's vocabularies): the engine core refuses one past the model's too, but only
    once a stream's 200 has gone out. `tokenized`: the server tokenized the prompt (a text, rendered messages),
    so its ids are the tokenizer's, which may hold more than the model's vocabulary: the message names the
    token."""
    processor = engine.input_processor
    bad = processor.first_out_of_vocab(token_ids)
    if bad is None:
        return
    if tokenized:
        raise BadRequestError(f"token id {bad} ({engine.tokenizer.decode([bad])!r}) of the tokenized {param} is "
                              f"out of range {processor.vocab_range()}", param)
    raise BadRequestError(f"token id {bad} is out of range {processor.vocab_range()}", param)


def log_request(ctx: ServingContext, request_id: str, num_prompt_tokens: int, params: SamplingParams,
                prompt: str | None) -> None:
    if not ctx.log_requests:
        return
    # NOTE: parameters and sizes only at INFO; prompts are user data and appear only at DEBUG.
    logger.info(
        "request %s: %d prompt tokens, n=%d, max_tokens=%s, temperature=%s, top_p=%s, top_k=%s, seed=%s, "
        "logprobs=%s, stop=%d strings",
        request_id, num_prompt_tokens, params.n, params.max_tokens, params.temperature, params.top_p,
        params.top_k, params.seed, params.logprobs, len(params.stop or []),
    )
    if prompt is not None and logger.isEnabledFor(logging.DEBUG):
        logger.debug("request %s prompt: %r", request_id, prompt)


def engine_error(e: Exception, structure_param: str = "structured_outputs") -> OpenAIError:
    """Map what `AsyncLLM.generate` raises to an HTTP error. `structure_param`: the request's field that set
    the output's structure, which a grammar the engine could not compile is reported against."""
    if isinstance(e, EngineDeadError):
        return ServiceUnavailableError(f"the engine is not running: {e}")
    if isinstance(e, RequestFailedError):
        return BadRequestError(str(e), structure_param if e.param == "structured_outputs" else e.param)
    if isinstance(e, SamplingParamsError):
        return BadRequestError(str(e), e.param)
    if isinstance(e, ValueError):
        return BadRequestError(str(e))
    # A bug: logged with its traceback, answered as an OpenAI error (a stream ends with it and [DONE]).
    logger.error("request failed in the server", exc_info=e)
    return InternalServerError(f"internal server error: {type(e).__name__}: {e}")


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


# ------------------------------------------------------------------------------------------ logprobs


def sampled_and_top(
    token_id: int, entry: dict[int, Logprob], num_top: int
) -> tuple[Logprob, list[tuple[int, Logprob]]]:
    """The sampled token's Logprob and the `num_top` most likely (token id, Logprob), most likely first."""
    sampled = entry[token_id]
    top = sorted(((tid, lp) for tid, lp in entry.items() if lp.rank <= num_top), key=lambda t: t[1].rank)
    return sampled, top[:num_top]


def _token_text(tokenizer: Any, token_id: int, lp: Logprob | None) -> str:
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else tokenizer.decode([token_id])


def _shown(token_id: int, text: str, as_ids: bool) -> str:
    """A token as logprobs show it: its text, or with vLLM's return_tokens_as_token_ids "token_id:<id>"
    (what a client can map back to the token when its text is not valid UTF-8 on its own)."""
    return f"token_id:{token_id}" if as_ids else text


def _label(tokenizer: Any, token_id: int, lp: Logprob | None, as_ids: bool) -> str:
    """`_shown` where the text is needed only to show it (not decoded for a token shown by its id)."""
    return f"token_id:{token_id}" if as_ids else _token_text(tokenizer, token_id, lp)


def chat_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int,
                  as_ids: bool = False) -> dict[str, Any]:
    """OpenAI chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}, ...]}; `as_ids`:
    tokens as "token_id:<id>"."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        sampled, top = sampled_and_top(token_id, entry, num_top)
        text = _token_text(tokenizer, token_id, sampled)
        content.append({
            "token": _shown(token_id, text, as_ids),
            "logprob": _finite(sampled.logprob),
            # `bytes`: the token's own bytes (a piece of a character too, whose text is U+FFFD), also when
            # `token` is its id
            "bytes": list(token_bytes(tokenizer, token_id, text)),
            "top_logprobs": [
                {"token": _shown(tid, t := _token_text(tokenizer, tid, lp), as_ids), "logprob": _finite(lp.logprob),
                 "bytes": list(token_bytes(tokenizer, tid, t))}
                for tid, lp in top
            ],
        })
    return {"content": content}


def completion_logprobs(
    tokenizer: Any, token_ids: list[int], entries: Sequence[dict[int, Logprob] | None], num_top: int,
    text_offset: int, as_ids: bool = False
) -> dict[str, Any]:
    """OpenAI completions `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset). An entry of
    None (an echoed prompt's first token, which has no logprob) gives null logprobs. `as_ids`: tokens (and
    top_logprobs' keys) as "token_id:<id>"; text_offset then counts those strings, as vLLM's does."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for token_id, entry in zip(token_ids, entries, strict=True):
        value: float | None = None
        entry_top: dict[str, float] | None = None
        if entry is None:
            text = _label(tokenizer, token_id, None, as_ids)
        else:
            sampled, top = sampled_and_top(token_id, entry, num_top)
            text = _label(tokenizer, token_id, sampled, as_ids)
            value = _finite(sampled.logprob)
            # The sampled token and the top `num_top`, as OpenAI's legacy API and vLLM give them (up to
            # num_top + 1). Keyed by text: where tokens decode alike (byte pieces all decode to U+FFFD) the
            # sampled token's value stays, then the most likely one's.
            entry_top = {text: value}
            for tid, lp in top:
                entry_top.setdefault(_label(tokenizer, tid, lp, as_ids), _finite(lp.logprob))
        tokens.append(text)
        token_logprobs.append(value)
        tops.append(entry_top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` response field: per prompt token, null (the first) or {token id: {logprob,
    rank, decoded_token}} holding the prompt token and the top-k at its position."""
    return [None if entry is None else {
        str(tid): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for tid, lp in entry.items()
    } for entry in entries]


def _finite(value: float) -> float:
    # -inf (a token masked out) and NaN are not valid JSON; report such tokens with a very low logprob.
    value = float(value)
    return value if math.isfinite(value) else -9999.0


def delta_logprobs(completion: CompletionOutput) -> list[dict[int, Logprob]]:
    """The logprob entries of this update's `token_ids_delta` (see `AsyncLLM.generate`)."""
    assert completion.logprobs is not None
    num = len(completion.token_ids_delta)
    return completion.logprobs[len(completion.logprobs) - num:] if num else []


# ---------------------------------------------------------------------------------------- disconnects


@asynccontextmanager
async def closing_updates(updates: AsyncGenerator[T, None]) -> AsyncIterator[AsyncGenerator[T, None]]:
    """`contextlib.aclosing` for `AsyncLLM.generate()`'s updates, or for a generator that reads them inside
    one of these. An exception of the caller's own while `updates` waits at an update (a failure of the server's
    code, the response under way) is first thrown into it there, so the engine ends the request as failed
    (finished reason "error") instead of aborted. A client that went away still aborts it: the caller is then
    cancelled or its response's generator closed, BaseExceptions that only close `updates`."""
    try:
        yield updates
    except Exception as e:
        try:
            await updates.athrow(e)
        except Exception:  # noqa: BLE001 - e again (or the generator's own end): the caller's error is raised
            pass
        raise
    finally:
        await updates.aclose()


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; cancel it if the client disconnects first (its generators then abort the request)."""
    work_task = asyncio.ensure_future(work)
    listen_task = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({work_task, listen_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        work_task.cancel()
        try:
            await work_task
        except BaseException:  # noqa: BLE001 - the client is gone; nothing to report to it
            pass
        raise ClientDisconnected()
    finally:
        listen_task.cancel()
        if not work_task.done():
            work_task.cancel()


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the request body must have been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
