"""Linear layers whose parameters load themselves.

Every parameter carries ``weight_loader(param, loaded, shard_id)`` and ``shard_ids`` (the shards it must
receive before it is complete). Fused layers stack several checkpoint tensors along the output dim:
`QKVLinear` holds [q | k | v] (shard ids "q", "k", "v"), `MergedLinear` holds e.g. [gate | up] (shard ids
0, 1, ...).

Tensor parallelism (`kvserve.distributed`): layers are built with one rank's sizes, and their loaders take
that rank's part of each full checkpoint tensor. `QKVLinear` and `MergedLinear` are column-parallel (each
rank holds its heads' / its share's rows of every shard); a `Linear` built with `row_parallel=True` holds
its share of the input columns and sums the ranks' outputs (its bias added once, by rank 0).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import nn

from kvserve import distributed
from kvserve.kernels import ops


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
    """Copy a whole, unsharded tensor into `param` (casting dtype and device); ValueError on mismatch."""
    if shard_id is not None:
        raise ValueError(f"parameter has no shards, got shard {shard_id!r}")
    _check_shape(tuple(loaded.shape), tuple(param.shape))
    param.data.copy_(loaded)


def _check_shape(got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ValueError(f"checkpoint shape {got} does not match parameter shape {want}")


def _new_param(shape: tuple[int, ...], dtype: torch.dtype, shard_ids: tuple[Hashable, ...]) -> nn.Parameter:
    # torch.empty: the loader overwrites every element; random init would only cost start-up time.
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.shard_ids = shard_ids  # type: ignore[attr-defined]
    return param


class Linear(nn.Module):
    """y = x @ weight.T + bias. weight: [output_size, input_size]; x: [..., input_size].

    row_parallel (with more than one rank): input_size is this rank's share of the input columns; the
    checkpoint's weight holds all of them, and the output is summed over the ranks."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, row_parallel: bool = False
    ) -> None:
        super().__init__()
        group = distributed.tp_group()
        self.tp_rank, self.tp_size = group.rank, group.size
        self.row_parallel = row_parallel and self.tp_size > 1
        self.input_size = input_size
        self.output_size = output_size
        self.weight = self._make_param((output_size, input_size), dtype)
        self.bias = self._make_param((output_size,), dtype) if bias else None

    def _make_param(self, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
        param = _new_param(shape, dtype, self.shard_ids())
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        return param

    def shard_ids(self) -> tuple[Hashable, ...]:
        return (None,)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        if self.row_parallel and loaded.dim() == 2:
            width = param.shape[1]
            _check_shape(tuple(loaded.shape), (param.shape[0], width * self.tp_size))
            loaded = loaded.narrow(1, self.tp_rank * width, width)
        default_weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_parallel:
            return distributed.all_reduce(ops.linear(x, self.weight, self.bias if self.tp_rank == 0 else None))
        return ops.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Projections of one input stacked along the output dim: rows [sum(sizes[:i]), sum(sizes[:i+1]))
    hold shard i (e.g. gate_proj = 0, up_proj = 1)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool, dtype: torch.dtype) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias, dtype)

    def shard_ids(self) -> tuple[Hashable, ...]:
        return tuple(range(len(self.output_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard id must be an index below {len(self.output_sizes)}, got {shard_id!r}")
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        _load_rows(param, _rank_rows(loaded, self.tp_rank * size, size, self.tp_size, size * self.tp_size),
                   offset, size)


class QKVLinear(Linear):
    """The q, k and v projections of attention as one matmul; output [q | k | v] with
    q: num_heads * head_dim columns, k and v: num_kv_heads * head_dim each (this rank's heads: with more
    than one rank, rank r holds query heads [r * num_heads, (r + 1) * num_heads) and the KV heads
    `distributed.first_kv_head` starts)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, dtype)

    def shard_ids(self) -> tuple[Hashable, ...]:
        return ("q", "k", "v")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        offsets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                   "v": (self.q_size + self.kv_size, self.kv_size)}
        if shard_id not in offsets:
            raise ValueError(f"shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        offset, size = offsets[shard_id]
        if shard_id == "q":
            start, total = self.tp_rank * size, size * self.tp_size
        else:  # this rank's KV heads, out of the checkpoint's (replicated when fewer than the ranks)
            first = distributed.first_kv_head(loaded.shape[0] // self.head_dim, self.tp_rank, self.tp_size)
            start, total = first * self.head_dim, loaded.shape[0]
        _load_rows(param, _rank_rows(loaded, start, size, self.tp_size, total), offset, size)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[num_tokens, q_size + 2 * kv_size] -> views (q, k, v)."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


def _rank_rows(loaded: torch.Tensor, start: int, size: int, tp_size: int, total: int) -> torch.Tensor:
    """Rows [start, start + size) of a full checkpoint tensor of `total` rows (all of it with one rank)."""
    if tp_size == 1:
        return loaded
    if loaded.shape[0] != total or start + size > total:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not split into this rank's rows "
                         f"[{start}, {start + size}) of {total}")
    return loaded.narrow(0, start, size)


def _load_rows(param: nn.Parameter, loaded: torch.Tensor, offset: int, size: int) -> None:
    _check_shape(tuple(loaded.shape), (size, *param.shape[1:]))
    param.data.narrow(0, offset, size).copy_(loaded)
