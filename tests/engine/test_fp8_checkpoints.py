"""Checkpoints stored in fp8 (vLLM's "fp8", llm-compressor's "compressed-tensors", FBGEMM's "fbgemm_fp8") on the
CPU: what is read, what is refused, and the engine against oracles that leave no tolerance.

The oracles: a checkpoint whose weights are quantized per output channel by `ops.quantize_rows_fp8` holds exactly
what `--quantization fp8` makes of the unquantized checkpoint at load (the same fp8 values and scales, row by row),
so the two engines must give the same tokens and the same logprobs; a checkpoint with one scale per tensor must
give exactly what the same fp8 values give with that scale written out per output channel. A scale given to the
wrong shard's rows, a transposed or misplaced weight, or a scale read as its inverse breaks equality.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch
from helpers.fp8_checkpoints import (
    FBGEMM,
    MAX_TOKENS,
    VLLM_FP8,
    compressed_tensors,
    fp8_core,
    fp8_runs,
    write_fp8_checkpoint,
)
from safetensors.torch import load_file, save_file

from kvserve.config import ConfigError, EngineArgs
from kvserve.layers.linear import Linear
from kvserve.layers.quantization import parse_quant_config
from kvserve.model.paths import ModelLoadError

FP8 = torch.float8_e4m3fn
ARCHS = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 64}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from helpers.tiny_models import make_bare_checkpoint

    return {arch: make_bare_checkpoint(str(tmp_path_factory.mktemp(f"fp8c-{arch}")), arch, seed=1, **overrides)
            for arch, overrides in ARCHS.items()}


@pytest.fixture(scope="module")
def online_runs(checkpoints: dict[str, str]) -> dict[str, list]:
    return {arch: fp8_runs(fp8_core(path, "fp8")) for arch, path in checkpoints.items()}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_per_channel_checkpoint_equals_quantizing_at_load(checkpoints: dict[str, str], online_runs: dict[str, list],
                                                             arch: str, tmp_path: Any) -> None:
    path = write_fp8_checkpoint(checkpoints[arch], str(tmp_path / "m"), compressed_tensors("channel"), per_tensor=False)
    core = fp8_core(path)
    assert core.config.model_config.quantization is None  # nothing quantized at load
    layers = [m for m in core.runner.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.weight is None and m.weight_fp8 is not None and m.weight_fp8.dtype == FP8 for m in layers)
    assert fp8_runs(core) == online_runs[arch]


def test_fbgemm_and_row_shaped_scales_read_the_same(checkpoints: dict[str, str], online_runs: dict[str, list],
                                                    tmp_path: Any) -> None:
    """FBGEMM's format (scales [N, 1], activation bounds `input_scale_ub`) and scales stored as [N]."""
    ub = {"model.layers.0.self_attn.q_proj.input_scale_ub": torch.tensor([1200.0])}
    fbgemm = write_fp8_checkpoint(checkpoints["qwen2"], str(tmp_path / "fb"), FBGEMM, per_tensor=False, extra=ub)
    assert fp8_runs(fp8_core(fbgemm)) == online_runs["qwen2"]
    rows = write_fp8_checkpoint(checkpoints["qwen2"], str(tmp_path / "rows"), compressed_tensors("channel"),
                                per_tensor=False, scale_shape="row")
    assert fp8_runs(fp8_core(rows)) == online_runs["qwen2"]


