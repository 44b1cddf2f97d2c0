"""Block-wise fp8 checkpoints (vLLM's "fp8" with `weight_block_size`, as Qwen's and DeepSeek's FP8 releases;
compressed-tensors' "block" strategy) on the CPU: what is read, what is refused, and oracles that leave no
tolerance.

The oracle: such a layer dequantizes its weight with the block scales at load and requantizes it per output
channel with `ops.quantize_rows_fp8`, as `--quantization fp8` does with a dense weight, so the engine on a
block-wise checkpoint must give the same tokens and logprobs, bit for bit, as `--quantization fp8` on the dense
checkpoint of the dequantized weights (`write_dequantized_checkpoint`); and every tensor-parallel rank must hold
what `Linear.quantize_fp8` makes of the dense layer's share. The helper's block scales differ by up to 16x from
block to block, so a scale applied to the wrong block, transposed, or to the wrong shard or rank breaks equality.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.fp8_checkpoints import (
    MAX_TOKENS,
    block_dequantize,
    block_fp8_config,
    compressed_tensors,
    fp8_core,
    fp8_runs,
    write_block_fp8_checkpoint,
    write_dequantized_checkpoint,
)
from safetensors.torch import load_file, save_file

from kvserve import distributed
from kvserve.kernels import ops
from kvserve.layers import linear
from kvserve.layers.linear import Linear, MergedLinear, QKVLinear
from kvserve.layers.quantization import QuantConfig, parse_quant_config
from kvserve.model.paths import ModelLoadError

FP8 = torch.float8_e4m3fn
# hidden 256, intermediate 512 (unless overridden), q 256 rows, k / v 128: blocks of 24 x 40 leave partial edge
# blocks on every side.
ARCHS = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 64}}
BLOCK = (24, 40)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from helpers.tiny_models import make_bare_checkpoint

    return {arch: make_bare_checkpoint(str(tmp_path_factory.mktemp(f"bfp8-{arch}")), arch, seed=2, **overrides)
            for arch, overrides in ARCHS.items()}


def _check_against_dense(block_path: str, dense_path: str, **kwargs: Any) -> None:
    core = fp8_core(block_path, **kwargs)
    assert core.config.model_config.quantization is None  # nothing quantized at load but the block-wise layers
    layers = [m for m in core.runner.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.weight is None and m.weight_fp8 is not None and m.weight_fp8.dtype == FP8
                          and m.weight_scale is not None and m.weight_scale.shape == (m.output_size,)
                          and m.fp8_blocks is None for m in layers)
    got = fp8_runs(core)
    assert got == fp8_runs(fp8_core(dense_path, "fp8", **kwargs))
    assert len({tokens[0] for tokens, _ in got}) > 1  # the prompts do not all collapse to one token


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_block_wise_checkpoint_equals_quantizing_its_dense_weights_at_load(
        checkpoints: dict[str, str], arch: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    block = write_block_fp8_checkpoint(checkpoints[arch], str(tmp_path / "b"), BLOCK)
    dense = write_dequantized_checkpoint(block, str(tmp_path / "d"), BLOCK)
    with caplog.at_level("WARNING", logger="kvserve.model.loader"):
        _check_against_dense(block, dense)
    said = [r.getMessage() for r in caplog.records if "block-wise scales" in r.getMessage()]
    assert len(said) == 1 and "blocks of 24 x 40" in said[0] and "requantized per output channel" in said[0]


def test_compressed_tensors_block_strategy(checkpoints: dict[str, str], tmp_path: Path) -> None:
    """compressed-tensors names the block scales `weight_scale`; non-square blocks (16 x 32) the other way round."""
    block = write_block_fp8_checkpoint(checkpoints["qwen2"], str(tmp_path / "b"), (16, 32), compressed=True, seed=3)
    assert "model.layers.0.mlp.up_proj.weight_scale" in load_file(os.path.join(block, "model.safetensors"))
    _check_against_dense(block, write_dequantized_checkpoint(block, str(tmp_path / "d"), (16, 32)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_of_128_with_partial_blocks(tmp_path: Path, dtype: str) -> None:
    """The released block size, 128 x 128, at shapes that leave every weight's last blocks partial: q 192 rows,
    k / v 64 (half a block), hidden 192 and intermediate 320 columns. In bfloat16 the dequantized weight is
    rounded to the model's dtype before it is requantized, as the dense checkpoint's weight is when it loads."""
    from helpers.tiny_models import make_bare_checkpoint

    source = make_bare_checkpoint(str(tmp_path / "s"), "qwen2", seed=4, hidden_size=192, intermediate_size=320,
                                  num_attention_heads=6, num_key_value_heads=2)
    block = write_block_fp8_checkpoint(source, str(tmp_path / "b"), (128, 128))
    scales = load_file(os.path.join(block, "model.safetensors"))
    assert scales["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape == (1, 2)
    assert scales["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 3)
    _check_against_dense(block, write_dequantized_checkpoint(block, str(tmp_path / "d"), (128, 128)), dtype=dtype)


def test_two_ranks_equal_quantizing_the_dense_checkpoint_at_load(checkpoints: dict[str, str], tmp_path: Path) -> None:
    """Tensor parallelism (2 CPU ranks, real processes): each rank holds what `--quantization fp8` makes of its
    share of the dense weights (rank boundaries inside blocks: q's 128 rows a rank against blocks of 24 rows,
    down's 256 columns against 40), so the two engines agree bit for bit at 2 ranks too."""
    block = write_block_fp8_checkpoint(checkpoints["qwen2"], str(tmp_path / "b"), BLOCK)
    dense = write_dequantized_checkpoint(block, str(tmp_path / "d"), BLOCK)
    got = fp8_runs(fp8_core(block, tensor_parallel_size=2))
    assert got == fp8_runs(fp8_core(dense, "fp8", tensor_parallel_size=2))
    assert len({tokens[0] for tokens, _ in got}) > 1


# ------------------------------------------------------------------------------------------ single layers


def _random_block_weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 values [n, k] and block scales 2 ** e, e an integer in [-6, 6] drawn per block."""
    generator = torch.Generator().manual_seed(seed)
    w8 = (100 * torch.randn(n, k, generator=generator)).clamp(-448.0, 448.0).to(FP8)
    shape = (-(-n // block[0]), -(-k // block[1]))
    return w8, 2.0 ** torch.randint(-6, 7, shape, generator=generator).float()


@pytest.mark.parametrize("block", [(16, 32), (32, 16), (8, 8)])
def test_each_block_gets_its_own_scale(block: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A 88 x 72 layer (partial blocks in both directions) against the block-by-block dequantization requantized
    per row: a scale looked up transposed, by the other dimension's block size, or one block off fails. The
    scales load before the weight (either may come first). Requantized 7 rows at a time (chunks that start inside
    blocks, the last one short), so a chunk given the wrong rows' scales fails too."""
    monkeypatch.setattr(linear, "_REQUANTIZE_ELEMENTS", 7 * 72)
    w8, scales = _random_block_weight(88, 72, block, seed=block[0] * 100 + block[1])
    layer = Linear(72, 88, False, torch.float32, quant=QuantConfig("fp8", 8, -1, weight_block=block))
    assert layer.weight_scale is not None and layer.weight_fp8 is not None
    layer.weight_scale.weight_loader(layer.weight_scale, scales)
    layer.weight_fp8.weight_loader(layer.weight_fp8, w8)
    layer.finish_loading()
    want_w8, want_scale = ops.quantize_rows_fp8(block_dequantize(w8, scales, block))
    assert torch.equal(layer.weight_fp8.view(torch.uint8), want_w8.view(torch.uint8))
    assert torch.equal(layer.weight_scale.data, want_scale)
    assert layer.fp8_blocks is None  # the block scales are released


Maker = Callable[[QuantConfig | None, int], Linear]  # (quantization, ranks) -> one rank's layer


def test_a_layer_without_its_block_scales_or_weight_is_refused() -> None:
    """What `load_weights`' check for missing tensors leaves to the layer: finishing a shard that lacks either."""
    w8, scales = _random_block_weight(64, 48, (16, 16), seed=5)
    quant = QuantConfig("fp8", 8, -1, weight_block=(16, 16))
    layer = MergedLinear(48, [32, 32], False, torch.float32, quant=quant)
    layer.weight_fp8.weight_loader(layer.weight_fp8, w8[:32], 0)
    layer.weight_scale.weight_loader(layer.weight_scale, scales[:2], 0)
    layer.weight_fp8.weight_loader(layer.weight_fp8, w8[32:], 1)
    with pytest.raises(ModelLoadError, match=r"^shard 1 of a block-wise fp8 layer has no block scales$"):
        layer.finish_loading()
    layer = Linear(48, 64, False, torch.float32, quant=quant)
    layer.weight_scale.weight_loader(layer.weight_scale, scales)
    with pytest.raises(ModelLoadError, match=r"^a block-wise fp8 layer has no fp8 weight$"):
        layer.finish_loading()


def test_a_weight_that_is_not_finite_is_refused_naming_it() -> None:
    """A NaN fp8 code (0x7f / 0xff), or a value whose product with its block scale overflows the model's dtype,
    is named as what it is (the shard, its row and column), not as the per-row scale it would make NaN or inf."""
    block = (16, 16)
    w8, scales = _random_block_weight(64, 48, block, seed=6)
    quant = QuantConfig("fp8", 8, -1, weight_block=block)

    def merged(w8: torch.Tensor, dtype: torch.dtype, ranks: int = 1) -> MergedLinear:
        layer = MergedLinear(48, [32 // ranks] * 2, False, dtype, quant=quant)
        for shard in (0, 1):
            layer.weight_fp8.weight_loader(layer.weight_fp8, w8[32 * shard:32 * (shard + 1)], shard)
            layer.weight_scale.weight_loader(layer.weight_scale, scales[2 * shard:2 * (shard + 1)], shard)
        return layer

    for code in (0x7F, 0xFF):
        nan = w8.clone()
        nan.view(torch.uint8)[32 + 3, 5] = code
        with pytest.raises(ModelLoadError, match=r"^the fp8 weight holds a NaN \(shard 1, its row 3 here, checkpoint "
                                                 r"column 5\): fp8 weights must be finite$"):
            merged(nan, torch.float32).finish_loading()
    big = w8.clone()
    big[32:48, :16] = 1.0  # block (2, 0): shard 1's rows 0-15, columns 0-15
    big[32 + 3, 5] = 448.0
    scales[2, 0] = 256.0  # 448 x 256 = 114688: past float16's 65504 (the other blocks' scales are 64 at most)
    with pytest.raises(ModelLoadError, match=r"^the fp8 weight's value 448.0 times its block scale 256.0 is inf in "
                                             r"float16 \(shard 1, its row 3 here, checkpoint column 5\)"):
        merged(big, torch.float16).finish_loading()
    merged(big, torch.float32).finish_loading()  # finite in float32
    previous = distributed.set_group_for_building(distributed.TPGroup(1, 2))  # rank 1 of 2 holds 16 rows a shard
    try:
        with pytest.raises(ModelLoadError, match=r"^the fp8 weight holds a NaN \(shard 1, its row 3 here on "
                                                 r"tensor-parallel rank 1 of 2, checkpoint column 5\)"):
            nan = w8.clone()
            nan.view(torch.uint8)[32 + 16 + 3, 5] = 0x7F
            merged(nan, torch.float32, ranks=2).finish_loading()
    finally:
        distributed.set_group_for_building(previous)


def _build(make: Maker, rank: int, ranks: int, quant: QuantConfig) -> tuple[Linear, Linear]:
    previous = distributed.set_group_for_building(distributed.TPGroup(rank, ranks))
    try:
        return make(quant, ranks), make(None, ranks)
    finally:
        distributed.set_group_for_building(previous)


@pytest.mark.parametrize("block", [(24, 40), (128, 128)])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("ranks", [2, 4])
def test_each_rank_holds_what_online_fp8_makes_of_its_share(block: tuple[int, int], kv_heads: int, ranks: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Built as rank r of `ranks` (fewer KV heads than ranks: replicated), a block-wise layer holds exactly what
    `quantize_fp8` makes of the dense layer of the dequantized weights on that rank: q/k/v and gate/up (each
    shard its own block scales) and a row-parallel down projection. Rank and shard boundaries fall inside blocks:
    with 24 x 40, q's 32 rows a rank and down's 32 columns; with 128 x 128, heads of 64 rows (2 KV heads over 4
    ranks), gate / up / down's 80 or 160 a rank, hidden 192 (a partial block). Requantized in chunks of 448
    elements: 7 rows of 64 columns, 14 of 32, 5 of 80, 2 of 160 or 192 (chunks that start inside blocks)."""
    monkeypatch.setattr(linear, "_REQUANTIZE_ELEMENTS", 7 * 64)
    quant = QuantConfig("fp8", 8, -1, weight_block=block)
    heads = 8
    head_dim, hidden, inter = (16, 64, 128) if block == (24, 40) else (64, 192, 320)
    seeds = iter(range(kv_heads * 10 + ranks, kv_heads * 10 + ranks + 100))
    qkv = {"q": _random_block_weight(heads * head_dim, hidden, block, next(seeds)),
           "k": _random_block_weight(kv_heads * head_dim, hidden, block, next(seeds)),
           "v": _random_block_weight(kv_heads * head_dim, hidden, block, next(seeds))}
    gate_up = {0: _random_block_weight(inter, hidden, block, next(seeds)),
               1: _random_block_weight(inter, hidden, block, next(seeds))}
    down = {None: _random_block_weight(hidden, inter, block, next(seeds))}
    cases: list[tuple[Maker, dict[Hashable, tuple[torch.Tensor, torch.Tensor]]]] = [
        (lambda q, n: QKVLinear(hidden, head_dim, heads // n, max(kv_heads // n, 1), False, torch.float32, quant=q),
         qkv),
        (lambda q, n: MergedLinear(hidden, [inter // n] * 2, False, torch.float32, quant=q), gate_up),
        (lambda q, n: Linear(inter // n, hidden, False, torch.float32, row_parallel=True, quant=q), down)]
    for make, shards in cases:
        one_rank, _ = _build(make, 0, 1, quant)
        for rank in range(ranks):
            layer, dense = _build(make, rank, ranks, quant)
            for shard, (w8, scales) in shards.items():
                layer.weight_fp8.weight_loader(layer.weight_fp8, w8, shard)
                layer.weight_scale.weight_loader(layer.weight_scale, scales, shard)
                dense.weight.weight_loader(dense.weight, block_dequantize(w8, scales, block), shard)
                if rank == 0:
                    one_rank.weight_fp8.weight_loader(one_rank.weight_fp8, w8, shard)
                    one_rank.weight_scale.weight_loader(one_rank.weight_scale, scales, shard)
            layer.finish_loading()
            dense.quantize_fp8()
            assert torch.equal(layer.weight_fp8.view(torch.uint8), dense.weight_fp8.view(torch.uint8))
            assert torch.equal(layer.weight_scale.data, dense.weight_scale.data)
            if rank == 0:
                one_rank.finish_loading()
            if not layer.row_parallel:  # a column-parallel rank's rows are the one rank's rows, bit for bit
                rows = torch.cat([one_rank.weight_fp8.float()[offset:offset + size] for offset, size in
                                  (_one_rank_rows(one_rank, layer, shard) for shard in layer.shard_ids())])
                assert torch.equal(layer.weight_fp8.float(), rows)


def _one_rank_rows(one_rank: Linear, layer: Linear, shard: Hashable) -> tuple[int, int]:
    """The rows of the one-rank layer that `layer`'s rank holds of shard `shard`: (first, count)."""
    offset, source_rows = one_rank._shard_rows(shard)  # one rank holds the checkpoint tensor's every row
    start, size, _total, _offset = layer.place(torch.empty(0), shard, source_rows)
    return offset + start, size


def test_dummy_weights_with_a_block_wise_config(checkpoints: dict[str, str], tmp_path: Path) -> None:
    path = write_block_fp8_checkpoint(checkpoints["llama"], str(tmp_path / "m"), BLOCK)
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


@pytest.mark.parametrize("size", [[128], [128, 0], [128.0, 128], "128", [True, 128], [128, 128, 128], [-128, 128]])
def test_block_sizes_must_be_two_positive_ints(size: Any) -> None:
    with pytest.raises(ModelLoadError, match=r"where: weight_block_size .* is not supported: block-wise fp8 scales "
                                             r"need a block size of two positive integers"):
        parse_quant_config({**block_fp8_config((128, 128)), "weight_block_size": size}, "where")
    quant = compressed_tensors("block")  # no block_structure
    with pytest.raises(ModelLoadError, match=r"where: compressed-tensors block_structure None is not supported"):
        parse_quant_config(quant, "where")


def test_block_configs_are_read() -> None:
    assert parse_quant_config(block_fp8_config((128, 64)), "where").weight_block == (128, 64)
    assert parse_quant_config(compressed_tensors("block", block=(64, 128)), "where").weight_block == (64, 128)
    assert parse_quant_config(compressed_tensors("channel"), "where").weight_block is None
    assert parse_quant_config({"quant_method": "fp8"}, "where").weight_block is None
    for none in (None, []):  # written by some exports for "no blocks"
        assert parse_quant_config({"quant_method": "fp8", "weight_block_size": none}, "where").weight_block is None


def _rewrite(path: str, change: Callable[[dict[str, torch.Tensor]], None]) -> str:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)
    return path


def test_bad_block_tensors_are_refused(checkpoints: dict[str, str], tmp_path: Path) -> None:
    source = checkpoints["llama"]
    block = write_block_fp8_checkpoint(source, str(tmp_path / "b"), BLOCK)

    def variant(name: str, change: Callable[[dict[str, torch.Tensor]], None]) -> str:
        path = str(tmp_path / name)
        shutil.copytree(block, path)
        return _rewrite(path, change)

    down = "model.layers.0.mlp.down_proj.weight_scale_inv"  # a 256 x 512 weight: 11 x 13 blocks of 24 x 40
    for i, wrong in enumerate(((11, 12), (13, 11), (12, 13))):  # a column short, transposed, a row too many
        path = variant(f"shape{i}", lambda t, wrong=wrong: t.update({down: torch.ones(wrong)}))
        # (the scales or the weight come second: the message names that tensor)
        with pytest.raises(ModelLoadError, match=r"down_proj.weight(_scale_inv)?': block-wise fp8 scales of shape "
                                                 rf"\({wrong[0]}, {wrong[1]}\) do not match a 256 x 512 weight in "
                                                 r"blocks of 24 x 40: \(11, 13\) expected"):
            fp8_core(path)
    path = variant("flat", lambda t: t.update({down: torch.ones(11 * 13)}))
    with pytest.raises(ModelLoadError, match=rf"'{down}': a weight scale of shape \(143,\): a block-wise fp8 "
                                             r"checkpoint \(blocks of 24 x 40\) needs one per block"):
        fp8_core(path)

    up = "model.layers.1.mlp.up_proj.weight_scale_inv"
    path = variant("missing", lambda t: t.pop(up))
    with pytest.raises(ModelLoadError, match=r"checkpoint lacks weights for model.layers.1.mlp.gate_up_proj.weight_scale "
                                             r"\(shard 1\)"):
        fp8_core(path)

    def negative(t: dict[str, torch.Tensor]) -> None:
        t[up][2, 3] = -0.5
    with pytest.raises(ModelLoadError, match=rf"checkpoint tensor '{up}': an fp8 block scale is -0.5 \(block row 2, "
                                             r"column 3\): scales must be finite and not negative"):
        fp8_core(variant("negative", negative))

    head = {"lm_head.weight": torch.zeros(1024, 256).to(FP8), "lm_head.weight_scale_inv": torch.ones(43, 7)}
    with pytest.raises(ModelLoadError, match=r"'lm_head.weight(_scale_inv)?' is .*but its layer is not an fp8 layer "
                                             r"of this model \(an fp8 LM head or embedding is not supported\)"):
        fp8_core(variant("head", lambda t: t.update(head)))
    with pytest.raises(ModelLoadError, match=r"'lm_head.weight_scale_inv' is an fp8 weight scale, but its layer is "
                                             r"not an fp8 layer"):
        fp8_core(variant("head_scale", lambda t: t.update({"lm_head.weight_scale_inv": torch.ones(43, 7)})))


def test_block_scales_without_a_block_size_are_refused(checkpoints: dict[str, str], tmp_path: Path) -> None:
    path = write_block_fp8_checkpoint(checkpoints["llama"], str(tmp_path / "m"), BLOCK)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]["weight_block_size"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ModelLoadError, match=r"checkpoint tensor 'model.layers.\d.(self_attn|mlp).\w+_proj.weight_scale_inv' "
                                             r"holds block-wise fp8 scales, but the quantization_config gives no "
                                             r"weight_block_size"):
        fp8_core(path)


def test_a_per_tensor_scale_under_a_block_config_is_refused(checkpoints: dict[str, str], tmp_path: Path) -> None:
    """A per-tensor fp8 checkpoint whose config claims blocks: its scalar scales are not block scales."""
    from helpers.fp8_checkpoints import VLLM_FP8, write_fp8_checkpoint

    path = write_fp8_checkpoint(checkpoints["llama"], str(tmp_path / "m"), VLLM_FP8, per_tensor=True)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {**compressed_tensors("block", block=(128, 128))}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ModelLoadError, match=r"weight_scale': a weight scale of shape \(\): a block-wise fp8 "
                                             r"checkpoint \(blocks of 128 x 128\) needs one per block"):
        fp8_core(path)

