"""The quantized matmul and dequantizer (kernels/triton_quant.py) against the reference dequantization.

Weights are random integers, zero points and scales packed with `layers.quantization`'s GPU layout; the
reference is `reference.quantized_linear` (dense weight from `PackedWeight.dense`, float32 arithmetic).
Outputs and split partials come from `torch.empty`, made NaN by `poison_allocations`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import reference, triton_gemm, triton_quant  # noqa: E402
from kvserve.kernels.triton_quant import (  # noqa: E402
    QuantMatmulConfig,
    dequantize,
    pairs_fit,
    pick_config,
    pick_pairs_config,
    prepare_pairs,
    quant_matmul,
    quant_matmul_pairs,
)
from kvserve.layers.quantization import (  # noqa: E402
    PackedWeight,
    deinterleave_tiles,
    interleave_tiles,
    pack_rows,
    unpack_rows,
)


@pytest.fixture(autouse=True)
def _poison(poison_allocations):
    poison_allocations(triton_quant)


def packed_weight(k: int, n: int, bits: int, group_rows: int, permuted: bool, device: torch.device,
                  seed: int = 0, scales_dtype: torch.dtype = torch.float16) -> PackedWeight:
    gen = torch.Generator().manual_seed(seed)
    top = (1 << bits) - 1
    q = torch.randint(0, top + 1, (k, n), generator=gen)
    groups = k // group_rows
    zeros = torch.randint(0, top + 1, (groups, n), generator=gen).to(torch.uint8)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).to(scales_dtype)
    perm = torch.randperm(k, generator=gen) if permuted else None
    return PackedWeight(pack_rows(q, bits).to(device), zeros.to(device), scales.to(device), bits, group_rows,
                        None if perm is None else perm.to(device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("bits", "group_rows", "permuted"), [(4, 32, False), (4, 64, True), (8, 32, False),
                                                             (2, 128, True)])
@pytest.mark.parametrize("m", [1, 7, 40])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "expand"])
def test_matches_reference(dtype, bits, group_rows, permuted, m, split_k, bias, gather, device,
                           skip_bf16_on_interpreter):
    skip_bf16_on_interpreter(dtype)
    k, n = 128, 96  # n not a multiple of the 64-column tile: a partial last tile
    weight = packed_weight(k, n, bits, group_rows, permuted, device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=gen).to(device=device, dtype=dtype) if bias else None
    config = QuantMatmulConfig(block_m=16 if m <= 16 else 64, block_n=64, block_k=32, split_k=split_k,
                               gather=gather)
    out = quant_matmul(x, weight, b, config)
    assert out.shape == (m, n) and out.dtype == dtype
    # The reference rounds the dense weight to x's dtype, then multiplies; float32 accumulation in both.
    dense = weight.dense(dtype).float()
    expected = torch.nn.functional.linear(x.float(), dense, None if b is None else b.float())
    tol = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(out.float(), expected.to(dtype).float(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.float(), reference.quantized_linear(x, weight, b).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "expand"])
def test_dequantize_matches_dense(bits, gather, device):
    """The dequantizer writes the dense weight in qweight's (sorted) row order: PackedWeight.dense without
    the permutation's un-sorting."""
    weight = packed_weight(256, 80, bits, 64, True, device, seed=bits)
    out = dequantize(weight, torch.float32, block_n=32, gather=gather)
    assert out is not None and out.shape == (80, 256)
    unsorted = PackedWeight(weight.qweight, weight.zeros, weight.scales, bits, 64, None)
    assert torch.equal(out, unsorted.dense(torch.float32))


def test_a_group_no_tile_divides_has_no_config():
    weight = packed_weight(48, 64, 4, 48, False, torch.device("cpu"))  # 48: a multiple of 16 only
    assert pick_config(1, weight, 132) is None and dequantize(weight, torch.float32) is None


