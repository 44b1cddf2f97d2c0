"""`--quantization fp8` (vLLM's online fp8) on the CPU: the flag's checks, the layers' quantization after loading
(scales, zero rows, merged and tensor-parallel shards), and the engine with fp8 weights (one rank and two) against
the same engine unquantized.

The differential oracle: greedy decoding of tiny random Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k norm) models
(`make_bare_checkpoint`: float32, 3 layers, hidden 256, logits of order 1). Every linear layer's weight and every
activation row entering it is rounded to e4m3 (3 mantissa bits: a relative error of at most 2^-4 each), so each
matmul's output moves by a few percent of its size, and the logprobs by a fraction of a nat: measured, over 6
prompts x 24 steps per model, at most 0.22 nats (90th percentile 0.12) on the top-5 tokens both runs list, and
the unquantized model's top token always among the fp8 run's top 5. The tolerance is 8x e4m3's relative error
(0.5 nats), about twice the largest gap seen: a scale missing or applied twice, scales of the wrong rows or a
transposed weight move logprobs by whole nats. Greedy tokens may part at a near tie (both tokens within the
tolerance in the unquantized run); after that the histories differ and nothing later is compared.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch
from helpers.engine_runs import greedy_with_logprobs, top_logprobs

from kvserve import LLM, SamplingParams, distributed
from kvserve.config import ConfigError, EngineArgs, _check_fp8_weights_device
from kvserve.engine.engine_core import EngineCore
from kvserve.entrypoints.cli import build_parser, engine_args_from
from kvserve.kernels import reference
from kvserve.layers.linear import Linear, MergedLinear, QKVLinear, quantize_fp8_layers

MAX_TOKENS = 24
LOGPROB_TOL = 8 * 2.0**-4  # see the module docstring
FP8 = torch.float8_e4m3fn
ARCHS = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 64}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from helpers.tiny_models import make_bare_checkpoint

    return {arch: make_bare_checkpoint(str(tmp_path_factory.mktemp(f"fp8w-{arch}")), arch, seed=0, **overrides)
            for arch, overrides in ARCHS.items()}


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1024, (n,), generator=generator).tolist() for n in (5, 17, 33, 70, 9, 48)]


def _core(path: str, quantization: str | None, **kwargs: Any) -> EngineCore:
    settings: dict[str, Any] = {"max_model_len": 256, "num_kv_blocks": 64, "max_num_batched_tokens": 64, **kwargs}
    return EngineCore(EngineArgs(model=path, device="cpu", quantization=quantization, **settings).create_engine_config())


def _compare(got: list, want: list, tol: float) -> float:
    """Asserts the module docstring's rule (`want` is the unquantized run); returns the largest logprob gap."""
    largest = 0.0
    compared = top1_listed = 0
    for (got_tokens, got_lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert len(got_tokens) == len(want_tokens) == MAX_TOKENS
        part = next((i for i, (a, b) in enumerate(zip(got_tokens, want_tokens, strict=True)) if a != b), None)
        for step in range(MAX_TOKENS if part is None else part + 1):
            mine, theirs = top_logprobs(got_lps[step]), top_logprobs(want_lps[step])
            compared += 1
            top1_listed += max(theirs, key=theirs.__getitem__) in mine
            common = mine.keys() & theirs.keys()
            assert len(common) >= 3, (step, mine, theirs)  # the same candidates, give or take the tail
            for token in common:
                assert abs(mine[token] - theirs[token]) <= tol, (step, token, mine[token], theirs[token])
                largest = max(largest, abs(mine[token] - theirs[token]))
        if part is not None:
            a, b = got_tokens[part], want_tokens[part]
            reference_top = top_logprobs(want_lps[part])
            assert a in reference_top and abs(reference_top[a] - reference_top[b]) <= tol, (part, a, b, reference_top)
    # measured: every position; 95 % leaves room for another machine's float32 rounding at a near tie
    assert top1_listed >= 0.95 * compared, (top1_listed, compared)
    return largest


@pytest.fixture(scope="module")
def unquantized_runs(checkpoints: dict[str, str]) -> dict[str, list]:
    return {arch: greedy_with_logprobs(_core(path, None), _prompts(), MAX_TOKENS) for arch, path in checkpoints.items()}


# ------------------------------------------------------------------------------------------------- engine


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp8_weights_agree_with_the_unquantized_model(checkpoints: dict[str, str], unquantized_runs: dict[str, list],
                                                      arch: str) -> None:
    core = _core(checkpoints[arch], "fp8")
    model = core.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(m.weight is None and m.weight_fp8 is not None and m.weight_fp8.dtype == FP8 for m in layers)
    # the embedding and the LM head keep the model's dtype
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    largest = _compare(greedy_with_logprobs(core, _prompts(), MAX_TOKENS), unquantized_runs[arch], LOGPROB_TOL)
    assert largest > 0.0  # the weights really are rounded


def test_fp8_weights_with_an_fp8_kv_cache(checkpoints: dict[str, str], unquantized_runs: dict[str, list]) -> None:
    """Both fp8 flags together: the tolerances add (the KV cache's own rule is 4x e4m3's error, 0.25 nats; measured
    largest gap 0.21 nats, against 0.22 with fp8 weights alone)."""
    core = _core(checkpoints["qwen2"], "fp8", kv_cache_dtype="fp8")
    assert all(cache.dtype == FP8 for cache in core.runner.kv_caches)
    _compare(greedy_with_logprobs(core, _prompts(), MAX_TOKENS), unquantized_runs["qwen2"], LOGPROB_TOL + 4 * 2.0**-4)


def test_two_ranks_with_fp8_weights(checkpoints: dict[str, str], unquantized_runs: dict[str, list]) -> None:
    """Tensor parallelism (2 CPU ranks, real processes): each rank quantizes its shards after loading. The
    row-parallel ranks' scales cover half the input columns each, so the result is not one rank's fp8 result
    bit for bit; against the unquantized model the same rule holds (measured: largest gap 0.22 nats)."""
    core = _core(checkpoints["qwen2"], "fp8", tensor_parallel_size=2)
    try:
        assert all(m.weight_fp8 is not None for m in core.runner.model.modules() if isinstance(m, Linear))
        _compare(greedy_with_logprobs(core, _prompts(), MAX_TOKENS), unquantized_runs["qwen2"], LOGPROB_TOL)
    finally:
        core.shutdown()


def test_fp8_weights_halve_the_weights_bytes_and_dummy_weights_take_the_same_path(checkpoints: dict[str, str]
                                                                                    ) -> None:
    path = checkpoints["llama"]
    dense, fp8 = _core(path, None), _core(path, "fp8", load_format="dummy")
    linear_bytes = sum(m.weight.numel() * 4 for m in dense.runner.model.modules() if isinstance(m, Linear))
    # float32 here: each weight value 4 bytes -> 1, plus a float32 scale per output row
    saved = dense.runner.weights_bytes() - fp8.runner.weights_bytes()
    assert 0.74 * linear_bytes < saved < 0.75 * linear_bytes
    assert all(m.weight_fp8 is not None for m in fp8.runner.model.modules() if isinstance(m, Linear))
    out = greedy_with_logprobs(fp8, _prompts()[:2], MAX_TOKENS)
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in out)


