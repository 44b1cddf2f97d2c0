"""The offline API as a user drives it: generate, chat, sampling options, errors, abort."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections.abc import Callable

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError
from kvserve.core.request import Request
from kvserve.protocol.sampling_params import SamplingParamsError


def test_generate_text_matches_tokens(default_llm: LLM) -> None:
    outs = default_llm.generate(
        ["Hello, my name is", "The capital of France is"],
        SamplingParams(temperature=0, max_tokens=16),
        use_tqdm=False,
    )
    tok = default_llm.get_tokenizer()
    assert [o.prompt for o in outs] == ["Hello, my name is", "The capital of France is"]
    for out in outs:
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason in ("stop", "length")
        assert 1 <= len(completion.token_ids) <= 16
        assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)


def test_chat_uses_the_template(default_llm: LLM) -> None:
    msgs = [{"role": "user", "content": "解释PagedAttention的工作原理"}]
    out = default_llm.chat([msgs], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    tok = default_llm.get_tokenizer()
    expected = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert out.outputs[0].text.strip()
    # A single conversation (not wrapped in a list) is accepted too.
    single = default_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert single.outputs[0].token_ids == out.outputs[0].token_ids


def test_chat_template_kwargs_override_the_arguments_chat_sets(default_llm: LLM) -> None:
    """As vLLM's chat(), chat_template_kwargs update the template arguments chat() sets (add_generation_prompt,
    chat_template, continue_final_message): given there, they win instead of failing as given twice."""
    tok = default_llm.get_tokenizer()
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    params = SamplingParams(temperature=0, max_tokens=1)
    plain = default_llm.chat(msgs, params, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})[0]
    assert plain.prompt == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    continued = default_llm.chat(msgs, params, use_tqdm=False, chat_template_kwargs={
        "add_generation_prompt": False, "continue_final_message": True})[0]
    assert continued.prompt.endswith("Hello")
    own = default_llm.chat(msgs, params, use_tqdm=False, chat_template_kwargs={
        "chat_template": "{% for m in messages %}{{ m.content }}|{% endfor %}"})[0]
    assert own.prompt == "Hi|Hello|"
    with pytest.raises(ValueError, match="continue_final_message needs add_generation_prompt=False"):
        default_llm.chat(msgs, params, use_tqdm=False, chat_template_kwargs={"continue_final_message": True})


def test_an_assistant_turn_of_tool_calls_without_content_is_the_empty_text(default_llm: LLM) -> None:
    """content None, or left out, beside tool_calls (as OpenAI clients send the turn back): the server reads
    it as the empty text; llm.chat passed None to the template, which failed ("'dict object' has no attribute
    'content'" with SmolLM2's)."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

    def conversation(assistant: dict) -> list[dict]:
        return [{"role": "user", "content": "weather?"}, {"role": "assistant", **assistant, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]

    params = SamplingParams(temperature=0, max_tokens=1)
    outs = [default_llm.chat(conversation(assistant), params, use_tqdm=False, tools=tools)[0]
            for assistant in ({"content": ""}, {"content": None}, {})]
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == outs[2].prompt_token_ids


def test_max_tokens_gives_length(default_llm: LLM) -> None:
    out = default_llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                               use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"


def test_stop_string_is_cut(default_llm: LLM) -> None:
    base = default_llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
    assert len(base.text) > 6
    stop = base.text[3:6]  # a stop string that occurs in the greedy text
    out = default_llm.generate(["Count: 1, 2, 3,"],
                               SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                               use_tqdm=False)[0].outputs[0]
    cut = base.text.index(stop)
    assert out.text == base.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # Generation ended at the stop string instead of running to max_tokens.
    assert len(out.token_ids) < len(base.token_ids)


def test_stop_token_ids(default_llm: LLM) -> None:
    base = default_llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = default_llm.generate(["Count: 1, 2, 3,"],
                               SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]),
                               use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_seeded_sampling_is_reproducible_and_batch_independent(default_llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = default_llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = default_llm.generate(
        ["The weather today", "Once upon a time", "我们今天"], [others, params, others], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone
    different = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=4321, ignore_eos=True)
    other_seed = default_llm.generate(["Once upon a time"], different, use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_n_samples_share_prompt_blocks(enable_prefix_caching: bool) -> None:
    llm = LLM(max_model_len=256, enable_prefix_caching=enable_prefix_caching)
    kv = llm.engine.core.scheduler.kv
    admitted: list[int] = []  # the prompt tokens each admission found in the hash map
    record_admission = kv.record_admission

    def recording(request: Request, num_hit_tokens: int) -> None:
        admitted.append(num_hit_tokens)
        record_admission(request, num_hit_tokens)

    kv.record_admission = recording
    prompt = "Write a haiku about the sea. " * 4  # several full blocks
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "distinct seeds should give distinct samples"
    # The later samples found the first one's prompt blocks...
    full = (len(out.prompt_token_ids) - 1) // 16 * 16
    assert admitted == [0, full, full]
    # ...which were in no prefix cache before the request: no cached tokens reported (it reported `full`).
    assert out.num_cached_tokens == 0
    stats = llm.engine.last_stats
    assert stats is not None and stats.num_free_blocks == stats.num_blocks


def test_logprobs(default_llm: LLM) -> None:
    out = default_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6, logprobs=3),
                               use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token_id in entry and 1 <= len(entry) <= 4
        sampled = entry[token_id]
        assert sampled.rank == 1  # greedy picks the most likely token
        assert sampled.logprob == pytest.approx(max(lp.logprob for lp in entry.values()))
        assert all(lp.logprob <= 0 for lp in entry.values())
        total += sampled.logprob
    assert out.cumulative_logprob == pytest.approx(total)
    assert math.isfinite(total)


def test_prompt_too_long_is_rejected_and_engine_survives() -> None:
    llm = LLM(max_model_len=64)
    with pytest.raises(ValueError, match=r"\b64\b") as info:
        llm.generate([list(range(100, 180))], SamplingParams(max_tokens=4), use_tqdm=False)
    assert "80" in str(info.value)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.finished and len(out.outputs[0].token_ids) >= 1


def test_a_shut_down_llm_generates_nothing(tiny_model_dir: Callable[..., str]) -> None:
    """After shutdown(), generate and chat raise EngineDeadError saying so, and queue nothing."""
    from kvserve.engine.errors import EngineDeadError

    llm = LLM(tiny_model_dir("llama"), max_model_len=64, kv_cache_memory="16MiB")
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    llm.shutdown()
    llm.shutdown()  # a second call changes nothing
    with pytest.raises(EngineDeadError, match="the engine was shut down"):
        llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(EngineDeadError, match="the engine was shut down"):
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_output_stops_at_max_model_len() -> None:
    llm = LLM(max_model_len=40)
    out = llm.generate([list(range(100, 130))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40
    assert out.outputs[0].finish_reason == "length"


def test_abort_frees_blocks(default_llm: LLM) -> None:
    engine = default_llm.engine
    engine.add_request("abort-me", "Tell me a long story about dragons.", SamplingParams(max_tokens=200))
    engine.add_request("keep-me", "Hello", SamplingParams(temperature=0, max_tokens=3))
    for _ in range(3):
        engine.step()
    pool = engine.core.scheduler.kv.pool
    assert pool.num_free_blocks < pool.num_blocks
    engine.abort_request("abort-me")
    while engine.has_unfinished_requests():
        engine.step()
    # Aborting frees the blocks at once, without waiting for another step.
    assert pool.num_free_blocks == pool.num_blocks
    assert not engine.core.scheduler.requests
    engine.core.scheduler.check_invariants()


def test_bad_sampling_params_are_clear() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(top_p=1.5)
    assert info.value.param == "top_p"
    with pytest.raises(SamplingParamsError):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize("field, value, message", [
    ("ignore_eos", "true", "ignore_eos must be true or false, got 'true'"),
    ("temperature", True, "temperature must be a number, got True"),
    ("temperature", "0.5", "temperature must be a number"),
    ("max_tokens", True, "max_tokens must be an integer, got True"),
    ("n", True, "n must be an integer"),
    ("max_tokens", 5.0, "max_tokens must be an integer, got 5.0"),
    ("seed", 2**70, "seed must be a 64-bit integer"),
    ("skip_special_tokens", None, "skip_special_tokens must be true or false"),
])
def test_sampling_params_of_the_wrong_type_are_refused_by_name(field: str, value: object, message: str) -> None:
    """A wrong type was taken before: read as truthy in this process, or refused only where the engine
    process decoded the request (the Triton backend's clients got "the engine could not read this request")."""
    with pytest.raises(SamplingParamsError, match=re.escape(message)) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_numpy_numbers_are_taken_as_pythons() -> None:
    """numpy's scalars (not Python's types) become Python's, so the request encodes for the engine process."""
    import msgspec
    import numpy as np

    params = SamplingParams(temperature=np.float32(0.5), max_tokens=np.int64(5), seed=np.int32(3),
                            ignore_eos=np.bool_(True))
    assert (params.temperature, params.max_tokens, params.seed, params.ignore_eos) == (0.5, 5, 3, True)
    assert [type(v) for v in (params.temperature, params.max_tokens, params.seed, params.ignore_eos)] == [
        float, int, int, bool]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params))["max_tokens"] == 5


def test_max_model_len_above_model_limit_is_refused() -> None:
    with pytest.raises(ConfigError, match="8192"):
        LLM(max_model_len=100_000)


def test_cli_generate(tiny_model_dir) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve", "generate", "--model", tiny_model_dir("llama"), "--prompt", "Hello",
         "--max-tokens", "4", "--max-model-len", "128"],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    llm = LLM(tiny_model_dir("llama"), max_model_len=128)
    expected = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert proc.stdout == expected.outputs[0].text + "\n"


def test_cli_reports_bad_model_path() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve", "generate", "--model", "/nonexistent/model", "--prompt", "x"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "/nonexistent/model" in proc.stderr


def test_token_ids_past_the_model_vocab_are_rejected(tiny_model_dir) -> None:
    # The tokenizer (49152 entries) is larger than this model's embedding table: such ids used to crash
    # the forward pass of the whole batch, and with it the server's engine process.
    llm = LLM(tiny_model_dir("llama", vocab_size=1000), max_model_len=128)
    with pytest.raises(ValueError, match=r"\[0, 1000\)"):
        llm.generate([[5, 999, 1000]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 999]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


def test_default_sampling_params_come_from_the_models_generation_config(tiny_model_dir, tmp_path) -> None:
    """A model whose generation_config.json sets top_k 1 (so sampling is greedy whatever the temperature) and
    max_new_tokens 6: `generate` without SamplingParams gives the greedy 6 tokens; with generation_config
    "vllm" the engine's own defaults (temperature 1, top_k off, 16 tokens) apply instead."""
    from helpers.tiny_models import with_generation_config

    model = with_generation_config(tiny_model_dir("llama"), str(tmp_path),
                                   {"top_k": 1, "temperature": 0.9, "max_new_tokens": 6})
    prompts = ["Hello, my name is", "The capital of France is"]
    llm = LLM(model, max_model_len=128)
    assert llm.get_default_sampling_params() == SamplingParams(top_k=1, temperature=0.9, max_tokens=6)
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    defaulted = llm.generate(prompts, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in defaulted] == [o.outputs[0].token_ids for o in greedy]
    assert all(len(o.outputs[0].token_ids) <= 6 for o in defaulted)
    chat = llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)[0]
    chat_greedy = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0.0, max_tokens=6),
                           use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == chat_greedy.outputs[0].token_ids

    plain = LLM(model, max_model_len=128, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    overridden = LLM(model, max_model_len=128, override_generation_config={"max_new_tokens": 3})
    assert overridden.get_default_sampling_params() == SamplingParams(top_k=1, temperature=0.9, max_tokens=3)
    assert [o.outputs[0].token_ids for o in overridden.generate(prompts, use_tqdm=False)] == [
        o.outputs[0].token_ids[:3] for o in greedy]
    # The override's max_new_tokens also caps what SamplingParams ask for (as vLLM's server caps requests);
    # the model's own file is only a default.
    capped = overridden.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in capped] == [o.outputs[0].token_ids[:3] for o in greedy]
    with pytest.raises(ValueError, match="min_tokens"):
        overridden.generate(prompts, SamplingParams(max_tokens=6, min_tokens=5), use_tqdm=False)


