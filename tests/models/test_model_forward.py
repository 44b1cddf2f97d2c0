"""Differential tests of the model against HF Transformers in float32 on the CPU.

The oracle is HF's own implementation of each architecture (tiny random checkpoints built with HF's classes,
and HF's GGUF loader for the default model). Paged-attention layouts that must not change the output
(non-contiguous block ids, chunked prefill, batching with other requests) are checked against it too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from helpers import RequestSlice, make_attn_metadata, make_kv_caches, run_model
from helpers.tiny_models import write_gguf

from kvserve.config import ModelConfig
from kvserve.layers.attention import Attention
from kvserve.layers.attention_metadata import last_token_metadata
from kvserve.model import llama
from kvserve.model.arch import load_arch_config
from kvserve.model.loader import load_model
from kvserve.model.registry import CausalLM

BLOCK_SIZE = 16
NUM_BLOCKS = 12
# HF and kvserve run the same float32 ops in the same order except for fused matmuls and the attention
# gather, so they agree to a few ulps of the logits' magnitude (order 1-10).
ATOL = 1e-4
RTOL = 1e-5
VARIANTS = ["llama", "llama3", "llama-tied", "qwen2", "qwen3", "qwen3-moe", "qwen3-moe-step", "mixtral"]

PROMPT = "The quick brown fox jumps over the lazy dog while the old cat sleeps on a warm mat by the door."
OTHER_PROMPT = "Paged attention stores keys in blocks."


def _load_ours(path: str) -> CausalLM:
    arch = load_arch_config(path)
    max_len = arch.max_position_embeddings
    config = ModelConfig(model=path, tokenizer=path, dtype="float32", max_model_len=max_len)
    return load_model(config, torch.device("cpu"))


def _hf_logits(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir: Callable[..., str]) -> Callable[[str], tuple[CausalLM, Any]]:
    """variant -> (our model, HF model) of the same tiny checkpoint, loaded once per module."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple[CausalLM, Any]] = {}

    def get(variant: str) -> tuple[CausalLM, Any]:
        if variant not in cache:
            path = tiny_model_dir(variant)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
            cache[variant] = (_load_ours(path), hf.eval())
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def prompt_ids(smollm_tokenizer: Any) -> list[int]:
    ids = smollm_tokenizer(PROMPT).input_ids
    # Two blocks, the second one partial: the test exercises a block boundary and a partial block.
    assert BLOCK_SIZE < len(ids) < 2 * BLOCK_SIZE
    return ids


@pytest.fixture(scope="module")
def other_ids(smollm_tokenizer: Any) -> list[int]:
    ids = smollm_tokenizer(OTHER_PROMPT).input_ids
    assert len(ids) < BLOCK_SIZE
    return ids


