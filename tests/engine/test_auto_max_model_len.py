"""max_model_len auto / -1 (vLLM's): the model's own length when one request of it fits in the KV cache, else the
longest length the cache holds, with a warning; everything after start-up sees that length."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError

MODEL_LEN = 512  # the checkpoint's max_position_embeddings: more than the small caches below hold
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def long_model(tiny_model_dir: Callable[..., str]) -> str:
    return tiny_model_dir("llama", max_position_embeddings=MODEL_LEN)


@pytest.fixture(scope="module")
def auto_llm(long_model: str) -> Iterator[tuple[LLM, list[logging.LogRecord]]]:
    """LLM(max_model_len="auto") whose KV cache, sized by kv_cache_memory, holds fewer tokens than MODEL_LEN; with
    the engine core's log records of its start-up."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    core_logger = logging.getLogger("kvserve.engine.engine_core")
    level = core_logger.level
    core_logger.addHandler(handler)
    core_logger.setLevel(logging.INFO)
    try:
        llm = LLM(long_model, device="cpu", max_model_len="auto", kv_cache_memory="96KiB")
    finally:
        core_logger.removeHandler(handler)
        core_logger.setLevel(level)
    yield llm, records
    llm.shutdown()


def test_auto_lowers_max_model_len_to_what_the_kv_cache_holds(auto_llm: tuple[LLM, list[logging.LogRecord]]) -> None:
    llm, records = auto_llm
    core = llm.engine.core
    per_block = core.runner.kv_cache_bytes_per_block()
    held = (96 * 1024 // per_block) * core.capacity.block_size
    assert 16 <= held < MODEL_LEN, "the test needs a cache of at least one block, short of the model's length"
    assert core.capacity.num_tokens == held
    # Everything that reads max_model_len after start-up sees the lowered length.
    assert core.max_model_len == held
    assert llm.config.model_config.max_model_len == held and llm.config.model_config.max_model_len_auto
    assert core.scheduler.config.max_model_len == held
    assert core.runner.config.model_config.max_model_len == held
    assert llm.engine.input_processor.max_model_len == held
    assert core.capacity.max_model_len == held and f"max_model_len={held}:" in core.capacity.describe()
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING and "max_model_len auto" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in records]
    assert f"model's length ({MODEL_LEN})" in warnings[0] and f"lowered to {held}" in warnings[0]
    assert "raise --kv-cache-memory to at least" in warnings[0] and "--kv-cache-dtype fp8" in warnings[0]


def test_prompts_are_held_to_the_lowered_length(auto_llm: tuple[LLM, list[logging.LogRecord]]) -> None:
    llm, _ = auto_llm
    held = llm.engine.core.max_model_len
    # At the limit: a prompt of held - 1 tokens and one output token (prompt + output = max_model_len) runs.
    out = llm.generate({"prompt_token_ids": [5] * (held - 1)}, SamplingParams(temperature=0, max_tokens=1),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1
    for length in (held, held + 1):
        with pytest.raises(ValueError, match=f"max_model_len|{held}"):
            llm.generate({"prompt_token_ids": [5] * length}, SamplingParams(max_tokens=1), use_tqdm=False)


def test_auto_generates_as_the_same_length_given_explicitly(auto_llm: tuple[LLM, list[logging.LogRecord]],
                                                            long_model: str) -> None:
    llm, _ = auto_llm
    held = llm.engine.core.max_model_len
    prompts = ["Hello, my name is", "The capital of France is"]
    auto_out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    explicit = LLM(long_model, device="cpu", max_model_len=held, kv_cache_memory="96KiB")
    try:
        assert explicit.engine.core.capacity.num_tokens == held
        assert [o.outputs[0].token_ids for o in explicit.generate(prompts, GREEDY, use_tqdm=False)] == auto_out
    finally:
        explicit.shutdown()


@pytest.mark.parametrize("value", [-1, "-1", " AUTO "])
def test_auto_keeps_the_models_length_when_it_fits(long_model: str, value: int | str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The cache holds more than MODEL_LEN tokens: the model's own length, with an info line and no warning
    (-1 and any case of auto mean the same)."""
    with caplog.at_level(logging.INFO, logger="kvserve.engine.engine_core"):
        llm = LLM(long_model, device="cpu", max_model_len=value, num_kv_blocks=MODEL_LEN // 16 + 3)
    try:
        assert llm.engine.core.max_model_len == MODEL_LEN == llm.engine.input_processor.max_model_len
        assert llm.engine.core.scheduler.config.max_model_len == MODEL_LEN
    finally:
        llm.shutdown()
    said = [r for r in caplog.records if "max_model_len auto" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO] and f"max_model_len={MODEL_LEN}" in said[0].getMessage()


def test_auto_with_a_block_override_lowers_to_whole_blocks(long_model: str) -> None:
    """num_kv_blocks (--num-gpu-blocks-override) sizes the cache: the length is that many whole blocks, and the
    warning names the override to raise."""
    llm = LLM(long_model, device="cpu", max_model_len="auto", num_kv_blocks=5, block_size=16,
              enable_chunked_prefill=False)
    try:
        assert llm.engine.core.max_model_len == 80 == llm.engine.core.scheduler.config.max_model_len
        # Without chunked prefill the step budget was sized for the model's length: larger, which is safe.
        assert llm.engine.core.scheduler.config.max_num_batched_tokens >= MODEL_LEN
    finally:
        llm.shutdown()


def test_explicit_too_long_length_still_fails_clearly(long_model: str) -> None:
    """Only auto lowers the length: a length given that the cache cannot hold is refused as before."""
    with pytest.raises(ConfigError, match=r"the KV cache holds 80 tokens .* max_model_len=512"):
        LLM(long_model, device="cpu", max_model_len=MODEL_LEN, num_kv_blocks=5)


def test_tensor_parallel_ranks_take_the_length_of_the_agreed_blocks(
        auto_llm: tuple[LLM, list[logging.LogRecord]], long_model: str) -> None:
    """Two ranks (gloo on the CPU) each size a cache from the same budget (half the KV heads each: twice the blocks
    of one rank), agree on the smallest count, and every rank's runner takes the length that count holds; the
    greedy tokens of a prompt at the limit are one rank's."""
    budget = "48KiB"  # per rank: each holds half the KV heads, so the blocks are those of 96KiB on one rank
    one, _ = auto_llm
    held = one.engine.core.max_model_len
    llm = LLM(long_model, device="cpu", dtype="float32", tensor_parallel_size=2, max_model_len="auto",
              kv_cache_memory=budget)
    try:
        core = llm.engine.core
        assert core.max_model_len == held == core.capacity.num_tokens
        # Each rank's runner config (rank 0 here, rank 1 in its process).
        configs = core._on_all_ranks("__getattribute__", "config")
        assert [c.model_config.max_model_len for c in configs] == [held, held]
        prompt = {"prompt_token_ids": list(range(3, held + 1))}  # held - 2 tokens, then 2 of output
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        split = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert split == one.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