def test_without_chunked_prefill_the_output_is_the_same(tiny_model_dir) -> None:
    """Prompts longer than a 32-token step budget are prefilled over several steps; without chunked prefill
    each is prefilled in one step. The greedy tokens are the same."""
    prompts = [" ".join(["owl"] * n) + " and" for n in (40, 75, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    chunked = LLM(tiny_model_dir("llama"), max_model_len=256, max_num_batched_tokens=32)
    whole = LLM(tiny_model_dir("llama"), max_model_len=256, enable_chunked_prefill=False)
    assert whole.config.scheduler_config.max_num_batched_tokens >= 256
    assert all(len(o.prompt_token_ids) > 32 for o in chunked.generate(prompts[:2], params, use_tqdm=False))
    assert [o.outputs[0].token_ids for o in whole.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in chunked.generate(prompts, params, use_tqdm=False)]


def test_min_tokens_holds_back_the_tokenizers_eos_when_the_models_differs(tiny_model_dir) -> None:
    """The request ends on its tokenizer's EOS as on the model's, so min_tokens holds both back (a model whose
    config names another EOS than its tokenizer)."""
    path = tiny_model_dir("llama", eos_token_id=7)
    llm = LLM(path, max_model_len=64)
    tokenizer_eos = llm.get_tokenizer().eos_token_id
    assert tokenizer_eos is not None and tokenizer_eos != 7
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logit_bias={tokenizer_eos: 100.0})
    [out] = llm.generate(["Hello"], params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert tokenizer_eos not in tokens[:3], tokens
    assert len(tokens) == 4 and tokens[3] == tokenizer_eos and out.outputs[0].finish_reason == "stop"


def test_stop_strings_wait_for_min_tokens(default_llm: LLM) -> None:
    """A stop string in the first min_tokens tokens does not end the request (as vLLM: stop strings count
    from the token after min_tokens); later it does."""
    prompt = ["Count: 1, 2, 3,"]
    early = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[","]),
                                 use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 4
    held = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[","], min_tokens=4),
                                use_tqdm=False)[0].outputs[0]
    assert held.finish_reason == "stop" and len(held.token_ids) > 4
    assert held.text.startswith(early.text + ",")  # the first comma came and went


