"""The whole MLP of a decode step in one persistent launch: out[M, H] = (silu(x Wg^T) * (x Wu^T)) Wd^T for M <= 64
rows (an experiment: `benchmarks/fused_mlp_probe.py` times it against the engine's two launches).

At 33-64 rows the engine runs the MLP as two launches: the TMA gate/up matmul with SiLU-and-mul
(`triton_gate_up.py`) and cuBLAS's down projection. Both stream weights from HBM, and each loses a few
microseconds at its start and end (docs/perf_notes.md, entry 33): the launch's first loads, the last programs'
half-empty tail, the split-K merge. Here one program per SM works through a list of units:

* gate/up units: a BLOCK_M x BN1 tile of silu(gate) * up (K = H), stored to a [M, I] scratch buffer;
* down units: a BLOCK_M x BN2 tile of the output over one of SPLIT2 ranges of the intermediate (K = I),
  whose float32 partial the last of the tile's SPLIT2 programs sums in split order (deterministic).

A down unit of range s needs only the gate/up tiles of range s: each finished gate/up tile adds one to its
range's counter (release, after a block barrier) and a down unit spins on its range's counter (acquire)
before its first load of the intermediate. There is no grid-wide barrier, so a program that ends its gate/up
tiles early streams down weights while others finish theirs.

Units are numbered gate/up first, then down (range-major), and program p takes units p, p + G, p + 2 G, ...
(G programs): every unit a down unit waits for has a smaller number, held by a program that never waits
before it. With all G programs resident at once (G <= the SMs, one program per SM by its shared memory) that
cannot deadlock; the launcher sizes G so. The interpreter runs programs one after another: the CPU tests
launch one program, which then does every unit in order.

The counters live in a zeroed int32 buffer; the last program to finish resets them, so the buffer is zero
again between launches (one buffer per device, launches do not overlap: kvserve computes on one stream).
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels import triton_pdl
from kvserve.kernels.split_counters import SplitCounters
from kvserve.kernels.triton_elementwise import silu_mul
from kvserve.kernels.triton_pdl import pdl_wait_then_release


@dataclass(frozen=True)
class FusedMlpConfig:
    block_n1: int = 64  # gate/up tile columns
    block_k1: int = 128
    stages1: int = 4
    block_n2: int = 64  # down tile columns
    block_k2: int = 128
    stages2: int = 4
    split2: int = 3  # ranges of the intermediate per down tile
    num_warps: int = 4
    flat: bool = False  # one pipelined K loop over all of a program's gate/up units (_fused_mlp_flat_kernel)
    flat_down: bool = True  # with flat: one for its down units too (else one down unit at a time)


BLOCK_M = 64
_counters = SplitCounters("fused MLP counters")


@triton.jit
def _split_begin(s, num_chunks, SPLIT: tl.constexpr):
    return s * num_chunks // SPLIT


@triton.jit
def _split_of_chunk(c, num_chunks, SPLIT: tl.constexpr):
    s = 0
    for j in tl.static_range(1, SPLIT):
        s += (j * num_chunks // SPLIT <= c).to(tl.int32)
    return s


@triton.jit
def _block_barrier(ASM: tl.constexpr):
    """bar.sync for the whole program. `tl.debug_barrier()` emits the same, but Triton's software pipeliner
    does not pipeline a loop that holds one (the flat kernel's loops then ran unpipelined, 3x slower on the
    H200), so compiled kernels issue it as inline assembly (a scalar operand: every thread runs it once). The
    interpreter, which has no inline assembly and runs programs one after another, takes debug_barrier."""
    if ASM:
        tl.inline_asm_elementwise("bar.sync 0;\n\tmov.u32 $0, 0;", "=r,r", [tl.program_id(0)], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        tl.debug_barrier()


@triton.jit
def _store_act(acc_g, acc_u, off_n, act_ptr, range_ctr, rows64, row_ok, INTER, num_chunks2,
               BN1: tl.constexpr, BK2: tl.constexpr, SPLIT2: tl.constexpr, ASM: tl.constexpr):
    """A finished gate/up tile: silu(gate) * up into the intermediate, then one more tile of its range done."""
    dtype = act_ptr.dtype.element_ty
    # Round gate and up to the activation dtype first, as the separate matmul would store them.
    act = silu_mul(acc_g.to(dtype).to(tl.float32), acc_u.to(dtype).to(tl.float32), dtype)
    cols = off_n + tl.arange(0, BN1)
    tl.store(act_ptr + rows64[:, None] * INTER + cols[None, :], act, mask=row_ok[:, None])
    _block_barrier(ASM)
    tl.atomic_add(range_ctr + _split_of_chunk(off_n // BK2, num_chunks2, SPLIT2), 1, sem="release")


@triton.jit
def _wait_range(range_ctr, s, num_chunks2, BN1: tl.constexpr, BK2: tl.constexpr, SPLIT2: tl.constexpr):
    """Spin until every gate/up tile of range s is stored."""
    need = (_split_begin(s + 1, num_chunks2, SPLIT2) - _split_begin(s, num_chunks2, SPLIT2)) * BK2 // BN1
    seen = tl.atomic_add(range_ctr + s, 0, sem="acquire")
    while seen < need:
        seen = tl.atomic_add(range_ctr + s, 0, sem="acquire")


@triton.jit
def _store_down(acc, s, n_tile, out_ptr, part_ptr, tile_ctr, rows64, row_ok, H, mn,
                BN2: tl.constexpr, SPLIT2: tl.constexpr, ASM: tl.constexpr):
    """A finished down partial (range s of output tile n_tile): stored, or, by the tile's last range to finish,
    summed with the others in range order and rounded into the output."""
    dtype = out_ptr.dtype.element_ty
    cols = n_tile * BN2 + tl.arange(0, BN2)
    tile = rows64[:, None] * H + cols[None, :]
    if SPLIT2 == 1:
        tl.store(out_ptr + tile, acc.to(dtype), mask=row_ok[:, None])
    else:
        tl.store(part_ptr + s.to(tl.int64) * mn + tile, acc, mask=row_ok[:, None])
        _block_barrier(ASM)
        finished = tl.atomic_add(tile_ctr + n_tile, 1, sem="acq_rel")
        if finished == SPLIT2 - 1:
            total = tl.load(part_ptr + tile, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
            for j in tl.static_range(1, SPLIT2):
                total += tl.load(part_ptr + j * mn + tile, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + tile, total.to(dtype), mask=row_ok[:, None])
            tl.atomic_xchg(tile_ctr + n_tile, 0)


@triton.jit
def _down_unit(down, act_ptr, wd_desc, part_ptr, out_ptr, range_ctr, tile_ctr, rows64, row_ok, H, INTER, mn,
               num_tiles2, num_chunks2, BLOCK_M: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr,
               BK2: tl.constexpr, STAGES2: tl.constexpr, SPLIT2: tl.constexpr, ASM: tl.constexpr):
    """Down unit `down` (range-major): wait for its range, then its own pipelined K loop and epilogue."""
    s = down // num_tiles2
    n_tile = down % num_tiles2
    c0 = _split_begin(s, num_chunks2, SPLIT2)
    c1 = _split_begin(s + 1, num_chunks2, SPLIT2)
    _wait_range(range_ctr, s, num_chunks2, BN1, BK2, SPLIT2)
    acc = tl.zeros((BLOCK_M, BN2), dtype=tl.float32)
    offs_k = tl.arange(0, BK2)
    a_ptrs = act_ptr + rows64[:, None] * INTER + c0 * BK2 + offs_k[None, :]
    for c in tl.range(c0, c1, num_stages=STAGES2):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        w = wd_desc.load([n_tile * BN2, c * BK2])
        acc = tl.dot(a, w.T, acc)
        a_ptrs += BK2
    _store_down(acc, s, n_tile, out_ptr, part_ptr, tile_ctr, rows64, row_ok, H, mn, BN2, SPLIT2, ASM)


@triton.jit
def _finish(sync_ptr, done_ctr, SPLIT2: tl.constexpr):
    """The last program out resets the range counters (every program has passed its waits by then)."""
    tl.debug_barrier()
    left = tl.atomic_add(done_ctr, 1, sem="acq_rel")
    if left == tl.num_programs(0) - 1:
        for j in tl.static_range(0, SPLIT2):
            tl.atomic_xchg(sync_ptr + j, 0)
        tl.atomic_xchg(done_ctr, 0)


@triton.jit(do_not_specialize=["M"])
def _fused_mlp_kernel(
    x_desc, wgu_desc, wd_desc, act_ptr, part_ptr, out_ptr, sync_ptr,
    M, H, INTER,
    BLOCK_M: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr, STAGES1: tl.constexpr,
    BN2: tl.constexpr, BK2: tl.constexpr, STAGES2: tl.constexpr, SPLIT2: tl.constexpr,
    PDL: tl.constexpr, ASM: tl.constexpr,
):
    """One unit at a time: each unit's K loop is pipelined on its own."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    num_tiles1 = INTER // BN1
    num_tiles2 = H // BN2
    num_chunks2 = INTER // BK2
    num_units = num_tiles1 + num_tiles2 * SPLIT2
    # sync_ptr: [SPLIT2] finished gate/up tiles per range, [num_tiles2] finished ranges per down tile, one
    # count of programs done.
    range_ctr = sync_ptr
    tile_ctr = sync_ptr + SPLIT2
    mn = M.to(tl.int64) * H
    pdl_wait_then_release(PDL)
    for unit in range(pid, num_units, num_programs):
        if unit < num_tiles1:
            off_n = unit * BN1
            acc_g = tl.zeros((BLOCK_M, BN1), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BN1), dtype=tl.float32)
            for k in tl.range(0, H // BK1, num_stages=STAGES1):
                a = x_desc.load([0, k * BK1])
                bg = wgu_desc.load([off_n, k * BK1])
                bu = wgu_desc.load([INTER + off_n, k * BK1])
                acc_g = tl.dot(a, bg.T, acc_g)
                acc_u = tl.dot(a, bu.T, acc_u)
            _store_act(acc_g, acc_u, off_n, act_ptr, range_ctr, rows64, row_ok, INTER, num_chunks2, BN1, BK2, SPLIT2,
                       ASM)
        else:
            _down_unit(unit - num_tiles1, act_ptr, wd_desc, part_ptr, out_ptr, range_ctr, tile_ctr, rows64, row_ok,
                       H, INTER, mn, num_tiles2, num_chunks2, BLOCK_M, BN1, BN2, BK2, STAGES2, SPLIT2, ASM)
    _finish(sync_ptr, sync_ptr + SPLIT2 + num_tiles2, SPLIT2)


@triton.jit(do_not_specialize=["M"])
def _fused_mlp_flat_kernel(
    x_desc, wgu_desc, wd_desc, act_ptr, part_ptr, out_ptr, sync_ptr,
    M, H, INTER,
    BLOCK_M: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr, STAGES1: tl.constexpr,
    BN2: tl.constexpr, BK2: tl.constexpr, STAGES2: tl.constexpr, SPLIT2: tl.constexpr,
    PDL: tl.constexpr, ASM: tl.constexpr, FLAT2: tl.constexpr,
):
    """The same units, with the K loops of all of a program's gate/up units flattened into one pipelined loop
    (the loads of a unit's first K steps are issued while the unit before it finishes), and with FLAT2 those of
    its down units into another, before which the program waits once for every range its down units read
    (FLAT2 needs ranges of equal length: SPLIT2 divides I // BK2). Without FLAT2 the down units run one at a
    time as in `_fused_mlp_kernel`, each waiting for its own range."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    num_tiles1 = INTER // BN1
    num_tiles2 = H // BN2
    num_chunks2 = INTER // BK2
    num_units = num_tiles1 + num_tiles2 * SPLIT2
    range_ctr = sync_ptr
    tile_ctr = sync_ptr + SPLIT2
    mn = M.to(tl.int64) * H
    k_steps1 = H // BK1
    k_steps2 = num_chunks2 // SPLIT2
    mine1 = tl.cdiv(tl.maximum(num_tiles1 - pid, 0), num_programs)  # this program's gate/up units
    mine = tl.cdiv(tl.maximum(num_units - pid, 0), num_programs)  # all its units
    pdl_wait_then_release(PDL)
    acc_g = tl.zeros((BLOCK_M, BN1), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BN1), dtype=tl.float32)
    for step in tl.range(0, mine1 * k_steps1, num_stages=STAGES1):
        j = step // k_steps1
        k = step % k_steps1
        off_n = (pid + j * num_programs) * BN1
        a = x_desc.load([0, k * BK1])
        bg = wgu_desc.load([off_n, k * BK1])
        bu = wgu_desc.load([INTER + off_n, k * BK1])
        acc_g = tl.dot(a, bg.T, acc_g)
        acc_u = tl.dot(a, bu.T, acc_u)
        if k == k_steps1 - 1:
            _store_act(acc_g, acc_u, off_n, act_ptr, range_ctr, rows64, row_ok, INTER, num_chunks2, BN1, BK2, SPLIT2,
                       ASM)
            acc_g = tl.zeros((BLOCK_M, BN1), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BN1), dtype=tl.float32)
    if FLAT2:
        for j in range(mine1, mine):
            _wait_range(range_ctr, (pid + j * num_programs - num_tiles1) // num_tiles2, num_chunks2, BN1, BK2,
                        SPLIT2)
        acc = tl.zeros((BLOCK_M, BN2), dtype=tl.float32)
        offs_k = tl.arange(0, BK2)
        for step in tl.range(0, (mine - mine1) * k_steps2, num_stages=STAGES2):
            down = pid + (mine1 + step // k_steps2) * num_programs - num_tiles1
            s = down // num_tiles2
            n_tile = down % num_tiles2
            c = s * k_steps2 + step % k_steps2
            a = tl.load(act_ptr + rows64[:, None] * INTER + c * BK2 + offs_k[None, :], mask=row_ok[:, None],
                        other=0.0, cache_modifier=".cg")
            w = wd_desc.load([n_tile * BN2, c * BK2])
            acc = tl.dot(a, w.T, acc)
            if step % k_steps2 == k_steps2 - 1:
                _store_down(acc, s, n_tile, out_ptr, part_ptr, tile_ctr, rows64, row_ok, H, mn, BN2, SPLIT2, ASM)
                acc = tl.zeros((BLOCK_M, BN2), dtype=tl.float32)
    else:
        for j in range(mine1, mine):
            _down_unit(pid + j * num_programs - num_tiles1, act_ptr, wd_desc, part_ptr, out_ptr, range_ctr, tile_ctr,
                       rows64, row_ok, H, INTER, mn, num_tiles2, num_chunks2, BLOCK_M, BN1, BN2, BK2, STAGES2, SPLIT2,
                       ASM)
    _finish(sync_ptr, sync_ptr + SPLIT2 + num_tiles2, SPLIT2)


def fits(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, config: FusedMlpConfig) -> bool:
    """The kernel's contract: x [M <= 64, H], w_gate_up [2 I, H], w_down [H, I], one 16-bit dtype, contiguous,
    16-byte aligned; H a multiple of block_k1 and block_n2, I of block_n1 and block_k2, block_k2 of block_n1."""
    if x.dim() != 2 or w_gate_up.dim() != 2 or w_down.dim() != 2:
        return False
    m, h = x.shape
    i = w_down.shape[1]
    return (
        0 < m <= BLOCK_M
        and w_gate_up.shape == (2 * i, h)
        and w_down.shape == (h, i)
        and x.dtype == w_gate_up.dtype == w_down.dtype
        and x.dtype in (torch.float16, torch.bfloat16)
        and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (x, w_gate_up, w_down))
        and h % config.block_k1 == 0 and h % config.block_n2 == 0
        and i % config.block_n1 == 0 and i % config.block_k2 == 0 and config.block_k2 % config.block_n1 == 0
        and i // config.block_k2 >= config.split2
        and (not (config.flat and config.flat_down) or i // config.block_k2 % config.split2 == 0)
    )


def num_programs(device: torch.device) -> int:
    """One program per SM: its shared memory keeps it to one, and all must be resident at once."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def compiled_for(device: torch.device) -> bool:
    """Whether launches on `device` run compiled (else under the interpreter, which runs on the CPU and has no
    inline assembly)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def fused_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, config: FusedMlpConfig,
              programs: int | None = None, scratch: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> torch.Tensor:
    """(silu(x @ Wg^T) * (x @ Wu^T)) @ w_down^T for w_gate_up = [Wg; Wu] (see the module docstring). `scratch`:
    the [M, I] intermediate and [split2, M, H] float32 partials, made here when not given."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, h = x.shape
    i = w_down.shape[1]
    if scratch is None:
        scratch = (torch.empty((m, i), dtype=x.dtype, device=x.device),
                   torch.empty((config.split2, m, h), dtype=torch.float32, device=x.device))
    act, partials = scratch
    out = torch.empty((m, h), dtype=x.dtype, device=x.device)
    num_tiles2 = h // config.block_n2
    sync = _counters.get(x.device, config.split2 + num_tiles2 + 1)
    grid = (programs or num_programs(x.device),)
    use_pdl = triton_pdl.enabled(x.device)
    kernel, extra = (_fused_mlp_flat_kernel, {"FLAT2": config.flat_down}) if config.flat else (_fused_mlp_kernel, {})
    kernel[grid](
        TensorDescriptor.from_tensor(x, [BLOCK_M, config.block_k1]),
        TensorDescriptor.from_tensor(w_gate_up, [config.block_n1, config.block_k1]),
        TensorDescriptor.from_tensor(w_down, [config.block_n2, config.block_k2]),
        act, partials, out, sync, m, h, i,
        BLOCK_M=BLOCK_M, BN1=config.block_n1, BK1=config.block_k1, STAGES1=config.stages1,
        BN2=config.block_n2, BK2=config.block_k2, STAGES2=config.stages2, SPLIT2=config.split2,
        PDL=use_pdl, ASM=compiled_for(x.device), num_warps=config.num_warps, **extra,
        **triton_pdl.launch_options(use_pdl),
    )
    return out