def test_a_scale_per_tensor_is_each_shards_own(checkpoints: dict[str, str], tmp_path: Any) -> None:
    """vLLM's "fp8" format (a scalar scale per tensor, static activation scales not read) against the same fp8
    values with each tensor's scale repeated over its rows: q, k and v (and gate and up) have different scales
    and share one layer, so each must reach its own shard's rows."""
    tensor = write_fp8_checkpoint(checkpoints["qwen2"], str(tmp_path / "t"), VLLM_FP8, per_tensor=True)
    expanded = str(tmp_path / "c")
    shutil.copytree(tensor, expanded)
    tensors = load_file(os.path.join(expanded, "model.safetensors"))
    scales = {name: value for name, value in tensors.items() if name.endswith(".weight_scale")}
    assert len({float(s) for s in scales.values()}) == len(scales)  # every tensor's scale differs
    for name, value in scales.items():
        rows = tensors[name.replace(".weight_scale", ".weight")].shape[0]
        tensors[name] = value.reshape(1, 1).expand(rows, 1).contiguous()
    save_file(tensors, os.path.join(expanded, "model.safetensors"))
    with open(os.path.join(expanded, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = compressed_tensors("channel")
    with open(os.path.join(expanded, "config.json"), "w") as f:
        json.dump(config, f)
    core = fp8_core(tensor)
    qkv = core.runner.model.model.layers[0].self_attn.qkv_proj
    q_rows = qkv.q_size
    assert float(qkv.weight_scale[0]) == float(scales["model.layers.0.self_attn.q_proj.weight_scale"])
    assert float(qkv.weight_scale[q_rows]) == float(scales["model.layers.0.self_attn.k_proj.weight_scale"])
    got = fp8_runs(core)
    assert got == fp8_runs(fp8_core(expanded))
    assert len({tokens[0] for tokens, _ in got}) > 1  # the prompts do not all collapse to one token


def test_ignored_layers_stay_dense(checkpoints: dict[str, str], tmp_path: Any) -> None:
    """compressed-tensors' `ignore` by name and by "re:" pattern: those layers are stored and run dense."""
    quant = compressed_tensors("channel", ignore=["lm_head", "re:.*layers\\.1\\.mlp\\..*", "model.layers.2.self_attn.o_proj"])
    path = write_fp8_checkpoint(checkpoints["llama"], str(tmp_path / "m"), quant, per_tensor=False,
                                skip=("layers.1.mlp.", "layers.2.self_attn.o_proj"))
    core = fp8_core(path)
    layers = core.runner.model.model.layers
    dense = {"1.gate_up", "1.down", "2.o"}
    for i, layer in enumerate(layers):
        for short, module in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                              ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
            if f"{i}.{short}" in dense:
                assert module.weight is not None and module.weight.dtype == torch.float32 and module.weight_fp8 is None
            else:
                assert module.weight is None and module.weight_fp8 is not None
    out = fp8_runs(core)
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in out)


def test_the_quantization_flag_with_an_fp8_checkpoint(checkpoints: dict[str, str], tmp_path: Any) -> None:
    path = write_fp8_checkpoint(checkpoints["llama"], str(tmp_path / "m"), compressed_tensors("tensor"), per_tensor=True)
    for flag in (None, "fp8", "compressed-tensors"):
        config = EngineArgs(model=path, device="cpu", quantization=flag).create_engine_config()
        assert config.model_config.quantization in (None, "compressed-tensors")
    with pytest.raises(ConfigError, match=r"--quantization awq asked for, but .* holds fp8 weights"):
        EngineArgs(model=path, device="cpu", quantization="awq").create_engine_config()
    with pytest.raises(ConfigError, match=r"--quantization fbgemm_fp8 asked for, but .* has no quantized weights"):
        EngineArgs(model=checkpoints["llama"], device="cpu", quantization="fbgemm_fp8").create_engine_config()


def test_dummy_weights_with_an_fp8_config(checkpoints: dict[str, str], tmp_path: Any) -> None:
    path = write_fp8_checkpoint(checkpoints["llama"], str(tmp_path / "m"), VLLM_FP8, per_tensor=True)
    dummy, online = fp8_core(path, load_format="dummy"), fp8_core(checkpoints["llama"], "fp8")
    try:
        layers = [m for m in dummy.runner.model.modules() if isinstance(m, Linear)]
        assert all(m.weight_fp8 is not None and m.weight_fp8.float().std() > 0.5 for m in layers)
        assert all(m.weight_scale is not None and bool((m.weight_scale == 0.02).all()) for m in layers)
        assert dummy.runner.weights_bytes() == online.runner.weights_bytes()
    finally:
        online.shutdown()
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in fp8_runs(dummy))


# ----------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("quant", "message"), [
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\] is not supported: block-wise fp8 "
                                                          r"scales need a block size of two positive integers"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, r"fp8 weights in e5m2"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, r"format 'pack-quantized'"),
    ({**compressed_tensors("channel"), "config_groups": {"a": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "strategy": "group"}}}}, r"weights of 4 bits, type 'int'"),
    ({**compressed_tensors("channel"), "config_groups": {"a": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "group"}}}}, r"fp8 weights with strategy 'group'"),
    ({**compressed_tensors("channel"), "config_groups": {"a": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "block"}}}}, r"compressed-tensors block_structure None is not "
                                                                 r"supported"),
    ({**compressed_tensors("channel"), "config_groups": {"a": {"targets": ["re:.*q_proj"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "channel"}}}}, r"targets \['re:.\*q_proj'\]"),
    ({"quant_method": "modelopt"}, r"'modelopt' is not supported; .*ModelOpt checkpoints are not read"),
    ({**compressed_tensors("channel"), "sparsity_config": {"format": "sparse-24-bitmask"}},
     r"compressed-tensors sparsity format 'sparse-24-bitmask'"),
])
def test_what_is_refused_by_its_config(quant: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=rf"where: .*{message}"):
        parse_quant_config(quant, "where")