def test_the_token_that_ends_a_request_is_not_shown_as_text(default_llm: LLM) -> None:
    """A stop_token_ids entry (or EOS) ends the request without its text, unless include_stop_str_in_output;
    stop_reason is the stop id, and None for EOS (as vLLM)."""
    prompt = ["The capital of France is"]
    free = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[2]
    tok = default_llm.get_tokenizer()
    assert tok.decode([stop_id], skip_special_tokens=True)  # a token with text
    ended = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]),
                                 use_tqdm=False)[0].outputs[0]
    assert ended.token_ids == free.token_ids[:3] and ended.finish_reason == "stop" and ended.stop_reason == stop_id
    assert ended.text == tok.decode(free.token_ids[:2], skip_special_tokens=True)
    kept = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id],
                                                       include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == tok.decode(free.token_ids[:3], skip_special_tokens=True)
    eos = tok.eos_token_id
    forced = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0},
                                                         skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [eos] and forced.text == "" and forced.stop_reason is None
    # vLLM checks the tokenizer's EOS before stop_token_ids: None even when it is listed there too; with
    # ignore_eos only the list can have ended it, and stop_reason is the id
    for ignore_eos, reason in ((False, None), (True, eos)):
        listed = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0},
                                                             stop_token_ids=[eos], ignore_eos=ignore_eos),
                                      use_tqdm=False)[0].outputs[0]
        assert (listed.token_ids, listed.finish_reason, listed.stop_reason) == ([eos], "stop", reason)


