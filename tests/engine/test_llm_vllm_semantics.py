"""vLLM offline code run unchanged: SamplingParams values and prompt forms read as vLLM reads them, and the
LLM still usable after a call that failed."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.protocol.sampling_params import SamplingParamsError


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    return LLM(tiny_model_dir("llama"), max_model_len=128)


def test_logprobs_true_is_one_logprob(llm: LLM) -> None:
    """vLLM reads logprobs=True (and prompt_logprobs=True) as 1; it used to reach torch.topk as a bool, which
    failed the step."""
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=True, prompt_logprobs=True)
    assert params.logprobs == 1 and params.prompt_logprobs == 1
    out = llm.generate([list(range(100, 110))], params, use_tqdm=False)[0]
    one = llm.generate([list(range(100, 110))], SamplingParams(temperature=0, max_tokens=3, logprobs=1,
                                                               prompt_logprobs=1), use_tqdm=False)[0]
    assert out.outputs[0].logprobs == one.outputs[0].logprobs and len(out.outputs[0].logprobs) == 3
    assert out.prompt_logprobs == one.prompt_logprobs
    assert SamplingParams(logprobs=False).logprobs == 0  # an int in vLLM: the sampled token's logprob only


@pytest.mark.timeout(120)  # before the fix, the call after a KeyboardInterrupt never returned
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_call_stopped_by_an_error_leaves_the_llm_usable(llm: LLM, monkeypatch: pytest.MonkeyPatch,
                                                          error: type[BaseException]) -> None:
    """An exception out of a step other than a request's ValueError (a failure inside the model runner, Ctrl-C
    in a notebook) drops the call's requests as a ValueError does; they used to stay live, and every later call
    failed ("a placeholder token the previous step did not sample") or, after Ctrl-C, never returned."""
    prompt = [list(range(100, 110))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    sampler = llm.engine.core.runner.sampler
    real = type(sampler).__call__
    calls = 0

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # a step into the call, as logprobs=True once failed in torch.topk
            raise error("boom")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(sampler), "__call__", failing)
    with pytest.raises(error, match="boom"):
        llm.generate(prompt * 2, params, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.output_processor.has_unfinished() and not llm.engine.core.scheduler.requests
    outs = llm.generate(prompt * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [expected, expected]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_call_stopped_between_steps_leaves_nothing_behind(llm: LLM, error: type[BaseException]) -> None:
    """Ctrl-C (or an error of the caller's progress bar class) while the call updates its progress bar between
    steps, one request done and another running: the call's unfinished requests are dropped, as when a step
    fails. They used to stay live, holding their blocks, and the next call ran them along (their outputs lost)."""

    class FailingBar:
        def __init__(self, **kwargs: Any) -> None:
            pass

        def set_postfix_str(self, text: str) -> None:
            pass

        def update(self, n: int) -> None:
            raise error("boom")

        def close(self) -> None:
            pass

    params = [SamplingParams(temperature=0, max_tokens=1), SamplingParams(temperature=0, max_tokens=20, n=2)]
    with pytest.raises(error, match="boom"):
        llm.generate([list(range(100, 110)), list(range(200, 230))], params, use_tqdm=FailingBar)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.output_processor.has_unfinished() and not llm.engine.core.scheduler.requests
    stats = llm.engine.core.make_stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_a_progress_bar_factory_that_fails_leaves_nothing_behind(llm: LLM) -> None:
    """A use_tqdm factory that refuses the arguments it is called with (one written for another signature): the
    call fails, and its requests, already queued when the bar is made, are dropped. They used to stay live."""

    def bar_without_dynamic_ncols(total: int, desc: str) -> Any:
        raise AssertionError("not called with these arguments")

    with pytest.raises(TypeError, match="dynamic_ncols"):
        llm.generate([list(range(100, 110))], SamplingParams(max_tokens=20), use_tqdm=bar_without_dynamic_ncols)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.output_processor.has_unfinished() and not llm.engine.core.scheduler.requests


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_request_stopped_while_its_samples_are_added_leaves_nothing_behind(
        llm: LLM, monkeypatch: pytest.MonkeyPatch, error: type[BaseException]) -> None:
    """Ctrl-C (or any error) while an n=2 request's second sample is being added to the core: the request's
    first sample and its output state are dropped too. They used to stay (only a ValueError dropped them): the
    engine then had an unfinished request no call owned, and the next call ran it along."""
    prompt = [list(range(100, 110))]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    expected = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    core = llm.engine.core
    real = type(core).add_request
    calls = 0

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # the second sample of the request
            raise error("boom")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(core), "add_request", failing)
    with pytest.raises(error, match="boom"):
        llm.generate(prompt, SamplingParams(n=2, temperature=0.8, max_tokens=3, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.output_processor.has_unfinished() and not core.scheduler.requests
    outs = llm.generate(prompt, params, use_tqdm=False)
    assert len(outs) == 1 and outs[0].outputs[0].token_ids == expected


def test_seed_minus_one_is_unseeded() -> None:
    """vLLM reads seed=-1 as no seed (its SamplingParams sets None; OpenAI clients send -1 for "random"): each
    request samples anew instead of every one repeating the samples of a fixed seed -1."""
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2 and SamplingParams(seed=0).seed == 0
    # an n > 1 request's samples take seed + index, -1 included (vLLM copies the params with it)
    assert [SamplingParams(seed=-2, n=3).for_sample(i).seed for i in range(3)] == [-2, -1, 0]


def test_largest_seed_takes_n_samples() -> None:
    """seed + index wraps within 64 bits: the largest seed, valid for one sample, is valid for n samples too
    (its second sample's seed 2**63 was refused, so the whole n>1 request failed naming a seed never given)."""
    top = (1 << 63) - 1
    seeds = [SamplingParams(seed=top, n=3).for_sample(i).seed for i in range(3)]
    assert seeds == [top, -(1 << 63), -(1 << 63) + 1]


@pytest.mark.parametrize("name", ["temperature", "repetition_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_temperature_and_repetition_penalty_are_refused(name: str, value: float) -> None:
    """As in vLLM ("must be a finite number"); NaN passed the range checks and sampled garbage (token 0 on every
    step with temperature=nan, one token over and over with repetition_penalty=nan)."""
    with pytest.raises(SamplingParamsError, match=f"{name} must be a finite number") as info:
        SamplingParams(**{name: value})
    assert info.value.param == name


def test_prompt_dicts_cache_salt(llm: LLM) -> None:
    """vLLM's TextPrompt / TokensPrompt: a "cache_salt" keeps the prompt's prefix-cache entries apart from other
    salts' (it was ignored: prompts of different salts shared their blocks)."""
    ids = list(range(200, 250))  # three full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2)

    def cached(prompt: Any) -> int:
        return llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens

    assert llm.reset_prefix_cache()
    assert cached({"prompt_token_ids": ids, "cache_salt": "alice"}) == 0
    assert cached({"prompt_token_ids": ids, "cache_salt": "bob"}) == 0
    assert cached({"prompt_token_ids": ids, "cache_salt": "alice"}) == 48
    assert cached({"prompt_token_ids": ids}) == 0
    with pytest.raises(ValueError, match="cache_salt must be a string, got int"):
        llm.generate({"prompt_token_ids": ids, "cache_salt": 42}, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_prompt_dicts_with_multimodal_data_are_refused(llm: LLM) -> None:
    """A text-only model given vLLM's "multi_modal_data" refuses the prompt, as vLLM does; it was ignored, and
    the model answered the text alone. As in vLLM, only data counts: None or {} is none, and the processor
    kwargs and uuids that go with data are read only with it."""
    params = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match="text-only models: a prompt cannot carry multi_modal_data"):
        llm.generate({"prompt": "Describe the image", "multi_modal_data": {"image": object()}}, params,
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    for extra in ({"multi_modal_data": None}, {"multi_modal_data": {}}, {"mm_processor_kwargs": {"num_crops": 4}},
                  {"multi_modal_uuids": {}}):
        assert llm.generate({"prompt": "Hi", **extra}, params, use_tqdm=False)[0].finished, extra


def test_llm_seed_none_samples(tiny_model_dir: Any) -> None:
    """LLM(seed=None), the default of vLLM's LLM signature for long: the engine draws a random seed (vLLM then
    seeds nothing); it used to reach torch's manual_seed as None and fail every sampled request."""
    llm = LLM(tiny_model_dir("llama"), max_model_len=64, seed=None)
    out = llm.generate([list(range(100, 105))], SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert isinstance(llm.config.model_config.seed, int)


def test_vllm_arguments_the_cli_ignores_are_ignored_offline_too(tiny_model_dir: Any) -> None:
    """vLLM's LLM() arguments that `kvserve serve` accepts and ignores as flags (--task generate, -pp 1, ...)
    are taken by LLM() too, at the values that change nothing; they were a TypeError offline only."""
    llm = LLM(tiny_model_dir("llama"), max_model_len=64, task="generate", pipeline_parallel_size=1,
              data_parallel_size=1, distributed_executor_backend="mp", max_seq_len_to_capture=8192,
              disable_custom_all_reduce=True, disable_async_output_proc=False, skip_tokenizer_init=False,
              hf_token=None)
    assert llm.generate([[100, 101]], SamplingParams(max_tokens=1), use_tqdm=False)[0].finished
    for name, value in (("task", "embed"), ("pipeline_parallel_size", 2), ("skip_tokenizer_init", True)):
        with pytest.raises(TypeError, match=f"kvserve does not take: {name}={value!r}"):
            LLM(tiny_model_dir("llama"), max_model_len=64, **{name: value})


def test_vllm_constructor_defaults_passed_explicitly(tiny_model_dir: Any) -> None:
    """What vLLM code passes to LLM() as it stands: None for a setting vLLM types Optional (its "not set") is
    kvserve's default (enable_prefix_caching=None and enable_chunked_prefill=None turned both off; None counts
    and sizes were a TypeError from a comparison), a torch.dtype is its name, lm-evaluation-harness's
    enable_lora=False with max_lora_rank are taken (no adapters; LoRA itself stays refused), and so is
    tokenizer_mode="hf" (as the CLI takes it). (max_logprobs is LLM's own: test_llm_api.)"""
    import torch

    from kvserve.config import EngineArgs
    from kvserve.engine.llm import _engine_args

    def config(**given: Any) -> Any:
        return EngineArgs(model=tiny_model_dir("llama"), **_engine_args(given)).create_engine_config()

    default = config()
    given = config(enable_prefix_caching=None, enable_chunked_prefill=None, max_num_seqs=None, block_size=None,
                   max_num_batched_tokens=None, gpu_memory_utilization=None, tensor_parallel_size=None,
                   kv_cache_dtype=None, dtype=torch.float32, enable_lora=False, max_lora_rank=16, max_loras=1,
                   tokenizer_mode="hf")
    assert given.cache_config.enable_prefix_caching is True and given.scheduler_config.enable_chunked_prefill is True
    assert (given.scheduler_config, given.cache_config, given.model_config.dtype) == (
        default.scheduler_config, default.cache_config, "float32")
    assert config(dtype=torch.float16).model_config.dtype == "float16"
    with pytest.raises(TypeError, match="kvserve does not take: enable_lora=True"):
        config(enable_lora=True)


def test_request_output_fields_of_what_kvserve_does_not_serve_are_none(llm: LLM) -> None:
    """As vLLM's offline API gives them (`metrics` too: vLLM's LLM() defaults to disable_log_stats=True, which
    leaves it None); `metrics` was an empty dict, so vLLM code that reads it when it is not None broke."""
    out = llm.generate([[100, 101]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert (out.metrics, out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids) == (None,) * 4


def test_vllm_keyword_arguments_of_generate_and_chat(llm: LLM) -> None:
    """vLLM code passes lora_request=None, chat_template_content_format and mm_processor_kwargs=None by keyword;
    each was a TypeError. An adapter is refused; "openai" hands the template a list of text parts."""
    params = SamplingParams(temperature=0, max_tokens=2)
    plain = llm.generate([[100, 101]], params, use_tqdm=False)[0]
    assert llm.generate([[100, 101]], params, use_tqdm=False, lora_request=None)[0].outputs[0].token_ids == \
        plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate([[100, 101]], params, use_tqdm=False, lora_request=object())  # type: ignore[arg-type]
    template = ("{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}"
                "{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}|{% endfor %}")
    conversation = [{"role": "user", "content": "Hi"},
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]

    def rendered(**kwargs: Any) -> str:
        return llm.chat(conversation, params, use_tqdm=False, chat_template=template, lora_request=None,
                        mm_processor_kwargs=None, **kwargs)[0].prompt

    assert rendered() == rendered(chat_template_content_format="string") == "user:Hi|user:a\nb|"
    assert rendered(chat_template_content_format="openai") == "user:[Hi]|user:[a][b]|"
    with pytest.raises(ValueError, match="chat_template_content_format"):
        rendered(chat_template_content_format="html")
    # a processor's kwargs are ignored for a conversation without images, as vLLM ignores them
    assert llm.chat(conversation, params, use_tqdm=False, chat_template=template,
                    mm_processor_kwargs={"num_crops": 4})[0].prompt == rendered()


def test_a_progress_bar_class_is_used_as_vllm_uses_it(llm: LLM) -> None:
    """use_tqdm may be tqdm's class or a factory (vLLM calls it as tqdm); it draws the bar."""
    from tqdm import tqdm

    made: list[dict[str, Any]] = []

    def quiet_bar(**kwargs: Any) -> Any:
        made.append(kwargs)
        return tqdm(**kwargs, disable=True)

    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=quiet_bar)
    assert len(outs) == 2 and [m["total"] for m in made] == [2] and made[0]["desc"] == "Processed prompts"
    llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=quiet_bar)
    assert [m["total"] for m in made] == [2, 1]


def test_inputs_of_the_wrong_kind_get_a_message_naming_the_argument(llm: LLM) -> None:
    with pytest.raises(TypeError, match=r"^prompts must be a string, a list of token ids, a prompt dict or a list "
                                        r"of these, got int$"):
        llm.generate(123)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^sampling_params must be a SamplingParams or a list of them \(one per "
                                        r"prompt\), got dict: pass SamplingParams\(\*\*it\)$"):
        llm.generate("a", {"max_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^cannot apply the chat template to conversation 1: UndefinedError: "):
        llm.chat([[{"role": "user", "content": "hi"}], [{"content": "no role"}]])
    with pytest.raises(ValueError, match=r"^cannot apply the chat template to conversation 0: TypeError: "):
        llm.chat([{"role": "user", "content": "hi"}], chat_template="{{ messages[0]['content'] + 1 }}")
    assert len(llm.generate("a", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    # Any iterable of prompts still is one: a numpy array, a generator.
    import numpy as np

    for prompts in (np.array(["a", "b"]), (p for p in ["a", "b"])):
        assert len(llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)) == 2


def test_the_engine_answers_what_vllm_code_asks_of_it(llm: LLM) -> None:
    engine = llm.llm_engine
    assert engine.get_tokenizer() is llm.get_tokenizer()
    assert engine.model_config.max_model_len == 128 and engine.model_config.dtype == "float32"
