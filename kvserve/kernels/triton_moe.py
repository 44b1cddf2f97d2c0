"""Mixture-of-experts MLP (`reference.fused_moe`'s contract) as grouped matmuls, graph-safe.

Steps, every shape and grid a function of T, k, E, H, I and constants only (no host sync, so a decode step
can be captured in a CUDA graph):

1. `align_by_expert`: the T * k (token, slot) pairs sorted by expert (a stable sort, so each expert's pairs
   keep token order), each expert's segment padded to a multiple of BLOCK_M. Gives `sorted_ids` (the pair
   index t * k + j, or the sentinel T * k for padding), `block_expert` (the expert of each BLOCK_M block, -1
   past the used ones) and `num_blocks` (a one-element tensor). Up to ALIGN_KERNEL_MAX_PAIRS pairs one
   single-program Triton kernel (one launch: decode steps); past that, torch ops with static shapes
   (counts by scatter_add, cumsums, a stable sort, a searchsorted for the blocks' experts).
   Blocks allocated: ceil(T k / BLOCK_M) + min(E, T k), a bound on sum_e ceil(count_e / BLOCK_M) since at most
   min(E, T k) experts have pairs and each pads by fewer than BLOCK_M rows.
2. `_moe_gate_up_kernel`: one program per (block, BLOCK_N columns of I): gathers the block's x rows, multiplies
   by the expert's gate and up rows (two accumulators), and writes silu(gate) * up for each pair into
   act[T k, I], in x's dtype.
3. `_moe_down_kernel`: one program per (block, BLOCK_N columns of H): act rows times w2[e]^T, times the pair's
   routing weight, into y[T k, H].
4. `_moe_sum_kernel`: out[t] = sum_j y[t k + j] in float32, rounded once to x's dtype.

Programs whose block is unused (expert -1) return at once; padding rows are masked off loads and stores.

Rounding: the matmuls accumulate in float32. As in the reference, gate and up are rounded to x's dtype before
the activation, silu(gate) is rounded before the multiply (`silu_mul`), the down projection's output is
rounded to x's dtype, then multiplied in float32 by the routing weight as given (float32, or x's dtype) and
rounded again. The sum over
the k slots differs: the reference adds the experts' outputs in x's dtype in expert order; here they are
added in float32 and rounded once (closer to the exact sum; within a 16-bit dtype's rounding of the
reference). float32 operands use IEEE float32 dot products (no TF32).
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_elementwise import silu_mul


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # pairs per block: the rows of one expert's tile
    block_n_gate_up: int  # columns of I per gate/up program (gate and up tiles of this width each)
    block_n_down: int  # columns of H per down program
    block_k: int
    num_warps: int
    num_stages: int


# Tilings by average pairs per expert (T k / E), the number of rows an expert's tile holds. First sweep
# (benchmarks/moe_kernel_bench.py --config, H100, Qwen3-30B-A3B's shape, bf16, one CUDA graph a call):
# * Decode (up to 16 pairs per expert, e.g. E=128, k=8 at T <= 256 rows): the smallest tl.dot tile, 16 rows.
#   Six tilings from 16 to 64 gate/up columns and block_k 64 to 256 were within 3% of each other at T = 1, 8,
#   64 and 256 (the matmuls read each hit expert's weights once; narrow N tiles spread them over the SMs).
# * Middle (up to 64): 32-row tiles (not swept yet).
# * Prefill (up to 256): 64-row tiles; at T = 2048 (128 pairs per expert) 836 us against 816 for the best.
# * Large prefill: 128-row tiles and 8 warps; at T = 8192 1,966 us against 2,184 for 64-row tiles.
DECODE_CONFIG = MoeConfig(block_m=16, block_n_gate_up=32, block_n_down=64, block_k=128, num_warps=4, num_stages=3)
MIDDLE_CONFIG = MoeConfig(block_m=32, block_n_gate_up=64, block_n_down=64, block_k=64, num_warps=4, num_stages=3)
PREFILL_CONFIG = MoeConfig(block_m=64, block_n_gate_up=64, block_n_down=128, block_k=64, num_warps=4,
                           num_stages=3)
LARGE_PREFILL_CONFIG = MoeConfig(block_m=128, block_n_gate_up=128, block_n_down=128, block_k=64, num_warps=8,
                                 num_stages=3)


def pick_config(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    """The tiling for T = num_tokens rows (a pure function of the shapes, so fixed for a captured size)."""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 16:
        return DECODE_CONFIG
    if per_expert <= 64:
        return MIDDLE_CONFIG
    if per_expert <= 256:
        return PREFILL_CONFIG
    return LARGE_PREFILL_CONFIG


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The static bound on the BLOCK_M blocks `align_by_expert` may use (see the module docstring)."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


# Up to this many pairs (T k) `align_by_expert` runs `_align_kernel`, one program and one launch (decode steps:
# Qwen3-30B-A3B's k = 8 at T <= 256 rows is 2,048 pairs); past it, the torch ops, whose dozen launches and
# sort scale better than one program's walk over the pairs.
ALIGN_KERNEL_MAX_PAIRS = 4096


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _align_kernel(
    ids_ptr, sorted_ids_ptr, block_expert_ptr, num_blocks_ptr, num_pairs, num_experts, max_blocks,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program: per-expert counts, each expert's first block (cumsum of its padded block count), the
    blocks' experts, then each pair written at its expert's start plus its rank among that expert's pairs."""
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    expert_blocks = (counts + (BLOCK_M - 1)) // BLOCK_M
    blocks_end = tl.cumsum(expert_blocks, axis=0)
    first_slot = (blocks_end - expert_blocks) * BLOCK_M
    tl.store(num_blocks_ptr, tl.sum(expert_blocks, axis=0))
    for start in range(0, max_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        # Experts past num_experts (padding) have no blocks: their end is the total, past every used block.
        owner = tl.sum((blocks_end[None, :] <= blocks[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(owner < num_experts, owner, -1), mask=blocks < max_blocks)
    for start in range(0, max_blocks * BLOCK_M, CHUNK):
        slots = start + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + slots, num_pairs, mask=slots < max_blocks * BLOCK_M)
    tl.debug_barrier()  # the sentinels are written before any pair overwrites its slot
    seen = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit  # this expert's pairs earlier in the chunk
        slot = tl.sum(hit * (first_slot + seen)[None, :] + hit * before, axis=1)
        tl.store(sorted_ids_ptr + slot, offs, mask=offs < num_pairs)
        seen += tl.sum(hit, axis=0)


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, use_kernel: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs of `topk_ids` [T, k] grouped by expert, each expert's group padded to a multiple of block_m.

    Returns (sorted_ids int32 [max_blocks * block_m]: pair index t * k + j, or T * k for padding;
    block_expert int32 [max_blocks]: the expert of each block, -1 for unused blocks; num_blocks int32 [1]).
    Within an expert the pairs keep their order; experts with no pairs get no block. Graph-safe: shapes
    depend on T, k, E and block_m only. `use_kernel` picks `_align_kernel` or the torch ops (default: the
    kernel up to ALIGN_KERNEL_MAX_PAIRS pairs); both give the same result."""
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    if use_kernel if use_kernel is not None else num_pairs <= ALIGN_KERNEL_MAX_PAIRS:
        ids = ids if ids.is_contiguous() else ids.contiguous()
        sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
        block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
        num_blocks = torch.empty(1, dtype=torch.int32, device=device)
        e_pad = triton.next_power_of_2(num_experts)
        _align_kernel[(1,)](
            ids, sorted_ids, block_expert, num_blocks, num_pairs, num_experts, blocks,
            BLOCK_M=block_m, E_PAD=e_pad, CHUNK=max(16, 8192 // e_pad), num_warps=4,
        )
        return sorted_ids, block_expert, num_blocks
    ids = ids.to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    expert_blocks = (counts + (block_m - 1)) // block_m
    blocks_end = torch.cumsum(expert_blocks, 0)  # each expert's first block past its segment
    first_pair = torch.cumsum(counts, 0) - counts  # each expert's first position among the sorted pairs
    sorted_experts, order = torch.sort(ids, stable=True)
    rank = torch.arange(num_pairs, device=device) - first_pair[sorted_experts]  # position within its expert
    dest = (blocks_end - expert_blocks)[sorted_experts] * block_m + rank
    sorted_ids = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_index = torch.arange(blocks, device=device)
    owner = torch.searchsorted(blocks_end, block_index, right=True)  # E for blocks past the last used one
    block_expert = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return sorted_ids, block_expert, blocks_end[-1:].to(torch.int32)


# num_pairs (T k) is not specialised: one compiled variant serves every batch size.
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(
    x_ptr, w_ptr, act_ptr, sorted_ids_ptr, block_expert_ptr,
    num_pairs, K, N,
    stride_xm, stride_we, stride_wn, stride_am,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """act[pair, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, N + n]) for the block's pairs."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pairs < num_pairs
    tokens = tl.where(m_ok, pairs // TOP_K, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N.to(tl.int64) * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        bg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        bu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    DTYPE = act_ptr.dtype.element_ty
    # gate and up rounded to the activation dtype first, as the reference's matmul output is.
    out = silu_mul(acc_g.to(DTYPE).to(tl.float32), acc_u.to(DTYPE).to(tl.float32), DTYPE)
    a_ptrs = act_ptr + pairs[:, None].to(tl.int64) * stride_am + offs_n[None, :]
    tl.store(a_ptrs, out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(
    act_ptr, w_ptr, y_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr,
    num_pairs, K, N,
    stride_am, stride_we, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """y[pair, n] = (act[pair] . w[e, n]) * routing weight of the pair: the dot product rounded to y's dtype, times
    the weight as given in float32, rounded to y's dtype."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pairs < num_pairs
    rows = tl.where(m_ok, pairs, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    DTYPE = y_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows, mask=m_ok, other=0.0).to(tl.float32)
    out = (acc.to(DTYPE).to(tl.float32) * weight[:, None]).to(DTYPE)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_sum_kernel(y_ptr, out_ptr, H, stride_ym, stride_om, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = sum over the k slots of y[t k + j], in float32, rounded once."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + j) * stride_ym + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


_SUM_BLOCK = 1024


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """`reference.fused_moe`'s result (see the module docstring for the rounding), with no host sync.

    x [T, H] (unit inner stride); w13 [E, 2 I, H]; w2 [E, H, I]; topk_weights [T, k] (float32 or x's dtype);
    topk_ids int32 or int64 [T, k]. `config` overrides the tiling `pick_config` chooses (for tuning and tests)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_pairs == 0:
        return out
    if config is None:
        config = pick_config(num_tokens, top_k, num_experts)
    if x.stride(1) != 1:
        x = x.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    weights = topk_weights.reshape(-1)  # float32 [T k], pair order
    if not weights.is_contiguous():
        weights = weights.contiguous()
    sorted_ids, block_expert, _ = align_by_expert(topk_ids, num_experts, config.block_m)
    blocks = block_expert.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(blocks, triton.cdiv(inter, config.block_n_gate_up))](
        x, w13, act, sorted_ids, block_expert,
        num_pairs, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=config.block_m, BLOCK_N=config.block_n_gate_up, BLOCK_K=config.block_k,
        PRECISION=precision, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _moe_down_kernel[(blocks, triton.cdiv(hidden, config.block_n_down))](
        act, w2, y, weights, sorted_ids, block_expert,
        num_pairs, inter, hidden,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n_down, BLOCK_K=config.block_k,
        PRECISION=precision, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, _SUM_BLOCK))](
        y, out, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=_SUM_BLOCK, num_warps=4,
    )
    return out