def test_vllm_constructor_arguments_and_chat_forms(tiny_model_dir) -> None:
    """vLLM's LLM() arguments that change nothing here are accepted, its name for the KV pool override is
    taken, others are refused by name; `llm_engine` is the engine; chat takes OpenAI's text parts,
    continue_final_message and tools (rendered by the template), and reports the rendered prompt."""
    llm = LLM(tiny_model_dir("llama"), max_model_len=128, trust_remote_code=True, disable_log_stats=True,
              swap_space=4, revision=None, num_gpu_blocks_override=40)
    assert llm.config.cache_config.num_blocks == 40 and llm.llm_engine is llm.engine
    with pytest.raises(TypeError, match="kvserve does not take: calculate_kv_scales=True.*max_model_len"):
        LLM(tiny_model_dir("llama"), calculate_kv_scales=True)
    params = SamplingParams(temperature=0, max_tokens=4)
    plain = llm.chat([{"role": "user", "content": "Hello\nthere"}], params, use_tqdm=False)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                   {"type": "input_text", "text": "there"}]}],
                     params, use_tqdm=False, tools=None)[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids and parts.outputs[0].token_ids == plain.outputs[0].token_ids
    assert plain.prompt == llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Hello\nthere"}], tokenize=False, add_generation_prompt=True)
    continued = llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}], params,
                         use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert continued.prompt.endswith("Well")
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    with_tools = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False, tools=tools,
                          chat_template=template)[0]
    assert with_tools.prompt == "[tool get_time]user: Hi\nassistant:"
    # A follow-up turn: the assistant's call arguments (OpenAI's JSON string) reach the template as an object.
    calls_template = ("{% for m in messages %}{{ m.role }}:{% for c in m.tool_calls or [] %}"
                      "{{ c.function.arguments | tojson }}{% endfor %}{{ m.content or '' }}\n{% endfor %}")
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    turn = llm.chat([{"role": "user", "content": "Time?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c1", "content": "12:00"}], params, use_tqdm=False, tools=tools,
                    chat_template=calls_template, add_generation_prompt=False)[0]
    assert turn.prompt == 'user:Time?\nassistant:{"zone": "UTC"}\ntool:12:00\n'
    with pytest.raises(ValueError, match="image_url"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params,
                 use_tqdm=False)