def test_pick_config_splits_k_to_cover_the_sms():
    # Qwen2.5-7B's down projection at 4 bits, groups of 128, one row.
    weight = PackedWeight(torch.empty((18944 // 8, 3584), dtype=torch.int32), torch.empty(0), torch.empty(0), 4,
                          128, None)
    config = pick_config(1, weight, 132)
    assert config is not None and config.block_m == 16 and config.block_k == 64 and config.block_n == 128
    # 28 column tiles; 296 K tiles: 8 divides them, 16 does not; 224 programs, short of 2 x 132 SMs
    assert config.split_k == 8
    assert pick_config(64, weight, 132).block_m == 64
    assert pick_config(100, weight, 132).block_m == 128
    wide = PackedWeight(torch.empty((3584 // 8, 37888), dtype=torch.int32), torch.empty(0), torch.empty(0), 4,
                        128, None)
    assert pick_config(1, wide, 132).split_k == 1  # 296 column tiles already cover the SMs twice


def test_interleaved_tiles_put_value_j_of_word_r_at_row_j_r():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (384, 24), generator=gen)
    words = pack_rows(q, 4)
    tiled = interleave_tiles(words, 4, 128)
    assert torch.equal(deinterleave_tiles(tiled, 4, 128), words)
    values = unpack_rows(tiled, 4)  # value j of word w at row 8 w + j
    for tile in range(3):
        for r in range(16):
            for j in range(8):
                assert torch.equal(values[tile * 128 + 8 * r + j], q[tile * 128 + 16 * j + r])
    with pytest.raises(ValueError, match="whole tiles"):
        interleave_tiles(pack_rows(q[:192], 4), 4, 128)


def test_prepared_weight_is_the_same_weight(device):
    """`prepare_pairs` changes the layout, not the weight: PackedWeight.dense and the (tiled) dequantizer
    give the plain weight's values exactly."""
    weight = packed_weight(256, 80, 4, 128, True, device, seed=2)
    assert not pairs_fit(weight, torch.float32)
    assert pairs_fit(weight, torch.float16) and pairs_fit(weight, torch.bfloat16)
    assert pairs_fit(weight, torch.bfloat16, (8, 0)) and pairs_fit(weight, torch.float16, (7, 5))
    assert not pairs_fit(weight, torch.bfloat16, (7, 5))  # no bf16x2 arithmetic before sm_80
    prepared = prepare_pairs(weight, torch.float16)
    assert prepared.tile_rows == 128 and prepared.zero_scale is not None
    assert torch.equal(prepared.dense(torch.float16), weight.dense(torch.float16))
    unsorted = PackedWeight(weight.qweight, weight.zeros, weight.scales, 4, 128, None)
    assert torch.equal(dequantize(prepared, torch.float16), unsorted.dense(torch.float16))
    # zero point << 16 | the scale's bits
    assert torch.equal((prepared.zero_scale >> 16).to(torch.uint8), weight.zeros)
    assert torch.equal((prepared.zero_scale & 0xFFFF).to(torch.int16).view(torch.float16), weight.scales)
    for bad in (packed_weight(256, 80, 8, 128, False, device), packed_weight(256, 80, 4, 64, False, device),
                packed_weight(192, 80, 4, 192, False, device)):
        assert not pairs_fit(bad, torch.float16)  # 8 bits; 64-row groups; K not whole 128-row tiles


def test_prepared_scales_are_rounded_to_the_activations_dtype(device):
    """float16 checkpoint scales for a bfloat16 model: the prepared weight carries them rounded to bfloat16
    (what the kernel multiplies by), and its dense form and dequantizer agree with that."""
    weight = packed_weight(256, 80, 4, 128, False, device, seed=4)
    assert weight.scales.dtype == torch.float16
    prepared = prepare_pairs(weight, torch.bfloat16)
    rounded = PackedWeight(weight.qweight, weight.zeros, weight.scales.to(torch.bfloat16), 4, 128, None)
    assert prepared.scales.dtype == torch.bfloat16
    assert torch.equal((prepared.zero_scale & 0xFFFF).to(torch.int16).view(torch.bfloat16), rounded.scales)
    assert torch.equal(prepared.dense(torch.float32), rounded.dense(torch.float32))
    assert torch.equal(dequantize(prepared, torch.float32), rounded.dense(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group_rows", [128, 256])
@pytest.mark.parametrize(("m", "block_m"), [(1, 16), (7, 16), (40, 16), (20, 32), (7, 64), (40, 64), (100, 64)])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_pairs_matches_reference(dtype, group_rows, m, block_m, split_k, bias, device, skip_bf16_on_interpreter):
    """n not a multiple of the 64-column tile; 40 rows: three 16-row tiles, the last partial; one partial
    32-row tile; 64-row tiles (two 32-row dots): the second dot's rows empty (7), partial (40), a second
    tile (100)."""
    skip_bf16_on_interpreter(dtype)
    k, n = 256, 96
    weight = prepare_pairs(packed_weight(k, n, 4, group_rows, False, device, seed=m, scales_dtype=dtype), dtype)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=gen).to(device=device, dtype=dtype) if bias else None
    out = quant_matmul_pairs(x, weight, b, QuantMatmulConfig(block_m, 64, 128, split_k))
    assert out.shape == (m, n) and out.dtype == dtype
    expected = torch.nn.functional.linear(x.float(), weight.dense(dtype).float(), None if b is None else b.float())
    tol = {torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(out.float(), expected.to(dtype).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("block_m", [16, 64])
def test_pairs_split_partials_are_summed_in_order_and_rounded_once(block_m, device, monkeypatch):
    """Four K splits: the output is the splits' float32 partials added in split order, plus the bias, rounded
    once (one launch after the matmul's), the same bits on every launch, and within rounding of the unsplit
    kernel."""
    k, n, m = 512, 96, 40
    dtype = torch.float16
    weight = prepare_pairs(packed_weight(k, n, 4, 128, False, device, seed=11, scales_dtype=dtype), dtype)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
    seen: list[torch.Tensor] = []
    reduce_kernel = triton_gemm.split_reduce_kernel

    class Spy:
        """Records the partials each launch of the sum kernel reads, then launches it."""

        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            def launch(partials: torch.Tensor, *args: object, **kwargs: object) -> None:
                seen.append(partials.clone())
                reduce_kernel[grid](partials, *args, **kwargs)

            return launch

    monkeypatch.setattr(triton_gemm, "split_reduce_kernel", Spy())
    out = quant_matmul_pairs(x, weight, b, QuantMatmulConfig(block_m, 64, 128, 4))
    assert len(seen) == 1 and seen[0].shape == (4, m, n)
    total = seen[0][0]
    for s in range(1, 4):
        total = total + seen[0][s]
    assert torch.equal(out, (total + b.float()).to(dtype))
    assert torch.equal(quant_matmul_pairs(x, weight, b, QuantMatmulConfig(block_m, 64, 128, 4)), out)
    whole = quant_matmul_pairs(x, weight, b, QuantMatmulConfig(block_m, 64, 128, 1))
    torch.testing.assert_close(out.float(), whole.float(), rtol=2**-9, atol=2**-9 * whole.abs().max().item())


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_split_partials_sum_order(bias, device):
    """The split sum's order is observable in float32: partials 2^24, 1, 1, -2^24 give 0 added in split order
    (2^24 + 1 rounds to 2^24), 1 pairwise and 2 in reverse; a bias of 1 added after the splits gives 1,
    added first 0."""
    big = float(2**24)
    partials = torch.tensor([big, 1.0, 1.0, -big], device=device).view(4, 1, 1).expand(4, 3, 5).contiguous()
    out = torch.empty(3, 5, device=device)
    b = torch.ones(5, device=device) if bias else None
    triton_gemm.sum_split_partials(partials, b, out)
    assert torch.equal(out, torch.full((3, 5), 1.0 if bias else 0.0, device=device))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_pairs_dequantizes_exactly(dtype, device, skip_bf16_on_interpreter):
    """One-hot rows of x pick single weights: out[i, n] = W[n, k_i] with one product, so the kernel's
    dequantized values (the PTX on a GPU) must equal the float32 reference rounded once, bit for bit, at
    every value position j of a word and in every tile."""
    skip_bf16_on_interpreter(dtype)
    k, n = 512, 128
    plain = packed_weight(k, n, 4, 128, False, device, seed=5, scales_dtype=dtype)
    plain.scales.mul_(torch.where(torch.arange(n, device=device) % 3 == 0, -1.0, 1.0).to(dtype))  # both signs
    weight = prepare_pairs(plain, dtype)
    columns = torch.arange(0, k, 3, device=device)  # every position j = column % 8 of every tile
    x = torch.zeros(len(columns), k, dtype=dtype, device=device)
    x[torch.arange(len(columns)), columns] = 1
    out = quant_matmul_pairs(x, weight, None, QuantMatmulConfig(16, 64, 128, 1))
    assert torch.equal(out, weight.dense(dtype)[:, columns].t())


def _tiled(k: int, n: int) -> PackedWeight:
    return PackedWeight(torch.empty((k // 8, n), dtype=torch.int32), torch.empty(0), torch.empty(0), 4, 128, None,
                        tile_rows=128)


def test_pick_pairs_config_splits_k_to_cover_the_sms():
    # down: 28 column tiles, 148 K tiles (4 divides them, 8 does not): 112 programs per row tile
    assert pick_pairs_config(1, _tiled(18944, 3584), 132) == QuantMatmulConfig(16, 128, 128, 4, 4, 3)
    assert pick_pairs_config(1, _tiled(3584, 4608), 132).split_k == 4  # qkv: 36 column tiles, 144 programs
    assert pick_pairs_config(1, _tiled(3584, 37888), 132).split_k == 1  # gate_up: 296 column tiles
    assert pick_pairs_config(1, _tiled(256, 64), 132).split_k == 2  # only 2 K tiles to split
    assert pick_pairs_config(17, _tiled(18944, 3584), 132) == QuantMatmulConfig(32, 128, 128, 4, 4, 3)
    assert pick_pairs_config(33, _tiled(18944, 3584), 132) == QuantMatmulConfig(64, 128, 128, 4, 4, 3)


@pytest.mark.parametrize(("k", "n"), [(18944, 3584), (3584, 4608), (3584, 37888), (3584, 512), (128, 64)])
def test_pick_pairs_config_rows_change_no_rows_values(k, n):
    """A row's value must not depend on how many rows its batch has (a CUDA graph pads the batch): the K
    split is the same at any count, and the tiles 16, 32 or 64 rows (16-row MMA instructions in each)."""
    configs = {pick_pairs_config(m, _tiled(k, n), 132) for m in range(1, 129)}
    assert len({c.split_k for c in configs}) == 1
    assert {c.block_m for c in configs} == {16, 32, 64}
    assert {(c.block_n, c.block_k, c.num_warps, c.num_stages) for c in configs} == {(128, 128, 4, 3)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("k", "n"), [(3584, 4608), (18944, 3584), (3584, 37888)], ids=["qkv", "down", "gate_up"])
@pytest.mark.parametrize("m", [1, 8, 64, 100, 300, 1024])
@pytest.mark.parametrize("layout", ["plain", "prepared"])
def test_real_shapes_through_ops(dtype, k, n, m, layout, device):
    """Qwen2.5-7B's projections at 4 bits (groups of 128), through `ops.quantized_linear`'s choice of a
    fused kernel (split-K where it splits; the paired-dequantizing one for the layout `prepare_quantized`
    gives) or the dequantizer and cuBLAS, with a bias; GPU only."""
    from kvserve.kernels import ops

    if device.type != "cuda":
        pytest.skip("real shapes run on a GPU only (the interpreter is too slow for them)")
    weight = packed_weight(k, n, 4, 128, False, device, seed=m, scales_dtype=dtype)
    if layout == "prepared":
        weight = ops.prepare_quantized(weight, dtype)
        assert weight.zero_scale is not None
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
    out = ops.quantized_linear(x, weight, b)
    expected = torch.nn.functional.linear(x.float(), weight.dense(dtype).float(), b.float())
    assert out.dtype == dtype and not out.isnan().any()
    scale = expected.abs().max().item()
    tol = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize(("k", "n"), [(3584, 4608), (18944, 3584)], ids=["qkv", "down"])
def test_paired_rows_do_not_depend_on_the_batch_rows(k, n, device):
    """Each row of the paired kernel's output is bitwise the same whether its batch has r rows or is padded
    to 64 or 128 (as a piecewise CUDA graph pads a step); GPU only."""
    from kvserve.kernels import ops

    if device.type != "cuda":
        pytest.skip("GPU only (the MMA instructions are what is checked)")
    weight = ops.prepare_quantized(
        packed_weight(k, n, 4, 128, False, device, seed=7, scales_dtype=torch.bfloat16), torch.bfloat16)
    assert weight.zero_scale is not None
    x = torch.randn(128, k, generator=torch.Generator().manual_seed(7)).to(device=device, dtype=torch.bfloat16)
    padded = {p: ops.quantized_linear(x[:p], weight) for p in (64, 128)}
    for r in (1, 5, 16, 17, 40, 64, 100):
        out = ops.quantized_linear(x[:r], weight)
        for p, whole in padded.items():
            if p >= r:
                assert torch.equal(out, whole[:r]), (r, p)


@pytest.mark.parametrize("bits", [8, 4])
def test_act_order_permutation_on_a_gpu(bits, device):
    """A permuted K at a real width, both paths (4 bits: the paired kernel's layout)."""
    from kvserve.kernels import ops

    if device.type != "cuda":
        pytest.skip("GPU only")
    weight = packed_weight(3584, 512, bits, 128, True, device, seed=3, scales_dtype=torch.bfloat16)
    weight = ops.prepare_quantized(weight, torch.bfloat16)
    assert (weight.zero_scale is not None) == (bits == 4)
    x = torch.randn(300, 3584, generator=torch.Generator().manual_seed(3)).to(device=device, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), weight.dense(torch.bfloat16).float())
    scale = expected.abs().max().item()
    for rows in (x[:7], x):
        out = ops.quantized_linear(rows, weight)
        torch.testing.assert_close(out.float(), expected[: rows.shape[0]], rtol=2**-7, atol=2**-7 * scale)


@pytest.mark.parametrize("arch", [90, 80], ids=["sm90", "sm80"])
def test_quant_kernels_compile_for_hopper_and_ampere(arch, device, monkeypatch, compiler_for):
    """The quantized kernels as the engine launches them at a real shape, compiled ahead of time (no GPU
    needed) with the paired kernel's PTX, which the interpreter never runs: for Hopper and for Ampere (whose
    PTX has no bf16x2 subtract or multiply, the first version's failure there)."""
    monkeypatch.setattr(triton_quant, "_PAIRS_ASM", True)
    compiler = compiler_for(arch)
    k, n = 3584, 4608
    for dtype in (torch.bfloat16, torch.float16):
        plain = packed_weight(k, n, 4, 128, False, device, scales_dtype=dtype)
        prepared = prepare_pairs(plain, dtype)
        x = torch.zeros(64, k, dtype=dtype, device=device)
        bias = torch.zeros(n, dtype=dtype, device=device)
        for rows, split in ((1, 1), (16, 2), (64, 1), (64, 4)):
            config = replace(pick_pairs_config(rows, prepared, 132), split_k=split)
            kernels = ["_quant_matmul_pairs_kernel"] + ([(triton_gemm, "split_reduce_kernel")] if split > 1 else [])
            compiler.record(triton_quant, kernels, partial(quant_matmul_pairs, x[:rows], prepared, bias, config))
        config = pick_config(8, plain, 132)
        assert config is not None and config.split_k > 1  # its sum, without a bias
        compiler.record(triton_quant, ["_quant_matmul_kernel", (triton_gemm, "split_reduce_kernel")],
                        partial(quant_matmul, x[:8], plain, None, config))
        compiler.record(triton_quant, ["_dequantize_kernel"], partial(dequantize, prepared, dtype))
        compiler.record(triton_quant, ["_dequantize_kernel"], partial(dequantize, plain, dtype))
    results = compiler.compile_all()
    assert len(results) == 20
    assert {r["block_m"] for r in results if r["kernel"] == "_quant_matmul_pairs_kernel"} == {16, 64}