def test_llm_api_passes_the_flag_through(checkpoints: dict[str, str], tmp_path: Any) -> None:
    from helpers.tiny_models import write_byte_tokenizer

    path = write_byte_tokenizer(shutil.copytree(checkpoints["qwen3"], str(tmp_path / "m")))
    llm = LLM(model=path, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16, quantization="FP8")
    assert llm.engine.config.model_config.quantization == "fp8"
    out = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6 and out[0].outputs[0].text


# ----------------------------------------------------------------------------------------- config checks


def _with_quant_config(source: str, directory: str, quant: dict[str, Any]) -> str:
    shutil.copytree(source, directory)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quant
    with open(path, "w") as f:
        json.dump(config, f)
    return directory


def test_the_flag_and_its_spellings(checkpoints: dict[str, str]) -> None:
    ns = build_parser().parse_args(["serve", checkpoints["llama"], "--quantization", "fp8"])
    assert engine_args_from(ns)["quantization"] == "fp8"
    for name in ("fp8", "FP8"):
        config = EngineArgs(model=checkpoints["llama"], device="cpu", quantization=name).create_engine_config()
        assert config.model_config.quantization == "fp8"
    with pytest.raises(ConfigError, match=r"quantization 'fp4' is not supported; .*and fp8"):
        EngineArgs(model=checkpoints["llama"], device="cpu", quantization="fp4").create_engine_config()
    with pytest.raises(ConfigError, match=r"has no quantized weights; drop the flag \(or pass --quantization fp8"):
        EngineArgs(model=checkpoints["llama"], device="cpu", quantization="awq").create_engine_config()