def test_a_config_alone_is_not_enough(checkpoints: dict[str, str], tmp_path: Any) -> None:
    """An fp8 config over weights that are not fp8 is refused at load, naming the tensor."""
    source = checkpoints["llama"]
    path = str(tmp_path / "m")
    shutil.copytree(source, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = VLLM_FP8
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ModelLoadError, match=r"_proj.weight': an fp8 checkpoint's weight must be float8_e4m3fn, "
                                             r"got torch.float32"):
        fp8_core(path)


def test_bad_tensors_are_refused(checkpoints: dict[str, str], tmp_path: Any) -> None:
    source = checkpoints["llama"]
    head = {"lm_head.weight": torch.zeros(1024, 256).to(FP8)}
    path = write_fp8_checkpoint(source, str(tmp_path / "head"), VLLM_FP8, per_tensor=True, extra=head)
    with pytest.raises(ModelLoadError, match=r"'lm_head.weight' is torch.float8_e4m3fn, but its layer is not an fp8"):
        fp8_core(path)
    negative = {"model.layers.1.mlp.up_proj.weight_scale": torch.tensor(-0.5)}
    path = write_fp8_checkpoint(source, str(tmp_path / "neg"), VLLM_FP8, per_tensor=True, extra=negative)
    with pytest.raises(ModelLoadError, match=r"model.layers.1.mlp.gate_up_proj: an fp8 weight scale is -0.5 \(shard 1, "
                                             r"its row 0 here\)"):
        fp8_core(path)
    blocks = {"model.layers.0.mlp.down_proj.weight_scale": torch.ones(2, 4)}
    path = write_fp8_checkpoint(source, str(tmp_path / "blk"), VLLM_FP8, per_tensor=True, extra=blocks)
    with pytest.raises(ModelLoadError, match=r"down_proj.weight_scale': a weight scale of shape \(2, 4\)"):
        fp8_core(path)
    e5m2 = {"model.layers.0.mlp.down_proj.weight": torch.zeros(256, 512).to(torch.float8_e5m2)}
    path = write_fp8_checkpoint(source, str(tmp_path / "e5"), VLLM_FP8, per_tensor=True, extra=e5m2)
    with pytest.raises(ModelLoadError, match=r"down_proj.weight': an fp8 checkpoint's weight must be float8_e4m3fn, "
                                             r"got torch.float8_e5m2"):
        fp8_core(path)


