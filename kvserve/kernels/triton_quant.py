"""Matmul with weight-only quantized weights (AWQ / GPTQ, after `layers.quantization` repacks them).

out[M, N] = x[M, K] @ W^T, W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n], with q packed
32 / bits values to an int32 word along K (`PackedWeight.qweight` [K / pack, N]), zero points uint8 and
scales [groups, N]. Act-order checkpoints have their K rows sorted by group; the kernel then reads x's
columns through the permutation (`perm`).

`quant_matmul`: one kernel that unpacks a [BLOCK_K, BLOCK_N] tile of q in registers, dequantizes it in
float32 (the reference's arithmetic) and rounds it to x's dtype for the tensor-core dot. Dequantizing is
ALU work on every weight, as much as the memory stream at small M: the integers become floats by bit
tricks instead of the conversion instruction, which runs at a quarter of the ALU's rate (docs/perf_notes.md
entry 52). Each K tile lies in
one group (BLOCK_K divides the group), so a tile loads one row of scales and zero points. Small M is a
stream over the packed weight (a quarter of a bf16 weight's bytes at 4 bits): with few output tiles the K
range is split over programs, whose float32 partials [splits, M, N] are summed in split order afterwards
(deterministic, as the CUDA-graph vs eager checks need).

`quant_matmul_pairs`: 4-bit weights with 128-row groups in a half-precision model, prepared by
`prepare_pairs` (tile-interleaved words, each column's zero point and scale in one int32). A few lines of
PTX turn one word into its 8 values two per instruction (`lop3` places two 4-bit values in the mantissas of
two 16-bit floats, then paired fused multiply-adds subtract the zero point and multiply by the scale): 15
instructions for 8 weights against about 6 per weight above. The interleaving makes value j of a tile's
words R consecutive K rows, so the tile is 8 dots of depth R over contiguous columns of x. Zero point and
scale in one 4-byte word are a load the pipeliner copies ahead (1- and 2-byte loads stay synchronous in the
loop). The values equal the float32 reference's rounded once (the subtraction is exact and the product is
rounded once), given the scales rounded to x's dtype (`prepare_pairs` does it; docs/perf_notes.md entry 53).

`dequantize`: the dense weight [N, K] in x's dtype (sorted K order), for large M where cuBLAS on the dense
weight beats dequantizing every tile once per row block.
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kvserve import envs
from kvserve.kernels.triton_gemm import sum_split_partials
from kvserve.layers.quantization import PackedWeight, interleave_tiles


@dataclass(frozen=True)
class QuantMatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    gather: bool = False  # how a tile's words are unpacked (`_unpack_tile`)


@triton.jit(do_not_specialize=["M"])
def _quant_matmul_kernel(
    x_ptr,
    qweight_ptr,
    zeros_ptr,
    scales_ptr,
    bias_ptr,
    perm_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    k_per_split,
    group_rows,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    PARTIALS: tl.constexpr,
    IEEE: tl.constexpr,
    GATHER: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    word_rows = tl.arange(0, BLOCK_K // PACK)
    shifts = tl.arange(0, PACK) * BITS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if HAS_PERM:
            cols = tl.load(perm_ptr + offs_k)
        else:
            cols = offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=mask_m[:, None], other=0.0)
        q = _unpack_tile(qweight_ptr, k0, offs_k, offs_n, mask_n, N, word_rows, shifts, BITS, BLOCK_K, BLOCK_N,
                         GATHER)
        group = k0 // group_rows
        z = tl.load(zeros_ptr + group * N + offs_n, mask=mask_n, other=0).to(tl.float32) + _MAGIC_FLOAT
        s = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = ((_as_magic_float(q) - z[None, :]) * s[None, :]).to(x.dtype)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if PARTIALS:
        part = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part, acc, mask=mask_m[:, None] & mask_n[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# Integer -> float without the (slow) conversion instruction: the bits 0x4B000000 | q read as a float32 are
# 2 ** 23 + q exactly (q < 2 ** 23), so (that - (2 ** 23 + z)) is q - z exactly.
_MAGIC_BITS = tl.constexpr(0x4B000000)
_MAGIC_FLOAT = tl.constexpr(8388608.0)


@triton.jit
def _as_magic_float(q):
    return (q | _MAGIC_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _unpack_tile(qweight_ptr, k0, offs_k, offs_n, mask_n, N, word_rows, shifts, BITS: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GATHER: tl.constexpr):
    """The integer values [BLOCK_K, BLOCK_N] of K rows k0.. and columns offs_n. GATHER: each row loads its
    word (a word is read PACK times, from L1) and shifts by its position; otherwise the tile's words are
    loaded once and expanded [rows, PACK, BLOCK_N] -> [BLOCK_K, BLOCK_N] (word row r's value i is K row
    PACK r + i)."""
    PACK: tl.constexpr = 32 // BITS
    if GATHER:
        words = tl.load(qweight_ptr + (offs_k // PACK)[:, None] * N + offs_n[None, :], mask=mask_n[None, :],
                        other=0)
        q = (words >> ((offs_k % PACK) * BITS)[:, None]) & ((1 << BITS) - 1)
    else:
        words = tl.load(qweight_ptr + (k0 // PACK + word_rows)[:, None] * N + offs_n[None, :],
                        mask=mask_n[None, :], other=0)
        q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
    return q


@triton.jit
def _dequantize_kernel(
    qweight_ptr,
    zeros_ptr,
    scales_ptr,
    out_ptr,
    N,
    K,
    group_rows,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATHER: tl.constexpr,
    TILED: tl.constexpr,
):
    """out [N, K] (row-major) of the packed weight, tile [BLOCK_K, BLOCK_N] per program, stored transposed
    so that consecutive threads write consecutive K. TILED: words interleaved in BLOCK_K-row tiles
    (`PackedWeight.tile_rows` = BLOCK_K)."""
    PACK: tl.constexpr = 32 // BITS
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    k0 = pid_k * BLOCK_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    if TILED:
        # Value j of the tile's word r is row k0 + j R + r: [R, PACK, BLOCK_N], stored as [BLOCK_N, PACK, R].
        R: tl.constexpr = BLOCK_K // PACK
        r = tl.arange(0, R)
        j = tl.arange(0, PACK)
        words = tl.load(qweight_ptr + (k0 // PACK + r)[:, None] * N + offs_n[None, :], mask=mask_n[None, :],
                        other=0)
        q3 = (words[:, None, :] >> (j * BITS)[None, :, None]) & ((1 << BITS) - 1)
        group = k0 // group_rows
        z = tl.load(zeros_ptr + group * N + offs_n, mask=mask_n, other=0).to(tl.float32) + _MAGIC_FLOAT
        s = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w3 = ((_as_magic_float(q3) - z[None, None, :]) * s[None, None, :]).to(out_ptr.dtype.element_ty)
        rows = k0 + j[:, None] * R + r[None, :]
        tl.store(out_ptr + offs_n[:, None, None] * K + rows[None, :, :], tl.permute(w3, (2, 1, 0)),
                 mask=mask_n[:, None, None])
        return
    q = _unpack_tile(qweight_ptr, k0, offs_k, offs_n, mask_n, N, tl.arange(0, BLOCK_K // PACK),
                     tl.arange(0, PACK) * BITS, BITS, BLOCK_K, BLOCK_N, GATHER)
    group = k0 // group_rows
    z = tl.load(zeros_ptr + group * N + offs_n, mask=mask_n, other=0).to(tl.float32) + _MAGIC_FLOAT
    s = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    w = tl.trans(((_as_magic_float(q) - z[None, :]) * s[None, :]).to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], w, mask=mask_n[:, None])


def block_k_for(weight: PackedWeight) -> int | None:
    """The K tile: the largest of 128 / 64 / 32 that divides the group (and so K); None when none does. A
    tile-interleaved weight: its tile."""
    if weight.tile_rows:
        return weight.tile_rows
    for block_k in (128, 64, 32):
        if weight.group_rows % block_k == 0 and weight.input_size % block_k == 0 and block_k % (32 // weight.bits) == 0:
            return block_k
    return None


def pick_config(num_rows: int, weight: PackedWeight, num_sms: int) -> QuantMatmulConfig | None:
    """Tiling for `num_rows` rows of x (fitted to `benchmarks/quant_matmul_bench.py --sweep` on the H200 at
    the 7B shapes, docs/perf_notes.md entry 52); None when the weight's groups fit no K tile."""
    block_k = block_k_for(weight)
    if block_k is None or weight.tile_rows:
        return None
    block_k = min(block_k, 64)
    n, k = weight.output_size, weight.input_size
    if num_rows <= 16:
        block_m, block_n = 16, 128
    elif num_rows <= 32:
        block_m, block_n = 32, 128
    elif num_rows <= 64:
        block_m, block_n = 64, 128
    else:
        block_m, block_n = 128, 64
    tiles = triton.cdiv(num_rows, block_m) * triton.cdiv(n, block_n)
    chunks = k // block_k
    split = 1
    # Split K until the programs cover the SMs twice, each split a whole number of K tiles.
    while tiles * split < 2 * num_sms and split < 16 and chunks % (split * 2) == 0:
        split *= 2
    return QuantMatmulConfig(block_m, block_n, block_k, split, 4, 3)


