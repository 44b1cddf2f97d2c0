"""Skinny matmul for decode-sized batches: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias), M small.

A decode step reads every weight once for a handful of rows, so the matmul is a stream over the weight at
HBM speed. Each program owns BLOCK_N weight rows and one slice of K (split-K when N alone gives too few
programs to keep every SM streaming). The weight tile is the tensor-core "M" side and the activations,
padded to BLOCK_M >= 16 rows, the narrow side: the dot costs nothing next to the bytes, and putting it in
the K loop lets Triton pipeline the weight loads `num_stages` deep.

Split-K writes float32 partials [splits, M, N]. The last program to finish an output tile (a per-tile
counter, incremented with release/acquire order after a block barrier, reset by that program) sums them in
split order, so the result is the same on every run whichever program comes last, as CUDA-graph vs eager
checks need; it adds the bias and rounds once, as a float32-accumulating matmul with a bias epilogue does.
`fused_reduce=False` sums them in a second kernel instead. One split rounds in the first kernel. The
counters are one buffer per device: launches must not overlap on two streams (kvserve computes on one).

fp8 weights (`--quantization fp8`, weight-only at these row counts): the weight may be float8_e4m3fn [N, K]
with a float32 scale per row. Each fp8 tile is converted in registers (every e4m3 value is exact in fp16 and
bf16) before the `tl.dot`, and the float32 accumulator is multiplied by its rows' scales right after the K
loop, so split-K partials, both reductions and both epilogues see a tile like a bf16 weight's
(`reference.fp8_linear_weight_only`). With fp16 activations the tile becomes fp16. With bf16 activations
and up to 16 rows a program (`fp8_fp16_dot`) it becomes fp16 too (e4m3 -> fp16 is one conversion a pair; the
64 x 128 tiling's PTX has 80 conversions that way against 127 to bf16), and each row of the activation tile
is scaled by a power of two into fp16's range, its dot scaled back as it is added: the same exact products,
short of values 2^31 below their tile row's largest, summed in float32 in another order (each tile's dot
apart, then added; docs/perf_notes.md entry 71). An fp8 weight takes bf16's tiling (`pick_config`: measured
best or near it on an H100).

Two epilogues fuse the kernel that would follow the matmul (`_store_output`): SiLU-and-mul for a [gate; up]
weight, and the rotary embedding plus the KV-cache write for a fused q/k/v weight. For either, the program's
BLOCK_N weight rows are chosen so the pairs the epilogue combines share a tile; the K loop is unchanged.
Launched with programmatic dependent launch (kernels/triton_pdl.py), a program waits for the previous
kernel before its first load of x; the counters, partials and outputs are touched only after that wait.

A tiling that needs more shared memory than the GPU has raises `OutOfResources` at launch. The launcher
takes the tiling as arguments (`benchmarks/gemm_sweep.py` sweeps them); `pick_config` is the
rule fitted to that sweep.
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001, ANN201

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources  # noqa: F401 (re-exported: ops.linear catches it)

from kvserve import envs
from kvserve.kernels import triton_pdl
from kvserve.kernels.split_counters import SplitCounters
from kvserve.kernels.triton_elementwise import quantize_fp8, rotate_pair, silu_mul
from kvserve.kernels.triton_pdl import pdl_wait_then_release

# What the matmul does with a finished tile (`_store_output`).
EPI_PLAIN = tl.constexpr(0)
EPI_SILU_MUL = tl.constexpr(1)
EPI_ROPE_CACHE = tl.constexpr(2)


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    split_k: int
    num_stages: int
    num_warps: int = 4
    # Split-K only: the last program of each output tile sums the partials (True), or a second kernel does.
    fused_reduce: bool = True


# M varies with the batch: left unspecialised (Triton specialises ints equal to 1 or divisible by 16), so the
# CUDA graphs of batch 1, 2, 4, 8 and 16 share one compiled variant per tiling.
@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    lock_ptr,
    pos_ptr,
    cos_sin_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    num_chunks,
    stride_cos_sin,
    stride_cache_slot,
    num_heads,
    num_kv_heads,
    k_scale,
    v_scale,
    w_scale_ptr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
    EPILOGUE: tl.constexpr = 0,
    HEAD_DIM: tl.constexpr = 0,
    FP8_MAX: tl.constexpr = 0.0,
    W_SCALED: tl.constexpr = False,
    FP16_DOT: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = tl.arange(0, BLOCK_N)
    if EPILOGUE == EPI_SILU_MUL:
        # Tile row 2j is gate row c + j and row 2j + 1 the matching up row (N // 2 further on), so the
        # epilogue finds each (gate, up) pair in the tile: output columns [c, c + BLOCK_N // 2).
        offs_n = pid_n * (BLOCK_N // 2) + rows // 2 + (rows % 2) * (N // 2)
    elif EPILOGUE == EPI_ROPE_CACHE:
        # Tile row 2j is column p + j of one head's first half and row 2j + 1 the column HEAD_DIM // 2 further
        # on: the pairs the rotary embedding mixes. A program covers BLOCK_N // 2 pairs of one head.
        per_head: tl.constexpr = HEAD_DIM // BLOCK_N
        offs_n = ((pid_n // per_head) * HEAD_DIM + (pid_n % per_head) * (BLOCK_N // 2) + rows // 2
                  + (rows % 2) * (HEAD_DIM // 2))
    else:
        offs_n = pid_n * BLOCK_N + rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Split s owns K chunks [s * C // SPLIT_K, (s + 1) * C // SPLIT_K) of C = K // BLOCK_K: splits differ by one
    # chunk at most when SPLIT_K does not divide C (the split count then follows the SM count, not K).
    chunk_begin = pid_s * num_chunks // SPLIT_K
    chunk_end = (pid_s + 1) * num_chunks // SPLIT_K
    k_start = chunk_begin.to(tl.int64) * BLOCK_K
    # N is a multiple of BLOCK_N (the launcher's contract): weight loads carry no mask.
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + k_start + offs_k[None, :]
    pdl_wait_then_release(PDL)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + k_start + offs_k[None, :]
    m_mask = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(chunk_begin, chunk_end):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs, mask=m_mask, other=0.0)
        if FP16_DOT:
            # bf16 activations and an fp8 weight, both to fp16: each row of the x tile scaled by a power of two
            # into fp16's range (rows past 65,504 or in fp16's subnormals keep their bits), its dot scaled back.
            xf = x.to(tl.float32)
            down, up = fp16_scales(tl.max(tl.abs(xf), axis=1))
            acc += tl.dot(w.to(tl.float16), tl.trans((xf * down[:, None]).to(tl.float16))) * up[None, :]
        else:
            if W_SCALED:  # an fp8 weight: to the activations' dtype, exactly
                w = w.to(x_ptr.dtype.element_ty)
            acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if W_SCALED:
        # Before the partials are stored: every split's partial, and so the sum and the epilogues, in real units.
        acc = acc * tl.load(w_scale_ptr + offs_n)[:, None]
    out_mask = offs_m[None, :] < M
    # [BLOCK_N, BLOCK_M] offsets into an [M, N] matrix: tile row r at column pid_n * BLOCK_N + r (the partials'
    # layout; with an epilogue that pairs rows, a column of no one weight row, which is all the partials need).
    tile = offs_m.to(tl.int64)[None, :] * N + (pid_n * BLOCK_N + rows)[:, None]
    mn = M.to(tl.int64) * N
    if SPLIT_K > 1:
        # partials[pid_s, m, n] in float32
        tl.store(part_ptr + pid_s.to(tl.int64) * mn + tile, acc, mask=out_mask)
        if FUSED_REDUCE:
            # Count this tile's finished splits; the last one to finish sums all partials in split order
            # (the same sum whichever program comes last) and resets the counter for the next launch.
            tl.debug_barrier()
            lock = lock_ptr + pid_m * tl.num_programs(0) + pid_n
            done = tl.atomic_add(lock, 1, sem="acq_rel")
            if done == SPLIT_K - 1:
                acc = tl.load(part_ptr + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):
                    acc += tl.load(part_ptr + s * mn + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
                _store_output(acc, bias_ptr, out_ptr, offs_n, offs_m, tile, out_mask, pid_n, M, N, HAS_BIAS,
                              pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_cos_sin,
                              stride_cache_slot, num_heads, num_kv_heads, k_scale, v_scale, EPILOGUE, HEAD_DIM,
                              BLOCK_N, BLOCK_M, FP8_MAX)
                tl.atomic_xchg(lock, 0)
    else:
        _store_output(acc, bias_ptr, out_ptr, offs_n, offs_m, tile, out_mask, pid_n, M, N, HAS_BIAS,
                      pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_cos_sin, stride_cache_slot,
                      num_heads, num_kv_heads, k_scale, v_scale, EPILOGUE, HEAD_DIM, BLOCK_N, BLOCK_M, FP8_MAX)


@triton.jit
def fp16_scales(amax):
    """Powers of two (down, up = 1 / down) for rows whose largest |x| is amax (float32): amax * down lies in
    [2^14, 2^15), below fp16's 65,504, read off amax's exponent field (clamped so both stay normal float32s;
    amax past 2^127 is beyond any bf16 activation worth keeping finite, and an all-zero row takes any scale)."""
    e = tl.minimum(tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15), 253)
    down = ((268 - e) << 23).to(tl.float32, bitcast=True)
    up = ((e - 14) << 23).to(tl.float32, bitcast=True)
    return down, up


@triton.jit
def _store_output(acc, bias_ptr, out_ptr, offs_n, offs_m, tile, out_mask, pid_n, M, N, HAS_BIAS: tl.constexpr,
                  pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_cos_sin, stride_cache_slot,
                  num_heads, num_kv_heads, k_scale, v_scale, EPILOGUE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, FP8_MAX: tl.constexpr):
    """The finished float32 tile: add the bias and round once to the output dtype, then (EPILOGUE)
    * EPI_PLAIN: store it;
    * EPI_SILU_MUL: silu(gate) * up of each (gate, up) row pair into [M, N // 2], rounded where
      `silu_and_mul` rounds;
    * EPI_ROPE_CACHE (a fused q/k/v projection): rotate the q and k heads' pairs as `rotary_embedding` does
      (same rounding steps), store q, k, v, and write this token's k and v into its KV cache slot (slots < 0:
      padding, not written; FP8_MAX > 0: an fp8 cache, stored as `triton_cache.reshape_and_cache` stores
      them: divided by k_scale / v_scale, saturated)."""
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n).to(tl.float32)[:, None]
    if EPILOGUE == EPI_PLAIN:
        tl.store(out_ptr + tile, acc.to(dtype), mask=out_mask)
    else:
        pairs = tl.permute(tl.reshape(acc.to(dtype).to(tl.float32), (BLOCK_N // 2, 2, BLOCK_M)), (0, 2, 1))
        first, second = tl.split(pairs)  # [BLOCK_N // 2, BLOCK_M] each
        half = tl.arange(0, BLOCK_N // 2)
        m64 = offs_m.to(tl.int64)[None, :]
        if EPILOGUE == EPI_SILU_MUL:
            cols = pid_n * (BLOCK_N // 2) + half
            tl.store(out_ptr + m64 * (N // 2) + cols[:, None], silu_mul(first, second, dtype), mask=out_mask)
        else:
            per_head: tl.constexpr = HEAD_DIM // BLOCK_N
            head = pid_n // per_head
            col = (pid_n % per_head) * (BLOCK_N // 2) + half  # within the head's first half
            o1 = first
            o2 = second
            if head < num_heads + num_kv_heads:  # a q or k head: rotate
                pos = tl.load(pos_ptr + offs_m, mask=offs_m < M, other=0).to(tl.int64)[None, :]
                cos_ptrs = cos_sin_ptr + pos * stride_cos_sin + col[:, None]
                o1, o2 = rotate_pair(first, second, tl.load(cos_ptrs), tl.load(cos_ptrs + HEAD_DIM // 2), dtype)
            dst = out_ptr + m64 * N + (head * HEAD_DIM + col)[:, None]
            tl.store(dst, o1.to(dtype), mask=out_mask)
            tl.store(dst + HEAD_DIM // 2, o2.to(dtype), mask=out_mask)
            if head >= num_heads:  # a k or v head: this token's cache slot too
                slot = tl.load(slot_ptr + offs_m, mask=offs_m < M, other=-1).to(tl.int64)[None, :]
                kv_head = head - num_heads
                cache_ptr = k_cache_ptr
                cache_scale = k_scale
                if kv_head >= num_kv_heads:
                    kv_head -= num_kv_heads
                    cache_ptr = v_cache_ptr
                    cache_scale = v_scale
                slot_dst = cache_ptr + slot * stride_cache_slot + (kv_head * HEAD_DIM + col)[:, None]
                keep = out_mask & (slot >= 0)
                c1 = o1.to(dtype)
                c2 = o2.to(dtype)
                if FP8_MAX > 0:
                    c1 = quantize_fp8(c1, cache_scale, FP8_MAX, k_cache_ptr.dtype.element_ty)
                    c2 = quantize_fp8(c2, cache_scale, FP8_MAX, k_cache_ptr.dtype.element_ty)
                tl.store(slot_dst, c1, mask=keep)
                tl.store(slot_dst + HEAD_DIM // 2, c2, mask=keep)


@triton.jit
def split_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out (M x N = MN elements) = split-K float32 partials [SPLITS, M, N] added in split order (+ bias [N]),
    rounded once to out's dtype; BLOCK elements a program (also the quantized matmuls' sum, triton_quant)."""
    pdl_wait_then_release(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * MN.to(tl.int64) + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def shared_bytes(config: GemmConfig, block_m: int = 16, elem_bytes: int = 2, weight_bytes: int | None = None) -> int:
    """Shared memory the pipelined loop needs at most: `num_stages` buffers of a weight tile and an
    activation tile (Triton keeps num_stages - 1 of them on some targets, num_stages on Hopper). elem_bytes:
    the activations' element size; weight_bytes: the weight's (1 for fp8), elem_bytes when None."""
    weight_bytes = elem_bytes if weight_bytes is None else weight_bytes
    return config.num_stages * (config.block_n * weight_bytes + block_m * elem_bytes) * config.block_k


def pick_config(m: int, n: int, k: int, num_sms: int, max_shared: int = 227 * 1024,
                weight_bytes: int = 2) -> GemmConfig | None:
    """The tiling for an [m, k] x [n, k]^T matmul, or None when no tiling of this kernel fits (torch then).

    Fitted to the H200 sweeps (docs/perf_notes.md, entries 14 and 26): 64-row weight tiles of 128 keys, 3
    stages, 4 warps; 128-row tiles with 8 warps and 4 stages when 64-row tiles would give 16 or more programs
    per SM (the LM head) and the device has the shared memory for them (`max_shared` bytes per block: 227 KiB
    on Hopper, 99 KiB on sm_86 / sm_89). Split-K: the most splits (at most 16, one K chunk each at least)
    whose programs are all resident at once (`resident_programs`), so that every program streams from the
    start and none waits for a second round: on the H200 qkv takes 5 splits, o_proj and down 7.

    weight_bytes=1 (an fp8 weight): the bf16 weight's tiling, split counts included (the stages then hold
    less than the shared memory fits). An H100 sweep of fp8 tilings at 1-64 rows (`gemm_sweep.py
    --weight-dtype fp8`, docs/perf_notes.md entry 69) found 128-key tiles best at every shape, and bf16's
    splits at or near the best at 1-8 rows: q/k/v 12.2 us (best 11.2, 128-row tiles in 7 splits), o_proj
    9.1 (the best), gate/up 64.0 (best 56.4, 2 splits); 256-key tiles, and the more splits that fp8's smaller
    stages would let be resident, were slower.
    """
    if m < 1:
        return None
    if weight_bytes == 1:
        weight_bytes = 2
    block_m = launch_block_m(m)
    for block_k in (128,):
        if k < block_k or k % block_k:
            continue
        wide = GemmConfig(128, block_k, 1, num_stages=4, num_warps=8)
        narrow = GemmConfig(64, block_k, 1, num_stages=3, num_warps=4)
        use_wide = (n % 128 == 0 and n // 64 >= 16 * num_sms
                    and shared_bytes(wide, block_m, weight_bytes=weight_bytes) <= max_shared)
        base = wide if use_wide else narrow
        if n % base.block_n or shared_bytes(base, block_m, weight_bytes=weight_bytes) > max_shared:
            continue
        tiles = n // base.block_n
        resident = resident_programs(base, num_sms, max_shared, block_m, weight_bytes)
        split = max(1, min(16, k // block_k, resident // tiles))
        return GemmConfig(base.block_n, block_k, split, base.num_stages, base.num_warps)
    return None


def resident_programs(config: GemmConfig, num_sms: int, max_shared: int, block_m: int = 16,
                      weight_bytes: int = 2) -> int:
    """Programs of this tiling (with `block_m`-row activation tiles, a weight of `weight_bytes` a value) the
    GPU holds at once, as its shared memory allows (`max_shared` per block, taken as the SM's capacity too;
    registers and warps do not bind for these tilings)."""
    return num_sms * max(1, max_shared // shared_bytes(config, block_m, weight_bytes=weight_bytes))


def launch_block_m(m: int) -> int:
    """Activation rows per program that `skinny_linear` launches an m-row matmul with."""
    return max(16, triton.next_power_of_2(min(m, 64)))


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Per-tile split-K counters (zero between launches; each tile's last program resets its own).
_LOCKS = SplitCounters("the matmul's split counters")
# An fp8 weight with bf16 activations: the dot in fp16, each x row of a K tile scaled into fp16's range
# (True), or the weight tile converted to bf16 (False). fp16 activations take the fp16 dot unscaled.
FP8_FP16_DOT: bool = envs.KVSERVE_FP8_FP16_DOT
# Whether an fp8 weight's skinny matmul that converts it to bf16 launches with PDL where PDL is on (off by
# default: on an H100 such decode steps were 4 % faster at 17 and 32 rows without it, docs/perf_notes.md entry 72).
FP8_CONVERT_PDL: bool = envs.KVSERVE_FP8_CONVERT_PDL
# ... up to this many activation rows a program (`launch_block_m`): the scaling's work grows with the x tile,
# and at 32 rows the bf16 way was ahead (an H100's decode step at batch 32 5.30 ms against 5.38; at batch 1
# and 8 4.42 / 4.77 against 3.80 / 4.18: docs/perf_notes.md entry 71).
FP8_FP16_DOT_MAX_BLOCK_M = 16


def fp8_fp16_dot(x_dtype: torch.dtype, fp8_weight: bool, block_m: int) -> bool:
    """Whether the skinny matmul runs its dot in fp16 on scaled activations of `x_dtype` (`FP16_DOT`), for a
    weight in fp8 or not, `block_m` activation rows a program."""
    return FP8_FP16_DOT and fp8_weight and x_dtype == torch.bfloat16 and block_m <= FP8_FP16_DOT_MAX_BLOCK_M


def launch_pdl(pdl_on: bool, fp8_weight: bool, fp16_dot: bool) -> bool:
    """Whether a skinny matmul launches with PDL (where `pdl_on`): not an fp8 weight's that converts it to bf16,
    unless FP8_CONVERT_PDL (KVSERVE_FP8_CONVERT_PDL=1)."""
    return pdl_on and (not fp8_weight or fp16_dot or FP8_CONVERT_PDL)


@dataclass(frozen=True)
class RopeCache:
    """What the EPI_ROPE_CACHE epilogue needs (contracts of `rotary_embedding` and `reshape_and_cache`): the
    matmul is a fused q/k/v projection of num_heads + 2 num_kv_heads heads of head_dim."""

    positions: torch.Tensor  # [M] int32/int64
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] float32, cos then sin
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous, x's dtype or fp8
    slot_mapping: torch.Tensor  # [M] int32/int64, < 0: not written
    num_heads: int
    num_kv_heads: int
    head_dim: int
    k_scale: float = 1.0  # an fp8 cache's scales (`reshape_and_cache`); ignored otherwise
    v_scale: float = 1.0

    def fits(self, x: torch.Tensor, n: int, block_n: int) -> bool:
        m, d = x.shape[0], self.head_dim
        cache = self.kv_cache
        return (
            d % block_n == 0
            and n == (self.num_heads + 2 * self.num_kv_heads) * d
            and self.positions.shape == (m,) and self.positions.is_contiguous()
            and self.slot_mapping.shape == (m,) and self.slot_mapping.is_contiguous()
            and self.positions.dtype in (torch.int32, torch.int64)
            and self.slot_mapping.dtype in (torch.int32, torch.int64)
            and self.cos_sin_cache.dtype == torch.float32 and self.cos_sin_cache.is_contiguous()
            and self.cos_sin_cache.dim() == 2 and self.cos_sin_cache.shape[1] == d
            and cache.dim() == 5 and cache.shape[0] == 2 and tuple(cache.shape[3:]) == (self.num_kv_heads, d)
            and cache.dtype in (x.dtype, *_FP8_DTYPES) and cache.is_contiguous()
            and self.positions.device == self.slot_mapping.device == cache.device == x.device
            and self.cos_sin_cache.device == x.device
        )


def fits(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemmConfig,
    bias: torch.Tensor | None = None,
    silu_mul: bool = False,
    rope: RopeCache | None = None,
    w_scale: torch.Tensor | None = None,
) -> bool:
    """Whether `skinny_linear` takes these operands with this tiling (else the caller uses torch)."""
    n, k = weight.shape
    if bias is not None and not (
        bias.shape == (n,) and bias.dtype == x.dtype and bias.is_contiguous() and bias.device == x.device
    ):
        return False
    if w_scale is not None and not (
        weight.dtype == torch.float8_e4m3fn and w_scale.dtype == torch.float32 and w_scale.shape == (n,)
        and w_scale.is_contiguous() and w_scale.device == x.device
    ):
        return False
    if (silu_mul or rope is not None) and config.split_k > 1 and not config.fused_reduce:
        return False  # the separate reduce kernel has no epilogue
    if silu_mul and (n % 2 or rope is not None):
        return False
    if rope is not None and not (x.dim() == 2 and rope.fits(x, n, config.block_n)):
        return False
    return (
        x.dim() == 2
        and x.shape[1] == k
        and (x.dtype == weight.dtype or w_scale is not None)
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and n % config.block_n == 0
        and k % config.block_k == 0
        and 1 <= config.split_k <= k // config.block_k
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemmConfig,
    silu_mul: bool = False,
    rope: RopeCache | None = None,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T + bias[N] -> [M, N] in x's dtype (fp16/bf16), with the given tiling.

    w_scale: an fp8 weight's float32 scales [N]: weight is float8_e4m3fn [N, K] standing for
    weight * w_scale[:, None], and the result is `reference.fp8_linear_weight_only`'s (x unquantized: the
    products of x with the exact e4m3 values, summed in float32 and scaled per row). bias: x's dtype.

    silu_mul: the weight is [gate; up] (N = 2 d rows) and the result is silu(gate) * up, [M, d], bitwise what
    `silu_and_mul` gives on the plain result (one launch, no [M, N] intermediate).
    rope: the weight is a fused q/k/v projection; the result holds the rotated q and k heads and v, bitwise
    what `rotary_embedding` gives, and k / v are also written into rope.kv_cache at rope.slot_mapping.

    Contract (`fits`): N % block_n == 0, K % block_k == 0, split_k <= K // block_k (the splits' chunk counts
    differ by one at most), unit stride along K; with an epilogue,
    the last program of a split tile sums the partials (fused_reduce).
    """
    assert fits(x, weight, config, bias, silu_mul, rope, w_scale), (
        f"skinny_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype} do not fit {config}"
    )
    m = x.shape[0]
    n, k = weight.shape
    out = torch.empty((m, n // 2 if silu_mul else n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = launch_block_m(m)
    grid = (n // config.block_n, config.split_k, triton.cdiv(m, block_m))
    has_bias = bias is not None
    split = config.split_k > 1
    fused = split and config.fused_reduce
    parts = torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device) if split else out
    locks = _LOCKS.get(x.device, grid[0] * grid[2]) if fused else parts
    fp16_dot = fp8_fp16_dot(x.dtype, w_scale is not None, block_m)
    pdl = launch_pdl(triton_pdl.enabled(x.device), w_scale is not None, fp16_dot)
    epilogue = EPI_ROPE_CACHE if rope is not None else EPI_SILU_MUL if silu_mul else EPI_PLAIN
    if rope is not None:
        rope_args = (rope.positions, rope.cos_sin_cache, rope.slot_mapping, rope.kv_cache[0], rope.kv_cache[1])
        rope_ints = (rope.cos_sin_cache.stride(0), rope.num_kv_heads * rope.head_dim, rope.num_heads,
                     rope.num_kv_heads, float(rope.k_scale), float(rope.v_scale))
        fp8_max = torch.finfo(rope.kv_cache.dtype).max if rope.kv_cache.dtype in _FP8_DTYPES else 0.0
    else:
        rope_args, rope_ints = (x, x, x, x, x), (0, 0, 0, 0, 1.0, 1.0)
        fp8_max = 0.0
    _skinny_gemm_kernel[grid](
        x,
        weight,
        bias if has_bias else weight,
        out,
        parts,
        locks,
        *rope_args,
        m,
        n,
        x.stride(0),
        weight.stride(0),
        k // config.block_k,
        *rope_ints,
        w_scale if w_scale is not None else weight,
        HAS_BIAS=has_bias,
        SPLIT_K=config.split_k,
        FUSED_REDUCE=fused,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        PDL=pdl,
        EPILOGUE=epilogue.value,
        HEAD_DIM=rope.head_dim if rope is not None else 0,
        FP8_MAX=fp8_max,
        W_SCALED=w_scale is not None,
        FP16_DOT=fp16_dot,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        # Each product of the rotation is rounded before the sum (as torch's bf16 ops round): no FMA contraction.
        enable_fp_fusion=rope is None,
        **triton_pdl.launch_options(pdl),
    )
    if split and not fused:
        sum_split_partials(parts, bias, out, pdl)
    return out


def sum_split_partials(parts: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                       pdl: bool = False) -> torch.Tensor:
    """out [M, N] = split-K float32 partials [splits, M, N] added in split order (+ bias), rounded once to
    out's dtype, in one launch of `split_reduce_kernel` (pdl: launched with programmatic dependent launch).
    The quantized matmuls sum theirs here too: torch's sum, bias add and cast took two or three launches, and
    were slower (docs/perf_notes.md entry 54)."""
    splits, m, n = parts.shape
    block = 1024
    split_reduce_kernel[(triton.cdiv(m * n, block),)](
        parts, bias if bias is not None else parts, out, m * n, n,
        SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=block, PDL=pdl, num_warps=4,
        **triton_pdl.launch_options(pdl),
    )
    return out
