"""Triton twin of `reference.penalise_rows_`: the sampler's repetition, frequency and presence penalties in
one pass over the penalised rows, in place.

The torch reference gathers the rows' logits and count rows into float32 copies and runs about ten
elementwise operations over them, each a pass over ``[rows, vocab]`` float32 (155 MB at 256 rows of a
152,064-token vocabulary), then scatters the rows back. This kernel reads each logit, its prompt mark and its
output count once and writes the logit once. The arithmetic is the reference's, in the same order and
rounding (IEEE division, no fused multiply-add), so the results agree to the bit.
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001, ANN201

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _penalise_rows_kernel(
    logits_ptr,
    logits_stride,
    rows_ptr,
    slots_ptr,
    seen_ptr,
    seen_stride,
    counts_ptr,
    counts_stride,
    repetition_ptr,
    frequency_ptr,
    presence_ptr,
    vocab_size,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab_size
    row = tl.load(rows_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    repetition = tl.load(repetition_ptr + i)
    frequency = tl.load(frequency_ptr + i)
    presence = tl.load(presence_ptr + i)
    x = tl.load(logits_ptr + row * logits_stride + cols, mask=mask, other=0.0)
    in_prompt = tl.load(seen_ptr + slot * seen_stride + cols, mask=mask, other=0) != 0
    count = tl.load(counts_ptr + slot * counts_stride + cols, mask=mask, other=0.0)
    in_output = count > 0
    penalised = tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition)
    x = tl.where(in_prompt | in_output, penalised, x)
    x = x - frequency * count
    x = x - presence * in_output.to(tl.float32)
    tl.store(logits_ptr + row * logits_stride + cols, x, mask=mask)


def penalise_rows_(
    logits: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor,
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> None:
    """See `reference.penalise_rows_` (same contract)."""
    num_rows, vocab_size = rows.shape[0], logits.shape[1]
    if num_rows == 0:
        return
    if logits.dtype != torch.float32 or counts.dtype != torch.float32 or seen.dtype != torch.bool:
        raise ValueError("penalise_rows_ takes float32 logits and counts and a bool prompt mask")
    if logits.stride(1) != 1 or seen.stride(1) != 1 or counts.stride(1) != 1:
        raise ValueError("penalise_rows_ needs unit-stride rows")
    if seen.shape[1] != vocab_size or counts.shape[1] != vocab_size:
        raise ValueError(f"count rows must have the logits' {vocab_size} columns")
    grid = (num_rows, triton.cdiv(vocab_size, _BLOCK))
    _penalise_rows_kernel[grid](
        logits,
        logits.stride(0),
        rows,
        slots,
        seen.view(torch.uint8),
        seen.stride(0),
        counts,
        counts.stride(0),
        repetition_penalties,
        frequency_penalties,
        presence_penalties,
        vocab_size,
        BLOCK=_BLOCK,
        num_warps=8,
        enable_fp_fusion=False,  # the products are rounded before the subtractions, as the reference's are
    )
