"""Matmuls of decode batches past the skinny matmul's rows (33-64 on the H200), TMA loads (sm_90+):
out[M, N] = x[M, K] @ weight[N, K]^T (+ bias), or for a [gate; up] weight of 2 N rows silu(x @ Wg^T) * (x @ Wu^T).

At these sizes a matmul streams its weight once, and the stream runs at the memory's rate only while every
SM pulls its share. Output tiles rarely fill whole waves: the gate/up projection of the Qwen2.5-7B shape has
296 tiles of 64 columns for 132 SMs (2.24 waves, the third wave a quarter full), the down projection 56
tiles (less than half a wave). So a launch follows a `Plan`: the first `dp_tiles` tiles are computed whole,
in full waves; each tile after them can be cut into `splits` ranges of K, so that the last wave holds about
as many programs as the GPU has room for. Measured on the H200, splitting cost more than the partial wave
(the stream is bound by the memory, not by the SMs: a partial wave's programs each get more bandwidth), so
the engine's tilings (`pick`) fill the SMs by the tile width instead and never split; the split path stays
for the sweep that measures it. The x rows are the tensor-core M side (one 64-row tile).

A split program writes its float32 partial (two for gate/up) to a workspace; the last of a tile's programs to
finish (a per-tile counter, incremented with release/acquire order after a block barrier, reset by that
program) sums the partials in split order, so the result does not depend on which program came last, and
runs the epilogue: bias, rounding to the activation dtype, and for gate/up `silu_mul` of the rounded gate
and up (the rounding of the separate matmul and `silu_and_mul`). The counters are one buffer per device:
launches must not overlap on two streams (kvserve computes on one).

Launched with programmatic dependent launch (kernels/triton_pdl.py) where the device has it: a program waits
for the previous kernel before its first load; the workspace, counters and output are touched after that.
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources  # noqa: F401 (re-exported: ops catches it)

from kvserve.kernels import triton_pdl
from kvserve.kernels.split_counters import SplitCounters
from kvserve.kernels.triton_elementwise import silu_mul
from kvserve.kernels.triton_pdl import pdl_wait_then_release


@dataclass(frozen=True)
class DecodeGemmConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    num_stages: int = 4
    num_warps: int = 4
    # x through a tensor descriptor (True) or masked pointer loads (the weight always through TMA).
    x_tma: bool = True


@dataclass(frozen=True)
class Plan:
    """Tiles 0 .. dp_tiles - 1 whole (one program each), every later tile as `splits` programs over K."""

    num_tiles: int
    dp_tiles: int
    splits: int

    @property
    def tail_tiles(self) -> int:
        return self.num_tiles - self.dp_tiles

    @property
    def grid(self) -> int:
        return self.dp_tiles + self.tail_tiles * self.splits


# The engine's tilings (`pick`), from benchmarks/decode_gemm_sweep.py on the H200 (docs/perf_notes.md entry
# 33): gate/up in 64-column tiles, four stages, one program per SM; a matmul whose 32-column tiles make one
# wave of at least MIN_WAVE_FILL of the SMs (o_proj and down) in those tiles, six stages; one of many waves (the
# LM head) in 64-column tiles, three stages, two programs per SM. Split-K (`Plan.splits` > 1) was slower
# at every shape swept, so the engine never splits.
GATE_UP_CONFIG = DecodeGemmConfig(64, 64, 128, 4, 4)
ONE_WAVE_CONFIG = DecodeGemmConfig(64, 32, 128, 6, 4)
MANY_WAVES_CONFIG = DecodeGemmConfig(64, 64, 128, 3, 4)
MIN_WAVE_FILL = 0.8
MANY_WAVES = 4
# x through TMA in the engine's tilings (False: masked pointer loads); A/B switch of the benchmarks.
X_TMA = True


def shared_bytes(config: DecodeGemmConfig, gate_up: bool, elem_bytes: int = 2) -> int:
    """Shared memory of the pipelined loop: `num_stages` buffers of an x tile and one (gate/up: two) weight
    tiles."""
    weights = 2 if gate_up else 1
    return config.num_stages * (config.block_m + weights * config.block_n) * config.block_k * elem_bytes


def programs_per_sm(config: DecodeGemmConfig, gate_up: bool, max_shared: int) -> int:
    """Programs of this tiling one SM holds at once, as its shared memory allows (`max_shared` per block,
    taken as the SM's capacity too), or 0 when one does not fit."""
    return max_shared // shared_bytes(config, gate_up)


@triton.jit
def _epilogue(acc, acc_u, bias_ptr, out_ptr, stride_om, off_m, off_n, M, N, GATE_UP: tl.constexpr,
              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if GATE_UP:
        # Round gate and up to the activation dtype first: what the separate matmul would have stored.
        out = silu_mul(acc.to(dtype).to(tl.float32), acc_u.to(dtype).to(tl.float32), dtype)
    else:
        out = acc.to(dtype)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], out, mask=mask)