def test_max_logprobs_argument_limits_requests_as_vllms(tiny_model_dir) -> None:
    """vLLM's LLM(max_logprobs=N) is taken: a request asking for more logprobs (or prompt_logprobs) than N is
    a ValueError and nothing runs; N above the engine's 20 (or -1) holds requests to 20."""
    llm = LLM(tiny_model_dir("llama"), max_model_len=64, max_logprobs=2)
    for params in (SamplingParams(max_tokens=2, logprobs=3), SamplingParams(max_tokens=2, prompt_logprobs=3)):
        with pytest.raises(ValueError, match="greater than max allowed: 2"):
            llm.generate("Hello", params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 2 and all(len(entry) <= 3 for entry in out.logprobs)
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(tiny_model_dir("llama"), max_model_len=64, max_logprobs="20")
    assert LLM(tiny_model_dir("llama"), max_model_len=64, max_logprobs=-1)._max_logprobs == 20


def test_reset_prefix_cache(tiny_model_dir) -> None:
    """After reset_prefix_cache() a repeated prompt hits nothing; before it, it hits; while a request is
    live, the reset is refused and the cache kept."""
    llm = LLM(tiny_model_dir("llama"), max_model_len=256, block_size=16)
    prompt = list(range(100, 180))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 64
    llm.engine.add_tokenized_request("live", None, prompt, params)
    llm.engine.step()
    assert llm.reset_prefix_cache() is False
    llm.engine.abort_request("live")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.reset_prefix_cache() is True
    llm.engine.core.scheduler.check_invariants()
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 64


def test_detokenize_false_and_clone(default_llm: LLM) -> None:
    """detokenize=False gives the same tokens with no text (logprobs without decoded tokens) and still ends
    requests as usual; stop strings need the text and are refused with it; clone() is a deep copy."""
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, stop_token_ids=[13])
    texts = default_llm.generate(["Hello, my name is"], params, use_tqdm=False)[0].outputs[0]
    ids_only = params.clone()
    ids_only.detokenize = False
    assert params.detokenize is True
    out = default_llm.generate(["Hello, my name is"], ids_only, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == texts.token_ids and texts.text and out.text == ""
    assert (out.finish_reason, out.stop_reason) == (texts.finish_reason, texts.stop_reason)
    assert out.logprobs is not None and texts.logprobs is not None
    assert [list(e) for e in out.logprobs] == [list(e) for e in texts.logprobs]
    assert all(lp.decoded_token is None for e in out.logprobs for lp in e.values())
    with pytest.raises(SamplingParamsError, match="detokenize"):
        SamplingParams(stop=["."], detokenize=False)
    biased = SamplingParams(logit_bias={5: 1.0})
    copy = biased.clone()
    assert copy == biased
    assert copy.logit_bias is not None and biased.logit_bias is not None
    copy.logit_bias[5] = 2.0
    assert biased.logit_bias[5] == 1.0


def test_truncate_prompt_tokens(tiny_model_dir) -> None:
    """truncate_prompt_tokens=k keeps the prompt's last k tokens (the same output as sending those alone);
    -1 keeps what max_model_len leaves room for, so a prompt too long for the model is served; 0 is refused."""
    llm = LLM(tiny_model_dir("llama"), max_model_len=128, block_size=16)
    prompt = list(range(100, 300))  # longer than max_model_len
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tail = llm.generate([prompt[-40:]], params, use_tqdm=False)[0]
    cut = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                truncate_prompt_tokens=40), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-40:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    most = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=-1),
                        use_tqdm=False)[0]
    assert most.prompt_token_ids == prompt[-127:] and len(most.outputs[0].token_ids) == 1  # room for one token
    with pytest.raises(ValueError):
        llm.generate([prompt], params, use_tqdm=False)
    short = llm.generate([prompt[:10]], SamplingParams(max_tokens=2, truncate_prompt_tokens=40), use_tqdm=False)[0]
    assert short.prompt_token_ids == prompt[:10]
    for bad in (0, -2):
        with pytest.raises(SamplingParamsError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_allowed_token_ids_past_the_models_vocabulary_are_refused(tiny_model_dir) -> None:
    """A tokenizer may be longer than the model's vocabulary: an allowed id between the two is refused (the
    sampler would mask every token of the row out and sample token 0)."""
    llm = LLM(tiny_model_dir("llama", vocab_size=49000), max_model_len=128)
    assert len(llm.get_tokenizer()) > 49100
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["Hi"], SamplingParams(max_tokens=2, allowed_token_ids=[5, 49100]), use_tqdm=False)
    out = llm.generate(["Hi"], SamplingParams(max_tokens=3, allowed_token_ids=[5, 48999]), use_tqdm=False)[0]
    assert set(out.outputs[0].token_ids) <= {5, 48999}


