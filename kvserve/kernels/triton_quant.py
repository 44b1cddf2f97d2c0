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

`dequantize`: the dense weight [N, K] in x's dtype (sorted K order), for large M where cuBLAS on the dense
weight beats dequantizing every tile once per row block.
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.layers.quantization import PackedWeight


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
):
    """out [N, K] (row-major) of the packed weight, tile [BLOCK_K, BLOCK_N] per program, stored transposed
    so that consecutive threads write consecutive K."""
    PACK: tl.constexpr = 32 // BITS
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    k0 = pid_k * BLOCK_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    q = _unpack_tile(qweight_ptr, k0, offs_k, offs_n, mask_n, N, tl.arange(0, BLOCK_K // PACK),
                     tl.arange(0, PACK) * BITS, BITS, BLOCK_K, BLOCK_N, GATHER)
    group = k0 // group_rows
    z = tl.load(zeros_ptr + group * N + offs_n, mask=mask_n, other=0).to(tl.float32) + _MAGIC_FLOAT
    s = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    w = tl.trans(((_as_magic_float(q) - z[None, :]) * s[None, :]).to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], w, mask=mask_n[:, None])


def block_k_for(weight: PackedWeight) -> int | None:
    """The K tile: the largest of 128 / 64 / 32 that divides the group (and so K); None when none does."""
    for block_k in (128, 64, 32):
        if weight.group_rows % block_k == 0 and weight.input_size % block_k == 0 and block_k % (32 // weight.bits) == 0:
            return block_k
    return None


def pick_config(num_rows: int, weight: PackedWeight, num_sms: int) -> QuantMatmulConfig | None:
    """Tiling for `num_rows` rows of x (fitted to `benchmarks/quant_matmul_bench.py --sweep` on the H200 at
    the 7B shapes, docs/perf_notes.md entry 52); None when the weight's groups fit no K tile."""
    block_k = block_k_for(weight)
    if block_k is None:
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
    return _finish_partials(target, bias, x.dtype) if partials else out


def _finish_partials(partials: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The split-K partials [splits, M, N] summed in split order (+ bias), rounded once to `dtype`."""
    total = partials.sum(dim=0)
    if bias is not None:
        total += bias.float()
    return total.to(dtype)


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
        BITS=weight.bits, BLOCK_N=block_n, BLOCK_K=block_k, GATHER=gather, num_warps=num_warps,
    )
    return out
