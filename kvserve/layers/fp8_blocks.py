"""Block-wise fp8 checkpoints' scales while a layer loads (`layers.linear`).

A block-wise checkpoint (`QuantConfig.weight_block` = (bn, bk)) stores each linear weight [N, K] in e4m3 with a
float32 scale per bn x bk block, [ceil(N / bn), ceil(K / bk)] (the last blocks of a row or column partial); the
weight is e4m3 x its block's scale. `Fp8Blocks` holds, per shard of a (merged) layer, the whole checkpoint
tensor's block scales and its weight's shape, in whichever order they arrive; `Linear.finish_loading` then takes
this rank's rows of `row_scales` and dequantizes its rows and columns with `dequantize`, and requantizes them per
output row. The scales of a 128 x 128 block are 1/16384 of its weight's elements: every rank keeps them all.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from kvserve.model.paths import ModelLoadError


@dataclass
class Fp8Blocks:
    """One layer's block scales while it loads: `block` (rows, columns) a scale covers; per shard id, its block
    scales (float32 [ceil(rows / bn), ceil(columns / bk)] of the whole checkpoint tensor) and its weight's
    checkpoint shape (rows, columns)."""

    block: tuple[int, int]
    scales: dict[Hashable, torch.Tensor] = field(default_factory=dict)
    weight_shapes: dict[Hashable, tuple[int, int]] = field(default_factory=dict)

    def add_weight(self, shard_id: Hashable, shape: tuple[int, ...]) -> None:
        """Shard `shard_id`'s checkpoint weight had `shape`; ValueError if its block scales, already in, do not fit."""
        self.weight_shapes[shard_id] = (int(shape[0]), int(shape[1]))
        self._check_shape(shard_id)

    def add_scales(self, shard_id: Hashable, loaded: torch.Tensor, device: torch.device) -> None:
        """Shard `shard_id`'s block scales (any float dtype, kept in float32 on `device`); ValueError for a tensor
        that is not 2-D float, holds a scale that is negative or not finite, or does not fit the shard's weight, if
        already in."""
        if not loaded.is_floating_point():
            raise ValueError(f"a weight scale must be floating point, got {loaded.dtype}")
        bn, bk = self.block
        if loaded.dim() != 2:
            raise ValueError(f"a weight scale of shape {tuple(loaded.shape)}: a block-wise fp8 checkpoint (blocks of "
                             f"{bn} x {bk}) needs one per block, [ceil(rows / {bn}), ceil(columns / {bk})]")
        scales = loaded.to(device=device, dtype=torch.float32, copy=True)
        bad = ~(torch.isfinite(scales) & (scales >= 0))
        if bool(bad.any()):  # (checked as it loads, so that the message names the checkpoint tensor)
            i, j = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"an fp8 block scale is {float(scales[i, j])} (block row {i}, column {j}): scales must "
                             "be finite and not negative")
        self.scales[shard_id] = scales
        self._check_shape(shard_id)

    def _check_shape(self, shard_id: Hashable) -> None:
        scales, shape = self.scales.get(shard_id), self.weight_shapes.get(shard_id)
        if scales is None or shape is None:
            return
        (bn, bk), (rows, columns) = self.block, shape
        want = (math.ceil(rows / bn), math.ceil(columns / bk))
        if tuple(scales.shape) != want:
            raise ValueError(f"block-wise fp8 scales of shape {tuple(scales.shape)} do not match a {rows} x {columns} "
                             f"weight in blocks of {bn} x {bk}: {want} expected")

    def row_scales(self, shard_id: Hashable) -> torch.Tensor:
        """Every checkpoint row's scales of shard `shard_id`, float32 [rows, ceil(columns / bk)] (row r: block row
        r // bn). ModelLoadError for a shard without its weight or scales (`add_scales` took only finite, non-negative
        ones)."""
        scales, shape = self.scales.get(shard_id), self.weight_shapes.get(shard_id)
        if scales is None or shape is None:
            layer = "a block-wise fp8 layer" if shard_id is None else f"shard {shard_id!r} of a block-wise fp8 layer"
            raise ModelLoadError(f"{layer} has no {'block scales' if scales is None else 'fp8 weight'}")
        return scales.repeat_interleave(self.block[0], dim=0)[: shape[0]]


def dequantize(w8: torch.Tensor, row_scales: torch.Tensor, first_column: int, block_columns: int,
               dtype: torch.dtype) -> torch.Tensor:
    """w8 e4m3 [n, k] times its scales, in float32, cast to `dtype` (what a dense checkpoint of those values
    holds): row_scales float32 [n, K-blocks] (`Fp8Blocks.row_scales`' rows); w8's columns are the checkpoint
    weight's columns from `first_column` on (a row-parallel rank's columns start anywhere in a block of
    `block_columns`). One float32 copy of w8 is made and scaled in place, a K-block at a time (the whole blocks
    in one broadcast multiply): no other [n, k] temporary but the `dtype` result."""
    x = w8.float()
    n, k = x.shape
    bk = block_columns
    column = 0
    while column < k:
        block = (first_column + column) // bk
        if (first_column + column) % bk == 0 and k - column >= bk:  # the whole blocks from here, at once
            count = (k - column) // bk
            x.narrow(1, column, count * bk).unflatten(1, (count, bk)).mul_(
                row_scales.narrow(1, block, count).unsqueeze(2))
            column += count * bk
        else:  # a partial block: the first of a row-parallel rank's columns, or the weight's last
            width = min(bk - (first_column + column) % bk, k - column)
            x.narrow(1, column, width).mul_(row_scales.narrow(1, block, 1))
            column += width
    return x.to(dtype)
