"""`--kv-cache-dtype fp8` (vLLM's flag and values) on the CPU: the flag, the cache's sizing and allocation, and
the engine with an fp8 KV cache against the same engine with the model-dtype cache.

The differential oracle: greedy decoding of a tiny random model (float32, 3 layers, head_dim 64, GQA 2) with
block size 16 over prompts that end inside blocks, share a 40-token prefix (prefix-cache hits) and are
prefilled in 64-token chunks (chunks over cached context). Storing K and V in fp8 rounds each value to the
format's precision: a relative error of at most 2^-4 for e4m3 (3 mantissa bits, round to nearest) and 2^-3
for e5m2. That moves the attention output, and through two more layers the logprobs, by a fraction of it on
these order-1-logit models (measured: at most 0.08 nats for e4m3, 0.15 for e5m2, over 8 prompts x 24 steps).
The tolerance is 4x the format's relative error (0.25 and 0.5 nats): wrong scaling (a scale applied twice or
not at all), a wrong block read or an unsaturated cast would move logprobs by whole nats or give NaN. Greedy
tokens may part at a near tie (both tokens within the tolerance in the model-dtype run); after that the
histories differ and nothing later is compared.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.engine_runs import greedy_with_logprobs, top_logprobs

from kvserve.config import ConfigError, EngineArgs, _check_kv_cache_dtype, kv_cache_torch_dtype
from kvserve.engine.engine_core import EngineCore
from kvserve.entrypoints.cli import build_parser, engine_args_from
from kvserve.kernels import ops, reference
from kvserve.layers.attention_metadata import AttentionMetadata
from kvserve.protocol.sampling_params import SamplingParams

MAX_TOKENS = 24
# The format's relative rounding error (half an ulp at 1.0) times 4: see the module docstring.
LOGPROB_TOL = {"fp8": 4 * 2.0**-4, "fp8_e4m3": 4 * 2.0**-4, "fp8_e5m2": 4 * 2.0**-3}


@pytest.fixture(scope="module")
def bare_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    from helpers.tiny_models import make_bare_checkpoint

    return make_bare_checkpoint(str(tmp_path_factory.mktemp("fp8-kv")), "llama", seed=0)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 1024, (40,), generator=generator).tolist()
    own = [torch.randint(3, 1024, (n,), generator=generator).tolist() for n in (5, 17, 33, 70, 120)]
    return [*own, shared + [5, 6, 7], shared + [9] * 20, shared]


def _core(path: str, kv_cache_dtype: str, **kwargs: Any) -> EngineCore:
    settings: dict[str, Any] = {"max_model_len": 512, "num_kv_blocks": 256, "max_num_batched_tokens": 64,
                                "block_size": 16, **kwargs}
    args = EngineArgs(model=path, device="cpu", kv_cache_dtype=kv_cache_dtype, **settings)
    return EngineCore(args.create_engine_config())


def _compare(got: list, want: list, tol: float) -> tuple[int, float]:
    """Asserts the module docstring's rule; returns (prompts with identical tokens, largest logprob gap)."""
    identical, largest = 0, 0.0
    for (got_tokens, got_lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert len(got_tokens) == len(want_tokens) == MAX_TOKENS
        part = next((i for i, (a, b) in enumerate(zip(got_tokens, want_tokens, strict=True)) if a != b), None)
        for step in range(MAX_TOKENS if part is None else part + 1):
            mine, theirs = top_logprobs(got_lps[step]), top_logprobs(want_lps[step])
            common = mine.keys() & theirs.keys()
            assert len(common) >= 3, (step, mine, theirs)  # the same candidates, give or take the tail
            for token in common:
                assert abs(mine[token] - theirs[token]) <= tol, (step, token, mine[token], theirs[token])
                largest = max(largest, abs(mine[token] - theirs[token]))
        if part is None:
            identical += 1
            continue
        a, b = got_tokens[part], want_tokens[part]
        reference_top = top_logprobs(want_lps[part])
        assert a in reference_top and abs(reference_top[a] - reference_top[b]) <= tol, (part, a, b, reference_top)
    return identical, largest


@pytest.fixture(scope="module")
def model_dtype_run(bare_checkpoint: str) -> list:
    core = _core(bare_checkpoint, "auto")
    assert core.runner.kv_caches[0].dtype == torch.float32
    return greedy_with_logprobs(core, _prompts(), MAX_TOKENS)


@pytest.mark.parametrize("kv_cache_dtype, torch_dtype", [("fp8", torch.float8_e4m3fn),
                                                          ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_cache_engine_agrees_with_the_model_dtype_cache(
    bare_checkpoint: str, model_dtype_run: list, kv_cache_dtype: str, torch_dtype: torch.dtype
) -> None:
    core = _core(bare_checkpoint, kv_cache_dtype)
    assert all(cache.dtype == torch_dtype for cache in core.runner.kv_caches)
    got = greedy_with_logprobs(core, _prompts(), MAX_TOKENS)
    identical, largest = _compare(got, model_dtype_run, LOGPROB_TOL[kv_cache_dtype])
    assert largest > 0.0  # the cache really holds rounded values
    if kv_cache_dtype == "fp8":
        assert identical >= len(got) // 2, identical  # most prompts: the same greedy tokens throughout


def test_fp8_cache_engine_under_preemption_and_without_prefix_cache(bare_checkpoint: str) -> None:
    """Recomputed (preempted) requests and no prefix caching rewrite the fp8 cache: the same tokens as the fp8
    engine given room (the same rounding of the same values)."""
    prompts = _prompts()[:6]
    roomy = greedy_with_logprobs(_core(bare_checkpoint, "fp8"), prompts, MAX_TOKENS)
    core = _core(bare_checkpoint, "fp8", num_kv_blocks=12, max_model_len=160, enable_prefix_caching=False)
    tight = greedy_with_logprobs(core, prompts, MAX_TOKENS)
    assert [t for t, _ in tight] == [t for t, _ in roomy]
    assert core.scheduler.num_preemptions > 0


# ------------------------------------------------------------------------------------------ memory sizing


@pytest.mark.parametrize("model_dtype, ratio", [("bfloat16", 2), ("float32", 4)])
def test_fp8_cache_holds_more_blocks_in_the_same_memory(bare_checkpoint: str, model_dtype: str, ratio: int) -> None:
    """One byte a value: twice the blocks of a bf16 cache, four times a float32 one, for one --kv-cache-memory;
    the tensors allocated take the bytes the sizing counted."""
    cores = {kv: _core(bare_checkpoint, kv, num_kv_blocks=None, kv_cache_memory="3MiB", dtype=model_dtype)
             for kv in ("auto", "fp8")}
    blocks = {kv: core.config.cache_config.num_blocks for kv, core in cores.items()}
    # 3 layers x K,V x 16 tokens x 2 KV heads x 64 dims = 12,288 values a block
    assert blocks["auto"] == 3 * 2**20 // (12288 * torch.empty((), dtype=getattr(torch, model_dtype)).element_size())
    assert blocks["fp8"] == 3 * 2**20 // 12288 == ratio * blocks["auto"]
    for kv, core in cores.items():
        runner = core.runner
        assert sum(c.numel() * c.element_size() for c in runner.kv_caches) == blocks[kv] * runner.kv_cache_bytes_per_block()
    assert cores["fp8"].runner.kv_caches[0].dtype == torch.float8_e4m3fn
    # The capacity log line names the cache's dtype when it is not the model's.
    assert cores["fp8"].capacity.describe().startswith(f"KV cache (fp8): {blocks['fp8']} blocks x 16 tokens")
    assert cores["auto"].capacity.describe().startswith(f"KV cache: {blocks['auto']} blocks x 16 tokens")


# ------------------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize("value, expected", [("auto", "bfloat16"), ("bfloat16", "bfloat16"), ("fp8", "float8_e4m3fn"),
                                             ("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")])
def test_kv_cache_dtype_values(value: str, expected: str) -> None:
    assert kv_cache_torch_dtype(value, "bfloat16") == expected
    assert _check_kv_cache_dtype(value.upper(), "cpu", "bfloat16") == value  # vLLM's values, any case


@pytest.mark.parametrize("model_dtype", ["bfloat16", "float16"])
def test_kv_cache_dtype_of_the_models_own_float_dtype_is_auto(bare_checkpoint: str, model_dtype: str) -> None:
    """vLLM's `--kv-cache-dtype bfloat16` (and float16) where it is the model's dtype: the same cache as auto."""
    core = _core(bare_checkpoint, model_dtype.upper(), dtype=model_dtype, num_kv_blocks=4, max_model_len=64)
    assert core.config.cache_config.kv_cache_dtype == model_dtype
    assert core.runner.kv_caches[0].dtype == getattr(torch, model_dtype)


def test_kv_cache_dtype_refusals(bare_checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="--kv-cache-dtype 'fp4' is not supported; choose auto, bfloat16, float16, fp8"):
        EngineArgs(model=bare_checkpoint, device="cpu", kv_cache_dtype="fp4").create_engine_config()
    # A float cache in another dtype than the model's (the CPU runs float32): refused with the way out.
    for value in ("bfloat16", "float16"):
        with pytest.raises(ConfigError, match=f"--kv-cache-dtype {value} with a float32 model is not supported.*"
                                              "--kv-cache-dtype auto"):
            EngineArgs(model=bare_checkpoint, device="cpu", kv_cache_dtype=value).create_engine_config()
    with pytest.raises(ConfigError, match="float16 with a bfloat16 model"):
        kv_cache_torch_dtype("float16", "bfloat16")  # a CacheConfig built without the check
    # vLLM's other values, by name with the reason.
    for value, reason in (("fp8_inc", "Intel Gaudi"), ("FP8_DS_MLA", "MLA"), ("int8", "no int8 cache")):
        with pytest.raises(ConfigError, match=f"--kv-cache-dtype {value.lower()} is not supported: .*{reason}"):
            EngineArgs(model=bare_checkpoint, device="cpu", kv_cache_dtype=value).create_engine_config()
    # A GPU older than 8.9 cannot run the kernels' fp8 conversions: refused at configuration, not mid-serving.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match="compute capability 8.9 or later.*this GPU is 8.0.*--kv-cache-dtype auto"):
        _check_kv_cache_dtype("fp8", "cuda", "bfloat16")
    assert _check_kv_cache_dtype("auto", "cuda", "bfloat16") == "auto"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert _check_kv_cache_dtype("fp8_e5m2", "cuda", "bfloat16") == "fp8_e5m2"


@pytest.mark.parametrize("command", [["serve", "m"], ["generate", "--prompt", "x"], ["triton-repo", "--name", "m"]])
def test_kv_cache_dtype_is_an_engine_flag(command: list[str]) -> None:
    assert engine_args_from(build_parser().parse_args(command))["kv_cache_dtype"] == "auto"
    for value in ("fp8", "fp8_e4m3", "fp8_e5m2", "auto", "bfloat16", "float16"):
        ns = build_parser().parse_args([*command, "--kv-cache-dtype", value])
        assert engine_args_from(ns)["kv_cache_dtype"] == value
        ns = build_parser().parse_args([*command, "--kv-cache-dtype", value.upper()])  # any case, as vLLM
        assert engine_args_from(ns)["kv_cache_dtype"] == value


def test_kv_cache_dtype_flag_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for value, reason in (("int8", "kvserve's attention kernels read no int8 cache"),
                          ("fp8_inc", "Intel Gaudi"), ("fp8_ds_mla", "DeepSeek's fp8 layout for MLA"),
                          ("fp4", "choose auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2")):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "m", "--kv-cache-dtype", value])
        err = capsys.readouterr().err
        assert "argument --kv-cache-dtype: --kv-cache-dtype" in err and "is not supported" in err and reason in err
    from kvserve.entrypoints.vllm_compat import parse_args_or_refuse

    with pytest.raises(SystemExit):
        parse_args_or_refuse(parser, ["serve", "m", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    err = capsys.readouterr().err
    assert "--calculate-kv-scales is a vLLM option kvserve does not support" in err and "scales of 1.0" in err


def test_llm_takes_kv_cache_dtype(bare_checkpoint: str) -> None:
    from kvserve.engine.llm import _engine_args

    assert _engine_args({"kv_cache_dtype": "fp8"}) == {"kv_cache_dtype": "fp8"}
    with pytest.raises(TypeError, match="calculate_kv_scales"):
        _engine_args({"calculate_kv_scales": True})


# ------------------------------------------------------------------------------------------ the CPU path


def _one_request_metadata(seq_len: int, query_len: int, block_table: list[int], block_size: int) -> AttentionMetadata:
    slots = [block_table[p // block_size] * block_size + p % block_size for p in range(seq_len - query_len, seq_len)]
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, query_len], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.tensor([block_table], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=query_len,
        max_seq_len=seq_len,
        query_start_loc_cpu=[0, query_len],
        seq_lens_cpu=[seq_len],
    )


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_cpu_write_and_read_scale_and_saturate(cache_dtype: torch.dtype) -> None:
    """The reference writes x / scale saturated and reads value * scale: attention over the fp8 cache equals
    attention over a model-dtype cache holding the dequantized values, and out-of-range inputs stay finite."""
    block_size, num_kv_heads, head_dim = 4, 2, 16
    gen = torch.Generator().manual_seed(1)
    block_table = [3, 0, 5]  # non-contiguous; the last block is partial (10 tokens)
    metadata = _one_request_metadata(10, 10, block_table, block_size)
    key = torch.randn(10, num_kv_heads, head_dim, generator=gen) * 3
    value = torch.randn(10, num_kv_heads, head_dim, generator=gen) * 3
    key[0, 0, 0] = 1e9  # past every fp8 range: saturates to the largest finite value
    query = torch.randn(10, 4, head_dim, generator=gen)
    k_scale, v_scale = 0.5, 2.0
    fp8 = torch.zeros(2, 6, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
    ops.reshape_and_cache(key, value, fp8, metadata.slot_mapping, k_scale, v_scale)
    assert bool(fp8.float().isfinite().all())
    limit = torch.finfo(cache_dtype).max
    assert fp8[0, 3, 0, 0, 0].float() == limit
    dequantized = fp8.float()
    dequantized[0] *= k_scale
    dequantized[1] *= v_scale
    # Each stored value is the input rounded to the format (relative error <= 2^-4 / 2^-3), slot by slot.
    rel = 2.0**-4 if cache_dtype == torch.float8_e4m3fn else 2.0**-3
    flat = dequantized.view(2, -1, num_kv_heads, head_dim)[:, metadata.slot_mapping]
    torch.testing.assert_close(flat[1], value, rtol=rel, atol=1e-2)
    torch.testing.assert_close(flat[0][1:], key[1:], rtol=rel, atol=1e-2)
    assert int(torch.count_nonzero(fp8.view(torch.uint8)[:, [1, 2, 4]])) == 0  # unused blocks untouched
    out = ops.paged_attention(query, fp8, metadata, head_dim**-0.5, None, k_scale, v_scale)
    expected = reference.paged_attention(query, dequantized, metadata, head_dim**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_cpu_rotary_and_cache_write_fp8() -> None:
    """The fused rotary + cache write's op takes the scales to the cache write; padding slots write nothing."""
    positions = torch.tensor([0, 1, 2])
    query, key, value = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    from kvserve.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(16, 64, 10000.0)
    cache = torch.zeros(2, 2, 4, 2, 16, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([5, -1, 0])
    q, k = ops.rotary_embedding_and_cache(positions, query, key, value, rope.cos_sin_cache, cache, slots, 0.25, 4.0)
    expected = torch.zeros_like(cache)
    reference.reshape_and_cache(k, value, expected, slots, 0.25, 4.0)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def test_fp8_cache_on_two_ranks(tiny_model_dir: Any) -> None:
    """Tensor parallelism: each rank holds its KV heads in fp8 and the two ranks agree with one under the
    module's rule (the ranks' q/k/v shards round differently in float32, which can tip an fp8 rounding)."""
    from kvserve import LLM

    path = tiny_model_dir("llama")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    prompts = ["Hello, my name is", "The three most important inventions of the twentieth century were"]
    runs = []
    for tp in (1, 2):
        llm = LLM(path, dtype="float32", tensor_parallel_size=tp, max_model_len=256, kv_cache_memory="16MiB",
                  kv_cache_dtype="fp8", max_num_batched_tokens=32)
        try:
            assert llm.engine.core.runner.kv_caches[0].dtype == torch.float8_e4m3fn
            assert llm.engine.core.runner.kv_caches[0].shape[3] == 2 // tp  # this rank's KV heads
            runs.append(llm.generate(prompts, params, use_tqdm=False))
        finally:
            llm.shutdown()
    for one, two in zip(*runs, strict=True):
        a, b = one.outputs[0], two.outputs[0]
        part = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), None)
        for step in range(len(a.token_ids) if part is None else part + 1):
            common = a.logprobs[step].keys() & b.logprobs[step].keys()
            assert len(common) >= 3
            assert all(abs(a.logprobs[step][t].logprob - b.logprobs[step][t].logprob) <= LOGPROB_TOL["fp8"]
                       for t in common)