@pytest.mark.parametrize("variant", VARIANTS)
def test_prompt_logits_match_hf(variant: str, tiny_pair: Callable, prompt_ids: list[int]) -> None:
    ours, hf = tiny_pair(variant)
    caches = make_kv_caches(ours.arch, NUM_BLOCKS, BLOCK_SIZE)
    # Out-of-order, non-contiguous blocks: position 0 lives in block 9, position 16 in block 4.
    request = RequestSlice(block_ids=(9, 4), num_cached_tokens=0, num_new_tokens=len(prompt_ids))
    [logits] = run_model(ours, [request], [prompt_ids], caches, BLOCK_SIZE)
    expected = _hf_logits(hf, prompt_ids)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)
    # The cache holds K/V only where the block table points.
    untouched = [b for b in range(NUM_BLOCKS) if b not in (9, 4)]
    assert not caches[0][:, untouched].any()
    assert caches[0][:, 4, : len(prompt_ids) - BLOCK_SIZE].abs().sum() > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_reads_cached_kv(variant: str, tiny_pair: Callable, prompt_ids: list[int]) -> None:
    ours, hf = tiny_pair(variant)
    caches = make_kv_caches(ours.arch, NUM_BLOCKS, BLOCK_SIZE)
    split = 12  # inside the first block: the second chunk fills it, then starts the next one
    n = len(prompt_ids)
    [first] = run_model(ours, [RequestSlice((3, 7), 0, split)], [prompt_ids], caches, BLOCK_SIZE)
    [second] = run_model(ours, [RequestSlice((3, 7), split, n - split)], [prompt_ids], caches, BLOCK_SIZE)
    expected = _hf_logits(hf, prompt_ids)
    torch.testing.assert_close(torch.cat([first, second]), expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_equals_each_request_alone(
    variant: str, tiny_pair: Callable, prompt_ids: list[int], other_ids: list[int]
) -> None:
    ours, hf = tiny_pair(variant)
    long_req = RequestSlice((6, 1), 0, len(prompt_ids))
    short_req = RequestSlice((10,), 0, len(other_ids))
    alone = [
        run_model(ours, [req], [ids], make_kv_caches(ours.arch, NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE)[0]
        for req, ids in ((long_req, prompt_ids), (short_req, other_ids))
    ]
    caches = make_kv_caches(ours.arch, NUM_BLOCKS, BLOCK_SIZE)
    # Shorter request first so its tokens are not simply a prefix of the flat batch.
    batched = run_model(ours, [short_req, long_req], [other_ids, prompt_ids], caches, BLOCK_SIZE)
    # Padding a batch changes SDPA's summation order: equal up to float32 rounding, not bit-exact.
    torch.testing.assert_close(batched[0], alone[1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(batched[1], alone[0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(batched[1], _hf_logits(hf, prompt_ids), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_decode_mixed_with_prefill_matches_hf(
    variant: str, tiny_pair: Callable, prompt_ids: list[int], other_ids: list[int]
) -> None:
    """One request decodes (1 new token over 16+ cached) while another prefills, in one step."""
    ours, hf = tiny_pair(variant)
    caches = make_kv_caches(ours.arch, NUM_BLOCKS, BLOCK_SIZE)
    n = len(prompt_ids)
    run_model(ours, [RequestSlice((8, 2), 0, n - 1)], [prompt_ids], caches, BLOCK_SIZE)
    decode, prefill = run_model(
        ours,
        [RequestSlice((8, 2), n - 1, 1), RequestSlice((5,), 0, len(other_ids))],
        [prompt_ids, other_ids],
        caches,
        BLOCK_SIZE,
    )
    torch.testing.assert_close(decode[0], _hf_logits(hf, prompt_ids)[-1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(prefill, _hf_logits(hf, other_ids), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3", "qwen3-moe", "mixtral"])
def test_output_rows_compute_only_those_rows(
    variant: str, tiny_pair: Callable, prompt_ids: list[int], other_ids: list[int]
) -> None:
    """A step that asks for some rows' final states (the tokens that sample) returns those rows, in the
    order asked, equal to the full forward's and to HF's, and writes the same KV cache bit for bit (the last
    layer prunes only after its cache write); no rows: an empty result and the same cache."""
    ours, hf = tiny_pair(variant)
    requests = [RequestSlice((6, 1), 0, len(prompt_ids)), RequestSlice((10,), 0, len(other_ids))]
    input_ids = torch.tensor(prompt_ids + other_ids)
    positions = torch.tensor([*range(len(prompt_ids)), *range(len(other_ids))])
    metadata = make_attn_metadata(requests, BLOCK_SIZE)

    def forward(rows: list[int] | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        caches = make_kv_caches(ours.arch, NUM_BLOCKS, BLOCK_SIZE)
        index = None if rows is None else torch.tensor(rows, dtype=torch.int64)
        with torch.inference_mode():
            return ours(input_ids, positions, caches, metadata, index), caches

    full, full_caches = forward(None)
    rows = [len(input_ids) - 1, len(prompt_ids) - 1, 3]  # the two requests' last tokens (out of order), one more
    some, some_caches = forward(rows)
    assert some.shape == (len(rows), full.shape[1])
    torch.testing.assert_close(some, full[rows], atol=ATOL, rtol=RTOL)
    logits = ours.compute_logits(some)
    torch.testing.assert_close(logits[1], _hf_logits(hf, prompt_ids)[-1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[0], _hf_logits(hf, other_ids)[-1], atol=ATOL, rtol=RTOL)
    none, none_caches = forward([])
    assert none.shape == (0, full.shape[1])
    for caches in (some_caches, none_caches):
        for got, want in zip(caches, full_caches, strict=True):
            assert torch.equal(got, want)
    assert full_caches[-1].abs().sum() > 0  # the last layer's K/V were written
    llama.set_last_layer_pruning(False)  # the A/B switch: every row computed, then the asked ones selected
    try:
        unpruned, unpruned_caches = forward(rows)
    finally:
        llama.set_last_layer_pruning(True)
    assert torch.equal(unpruned, full[rows])
    assert all(torch.equal(got, want) for got, want in zip(unpruned_caches, full_caches, strict=True))


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_sampled_rows_attend_as_decode_queries(
    variant: str, tiny_pair: Callable, prompt_ids: list[int], other_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `metadata.sampled`, the last layer attends only for the sampling rows, each as one query over its
    request's cache: the rows equal the full forward's (and HF's), the cache is written the same, in a step
    that mixes a later chunk after cached context, a fresh prompt, a decode row and a non-final chunk that
    samples nothing."""
    ours, hf = tiny_pair(variant)
    n, split = len(prompt_ids), 12
    first = RequestSlice((8, 2), 0, split)
    setup_ids = prompt_ids[:split] + other_ids[:-1]
    setup_positions = [*range(split), *range(len(other_ids) - 1)]
    setup = make_attn_metadata([first, RequestSlice((5,), 0, len(other_ids) - 1)], BLOCK_SIZE)
    # The step under test: prompt_ids' second chunk (samples), other_ids' last token (a decode row, samples),
    # a fresh prompt (samples), and a non-final first chunk of another prompt (does not sample).
    requests = [
        RequestSlice((8, 2), split, n - split),
        RequestSlice((5,), len(other_ids) - 1, 1),
        RequestSlice((11, 0), 0, n),
        RequestSlice((3,), 0, 7),
    ]
    input_ids = torch.tensor(prompt_ids[split:] + other_ids[-1:] + prompt_ids + other_ids[:7])
    positions = torch.tensor([*range(split, n), len(other_ids) - 1, *range(n), *range(7)])
    metadata = make_attn_metadata(requests, BLOCK_SIZE)
    starts = metadata.query_start_loc_cpu
    sampling = [2, 0, 1]  # the order of logits_indices need not be the batch's
    rows = torch.tensor([starts[i + 1] - 1 for i in sampling], dtype=torch.int64)

    def step(sampled: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        caches = make_kv_caches(ours.arch, NUM_BLOCKS, BLOCK_SIZE)
        with torch.inference_mode():
            ours(torch.tensor(setup_ids), torch.tensor(setup_positions), caches, setup)
            md = replace(metadata, sampled=last_token_metadata(metadata, sampling) if sampled else None,
                         backend_cache={})
            full = ours(input_ids, positions, [c.clone() for c in caches], md)
            return full, ours(input_ids, positions, caches, md, rows), caches

    # The decode-query path ran: once per forward with rows and `sampled` (the last layer), for the 3 rows.
    cached_calls: list[int] = []
    forward_cached = Attention.forward_cached

    def counting(self: Attention, query: torch.Tensor, *args: Any) -> torch.Tensor:
        cached_calls.append(query.shape[0])
        return forward_cached(self, query, *args)

    monkeypatch.setattr(Attention, "forward_cached", counting)
    full, got, caches = step(sampled=True)
    assert cached_calls == [len(sampling)]
    _, unsampled, unsampled_caches = step(sampled=False)
    assert cached_calls == [len(sampling)]
    torch.testing.assert_close(got, full[rows], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(unsampled, full[rows], atol=ATOL, rtol=RTOL)
    assert all(torch.equal(a, b) for a, b in zip(caches, unsampled_caches, strict=True))
    logits = ours.compute_logits(got)
    torch.testing.assert_close(logits[0], _hf_logits(hf, prompt_ids)[-1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[1], _hf_logits(hf, prompt_ids)[-1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[2], _hf_logits(hf, other_ids)[-1], atol=ATOL, rtol=RTOL)
    # The metadata's sampled rows must be the output rows: another count is an error, not a wrong answer.
    md = replace(metadata, sampled=last_token_metadata(metadata, sampling), backend_cache={})
    with torch.inference_mode(), pytest.raises(ValueError, match="sampled rows"):
        ours(input_ids, positions, make_kv_caches(ours.arch, NUM_BLOCKS, BLOCK_SIZE), md, rows[:2])


def test_last_token_metadata_describes_one_query_per_request() -> None:
    requests = [RequestSlice((4, 1), 10, 9), RequestSlice((2,), 5, 1), RequestSlice((7, 3, 6), 0, 40)]
    metadata = make_attn_metadata(requests, BLOCK_SIZE)
    sampled = last_token_metadata(metadata, [2, 0])
    assert sampled.query_start_loc.tolist() == sampled.query_start_loc_cpu == [0, 1, 2]
    assert sampled.seq_lens.tolist() == sampled.seq_lens_cpu == [40, 19]
    assert sampled.block_tables.tolist() == [[7, 3, 6], [4, 1, 0]]
    assert (sampled.max_query_len, sampled.max_seq_len, sampled.num_tokens) == (1, 40, 2)
    assert sampled.is_decode_only and sampled.slot_mapping.numel() == 0


# ------------------------------------------------------------------------------------------------ GGUF


@pytest.mark.parametrize(
    "variant", ["llama", "llama-tied", "qwen2", "qwen3", "qwen2-yarn", "llama-yarn-explicit"]
)
def test_gguf_export_reproduces_hf_checkpoint(
    variant: str,
    tiny_model_dir: Callable,
    tiny_gguf_path: Callable,
    tiny_pair: Callable,
    prompt_ids: list[int],
) -> None:
    """A float32 GGUF of a tiny checkpoint, laid out as llama.cpp's converter writes it (tensor names,
    metadata, Llama's permuted q/k rows), loads into the same model as the HF checkpoint."""
    gguf_path = tiny_gguf_path(variant)
    from_gguf = load_arch_config(gguf_path)
    from_hf = load_arch_config(tiny_model_dir(variant))
    # GGUF stores eps as float32, and names no dtype (--dtype auto then takes the GPU's; config.auto_dtype).
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps, rel=1e-6)
    assert from_gguf.config_dtype is None and from_hf.config_dtype == "float32"
    assert replace(from_gguf, rms_norm_eps=from_hf.rms_norm_eps, config_dtype=from_hf.config_dtype) == from_hf

    ours = _load_ours(gguf_path)
    _, hf = tiny_pair(variant)
    caches = make_kv_caches(ours.arch, NUM_BLOCKS, BLOCK_SIZE)
    [logits] = run_model(ours, [RequestSlice((2, 0), 0, len(prompt_ids))], [prompt_ids], caches, BLOCK_SIZE)
    torch.testing.assert_close(logits, _hf_logits(hf, prompt_ids), atol=ATOL, rtol=RTOL)


def test_gguf_rope_freqs_divide_frequencies(
    tmp_path: Any, tiny_model_dir: Callable, prompt_ids: list[int]
) -> None:
    """llama.cpp stores Llama 3 style scaling as `rope_freqs` divisors; divisors all equal to 8 are HF's
    linear scaling with factor 8 (which divides every inverse frequency by 8)."""
    from transformers import AutoModelForCausalLM

    linear = {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}
    checkpoint = tiny_model_dir("llama", rope_parameters=linear)
    head_dim = load_arch_config(checkpoint).head_dim
    gguf_path = write_gguf(checkpoint, str(tmp_path / "freqs.gguf"), rope_freqs=[8.0] * (head_dim // 2))
    ours = _load_ours(gguf_path)
    assert ours.arch.rope_scaling is None and ours.arch.rope_freq_factors == (8.0,) * (head_dim // 2)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    caches = make_kv_caches(ours.arch, NUM_BLOCKS, BLOCK_SIZE)
    [logits] = run_model(ours, [RequestSlice((1, 3), 0, len(prompt_ids))], [prompt_ids], caches, BLOCK_SIZE)
    torch.testing.assert_close(logits, _hf_logits(hf.eval(), prompt_ids), atol=ATOL, rtol=RTOL)


@pytest.fixture(scope="module")
def default_gguf_model(default_gguf_path: str) -> CausalLM:
    return _load_ours(default_gguf_path)


@pytest.mark.parametrize(
    "prompt", ["The capital of France is", "请用一句话介绍一下长城。"], ids=["english", "chinese"]
)
def test_default_gguf_matches_hf_gguf_loader(
    prompt: str, default_gguf_model: CausalLM, hf_gguf_model: Any, smollm_tokenizer: Any
) -> None:
    """SmolLM2 Q4_1/Q8_0: same dequantized weights and Llama q/k un-permutation as HF's GGUF loader."""
    messages = [{"role": "user", "content": prompt}]
    text = smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = smollm_tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > BLOCK_SIZE
    arch = default_gguf_model.arch
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    caches = make_kv_caches(arch, num_blocks + 2, BLOCK_SIZE)
    block_ids = tuple(reversed(range(2, num_blocks + 2)))
    request = RequestSlice(block_ids, 0, len(ids))
    [logits] = run_model(default_gguf_model, [request], [ids], caches, BLOCK_SIZE)
    expected = _hf_logits(hf_gguf_model, ids)
    torch.testing.assert_close(logits[-1], expected[-1], atol=1e-3, rtol=1e-4)
    assert int(logits[-1].argmax()) == int(expected[-1].argmax())


def test_default_gguf_arch_config(default_gguf_path: str) -> None:
    """The facts of the shipped model, as its model card states them (independent of our reading code)."""
    arch = load_arch_config(default_gguf_path)
    assert os.path.basename(default_gguf_path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (arch.architecture, arch.num_hidden_layers, arch.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert (arch.vocab_size, arch.rope_theta, arch.tie_word_embeddings) == (49152, 100000.0, True)
    assert arch.max_position_embeddings == 8192 and arch.eos_token_ids == (2,)