def test_an_already_quantized_checkpoint_is_refused(checkpoints: dict[str, str], tmp_path: Any) -> None:
    from helpers.tiny_models import write_config_gguf

    awq = _with_quant_config(checkpoints["llama"], str(tmp_path / "awq"),
                             {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"})
    with pytest.raises(ConfigError, match=r"--quantization fp8 quantizes an unquantized .* already quantized as awq"):
        EngineArgs(model=awq, device="cpu", quantization="fp8").create_engine_config()
    with pytest.raises(ConfigError, match=r"already quantized as gguf; drop the flag"):
        gguf_path = write_config_gguf(str(tmp_path / "m.gguf"), "llama", {})
        EngineArgs(model=gguf_path, device="cpu", quantization="fp8").create_engine_config()


def test_a_gpu_before_ada_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _check_fp8_weights_device("cpu")  # the reference path
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(ConfigError, match=r"--quantization fp8 needs a GPU of compute capability 8.9 or later .* "
                                          r"this GPU is 8.6"):
        _check_fp8_weights_device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    _check_fp8_weights_device("cuda")


# ------------------------------------------------------------------------------------------------ layers


def _loaded(layer: Linear, shards: dict[Any, torch.Tensor], bias: torch.Tensor | None = None) -> Linear:
    assert layer.weight is not None
    for shard_id, tensor in shards.items():
        layer.weight.weight_loader(layer.weight, tensor, shard_id)  # type: ignore[attr-defined]
    if bias is not None:
        assert layer.bias is not None
        layer.bias.weight_loader(layer.bias, bias, None)  # type: ignore[attr-defined]
    return layer


def test_a_layer_quantizes_per_output_row() -> None:
    weight = torch.randn(32, 48)
    weight[3] = 0.0  # an all-zero row: scale 1, values 0
    bias = torch.randn(32)
    layer = _loaded(Linear(48, 32, True, torch.float32), {None: weight}, bias)
    before, after = layer.quantize_fp8()
    assert (before, after) == (32 * 48 * 4, 32 * 48 + 32 * 4)
    assert layer.weight is None and "weight" not in dict(layer.named_parameters())
    assert layer.weight_fp8 is not None and layer.weight_scale is not None
    assert {"weight_fp8", "weight_scale", "bias"} <= set(dict(layer.named_parameters()))
    want8, want_scale = reference.quantize_rows_fp8(weight)
    assert torch.equal(layer.weight_fp8.view(torch.uint8), want8.view(torch.uint8))
    assert torch.equal(layer.weight_scale, want_scale)
    assert layer.weight_scale[3].item() == 1.0 and layer.weight_fp8[3].float().abs().sum().item() == 0.0
    assert torch.equal(layer.weight_scale, weight.abs().amax(dim=1).where(weight.abs().amax(dim=1) > 0,
                                                                          torch.tensor(448.0)) / 448)
    x = torch.randn(5, 48)
    assert torch.equal(layer(x), reference.fp8_linear(x, want8, want_scale, bias))
    with pytest.raises(ValueError, match="only a dense layer"):
        layer.quantize_fp8()
    # what the model hands the fused ops (ops.linear_rope_cache / linear_silu_mul): the fp8 weight and scales
    fusable = layer.fusable_weight()
    assert fusable is not None and fusable[0] is layer.weight_fp8 and fusable[1] is layer.weight_scale
    dense = _loaded(Linear(48, 32, False, torch.float32), {None: weight})
    assert dense.fusable_weight() == (dense.weight, None)


def test_merged_layers_are_quantized_after_all_their_shards() -> None:
    """Per-row scales: a fused layer's rows quantize as its checkpoint tensors would alone."""
    gate, up = torch.randn(24, 32), torch.randn(24, 32) * 10
    merged = _loaded(MergedLinear(32, [24, 24], False, torch.float32), {0: gate, 1: up})
    merged.quantize_fp8()
    q, k, v = torch.randn(32, 32), torch.randn(16, 32) * 0.01, torch.randn(16, 32)
    qkv = _loaded(QKVLinear(32, 8, 4, 2, True, torch.float32), {"q": q, "k": k, "v": v})
    qkv.quantize_fp8()
    for layer, parts in ((merged, (gate, up)), (qkv, (q, k, v))):
        wants = [reference.quantize_rows_fp8(part) for part in parts]
        assert layer.weight_fp8 is not None and layer.weight_scale is not None
        assert torch.equal(layer.weight_fp8.view(torch.uint8), torch.cat([w[0] for w in wants]).view(torch.uint8))
        assert torch.equal(layer.weight_scale, torch.cat([w[1] for w in wants]))


def _build_rank(make: Any, rank: int, size: int) -> Any:
    previous = distributed.set_group_for_building(distributed.TPGroup(rank, size))
    try:
        return make()
    finally:
        distributed.set_group_for_building(previous)


def test_two_ranks_quantize_their_own_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-rank simulation: a column-parallel rank's rows get the scales of the whole checkpoint's rows; a
    row-parallel rank scales its own input columns, and the ranks' outputs summed (the all-reduce, here done by
    hand) give the one-rank fp8 layer's result within fp8's error, the bias added once."""
    size, hidden, inner = 2, 32, 64
    gen = torch.Generator().manual_seed(3)
    gate, up = torch.randn(inner, hidden, generator=gen), torch.randn(inner, hidden, generator=gen)
    down, bias = torch.randn(hidden, inner, generator=gen), torch.randn(hidden, generator=gen)
    x = torch.randn(4, inner, generator=gen)
    full8, full_scale = reference.quantize_rows_fp8(torch.cat([gate, up]))
    monkeypatch.setattr(distributed, "all_reduce", lambda t: t)
    partial = []
    for rank in range(size):
        merged = _build_rank(lambda: MergedLinear(hidden, [inner // size] * 2, False, torch.float32), rank, size)
        _loaded(merged, {0: gate, 1: up}).quantize_fp8()
        rows = torch.cat([torch.arange(rank * inner // size, (rank + 1) * inner // size) + i * inner for i in (0, 1)])
        assert torch.equal(merged.weight_fp8.view(torch.uint8), full8[rows].view(torch.uint8))
        assert torch.equal(merged.weight_scale, full_scale[rows])
        row = _build_rank(lambda: Linear(inner // size, hidden, True, torch.float32, row_parallel=True), rank, size)
        _loaded(row, {None: down}, bias).quantize_fp8()
        cols = slice(rank * inner // size, (rank + 1) * inner // size)
        want8, want_scale = reference.quantize_rows_fp8(down[:, cols])
        assert torch.equal(row.weight_fp8.view(torch.uint8), want8.view(torch.uint8))
        assert torch.equal(row.weight_scale, want_scale)
        partial.append(row(x[:, cols]))
    exact = x @ down.T + bias
    one_rank = reference.fp8_linear(x, *reference.quantize_rows_fp8(down), bias)
    bound = 2.0**-3 * (x.abs() @ down.abs().T) + 1e-5
    assert ((sum(partial) - exact).abs() <= bound).all()
    assert ((one_rank - exact).abs() <= bound).all()


def test_a_model_quantizes_every_linear_and_nothing_else(checkpoints: dict[str, str]) -> None:
    core = _core(checkpoints["qwen3"], None)
    model = core.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    summary = quantize_fp8_layers(model)
    assert summary.num_layers == len(linears) == 4 * 3  # qkv, o, gate_up, down per layer
    assert summary.bytes_after < summary.bytes_before / 3.9 and summary.unfit_layers == ()
    assert "12 linear layers quantized" in summary.describe()
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert all(dtype == FP8 for name, dtype in dtypes.items() if name.endswith("weight_fp8"))
    assert all(dtype == torch.float32 for name, dtype in dtypes.items() if not name.endswith("weight_fp8"))
    assert quantize_fp8_layers(model).num_layers == 0  # nothing left to quantize