# M varies with the batch and dp_tiles with the plan: left unspecialised (one compiled variant per tiling).
@triton.jit(do_not_specialize=["M", "dp_tiles"])
def _decode_gemm_kernel(
    x_desc, w_desc, bias_ptr, out_ptr, ws_ptr, counter_ptr,
    M, N, K, stride_xm, stride_om, dp_tiles,
    SPLITS: tl.constexpr, GATE_UP: tl.constexpr, HAS_BIAS: tl.constexpr, X_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    num_k = tl.cdiv(K, BLOCK_K)
    split = pid * 0
    tile = pid
    k_begin = pid * 0
    k_end = num_k + pid * 0
    if SPLITS > 1:
        if pid >= dp_tiles:
            unit = pid - dp_tiles
            tile = dp_tiles + unit // SPLITS
            split = unit % SPLITS
            # Split s owns K steps [s * C // SPLITS, (s + 1) * C // SPLITS): they differ by one step at most.
            k_begin = split * num_k // SPLITS
            k_end = (split + 1) * num_k // SPLITS
    num_n = tl.cdiv(N, BLOCK_N)
    off_m = (tile // num_n) * BLOCK_M
    off_n = (tile % num_n) * BLOCK_N
    pdl_wait_then_release(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the up half of a gate/up weight (else unused)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    for k in tl.range(k_begin, k_end, num_stages=NUM_STAGES):
        if X_TMA:
            a = x_desc.load([off_m, k * BLOCK_K])
        else:  # x_desc is x's pointer
            a = tl.load(x_desc + offs_m.to(tl.int64)[:, None] * stride_xm + (k * BLOCK_K + offs_k)[None, :],
                        mask=(offs_m < M)[:, None], other=0.0)
        acc = tl.dot(a, w_desc.load([off_n, k * BLOCK_K]).T, acc)
        if GATE_UP:
            acc_u = tl.dot(a, w_desc.load([N + off_n, k * BLOCK_K]).T, acc_u)
    finish = pid >= 0
    if SPLITS > 1:
        if pid >= dp_tiles:
            # partial [tail tile, split, (gate, up), BLOCK_M, BLOCK_N] in float32
            NUM_ACC: tl.constexpr = 2 if GATE_UP else 1
            TILE: tl.constexpr = BLOCK_M * BLOCK_N
            offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            tail = tile - dp_tiles
            part = ws_ptr + ((tail * SPLITS + split) * NUM_ACC).to(tl.int64) * TILE
            tl.store(part + offs, acc)
            if GATE_UP:
                tl.store(part + TILE + offs, acc_u)
            # Count this tile's finished splits; the last one to finish sums all partials in split order (the
            # same sum whichever program comes last) and resets the counter for the next launch.
            tl.debug_barrier()
            counter = counter_ptr + tail
            done = tl.atomic_add(counter, 1, sem="acq_rel")
            finish = done == SPLITS - 1
            if finish:
                first = ws_ptr + (tail * SPLITS * NUM_ACC).to(tl.int64) * TILE
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    acc += tl.load(first + s * NUM_ACC * TILE + offs, cache_modifier=".cg")
                    if GATE_UP:
                        acc_u += tl.load(first + (s * NUM_ACC + 1) * TILE + offs, cache_modifier=".cg")
                tl.atomic_xchg(counter, 0)
    if finish:
        _epilogue(acc, acc_u, bias_ptr, out_ptr, stride_om, off_m, off_n, M, N, GATE_UP, HAS_BIAS, BLOCK_M,
                  BLOCK_N)


# Per-tile split counters (zero between launches; each tile's last program resets its own).
_COUNTERS = SplitCounters("the decode matmul's split counters")


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gate_up: bool,
         config: DecodeGemmConfig) -> bool:
    """The contract: 2-D x [M, K] (M <= block_m) and weight [N, K] (gate/up: [2 D, K], no bias) of one
    16-bit dtype, unit inner strides, 16-byte aligned starts and row strides (a tensor descriptor's rule), K
    a multiple of block_k; bias [N] of the weight's dtype."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] > config.block_m or x.shape[1] != weight.shape[1]:
        return False
    if not all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 and t.stride(1) == 1
               for t in (x, weight)):
        return False
    if gate_up and (bias is not None or weight.shape[0] % 2):
        return False
    if bias is not None and not (bias.shape == (weight.shape[0],) and bias.dtype == weight.dtype
                                 and bias.is_contiguous() and bias.device == x.device):
        return False
    return (x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16)
            and x.shape[1] % config.block_k == 0)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: DecodeGemmConfig,
                  schedule: Plan, gate_up: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias -> [M, N], or with gate_up silu(gate) * up -> [M, N / 2], in x's dtype, computed
    as `schedule` says (its num_tiles must be the output's tile count). Contract: `fits`."""
    assert fits(x, weight, bias, gate_up, config), (
        f"decode_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype} do not fit "
        f"{config}"
    )
    m, k = x.shape
    n = weight.shape[0] // 2 if gate_up else weight.shape[0]
    assert schedule.num_tiles == triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), schedule
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    from triton.tools.tensor_descriptor import TensorDescriptor

    x_desc = TensorDescriptor.from_tensor(x, [config.block_m, config.block_k]) if config.x_tma else x
    w_desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
    split = schedule.splits > 1 and schedule.tail_tiles > 0
    if split:
        per_tile = (2 if gate_up else 1) * config.block_m * config.block_n
        ws = torch.empty(schedule.tail_tiles * schedule.splits * per_tile, dtype=torch.float32, device=x.device)
        counters = _COUNTERS.get(x.device, schedule.tail_tiles)
    else:
        ws = counters = out  # never touched: SPLITS is 1
    pdl = triton_pdl.enabled(x.device)
    _decode_gemm_kernel[(schedule.grid,)](
        x_desc, w_desc, bias if bias is not None else out, out, ws, counters,
        m, n, k, x.stride(0), out.stride(0), schedule.dp_tiles,
        SPLITS=schedule.splits if split else 1, GATE_UP=gate_up, HAS_BIAS=bias is not None, X_TMA=config.x_tma,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, NUM_STAGES=config.num_stages,
        PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages, **triton_pdl.launch_options(pdl),
    )
    return out


def pick(m: int, n: int, k: int, gate_up: bool, num_sms: int, max_shared: int) -> tuple[DecodeGemmConfig, Plan] | None:
    """The tiling and plan the engine launches an m-row matmul of n output columns with, or None where cuBLAS
    stays (a plain matmul that fills one wave only partly, e.g. q/k/v's 4608 columns: 144 tiles of 32 for 132
    SMs, 72 of 64; or a tiling past this GPU's shared memory)."""
    if gate_up:
        config = GATE_UP_CONFIG
    elif MIN_WAVE_FILL * num_sms <= triton.cdiv(n, ONE_WAVE_CONFIG.block_n) <= num_sms:
        config = ONE_WAVE_CONFIG
    elif triton.cdiv(n, MANY_WAVES_CONFIG.block_n) >= MANY_WAVES * num_sms * max(
            1, programs_per_sm(MANY_WAVES_CONFIG, False, max_shared)):
        config = MANY_WAVES_CONFIG
    else:
        return None
    if config.x_tma != X_TMA:
        config = DecodeGemmConfig(**(vars(config) | {"x_tma": X_TMA}))
    if programs_per_sm(config, gate_up, max_shared) < 1:
        return None
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    return config, Plan(tiles, tiles, 1)