def quant_matmul(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None,
                 config: QuantMatmulConfig) -> torch.Tensor:
    """x [M, K] (contiguous rows) @ W^T (+ bias) -> [M, N] in x's dtype."""
    m = x.shape[0]
    n, k = weight.output_size, weight.input_size
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    partials = config.split_k > 1
    target = torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device) if partials else out
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), config.split_k)
    _quant_matmul_kernel[grid](
        x, weight.qweight, weight.zeros, weight.scales, bias if bias is not None else x,
        weight.perm if weight.perm is not None else weight.qweight, target,
        m, n, x.stride(0), k // config.split_k, weight.group_rows,
        BITS=weight.bits, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        HAS_BIAS=bias is not None and not partials, HAS_PERM=weight.perm is not None, PARTIALS=partials,
        IEEE=x.dtype == torch.float32, GATHER=config.gather, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return sum_split_partials(target, bias, out) if partials else out


def dequantize(weight: PackedWeight, dtype: torch.dtype, block_n: int = 64, gather: bool = False,
               num_warps: int = 8) -> torch.Tensor | None:
    """The dense weight [N, K] in `dtype`, K in qweight's (sorted) order; None when no K tile fits. The
    default tiling was the fastest or within 0.6 us of it at each 7B shape in session 33's sweep (`call3`)."""
    block_k = block_k_for(weight)
    if block_k is None:
        return None
    n, k = weight.output_size, weight.input_size
    out = torch.empty((n, k), dtype=dtype, device=weight.qweight.device)
    _dequantize_kernel[(k // block_k, triton.cdiv(n, block_n))](
        weight.qweight, weight.zeros, weight.scales, out, n, k, weight.group_rows,
        BITS=weight.bits, BLOCK_N=block_n, BLOCK_K=block_k, GATHER=gather, TILED=weight.tile_rows > 0,
        num_warps=num_warps,
    )
    return out


# ---------------------------------------------------------------------------- the paired-dequantizing kernel

PAIRS_TILE_ROWS = 128  # K rows of a tile: 8 dots of depth 16
# Rows past 32 in 64-row tiles of two 32-row dots (else 32-row tiles); an A/B switch for the benchmarks.
PAIRS_TWO_DOTS = True


def pairs_fit(weight: PackedWeight, dtype: torch.dtype, capability: tuple[int, int] | None = None) -> bool:
    """Whether `quant_matmul_pairs` can run this (plain, not yet prepared) weight for activations of `dtype`
    on a GPU of compute `capability` (None: not checked): 4 bits, 128-row groups, half precision (bf16 pairs
    need sm_80)."""
    return (dtype in (torch.float16, torch.bfloat16) and weight.bits == 4 and not weight.tile_rows
            and weight.group_rows % PAIRS_TILE_ROWS == 0 and weight.input_size % PAIRS_TILE_ROWS == 0
            and (capability is None or dtype == torch.float16 or capability >= (8, 0)))


def prepare_pairs(weight: PackedWeight, dtype: torch.dtype) -> PackedWeight:
    """The weight in `quant_matmul_pairs`'s layout for activations of `dtype` (`pairs_fit` must hold): words
    interleaved in 128-row tiles, scales rounded to `dtype` (the kernel multiplies in it) and packed with the
    zero points as zero_scale = zero point << 16 | the scale's bits."""
    scales = weight.scales.to(dtype).contiguous()
    scale_bits = scales.view(torch.int16).to(torch.int32) & 0xFFFF
    zero_scale = (weight.zeros.to(torch.int32) << 16) | scale_bits
    return replace(weight, qweight=interleave_tiles(weight.qweight, weight.bits, PAIRS_TILE_ROWS), scales=scales,
                   tile_rows=PAIRS_TILE_ROWS, zero_scale=zero_scale.contiguous())


# One int32 word of eight 4-bit values (value i at bits 4 i) -> the 8 values (q - z) * s as 16-bit floats, two
# per instruction: lop3 (word & 0x000f000f) | magic puts values i and i + 4 in the low mantissa bits of two
# floats of magic + q (128 + q in bf16, 1024 + q in fp16, exact); p * 1 - (magic + z) (both halves) is exact;
# p * s - 0 rounds once. Paired fma, not sub / mul: sm_80 has bf16x2 fma only (sub and mul need sm_90).
# $8: the word; $9: -(magic + z); $10: s (16-bit); $0..$7: the values.
_PAIRS_ASM_TEMPLATE = """{
.reg .b32 t, p, nz, ss, one, nzero;
mov.b32 nz, {$9, $9};
mov.b32 ss, {$10, $10};
mov.b32 one, ONE;
mov.b32 nzero, 0x80008000;
lop3.b32 p, $8, 0x000f000f, MAGIC, 0xea;
fma.rn.TYPE p, p, one, nz;
fma.rn.TYPE p, p, ss, nzero;
mov.b32 {$0, $4}, p;
shr.u32 t, $8, 4;
lop3.b32 p, t, 0x000f000f, MAGIC, 0xea;
fma.rn.TYPE p, p, one, nz;
fma.rn.TYPE p, p, ss, nzero;
mov.b32 {$1, $5}, p;
shr.u32 t, $8, 8;
lop3.b32 p, t, 0x000f000f, MAGIC, 0xea;
fma.rn.TYPE p, p, one, nz;
fma.rn.TYPE p, p, ss, nzero;
mov.b32 {$2, $6}, p;
shr.u32 t, $8, 12;
lop3.b32 p, t, 0x000f000f, MAGIC, 0xea;
fma.rn.TYPE p, p, one, nz;
fma.rn.TYPE p, p, ss, nzero;
mov.b32 {$3, $7}, p;
}"""
_PAIRS_ASM_BF16 = tl.constexpr(_PAIRS_ASM_TEMPLATE.replace("MAGIC", "0x43004300").replace("ONE", "0x3f803f80")
                               .replace("TYPE", "bf16x2"))
_PAIRS_ASM_FP16 = tl.constexpr(_PAIRS_ASM_TEMPLATE.replace("MAGIC", "0x64006400").replace("ONE", "0x3c003c00")
                               .replace("TYPE", "f16x2"))
_PAIRS_CONSTRAINTS = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,h,h")


@triton.jit
def _pair_value(words, j: tl.constexpr, z, s, dtype: tl.constexpr):
    """Value j of each word as (q - z) * s in float32, rounded once to `dtype`: what the PTX computes."""
    return ((((words >> (4 * j)) & 15).to(tl.float32) - z) * s).to(dtype)


@triton.jit
def _word_values(words, zero_scale, dtype: tl.constexpr, ASM: tl.constexpr):
    """The 8 values of each word [R, BLOCK_N] (zero_scale [BLOCK_N]) as a tuple of [R, BLOCK_N] in `dtype`.
    ASM: the PTX above (a GPU); otherwise Triton arithmetic with the same results (TRITON_INTERPRET)."""
    z = ((zero_scale >> 16) & 0xFF).to(tl.float32)
    scale_bits = (zero_scale & 0xFFFF).to(tl.int16)
    if ASM:
        sb = tl.broadcast_to(scale_bits[None, :], words.shape)
        if dtype == tl.float16:
            zb = tl.broadcast_to((-(z + 1024.0)).to(dtype).to(tl.int16, bitcast=True)[None, :], words.shape)
            o = tl.inline_asm_elementwise(_PAIRS_ASM_FP16, _PAIRS_CONSTRAINTS, [words, zb, sb],
                                          dtype=(tl.int16,) * 8, is_pure=True, pack=1)
        else:
            zb = tl.broadcast_to((-(z + 128.0)).to(dtype).to(tl.int16, bitcast=True)[None, :], words.shape)
            o = tl.inline_asm_elementwise(_PAIRS_ASM_BF16, _PAIRS_CONSTRAINTS, [words, zb, sb],
                                          dtype=(tl.int16,) * 8, is_pure=True, pack=1)
        values = (o[0].to(dtype, bitcast=True), o[1].to(dtype, bitcast=True), o[2].to(dtype, bitcast=True),
                  o[3].to(dtype, bitcast=True), o[4].to(dtype, bitcast=True), o[5].to(dtype, bitcast=True),
                  o[6].to(dtype, bitcast=True), o[7].to(dtype, bitcast=True))
    else:
        zf = z[None, :]
        sf = scale_bits.to(dtype, bitcast=True).to(tl.float32)[None, :]
        values = (_pair_value(words, 0, zf, sf, dtype), _pair_value(words, 1, zf, sf, dtype),
                  _pair_value(words, 2, zf, sf, dtype), _pair_value(words, 3, zf, sf, dtype),
                  _pair_value(words, 4, zf, sf, dtype), _pair_value(words, 5, zf, sf, dtype),
                  _pair_value(words, 6, zf, sf, dtype), _pair_value(words, 7, zf, sf, dtype))
    return values


@triton.jit(do_not_specialize=["M"])
def _quant_matmul_pairs_kernel(
    x_ptr,
    qweight_ptr,
    zero_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    k_per_split,
    group_rows,
    m_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIALS: tl.constexpr,
    ASM: tl.constexpr,
):
    """out[M, N] (or split-K partials) for a `prepare_pairs` weight; programs (m tile fastest, so the row
    tiles of one column tile run together and share its weight in L2) x K splits. A 64-row tile runs two
    32-row dots per dequantized tile (one dequantization for both; the 16-row MMA instructions stay what
    a 16- or 32-row tile runs, where one 64-row dot would be Hopper's warpgroup MMA)."""
    BLOCK_K: tl.constexpr = 128
    R: tl.constexpr = BLOCK_K // 8
    SUB_M: tl.constexpr = BLOCK_M if BLOCK_M <= 32 else 32
    TWO: tl.constexpr = BLOCK_M == 2 * SUB_M
    pid = tl.program_id(0)
    pid_m = pid % m_tiles
    pid_n = pid // m_tiles
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, SUB_M)
    offs_m2 = offs_m + SUB_M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_m2 = offs_m2 < M
    mask_n = offs_n < N
    r = tl.arange(0, R)
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros((SUB_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((SUB_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        words = tl.load(qweight_ptr + (k0 // 8 + r)[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
        zero_scale = tl.load(zero_scale_ptr + (k0 // group_rows) * N + offs_n, mask=mask_n, other=0)
        values = _word_values(words, zero_scale, dtype, ASM)
        x_tile = x_ptr + offs_m[:, None] * stride_xm + k0 + r[None, :]
        for j in tl.static_range(8):
            # Value j of the tile's words: rows k0 + j R .. k0 + j R + R - 1.
            x = tl.load(x_tile + j * R, mask=mask_m[:, None], other=0.0)
            acc = tl.dot(x, values[j], acc)
            if TWO:
                x2 = tl.load(x_tile + SUB_M * stride_xm + j * R, mask=mask_m2[:, None], other=0.0)
                acc2 = tl.dot(x2, values[j], acc2)
    _store_pairs_tile(acc, offs_m, mask_m, offs_n, mask_n, bias_ptr, out_ptr, M, N, pid_k, HAS_BIAS, PARTIALS)
    if TWO:
        _store_pairs_tile(acc2, offs_m2, mask_m2, offs_n, mask_n, bias_ptr, out_ptr, M, N, pid_k, HAS_BIAS,
                          PARTIALS)


@triton.jit
def _store_pairs_tile(acc, offs_m, mask_m, offs_n, mask_n, bias_ptr, out_ptr, M, N, pid_k,
                      HAS_BIAS: tl.constexpr, PARTIALS: tl.constexpr):
    """A tile's float32 sums as split pid_k's partials, or (+ bias) rounded into out."""
    mask = mask_m[:, None] & mask_n[None, :]
    if PARTIALS:
        tl.store(out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def pick_pairs_config(num_rows: int, weight: PackedWeight, num_sms: int) -> QuantMatmulConfig:
    """Tiling of `quant_matmul_pairs` for `num_rows` rows (block_k is the fixed 128-row tile), from session
    35's sweep at the 7B shapes (docs/perf_notes.md entry 53): 16-row tiles up to 16 rows, 32 up to 32, 64
    (two 32-row dots) above; K split until the column tiles give 3/4 of the SMs a program. Each row's value
    is the same at any row count (the same 16-row MMA instructions over the same K order, a split that
    depends on the weight only), so a CUDA graph padding a step's rows does not change the matmul's rows."""
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 or not PAIRS_TWO_DOTS else 64
    block_n = 128
    column_tiles = triton.cdiv(weight.output_size, block_n)
    chunks = weight.input_size // PAIRS_TILE_ROWS
    split = 1
    while 4 * column_tiles * split < 3 * num_sms and split < 16 and chunks % (split * 2) == 0:
        split *= 2
    return QuantMatmulConfig(block_m, block_n, PAIRS_TILE_ROWS, split, 4, 3)


def quant_matmul_pairs(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None,
                       config: QuantMatmulConfig) -> torch.Tensor:
    """x [M, K] (contiguous rows, K in qweight's sorted order) @ W^T (+ bias) -> [M, N] in x's dtype, for a
    `prepare_pairs` weight."""
    assert weight.zero_scale is not None and weight.tile_rows == PAIRS_TILE_ROWS
    assert x.dtype == weight.scales.dtype, "the kernel reads the scales' bits in x's dtype"
    m = x.shape[0]
    n, k = weight.output_size, weight.input_size
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    partials = config.split_k > 1
    target = torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device) if partials else out
    m_tiles = triton.cdiv(m, config.block_m)
    grid = (m_tiles * triton.cdiv(n, config.block_n), config.split_k)
    _quant_matmul_pairs_kernel[grid](
        x, weight.qweight, weight.zero_scale, bias if bias is not None else x, target,
        m, n, x.stride(0), k // config.split_k, weight.group_rows, m_tiles,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, HAS_BIAS=bias is not None and not partials,
        PARTIALS=partials, ASM=_PAIRS_ASM, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return sum_split_partials(target, bias, out) if partials else out


# The interpreter runs no PTX: the same arithmetic in Triton operations there. Read when this module is
# imported (the kernels are imported lazily, after a test session has set TRITON_INTERPRET).
_PAIRS_ASM = not envs.triton_interpreting()
