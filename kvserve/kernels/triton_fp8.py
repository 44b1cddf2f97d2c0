"""Per-row fp8 quantization in one launch: the Triton twin of `reference.quantize_rows_fp8`.

Online fp8 weights (`--quantization fp8`) quantize each matmul's activations per token before
`torch._scaled_mm` (`ops.fp8_linear`), and each weight per output channel once at load. One program per row
finds the row's largest magnitude and writes the scaled, rounded values and the scale: a row of up to
`ONE_TILE_MAX_COLS` columns is held in registers and read once (decode's rows are few: a second pass over
memory would be a second round of load latency per layer); longer rows are read twice in tiles.

Bits: the scale is max|x| / 448 with IEEE division (`div_rn`; Triton's `/` may be approximate), and each value
goes through `triton_elementwise.quantize_fp8` (x / scale in fp32, saturated, rounded to nearest even): on a
GPU the same bytes as the reference. The interpreter's fp32 -> fp8 rounding is not a GPU's (it drops a
round-up's carry into the exponent), so CPU tests feed values on the fp8 grid. A row holding a NaN gets a
NaN scale and NaN values on both paths (a NaN's sign and payload aside).
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001, ANN201

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels import triton_pdl
from kvserve.kernels.reference import FP8_E4M3_MAX
from kvserve.kernels.triton_elementwise import quantize_fp8
from kvserve.kernels.triton_pdl import pdl_wait_then_release

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Rows up to this many columns are quantized from registers in one read; longer ones in two passes of
# _LOOP_TILE (the second mostly from L2). Measured on an H100 (benchmarks/fp8_quant_rows_probe.py): the down
# projection's 18,944-column input at 4,096 rows took 281 us as one 32,768-wide tile (0.83 TB/s) and 102 us
# in 4,096-wide passes (2.28 TB/s); 3,584 columns took 25.5 us either way.
ONE_TILE_MAX_COLS = 8192
_LOOP_TILE = 4096


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    stride_x,
    stride_out,
    num_cols,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_TILE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    cols = tl.arange(0, BLOCK)
    if ONE_TILE:
        mask = cols < num_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        num_nan = tl.sum((x != x).to(tl.int32), axis=0)
    else:
        amax = tl.full([], 0.0, tl.float32)
        num_nan = tl.full([], 0, tl.int32)
        for start in range(0, num_cols, BLOCK):
            mask = start + cols < num_cols
            part = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(part), axis=0))
            num_nan += tl.sum((part != part).to(tl.int32), axis=0)
    # NOTE: tl.max may skip a NaN where torch's amax returns it: a row holding one gets a NaN scale (every value
    # NaN), as in the reference.
    amax = tl.where(num_nan > 0, float("nan"), amax)
    scale = tl.math.div_rn(amax, FP8_MAX)
    scale = tl.where(scale == 0.0, 1.0, scale)  # a zero row stays zeros (reference.quantize_rows_fp8)
    tl.store(scale_ptr + row, scale)
    if ONE_TILE:
        tl.store(out_row + cols, quantize_fp8(x, scale, FP8_MAX, out_ptr.dtype.element_ty), mask=mask)
    else:
        for start in range(0, num_cols, BLOCK):
            mask = start + cols < num_cols
            part = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + start + cols, quantize_fp8(part, scale, FP8_MAX, out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    """~8-64 values a thread: loads stay 16 bytes wide and a one-tile row fits the registers."""
    if block <= 1024:
        return 4
    if block <= 4096:
        return 8
    return 16


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.quantize_rows_fp8`'s contract: x [M, K] float16/bfloat16/float32 with stride(1) == 1 ->
    (x8 float8_e4m3fn [M, K] contiguous, scale float32 [M]), both new tensors. One launch of M programs; no
    host sync, so it can be captured in a CUDA graph."""
    assert x.dim() == 2, f"x must be [M, K], got {tuple(x.shape)}"
    assert x.dtype in _FLOAT_DTYPES, f"x must be float16/bfloat16/float32, got {x.dtype}"
    assert x.stride(1) == 1 or x.shape[1] <= 1, f"x's rows must be contiguous, got strides {x.stride()}"
    num_rows, num_cols = x.shape
    out = torch.empty((num_rows, num_cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((num_rows,), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return out, scale
    one_tile = num_cols <= ONE_TILE_MAX_COLS
    block = triton.next_power_of_2(max(num_cols, 16)) if one_tile else _LOOP_TILE
    pdl = triton_pdl.enabled(x.device)
    _quantize_rows_kernel[(num_rows,)](
        x,
        out,
        scale,
        x.stride(0),
        out.stride(0),
        num_cols,
        FP8_MAX=FP8_E4M3_MAX,
        BLOCK=block,
        ONE_TILE=one_tile,
        PDL=pdl,
        num_warps=_num_warps(block),
        **triton_pdl.launch_options(pdl),
    )
    return out, scale
