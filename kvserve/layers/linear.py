"""Linear layers whose parameters load themselves.

Every parameter carries ``weight_loader(param, loaded, shard_id)`` and ``shard_ids`` (the shards it must
receive before it is complete). Fused layers stack several checkpoint tensors along the output dim:
`QKVLinear` holds [q | k | v] (shard ids "q", "k", "v"), `MergedLinear` holds e.g. [gate | up] (shard ids
0, 1, ...).

Tensor parallelism (`kvserve.distributed`): layers are built with one rank's sizes, and their loaders take
that rank's part of each full checkpoint tensor. `QKVLinear` and `MergedLinear` are column-parallel (each
rank holds its heads' / its share's rows of every shard); a `Linear` built with `row_parallel=True` holds
its share of the input columns and sums the ranks' outputs (its bias added once, by rank 0).

Quantized checkpoints (`layers.quantization`, AWQ / GPTQ): a layer built with a `QuantConfig` has the
checkpoint's parameters (qweight, qzeros, scales, g_idx) instead of `weight`, loaded by the same shard
placement; `finish_loading` then packs them for the GPU's quantized matmul, or, on other devices, replaces
them with the dense `weight` they stand for.

Online fp8 weights (`--quantization fp8`, for unquantized checkpoints): once the whole model is loaded, every
dense layer's `quantize_fp8` replaces its `weight` with `weight_fp8` (float8_e4m3fn, same shape) and
`weight_scale` (float32, one per output row): each rank quantizes the rows and input columns it holds, after
all of its shards are in, so merged q/k/v and gate/up layers and tensor-parallel shards need nothing more (a
row-parallel rank's scales are its own columns'; its partial sums are added after the matmul as before).

fp8 checkpoints (a `QuantConfig` of method "fp8"): the layer is built with `weight_fp8` and `weight_scale` in
place of `weight`, and loads the checkpoint's float8_e4m3fn `weight` rows and its `weight_scale` (a scalar per
tensor, repeated over the tensor's rows, or one per output row) by the same shard placement; from then on it
is the layer `quantize_fp8` leaves. A row-parallel rank keeps every output row's scale (it spans all columns).

Block-wise fp8 checkpoints (`QuantConfig.weight_block` = (bn, bk): a float32 scale per bn x bk block of each
checkpoint weight, [ceil(N / bn), ceil(K / bk)]) load into the same `weight_fp8` / `weight_scale` layer: the
weight's rows are placed as above, each shard's block scales are kept whole (`fp8_blocks.Fp8Blocks`, a float
per 128 x 128 block) until `finish_loading`, which dequantizes this rank's rows and columns of each shard (e4m3 times
its block's scale in float32, cast to the model's dtype: what a dense checkpoint holding those values in float32
or in that dtype loads as) and requantizes them per output row with `ops.quantize_rows_fp8`, the function
`quantize_fp8` uses, a chunk of about `_REQUANTIZE_ELEMENTS` values (whole rows) at a time. The fp8 matmuls
are unchanged and every rank holds exactly what `quantize_fp8` makes of the dense layer's share (a shard or
rank boundary may fall inside a block: scales are looked up per row and per column); outputs differ slightly
from an engine that applies the block scales inside its matmul (the load logs it).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvserve import distributed
from kvserve.kernels import ops
from kvserve.layers.fp8_blocks import Fp8Blocks, dequantize
from kvserve.layers.quantization import PackedWeight, QuantConfig, QuantizedWeights
from kvserve.model.paths import ModelLoadError

logger = logging.getLogger(__name__)

# Elements a block-wise fp8 layer dequantizes at a time in `finish_loading` (whole rows, at least one): its float32
# chunk is 64 MiB (plus the chunk in the model's dtype and `ops.quantize_rows_fp8`'s temporaries of its size).
_REQUANTIZE_ELEMENTS = 1 << 24


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
    checkpoint's weight holds all of them, and the output is summed over the ranks, unless `reduce_output` is
    False: then the caller sums this rank's partial output (with others of its own) over the ranks, once."""

    weight: nn.Parameter | None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        row_parallel: bool = False,
        quant: QuantConfig | None = None,
        reduce_output: bool = True,
    ) -> None:
        super().__init__()
        group = distributed.tp_group()
        self.tp_rank, self.tp_size = group.rank, group.size
        self.row_parallel = row_parallel and self.tp_size > 1
        self.reduce_output = reduce_output
        self.input_size = input_size
        self.output_size = output_size
        self.dtype = dtype
        self.quantized: QuantizedWeights | None = None
        self.packed: PackedWeight | None = None  # the GPU layout of a quantized layer, after loading
        # --quantization fp8, after loading (`quantize_fp8`): float8_e4m3fn [N, K] and float32 [N]; weight is None.
        self.weight_fp8: nn.Parameter | None = None
        self.weight_scale: nn.Parameter | None = None
        # A block-wise fp8 checkpoint's block scales while it loads (None otherwise, and after `finish_loading`).
        self.fp8_blocks: Fp8Blocks | None = None
        if quant is None:
            self.weight = self._make_param((output_size, input_size), dtype)
        elif quant.method == "fp8":
            self.weight = None
            self.weight_fp8 = _new_param((output_size, input_size), torch.float8_e4m3fn, self.shard_ids())
            self.weight_fp8.weight_loader = self._fp8_weight_loader  # type: ignore[attr-defined]
            self.weight_fp8.dummy_fill = _dummy_fp8_weight  # type: ignore[attr-defined]
            self.weight_scale = _new_param((output_size,), torch.float32, self.shard_ids())
            self.weight_scale.weight_loader = self._fp8_scale_loader  # type: ignore[attr-defined]
            self.weight_scale.dummy_fill = _dummy_fp8_scale  # type: ignore[attr-defined]
            if quant.weight_block is not None:
                # weight_scale is computed by finish_loading; the checkpoint's block scales load into fp8_blocks.
                self.fp8_blocks = Fp8Blocks(quant.weight_block)
                self.weight_scale.weight_loader = self._fp8_block_scale_loader  # type: ignore[attr-defined]
                self.weight_scale.dummy_fill = self._dummy_fp8_block_scale  # type: ignore[attr-defined]
        else:
            self.weight = None
            row_share = (self.tp_rank, self.tp_size) if self.row_parallel else None
            try:
                self.quantized = QuantizedWeights(quant, self, input_size, output_size, self.shard_ids(),
                                                  self.place, row_share)
            except ValueError as exc:
                raise ModelLoadError(str(exc)) from None
        self.bias = self._make_param((output_size,), dtype) if bias else None

    def _make_param(self, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
        param = _new_param(shape, dtype, self.shard_ids())
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        return param

    def shard_ids(self) -> tuple[Hashable, ...]:
        return (None,)

    def place(self, loaded: torch.Tensor, shard_id: Hashable, loaded_rows: int) -> tuple[int, int, int, int]:
        """Where shard `shard_id` of the checkpoint (`loaded_rows` output rows) goes: (start, size, total,
        offset): this rank's rows [start, start + size) of the checkpoint's `total` fill the layer's rows
        [offset, offset + size). ValueError for a shard id the layer does not have."""
        if shard_id is not None:
            raise ValueError(f"parameter has no shards, got shard {shard_id!r}")
        return 0, self.output_size, self.output_size, 0

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        if self.row_parallel and loaded.dim() == 2:
            width = param.shape[1]
            _check_shape(tuple(loaded.shape), (param.shape[0], width * self.tp_size))
            loaded = loaded.narrow(1, self.tp_rank * width, width)
        if self.shard_ids() == (None,):
            default_weight_loader(param, loaded, shard_id)
            return
        start, size, total, offset = self.place(loaded, shard_id, loaded.shape[0])
        _load_rows(param, _rank_rows(loaded, start, size, self.tp_size, total), offset, size)

    def _fp8_weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        """An fp8 checkpoint's weight (float8_e4m3fn [N, K]), placed as a dense weight is."""
        if loaded.dtype != torch.float8_e4m3fn:
            raise ValueError(f"an fp8 checkpoint's weight must be float8_e4m3fn, got {loaded.dtype}")
        self.weight_loader(param, loaded, shard_id)
        if self.fp8_blocks is not None:
            self.fp8_blocks.add_weight(shard_id, tuple(loaded.shape))

    def _fp8_block_scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        """A block-wise fp8 checkpoint's scales (`weight_scale_inv`, or compressed-tensors' `weight_scale`): float
        [ceil(N / bn), ceil(K / bk)] of the whole checkpoint tensor, kept (every rank's, in float32) until
        `finish_loading`; checked against the weight's shape once both are in."""
        assert self.fp8_blocks is not None
        self._shard_rows(shard_id)  # ValueError for a shard id this layer does not have
        self.fp8_blocks.add_scales(shard_id, loaded, param.device)

    def _dummy_fp8_block_scale(self, param: nn.Parameter, generator: torch.Generator) -> None:
        """`--load-format dummy`: the dummy fp8 weight with `_dummy_fp8_scale`'s scale per row, nothing to
        requantize."""
        _dummy_fp8_scale(param, generator)
        self.fp8_blocks = None

    def _fp8_scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        """An fp8 checkpoint's weight scale: one for the tensor (repeated over the shard's rows here) or one
        per output row ([N] or [N, 1], placed as the weight's rows)."""
        if not loaded.is_floating_point():
            raise ValueError(f"a weight scale must be floating point, got {loaded.dtype}")
        loaded = loaded.float()
        if loaded.numel() == 1:
            offset, size = self._shard_rows(shard_id)
            param.data.narrow(0, offset, size).fill_(loaded.reshape(()))
            return
        if loaded.dim() == 2 and loaded.shape[1] == 1:
            loaded = loaded.reshape(-1)
        if loaded.dim() != 1:
            raise ValueError(f"a weight scale of shape {tuple(loaded.shape)}: one per tensor or per output row "
                             "is supported (block-wise scales where the quantization_config gives their block size)")
        if self.shard_ids() == (None,):
            default_weight_loader(param, loaded, shard_id)
            return
        start, size, total, offset = self.place(loaded, shard_id, loaded.shape[0])
        _load_rows(param, _rank_rows(loaded, start, size, self.tp_size, total), offset, size)

    def _shard_rows(self, shard_id: Hashable) -> tuple[int, int]:
        """(first row, rows) of shard `shard_id` in this layer (`place`'s offset and size, which do not depend on
        the checkpoint tensor's rows)."""
        _start, size, _total, offset = self.place(torch.empty(0), shard_id, self.output_size * self.tp_size)
        return offset, size

    def _describe_row(self, row: int) -> str:
        """Output row `row` of this layer as its checkpoint shard's row ("shard 'v', row 3")."""
        for shard in self.shard_ids():
            offset, size = self._shard_rows(shard)
            if offset <= row < offset + size:
                return f"output row {row}" if shard is None else f"shard {shard!r}, its row {row - offset} here"
        return f"output row {row}"

    def finish_loading(self) -> None:
        """After every checkpoint tensor is in: a quantized layer packs its tensors for the GPU's quantized
        matmul (CUDA) or becomes a dense layer of the weight they stand for (other devices); an fp8 one checks
        its scales (a block-wise one first requantizes its weight per output row: `_requantize_blocks`)."""
        if self.fp8_blocks is not None:
            self._requantize_blocks()
        if self.weight_scale is not None and self.weight is None and self.quantized is None:
            scale = self.weight_scale.data
            bad = ~(torch.isfinite(scale) & (scale >= 0))
            if bool(bad.any()):
                row = int(bad.nonzero()[0, 0])
                raise ModelLoadError(f"an fp8 weight scale is {float(scale[row])} ({self._describe_row(row)}): "
                                     "scales must be finite and not negative")
        if self.quantized is None:
            return
        try:
            packed = self.quantized.finish()
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
        self.quantized = None
        if packed.qweight.is_cuda and ops.quantized_kernel_fits(packed):
            self.packed = ops.prepare_quantized(packed, self.dtype)
            return
        if packed.qweight.is_cuda:
            logger.warning("a %d x %d quantized layer's groups of %d rows fit no tile of the quantized matmul: "
                           "its weight is dequantized once and kept dense", packed.input_size, packed.output_size,
                           packed.group_rows)
        self.weight = nn.Parameter(packed.dense(self.dtype), requires_grad=False)

    def _requantize_blocks(self) -> None:
        """A block-wise fp8 layer's weight as `quantize_fp8` makes it of the dense layer: this rank's rows and
        columns of each shard dequantized (e4m3 x its block's scale in float32, cast to the model's dtype) and
        quantized per output row by `ops.quantize_rows_fp8`, into `weight_fp8` / `weight_scale`; the block scales
        are released. ModelLoadError for a shard without its weight or block scales, or a weight value that is
        NaN or dequantizes to one that is not finite."""
        blocks = self.fp8_blocks
        assert blocks is not None and self.weight_fp8 is not None and self.weight_scale is not None
        first_column = self.tp_rank * self.input_size if self.row_parallel else 0
        chunk_rows = max(1, _REQUANTIZE_ELEMENTS // max(1, self.input_size))
        for shard in self.shard_ids():
            every_row = blocks.row_scales(shard)
            start, size, total, offset = self.place(torch.empty(0), shard, every_row.shape[0])
            try:  # this rank's rows, as its weight rows were taken
                row_scales = _rank_rows(every_row, start, size, self.tp_size, total)
            except ValueError as exc:
                raise ModelLoadError(f"shard {shard!r}: {exc}") from None
            for first in range(0, size, chunk_rows):
                count = min(chunk_rows, size - first)
                w8 = self.weight_fp8.data.narrow(0, offset + first, count)
                chunk_scales = row_scales.narrow(0, first, count)
                weight = dequantize(w8, chunk_scales, first_column, blocks.block[1], self.dtype)
                q, row_scale = ops.quantize_rows_fp8(weight)
                # (a row's scale is max|row| / 448: not finite where the row holds a value that is not)
                if not bool(torch.isfinite(row_scale).all()):
                    row = int((~torch.isfinite(row_scale)).nonzero()[0, 0])
                    raise ModelLoadError(self._non_finite_weight(w8[row], weight[row], chunk_scales[row],
                                                                 first_column, blocks.block[1], offset + first + row))
                del weight
                w8.copy_(q)
                self.weight_scale.data.narrow(0, offset + first, count).copy_(row_scale)
        self.fp8_blocks = None

    def _non_finite_weight(self, w8: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, first_column: int,
                           block_columns: int, row: int) -> str:
        """Why output row `row` of a block-wise fp8 layer did not requantize: its fp8 values `w8` hold a NaN, or
        one of them times its block scale (`scales`, the row's) is not finite in float32 or the model's dtype
        (`weight`, the row dequantized)."""
        where = self._describe_row(row)
        if self.tp_size > 1:  # (the row is this rank's: each rank says which it is)
            where += f" on tensor-parallel rank {self.tp_rank} of {self.tp_size}"
        nan = torch.isnan(w8.float()).nonzero()
        if len(nan):
            return (f"the fp8 weight holds a NaN ({where}, checkpoint column {first_column + int(nan[0, 0])}): fp8 "
                    "weights must be finite")
        bad = (~torch.isfinite(weight)).nonzero()
        column = int(bad[0, 0]) if len(bad) else 0
        value = float(w8[column].float())
        scale = float(scales[(first_column + column) // block_columns])
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"the fp8 weight's value {value} times its block scale {scale} is {float(weight[column])} in "
                f"{dtype} ({where}, checkpoint column {first_column + column}): a dequantized weight must be finite")

    def quantize_fp8(self) -> tuple[int, int]:
        """Replace the loaded dense weight [N, K] by its per-output-channel fp8 quantization
        (`ops.quantize_rows_fp8`: scale[n] = max|W[n, :]| / 448, W8 = W / scale saturated and rounded to e4m3),
        kept as parameters `weight_fp8` / `weight_scale`; the high-precision weight is dropped (its memory is
        free once the caller empties the allocator's cache). The bias stays in the model's dtype. Returns
        (bytes of the weight before, bytes of weight_fp8 + weight_scale). ValueError for a layer without a
        dense weight (an AWQ / GPTQ one, or one already quantized)."""
        if self.weight is None:
            raise ValueError("only a dense layer's weight can be quantized to fp8")
        weight = self.weight.data
        before = weight.numel() * weight.element_size()
        w8, scale = ops.quantize_rows_fp8(weight)
        self.weight = None  # drops the parameter: the model holds no other reference to it
        del weight
        self.weight_fp8 = nn.Parameter(w8, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        return before, w8.numel() * w8.element_size() + scale.numel() * scale.element_size()

    def fusable_weight(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """What the fused ops (`ops.linear_rope_cache`, `ops.linear_silu_mul`) take as this layer's weight:
        (weight, None) for a dense layer, (weight_fp8, weight_scale) for an fp8 one (their `w_scale`), None
        for a packed AWQ / GPTQ layer (its own matmul: `forward`)."""
        if self.weight_fp8 is not None:
            assert self.weight_scale is not None
            return self.weight_fp8, self.weight_scale
        return None if self.weight is None else (self.weight, None)

    def applied_bias(self) -> torch.Tensor | None:
        """The bias this rank's matmul adds: none on a row-parallel layer's ranks past 0 (rank 0 adds it once
        to the sum)."""
        return self.bias if self.tp_rank == 0 or not self.row_parallel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.applied_bias()
        if self.packed is not None:
            out = ops.quantized_linear(x, self.packed, bias)
        elif self.weight_fp8 is not None:
            assert self.weight_scale is not None
            out = ops.fp8_linear(x, self.weight_fp8, self.weight_scale, bias)
        else:
            assert self.weight is not None, "a quantized layer is used before finish_loading"
            out = ops.linear(x, self.weight, bias)
        return distributed.all_reduce(out) if self.row_parallel and self.reduce_output else out


class MergedLinear(Linear):
    """Projections of one input stacked along the output dim: rows [sum(sizes[:i]), sum(sizes[:i+1]))
    hold shard i (e.g. gate_proj = 0, up_proj = 1)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool, dtype: torch.dtype,
                 quant: QuantConfig | None = None) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias, dtype, quant=quant)

    def shard_ids(self) -> tuple[Hashable, ...]:
        return tuple(range(len(self.output_sizes)))

    def place(self, loaded: torch.Tensor, shard_id: Hashable, loaded_rows: int) -> tuple[int, int, int, int]:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard id must be an index below {len(self.output_sizes)}, got {shard_id!r}")
        size = self.output_sizes[shard_id]
        return self.tp_rank * size, size, size * self.tp_size, sum(self.output_sizes[:shard_id])


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
        quant: QuantConfig | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, dtype, quant=quant)

    def shard_ids(self) -> tuple[Hashable, ...]:
        return ("q", "k", "v")

    def place(self, loaded: torch.Tensor, shard_id: Hashable, loaded_rows: int) -> tuple[int, int, int, int]:
        offsets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                   "v": (self.q_size + self.kv_size, self.kv_size)}
        if shard_id not in offsets:
            raise ValueError(f"shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        offset, size = offsets[shard_id]
        if shard_id == "q":
            return self.tp_rank * size, size, size * self.tp_size, offset
        # this rank's KV heads, out of the checkpoint's (replicated when fewer than the ranks)
        first = distributed.first_kv_head(loaded_rows // self.head_dim, self.tp_rank, self.tp_size)
        return first * self.head_dim, size, loaded_rows, offset

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[num_tokens, q_size + 2 * kv_size] -> views (q, k, v)."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


@dataclass(frozen=True)
class Fp8Summary:
    """What `quantize_fp8_layers` did: layers quantized, their weights' bytes before and after (fp8 values and
    scales), and, on CUDA, the layers whose shapes `torch._scaled_mm` cannot take (they run the torch reference
    there)."""

    num_layers: int
    bytes_before: int
    bytes_after: int
    unfit_layers: tuple[str, ...] = ()
    from_checkpoint: bool = False  # `fp8_checkpoint_layers`: read, not quantized (bytes_before is 0)

    def describe(self) -> str:
        mib = 1 << 20
        if self.from_checkpoint:
            text = (f"fp8 checkpoint: {self.num_layers} linear layers with fp8 weights, {self.bytes_after / mib:.1f} "
                    "MiB with their scales (per output channel, as --quantization fp8 keeps them)")
        else:
            text = (f"fp8 weights (--quantization fp8): {self.num_layers} linear layers quantized per output "
                    f"channel, {self.bytes_before / mib:.1f} MiB -> {self.bytes_after / mib:.1f} MiB (embeddings, "
                    "LM head and norms stay in the model's dtype)")
        if self.unfit_layers:
            shown = ", ".join(self.unfit_layers[:3]) + (" ..." if len(self.unfit_layers) > 3 else "")
            text += (f"; {len(self.unfit_layers)} layers have a dimension that is not a multiple of 16 and run the "
                     f"slow torch fp8 matmul on the GPU: {shown}")
        return text


def quantize_fp8_layers(model: nn.Module) -> Fp8Summary:
    """`Linear.quantize_fp8` on every dense `Linear` of `model` (not the embedding or LM head, which are not
    `Linear`s): call once every weight is loaded (all shards of merged and tensor-parallel layers in). On CUDA
    it also settles `ops.scaled_mm_out_dtype` for the model's dtype (a probe that must not run inside a graph
    capture) and empties the allocator's cache, so that the memory profile sees the freed weights."""
    return _fp8_layers(model, quantize=True)


def fp8_checkpoint_layers(model: nn.Module) -> Fp8Summary:
    """What an fp8 checkpoint's layers hold, once loaded; on CUDA the same settling as `quantize_fp8_layers`."""
    return _fp8_layers(model, quantize=False)


def _fp8_layers(model: nn.Module, quantize: bool) -> Fp8Summary:
    num_layers = before = after = 0
    unfit: list[str] = []
    device: torch.device | None = None
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or (module.weight is None if quantize else module.weight_fp8 is None):
            continue
        if quantize:
            layer_before, layer_after = module.quantize_fp8()
        else:
            assert module.weight_fp8 is not None and module.weight_scale is not None
            layer_before = 0
            layer_after = (module.weight_fp8.numel() * module.weight_fp8.element_size()
                           + module.weight_scale.numel() * module.weight_scale.element_size())
        num_layers += 1
        before += layer_before
        after += layer_after
        assert module.weight_fp8 is not None
        device = module.weight_fp8.device
        if device.type == "cuda":  # (elsewhere every layer runs the reference)
            try:
                ops.scaled_mm_out_dtype(device, module.dtype)
            except RuntimeError as exc:
                raise ModelLoadError(str(exc)) from None
            if not ops.fp8_matmul_fits(module.weight_fp8):
                unfit.append(name)
    if device is not None and device.type == "cuda" and quantize:
        torch.cuda.empty_cache()
    return Fp8Summary(num_layers, before, after, tuple(unfit), from_checkpoint=not quantize)


def _dummy_fp8_weight(param: nn.Parameter, generator: torch.Generator) -> None:
    """`--load-format dummy` for an fp8 checkpoint's weight: N(0, 1) values in e4m3 (times `_dummy_fp8_scale`'s
    0.02, the usual init scale)."""
    values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
    values.normal_(0.0, 1.0, generator=generator)
    param.data.copy_(values.clamp_(-448.0, 448.0))


def _dummy_fp8_scale(param: nn.Parameter, generator: torch.Generator) -> None:
    param.data.fill_(0.02)


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
