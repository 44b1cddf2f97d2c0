"""Gate/up matmul with SiLU-and-mul in its epilogue, for batches past the skinny matmul's rows: out[M, D] =
silu(x @ Wg^T) * (x @ Wu^T), where weight[2 D, K] holds [gate; up].

The separate `silu_and_mul` is a pass over memory that reads the [M, 2 D] intermediate and writes [M, D]: at
8,192 rows of the Qwen2.5-7B shape that is 0.93 GB a layer, about 0.22 ms; at decode sizes it is one more
launch a layer. Here each program computes a BLOCK_M x BLOCK_N tile of gate and the matching tile of up (two
accumulators over the same x tile), rounds both to the activation dtype, as the matmul's output would be, and
writes silu(gate) * up only (`silu_mul`, the rounding of the separate kernel). The x rows are the tensor-core
M side (the skinny matmul puts the weight there).

Tiles are walked in groups of GROUP_M row tiles so a group's x rows stay in L2 while it sweeps the weight.
Two loaders: plain pointers, and TMA tensor descriptors (Hopper and later; `use_tma`). A persistent variant
(one program per SM walking the tiles) was measured slower at 8,192 rows and dropped (docs/perf_notes.md,
entry 32).
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources  # noqa: F401 (re-exported: ops catches it)

from kvserve.kernels.triton_elementwise import silu_mul


@dataclass(frozen=True)
class GateUpConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 3
    num_warps: int = 8
    group_m: int = 8
    use_tma: bool = False


@triton.jit
def _tile_ids(M, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(D, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _store_silu_mul(acc_g, acc_u, out_ptr, stride_om, pid_m, pid_n, M, D, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    DTYPE = out_ptr.dtype.element_ty
    # Round gate and up to the activation dtype first: what the separate matmul would have stored.
    gate = acc_g.to(DTYPE).to(tl.float32)
    up = acc_u.to(DTYPE).to(tl.float32)
    out = silu_mul(gate, up, DTYPE)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < D)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _gate_up_silu_kernel(
    x_ptr, w_ptr, out_ptr, M, K, D, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, D, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < D
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + D.to(tl.int64) * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            bg = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, bg, acc_g)
        acc_u = tl.dot(a, bu, acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    _store_silu_mul(acc_g, acc_u, out_ptr, stride_om, pid_m, pid_n, M, D, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _gate_up_silu_tma_kernel(
    x_desc, w_desc, out_ptr, M, K, D, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, D, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
        off_k = k * BLOCK_K
        a = x_desc.load([off_m, off_k])
        bg = w_desc.load([off_n, off_k])
        bu = w_desc.load([D + off_n, off_k])
        acc_g = tl.dot(a, bg.T, acc_g)
        acc_u = tl.dot(a, bu.T, acc_u)
    _store_silu_mul(acc_g, acc_u, out_ptr, stride_om, pid_m, pid_n, M, D, BLOCK_M, BLOCK_N)


# The engine's tilings (`ops.gate_up_tma_config`), the best of benchmarks/gate_up_sweep.py on the H200 at 8192
# rows and at 64 rows.
PREFILL_CONFIG = GateUpConfig(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=8, group_m=16,
                              use_tma=True)
DECODE_CONFIG = GateUpConfig(block_m=64, block_n=64, block_k=128, num_stages=4, num_warps=4, group_m=8,
                             use_tma=True)


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GateUpConfig) -> bool:
    """The kernel's contract: 2-D x [M, K] and weight [2 D, K] of one 16-bit dtype, unit inner strides,
    no bias; with TMA also 16-byte aligned starts and row strides (a tensor descriptor's rule)."""
    if x.dim() != 2 or weight.dim() != 2:
        return False
    if config.use_tma and not all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
                                  for t in (x, weight)):
        return False
    return (
        bias is None
        and x.dtype == weight.dtype
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.shape[1] == weight.shape[1]
        and weight.shape[0] % 2 == 0
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, config: GateUpConfig,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ weight[:D]^T) * (x @ weight[D:]^T) -> [M, D] in x's dtype (see the module docstring)."""
    m, k = x.shape
    d = weight.shape[0] // 2
    if out is None:
        out = torch.empty((m, d), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(d, config.block_n),)
    if config.use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor.from_tensor(x, [config.block_m, config.block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
        _gate_up_silu_tma_kernel[grid](
            x_desc, w_desc, out, m, k, d, out.stride(0),
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, NUM_STAGES=config.num_stages, num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    else:
        _gate_up_silu_kernel[grid](
            x, weight, out, m, k, d, x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, NUM_STAGES=config.num_stages, EVEN_K=k % config.block_k == 0,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out
