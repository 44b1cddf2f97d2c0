"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(conversations)`."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jinja2
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from kvserve.config import EngineArgs
from kvserve.engine.input_processor import PromptType
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.generation_defaults import apply_cap, describe
from kvserve.model.tokenizer import load_tokenizer
from kvserve.protocol.outputs import RequestOutput
from kvserve.protocol.sampling_params import MAX_LOGPROBS, SamplingParams

Conversation = list[dict[str, Any]]

logger = logging.getLogger(__name__)


# vLLM's LLM(...) arguments that change nothing here (kvserve runs no checkpoint code, never downloads, logs
# no periodic stats offline, recomputes instead of swapping): accepted at these values, with a log line.
_IGNORED_VLLM_ARGS: dict[str, tuple[Any, ...]] = {
    "trust_remote_code": (True, False), "disable_log_stats": (True, False), "swap_space": (),
    "tokenizer_mode": ("auto", "hf"), "code_revision": (None,),
    # those `kvserve serve` / `generate` accept and ignore too (vllm_compat.add_ignored_engine_args)
    "task": ("auto", "generate"), "pipeline_parallel_size": (1,), "data_parallel_size": (1,),
    "distributed_executor_backend": (None, "mp", "uni"), "max_seq_len_to_capture": (),
    "disable_custom_all_reduce": (True, False), "preemption_mode": (None, "recompute"),
    "max_parallel_loading_workers": (), "max_cudagraph_capture_size": (), "enable_expert_parallel": (True, False),
    "enable_eplb": (True, False),
    # offline only (no such flags here): no async output processing to turn off, the tokenizer is always
    # loaded, nothing is downloaded
    "disable_async_output_proc": (True, False), "skip_tokenizer_init": (False,), "hf_token": (None,),
    # no LoRA adapters: LoRA off, and the sizes of adapters that never come (lm-evaluation-harness's vLLM
    # model passes enable_lora=False and max_lora_rank to every LLM it makes)
    "enable_lora": (False, None), "max_lora_rank": (), "max_loras": (), "max_cpu_loras": (),
}
# Settings whose None is vLLM's "not set" (its defaults are Optional): the default here too. Not `seed`, whose
# None asks for a random seed.
_NONE_IS_DEFAULT = frozenset(f.name for f in dataclasses.fields(EngineArgs) if f.default is not None) - {"seed"}
# vLLM's names for kvserve's own settings (kv_cache_memory_bytes is EngineArgs' own: read as vLLM reads it).
_VLLM_ALIASES = {"num_gpu_blocks_override": "num_kv_blocks"}


class UnknownEngineArgument(TypeError):
    """An engine argument kvserve does not take (`_engine_args`); `known`: the settings it does."""

    def __init__(self, name: str, value: Any, known: list[str]) -> None:
        super().__init__(f"LLM() got an argument kvserve does not take: {name}={value!r}. Engine settings: "
                         f"{', '.join(known)}")
        self.name, self.value, self.known = name, value, known


def _engine_args(given: dict[str, Any]) -> dict[str, Any]:
    """LLM(...)'s keyword arguments as EngineArgs takes them: vLLM's aliases renamed, None for a setting
    with a default left to the default (as vLLM reads None), the arguments that change nothing here dropped
    with a log line, and anything else EngineArgs does not know refused with the
    list of what it does (instead of a bare TypeError)."""
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    out: dict[str, Any] = {}
    for name, value in given.items():
        name = _VLLM_ALIASES.get(name, name)
        if value is None and name in _NONE_IS_DEFAULT:
            continue  # e.g. enable_prefix_caching=None: on, as vLLM's default (None was read as False)
        if name in known:
            out[name] = value
        elif name in _IGNORED_VLLM_ARGS and (not _IGNORED_VLLM_ARGS[name] or value in _IGNORED_VLLM_ARGS[name]):
            logger.info("LLM(%s=%r): accepted for vLLM code; it changes nothing in kvserve", name, value)
        else:
            raise UnknownEngineArgument(name, value, sorted(known - {"extra"}))
    return out


def _max_logprobs(value: Any) -> int:
    """vLLM's `LLM(max_logprobs=N)`: the most logprobs (and prompt_logprobs) a request may ask for. kvserve's
    engine returns at most MAX_LOGPROBS: a larger N (or vLLM's -1, the whole vocabulary) is taken as that,
    with a log line, so that a script written for vLLM runs when its requests ask for no more."""
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"max_logprobs must be an integer >= 0 (or -1), got {value!r}")
    if value == -1 or value > MAX_LOGPROBS:
        logger.info("LLM(max_logprobs=%d): kvserve returns at most %d logprobs per token; requests are held to %d",
                    value, MAX_LOGPROBS, MAX_LOGPROBS)
        return MAX_LOGPROBS
    return value


def _no_lora(lora_request: Any) -> None:
    """vLLM's `lora_request` argument: None (no adapter) is all kvserve takes."""
    if lora_request is not None:
        raise ValueError("kvserve does not serve LoRA adapters: merge the adapter into the model's weights and "
                         "load the merged checkpoint")


