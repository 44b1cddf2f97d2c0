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

A tiling that needs more shared memory than the GPU has raises `OutOfResources` at launch. The launcher
takes the tiling as arguments (`benchmarks/gemm_sweep.py` sweeps them); `pick_config` is the
rule fitted to that sweep.
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources  # noqa: F401 (re-exported: ops.linear catches it)


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
    M,
    N,
    stride_xm,
    stride_wn,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_s.to(tl.int64) * k_per_split
    # N is a multiple of BLOCK_N (the launcher's contract): weight loads carry no mask.
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + k_start + offs_k[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + k_start + offs_k[None, :]
    m_mask = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs, mask=m_mask, other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out_mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    tile = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]  # [BLOCK_N, BLOCK_M] offsets into [M, N]
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
                if HAS_BIAS:
                    acc += tl.load(bias_ptr + offs_n).to(tl.float32)[:, None]
                tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(lock, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n).to(tl.float32)[:, None]
        tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * MN.to(tl.int64) + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def shared_bytes(config: GemmConfig, block_m: int = 16, elem_bytes: int = 2) -> int:
    """Shared memory the pipelined loop needs at most: `num_stages` buffers of a weight tile and an
    activation tile (Triton keeps num_stages - 1 of them on some targets, num_stages on Hopper)."""
    return config.num_stages * (config.block_n + block_m) * config.block_k * elem_bytes


def pick_config(m: int, n: int, k: int, num_sms: int, max_shared: int = 227 * 1024) -> GemmConfig | None:
    """The tiling for an [m, k] x [n, k]^T matmul, or None when no tiling of this kernel fits (torch then).

    Fitted to the H200 sweep (docs/perf_notes.md, entry 14): 64-row weight tiles of 128 keys, 3 stages, 4
    warps; 128-row tiles with 8 warps and 4 stages when 64-row tiles would give 16 or more programs per SM
    (the LM head) and the device has the shared memory for them (`max_shared` bytes per block: 227 KiB on
    Hopper, 99 KiB on sm_86 / sm_89); split-K only as far as needed for 1.5 programs per SM (o_proj and
    down on the H200: 4 splits of a 56-tile matrix).
    """
    block_k = 128
    if m < 1 or k % block_k:
        return None
    wide = GemmConfig(128, block_k, 1, num_stages=4, num_warps=8)
    narrow = GemmConfig(64, block_k, 1, num_stages=3, num_warps=4)
    use_wide = n % 128 == 0 and n // 64 >= 16 * num_sms and shared_bytes(wide) <= max_shared
    base = wide if use_wide else narrow
    if n % base.block_n or shared_bytes(base) > max_shared:
        return None
    tiles = n // base.block_n
    chunks = k // block_k
    split = next((s for s in range(1, 17) if chunks % s == 0 and tiles * s * 2 >= 3 * num_sms), None)
    if split is None:
        split = max(s for s in range(1, 17) if chunks % s == 0)
    return GemmConfig(base.block_n, block_k, split, base.num_stages, base.num_warps)


_LOCKS: dict[torch.device, torch.Tensor] = {}
# Counter buffers replaced by a larger one stay alive: a CUDA graph captured earlier may still point at them.
_RETIRED_LOCKS: list[torch.Tensor] = []


def _locks(device: torch.device, count: int) -> torch.Tensor:
    """Per-tile split counters, zero between launches (each launch's last programs reset theirs)."""
    locks = _LOCKS.get(device)
    if locks is None or locks.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split counters must be allocated before CUDA graph capture (run eagerly first)")
        if locks is not None:
            _RETIRED_LOCKS.append(locks)
        locks = torch.zeros(max(count, 1 << 16), dtype=torch.int32, device=device)
        _LOCKS[device] = locks
    return locks


def fits(
    x: torch.Tensor, weight: torch.Tensor, config: GemmConfig, bias: torch.Tensor | None = None
) -> bool:
    """Whether `skinny_linear` takes these operands with this tiling (else the caller uses torch)."""
    n, k = weight.shape
    if bias is not None and not (
        bias.shape == (n,) and bias.dtype == weight.dtype and bias.is_contiguous() and bias.device == x.device
    ):
        return False
    return (
        x.dim() == 2
        and x.shape[1] == k
        and x.dtype == weight.dtype
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and n % config.block_n == 0
        and k % (config.split_k * config.block_k) == 0
    )


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemmConfig
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T + bias[N] -> [M, N] in x's dtype (fp16/bf16), with the given tiling.

    Contract (`fits`): N % block_n == 0, K % (split_k * block_k) == 0, unit stride along K.
    """
    assert fits(x, weight, config, bias), (
        f"skinny_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype} do not fit {config}"
    )
    m = x.shape[0]
    n, k = weight.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = max(16, triton.next_power_of_2(min(m, 64)))
    grid = (n // config.block_n, config.split_k, triton.cdiv(m, block_m))
    has_bias = bias is not None
    split = config.split_k > 1
    fused = split and config.fused_reduce
    parts = torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device) if split else out
    locks = _locks(x.device, grid[0] * grid[2]) if fused else parts
    _skinny_gemm_kernel[grid](
        x,
        weight,
        bias if has_bias else weight,
        out,
        parts,
        locks,
        m,
        n,
        x.stride(0),
        weight.stride(0),
        k // config.split_k,
        HAS_BIAS=has_bias,
        SPLIT_K=config.split_k,
        FUSED_REDUCE=fused,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split and not fused:
        block = 1024
        _split_reduce_kernel[(triton.cdiv(m * n, block),)](
            parts, bias if has_bias else parts, out, m * n, n,
            SPLITS=config.split_k, HAS_BIAS=has_bias, BLOCK=block, num_warps=4,
        )
    return out