def test_skip_lists_match_whole_name_parts() -> None:
    """vLLM's fp8 format lists skipped layers as `ignored_layers` (transformers writes `modules_to_not_convert`);
    a plain entry matches whole dotted parts of a layer's name, a "re:" one as a regular expression."""
    for key in ("ignored_layers", "modules_to_not_convert"):
        config = parse_quant_config({"quant_method": "fp8", key: ["model.layers.1", "down_proj"]}, "where")
        assert not config.applies_to("model.layers.1.self_attn.q_proj")
        assert config.applies_to("model.layers.10.self_attn.q_proj")  # not layer 1
        assert not config.applies_to("model.layers.10.mlp.down_proj")
        assert config.applies_to("model.layers.10.mlp.up_proj")
    config = parse_quant_config(compressed_tensors("channel", ignore=["re:.*mlp\\.gate_proj$"]), "where")
    assert not config.applies_to("model.layers.3.mlp.gate_proj") and config.applies_to("model.layers.3.mlp.up_proj")


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("per_tensor", [True, False], ids=["tensor", "channel"])
def test_each_rank_holds_the_dense_layers_rows(kv_heads: int, ranks: int, per_tensor: bool) -> None:
    """Built as rank r of `ranks` (fewer KV heads than ranks: replicated), an fp8-checkpoint layer's weight times
    its scales equals what the dense layer of the dequantized weights holds on that rank: q/k/v, gate/up and a
    row-parallel down projection, scales per tensor or per output row."""
    from kvserve import distributed
    from kvserve.kernels import ops
    from kvserve.layers.linear import MergedLinear, QKVLinear
    from kvserve.layers.quantization import QuantConfig

    fp8 = QuantConfig("fp8", 8, -1)
    gen = torch.Generator().manual_seed(kv_heads * 10 + ranks)

    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if per_tensor:
            scale = w.abs().amax() / 448.0
            return (w / scale).to(FP8), scale.reshape(())
        w8, scale = ops.quantize_rows_fp8(w)
        return w8, scale.view(-1, 1)

    def dequantized(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return w8.float() * (scale if scale.dim() == 0 else scale.view(-1, 1))

    heads, head_dim, hidden, inter = 8, 16, 64, 128
    qkv = {"q": torch.randn(heads * head_dim, hidden, generator=gen),
           "k": 3 * torch.randn(kv_heads * head_dim, hidden, generator=gen),
           "v": 0.5 * torch.randn(kv_heads * head_dim, hidden, generator=gen)}
    gate_up = {0: torch.randn(inter, hidden, generator=gen), 1: 2 * torch.randn(inter, hidden, generator=gen)}
    down = {None: torch.randn(hidden, inter, generator=gen)}
    cases = [(lambda q: QKVLinear(hidden, head_dim, heads // ranks, max(kv_heads // ranks, 1), False, torch.float32,
                                  quant=q), qkv),
             (lambda q: MergedLinear(hidden, [inter // ranks] * 2, False, torch.float32, quant=q), gate_up),
             (lambda q: Linear(inter // ranks, hidden, False, torch.float32, row_parallel=True, quant=q), down)]
    for make, shards in cases:
        stored = {shard: quantize(w) for shard, w in shards.items()}
        for rank in range(ranks):
            previous = distributed.set_group_for_building(distributed.TPGroup(rank, ranks))
            try:
                layer, dense = make(fp8), make(None)
            finally:
                distributed.set_group_for_building(previous)
            for shard, (w8, scale) in stored.items():
                layer.weight_fp8.weight_loader(layer.weight_fp8, w8, shard)
                layer.weight_scale.weight_loader(layer.weight_scale, scale, shard)
                dense.weight.weight_loader(dense.weight, dequantized(w8, scale), shard)
            assert torch.equal(layer.weight_fp8.float() * layer.weight_scale.view(-1, 1), dense.weight.data)


@pytest.mark.parametrize("per_tensor", [True, False], ids=["tensor", "channel"])
def test_two_ranks_read_their_shards(checkpoints: dict[str, str], tmp_path: Any, per_tensor: bool) -> None:
    """Tensor parallelism (2 CPU ranks, real processes): column-parallel ranks take their rows of the weights and
    scales, row-parallel ranks their columns and every row's scale. On the CPU each row-parallel rank quantizes
    its half of the activations with its own per-token scale, so the ranks do not compute one rank's result bit for
    bit: logprobs agree within test_fp8_weights' bound for fp8 rounding (8x e4m3's relative error, 0.5 nats), and
    greedy tokens up to a near tie. A scale or weight rows given to the wrong rank or shard move them by nats."""
    tol = 8 * 2.0**-4
    quant = VLLM_FP8 if per_tensor else compressed_tensors("channel")
    path = write_fp8_checkpoint(checkpoints["qwen2"], str(tmp_path / "m"), quant, per_tensor=per_tensor)
    one, two = fp8_runs(fp8_core(path)), fp8_runs(fp8_core(path, tensor_parallel_size=2))
    compared = 0
    for (tokens1, tops1), (tokens2, tops2) in zip(one, two, strict=True):
        for step, (a, b) in enumerate(zip(tokens1, tokens2, strict=True)):
            common = tops1[step].keys() & tops2[step].keys()
            assert len(common) >= 3, (step, tops1[step], tops2[step])  # the same candidates, give or take the tail
            assert all(abs(tops1[step][t] - tops2[step][t]) < tol for t in common), (step, tops1[step], tops2[step])
            compared += 1
            if a != b:  # a near tie: the one rank's run ranks the two within the bound
                assert b in tops1[step] and abs(tops1[step][a] - tops1[step][b]) < tol
                break
    assert compared >= len(one)  # every prompt's first token at least (the tiny model's flat logits tie often)


def test_a_gpu_before_ada_is_refused_for_an_fp8_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.config import _check_fp8_weights_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"an fp8 checkpoint needs a GPU of compute capability 8.9 or later .* this "
                                          r"GPU is 8.0: use the unquantized checkpoint, or an AWQ / GPTQ one"):
        _check_fp8_weights_device("cuda", checkpoint=True)