def _text_message(message: dict[str, Any], content_format: str = "string") -> dict[str, Any]:
    """A chat message with OpenAI's list of text parts joined into one string (vLLM's "string" content format,
    what it picks for templates that print the content), or with the content as a list of text parts
    ({"type": "text", "text": ...}; vLLM's "openai" format) for templates that loop over the parts. No content
    (None or left out, as an assistant turn of tool calls has) is the empty text, as the server reads it:
    templates that print the content failed on None."""
    content = message.get("content")
    if content is None:
        message = {**message, "content": "" if content_format == "string" else []}
        content = message["content"]
    if content_format == "openai":
        if isinstance(content, str):
            return {**message, "content": [{"type": "text", "text": content}]}
        if isinstance(content, list):
            return {**message, "content": [{"type": "text", "text": text}
                                           for text in _text_parts(content)]}
        return message
    if not isinstance(content, list):
        return message
    return {**message, "content": "\n".join(_text_parts(content))}


def _text_parts(content: list[Any]) -> list[str]:
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise ValueError(f"content parts of type {kind!r} are not supported (only text parts)")
    return texts


class LLM:
    """Generate with a model in this process.

    `model` is an HF model directory, a .gguf file, the id of an HF repo already in the local Hugging Face
    cache (`revision`, `download_dir`, `tokenizer_revision` pick its snapshot as in vLLM; nothing is
    downloaded), or None for the default model (SmolLM2-135M-Instruct GGUF). Other keyword arguments are engine settings named as vLLM names them (`dtype`,
    `max_model_len`, `block_size`, `enable_prefix_caching`, `max_num_seqs`, `max_num_batched_tokens`,
    `kv_cache_memory`, `seed`, ...; see `kvserve.config.EngineArgs`).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self._max_logprobs = _max_logprobs(engine_args.pop("max_logprobs", MAX_LOGPROBS))
        args = EngineArgs(model=model, **_engine_args(engine_args))
        config = args.create_engine_config()
        tokenizer = load_tokenizer(config.model_config.tokenizer, config.model_config.chat_template)
        self.engine = LLMEngine(config, tokenizer)
        self.config = self.engine.config
        self._ids = itertools.count()
        if self.config.model_config.sampling_defaults:
            logger.info("%s", describe(self.config.model_config.sampling_defaults,
                                       self.config.model_config.max_tokens_cap))

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine (`engine`)."""
        return self.engine

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: the model's generation config
        (`generation_config`, `override_generation_config`) over SamplingParams' own defaults, max_tokens
        within the generation config's cap."""
        return apply_cap(SamplingParams(**self.config.model_config.sampling_defaults),
                         self.config.model_config.max_tokens_cap)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, so that the next requests compute every prompt token (as vLLM's: for
        benchmarks that must not hit what an earlier run cached). Returns False, changing nothing, while a
        request is still live."""
        return self.engine.core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel processes (with `tensor_parallel_size` > 1; they also
        stop when this process exits). The object generates nothing after: `generate` and `chat` raise
        EngineDeadError."""
        self.engine.core.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        cache_salt: str | None = None,
        priority: Sequence[int] | None = None,
        *,
        lora_request: None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`.

        A prompt is a string, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": ...} (vLLM's
        TextPrompt / TokensPrompt; a "cache_salt" there is that prompt's, over the `cache_salt` argument).
        `sampling_params` is one SamplingParams for all prompts or one per prompt. `priority`: one per
        prompt, lower first (needs `scheduling_policy="priority"`, as in vLLM). `use_tqdm`: the progress bar
        on or off, or a tqdm class (or factory) to draw it with.
        """
        _no_lora(lora_request)
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        # The generation config's cap on max_tokens (an override's max_new_tokens, a --generation-config
        # DIR's) lowers every request's, as the server does.
        cap = self.config.model_config.max_tokens_cap
        params_list = [apply_cap(p, cap) for p in self._as_params_list(sampling_params, len(prompt_list))]
        for params in params_list:
            for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
                count = getattr(params, name)
                if count is not None and count > self._max_logprobs:
                    raise ValueError(f"Requested {kind} logprobs of {count}, which is greater than max allowed: "
                                     f"{self._max_logprobs} (LLM(max_logprobs=...))")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority has {len(priorities)} values for {len(prompt_list)} prompts")
        if any(type(p) is not int for p in priorities):
            raise ValueError(f"priority must be integers, got {priorities}")
        request_ids = []
        try:
            for prompt, params, prio in zip(prompt_list, params_list, priorities, strict=True):
                request_id = str(next(self._ids))
                # vLLM's prompt dicts carry their own cache_salt (TextPrompt / TokensPrompt)
                salt = prompt.get("cache_salt", cache_salt) if isinstance(prompt, dict) else cache_salt
                if salt is not None and not isinstance(salt, str):
                    raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
                self.engine.add_request(request_id, prompt, params, cache_salt=salt, priority=prio)
                request_ids.append(request_id)
        except BaseException:  # a bad prompt, or Ctrl-C while tokenizing: none of this call's requests stay
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        *,
        lora_request: None = None,
        chat_template_content_format: str = "auto",
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Like `generate`, for conversations ([{"role": ..., "content": ...}, ...]) rendered with the
        tokenizer's chat template (or `chat_template`). A message's content may be a string or OpenAI's list
        of text parts (joined with newlines). `continue_final_message` continues the last (assistant)
        message instead of opening a new one (with add_generation_prompt=False). Each output's `prompt` is
        the rendered text. `tools` (OpenAI's function tools) go to the template; the outputs are the model's
        text, tool calls unparsed (the server's --tool-call-parser reads them). vLLM's `lora_request` (None
        only), `chat_template_content_format` ("auto" = "string": parts joined; "openai": every content as a
        list of text parts) and `mm_processor_kwargs` (a multimodal processor's: ignored, as vLLM ignores them
        for a conversation without images) are taken by keyword."""
        # vLLM's chat_template_kwargs update the arguments chat() sets: add_generation_prompt, chat_template,
        # continue_final_message and tools given there win (and must not reach the template twice).
        kwargs = dict(chat_template_kwargs or {})
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", add_generation_prompt))
        chat_template = kwargs.pop("chat_template", chat_template)
        continue_final_message = bool(kwargs.pop("continue_final_message", continue_final_message))
        tools = kwargs.pop("tools", tools)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        _no_lora(lora_request)
        del mm_processor_kwargs  # processor settings for images; text-only conversations have none
        # vLLM's content formats; its "auto" picks "openai" only for templates that loop over content parts,
        # which kvserve's (text) models' templates do not: "auto" is "string" here.
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got "
                             f"{chat_template_content_format!r}")
        content_format = "openai" if chat_template_content_format == "openai" else "string"
        conversations: list[Conversation]
        if messages and isinstance(messages[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        if continue_final_message:
            kwargs["continue_final_message"] = True
        if tools:
            kwargs["tools"] = tools
        processed = []
        for i, conv in enumerate(conversations):
            try:
                processed.append(self.engine.input_processor.apply_chat_template(
                    [_text_message(m, content_format) for m in conv], chat_template, add_generation_prompt, kwargs))
            except (jinja2.TemplateError, TypeError, KeyError, IndexError) as e:  # as the server reads them: a
                # message without its content, a role the template refuses, content of a type it cannot add
                raise ValueError(f"cannot apply the chat template to conversation {i}: {type(e).__name__}: "
                                 f"{e}") from None
        return self.generate(
            [{"prompt": p.prompt, "prompt_token_ids": p.prompt_token_ids} for p in processed], sampling_params,
            use_tqdm,
        )

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if not isinstance(prompts, Iterable):  # (any iterable of prompts, as vLLM: a numpy array, a generator)
            raise TypeError(f"prompts must be a string, a list of token ids, a prompt dict or a list of these, "
                            f"got {type(prompts).__name__}")
        items = list(prompts)
        if items and all(isinstance(t, int) for t in items):
            return [items]  # one prompt given as token ids
        return items

    @staticmethod
    def _as_params_list(params: SamplingParams | Sequence[SamplingParams], num_prompts: int) -> list[SamplingParams]:
        if isinstance(params, SamplingParams):
            return [params] * num_prompts
        if not isinstance(params, Sequence) or not all(isinstance(p, SamplingParams) for p in params):
            hint = ": pass SamplingParams(**it)" if isinstance(params, dict) else ""
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                            f"{type(params).__name__}{hint}")
        params = list(params)
        if len(params) != num_prompts:
            raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
        return params

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        start = time.perf_counter()
        num_prompt_tokens = num_output_tokens = 0
        try:
            # use_tqdm: on / off, or (as vLLM takes it) the progress bar's class or factory, called as tqdm is
            # (inside the try: a factory that refuses these arguments must not leave the requests running)
            if callable(use_tqdm):
                bar = use_tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
            else:
                bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
            while self.engine.has_unfinished_requests():
                step_outputs = self.engine.step()
                for output in step_outputs:
                    if not output.finished:
                        continue
                    finished[output.request_id] = output
                    num_prompt_tokens += len(output.prompt_token_ids)
                    num_output_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(
                        f"input: {num_prompt_tokens / elapsed:.1f} tok/s, "
                        f"output: {num_output_tokens / elapsed:.1f} tok/s"
                    )
                    bar.update(1)
        except BaseException:
            # A request failed in the core (ValueError), or anything else stopped the call (an error in a step,
            # Ctrl-C, also while the progress bar draws between steps, or an error of a caller's progress bar
            # class, its construction included): the call's requests are dropped, so that they neither run on in
            # the next call nor leave the engine waiting for a step that never finished.
            for request_id in request_ids:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
            if bar is not None:
                bar.close()
            raise
        bar.close()
        return [finished[request_id] for request_id in request_ids]