def test_token_ids_past_the_models_vocabulary_are_refused_by_the_input_processor(tiny_model_dir) -> None:
    """The input processor's bound is the smaller of the tokenizer's and the model's vocabularies: a logit_bias
    between the two was silently ignored, a prompt id refused by the engine core only."""
    llm = LLM(tiny_model_dir("llama", vocab_size=49000), max_model_len=128)
    processor = llm.engine.input_processor
    for params, param in ((SamplingParams(max_tokens=2, logit_bias={49100: 5.0}), "logit_bias"),
                          (SamplingParams(max_tokens=2, allowed_token_ids=[49100]), "allowed_token_ids"),
                          (SamplingParams(max_tokens=2, bad_words_token_ids=[[5, 49100]]), "bad_words")):
        with pytest.raises(SamplingParamsError, match=re.escape("out of range [0, 49000) (the model's vocabulary")) \
                as caught:
            llm.generate(["Hi"], params, use_tqdm=False)
        assert caught.value.param == param
    with pytest.raises(ValueError, match=re.escape("prompt token id 49100 is out of range [0, 49000)")):
        llm.generate([{"prompt_token_ids": [1, 49100]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert processor.vocab_size == 49000 < len(llm.get_tokenizer())
    # A bad word whose tokens the model lacks is left out (the model never samples them), not refused.
    assert processor.tokenizer.encode(" CMOS", add_special_tokens=False) == [49100]
    words = processor.resolve_bad_words(SamplingParams(bad_words=["CMOS", "hello"])).bad_words_token_ids
    assert words and all(max(ids) < 49000 for ids in words)
    out = llm.generate(["Hi"], SamplingParams(max_tokens=2, logit_bias={48999: 100.0}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [48999, 48999]


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async"])
def test_the_engine_core_checks_the_runners_requests_against_the_schedulers(tiny_model_dir, pipelined: bool) -> None:
    """The runner holds exactly the requests the scheduler told it of and has not released: a finished request
    lingers until the next step's output releases it, and that passes; a stale or a missing one does not."""
    # A small pool: the tiny model's default one (131072 blocks) makes each step's invariant check slow.
    llm = LLM(tiny_model_dir("llama"), max_model_len=128, num_kv_blocks=256, async_scheduling=pipelined)
    engine, core = llm.engine, llm.engine.core
    core.check_invariants_every_step = True
    engine.add_request("a", "Hello", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(2):
        engine.step()
    engine.abort_request("a")
    core.check_invariants()
    runner = core.runner
    assert "a" in runner.requests and not core.scheduler.requests  # until the next output releases it
    state = runner.requests.pop("a")  # released before the scheduler said so
    with pytest.raises(AssertionError, match=r"lacks \['a'\]"):
        core.check_invariants()
    runner.requests["a"] = state
    while engine.has_unfinished_requests():
        engine.step()
    # Pipelined, the step in flight ran once more and its output released "a"; step by step no step came after
    # the abort, and "a" waits for the next one.
    assert set(runner.requests) == ({"a"} if not pipelined else set())
    runner.requests["z"] = state  # a request never told of, or finished and never released
    with pytest.raises(AssertionError, match=r"holds requests \['z'\]"):
        core.check_invariants()


def test_a_stop_string_ends_the_request_in_the_engine_core_too(tiny_model_dir) -> None:
    """The output processor ends a request on a stop string; LLMEngine then aborts it in the engine core, which
    would otherwise go on computing it to max_tokens."""
    # A small pool: the tiny model's default one (131072 blocks) makes each step's invariant check slow.
    llm = LLM(tiny_model_dir("llama"), max_model_len=128, num_kv_blocks=256)
    engine = llm.engine
    engine.core.check_invariants_every_step = True
    base = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert len(base.text) >= 4
    stop = base.text[:4]
    engine.add_request("s", "Hello", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    finished = []
    for _ in range(40):
        finished = [o.outputs[0] for o in engine.step() if o.finished]
        if finished:
            break
    [out] = finished
    assert out.finish_reason == "stop" and out.stop_reason == stop and len(out.token_ids) < 40
    assert "s" not in engine.core.unfinished_req_ids()
    for _ in range(3):  # the step in flight
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
