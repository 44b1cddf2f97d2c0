"""Quantized checkpoints: AWQ (4-bit) and GPTQ (2, 4 and 8 bits, with or without act-order), and fp8 weights.

fp8 checkpoints (`FP8_CHECKPOINT_FORMATS`: vLLM's / AutoFP8's "fp8", llm-compressor's "compressed-tensors" with
float 8-bit weights, FBGEMM's "fbgemm_fp8") store each linear layer's weight in float8_e4m3fn with a float32
scale per tensor or per output channel (`weight_scale`); `parse_quant_config` gives them method "fp8", and such a
layer (`layers.linear`) holds them as `--quantization fp8` holds what it quantizes at load (per output channel: a
tensor's scale is repeated over its rows). Activations are quantized per token at run time, as online fp8 does;
a checkpoint's static activation scales (`input_scale`) are not read.

Block-wise fp8 checkpoints (vLLM's "fp8" with `weight_block_size` [bn, bk], as DeepSeek's and Qwen's own FP8
releases; compressed-tensors' strategy "block" with `block_structure`) store a float32 scale per bn x bk block
of the weight [N, K], shape [ceil(N / bn), ceil(K / bk)] (`weight_scale_inv`, or `weight_scale` in
compressed-tensors; it multiplies despite the name). `QuantConfig.weight_block` holds (bn, bk); such a layer
dequantizes its weight with the block scales after loading and requantizes it per output channel as
`--quantization fp8` does (`Linear.finish_loading`), so its outputs differ slightly from an engine that applies
the block scales inside its matmul.

Both formats store, per linear layer, integer weights `q` packed into int32 words, and per group of
`group_size` input rows a scale `s` and a zero point `z` for every output column; the weight is

    W[n, k] = (q[k, n] - z[g(k), n]) * s[g(k), n]

with g(k) = k // group_size, or GPTQ's stored `g_idx[k]` (act-order checkpoints). The layouts differ
(`QuantConfig` reads which from config.json's `quantization_config`):

* AWQ ("gemm" version): qweight int32 [K, N / 8], eight 4-bit values of consecutive output columns per
  word in the interleaved order `AWQ_ORDER` (value of column 8c + AWQ_ORDER[i] at bits 4i); qzeros int32
  [K / G, N / 8] packed the same way; scales [K / G, N].
* GPTQ: qweight int32 [K / p, N] (p = 32 / bits), value of row p r + i at bits `bits * i` of word r;
  qzeros int32 [groups, N / p] packed along the columns in plain order, holding z - 1 in the original
  ("gptq") checkpoint format and z in "gptq_v2"; scales [groups, N]; g_idx int32 [K].

After loading, `QuantizedWeights.finish` turns a layer's tensors into one layout for both formats: q packed
along K as GPTQ packs it (act-order rows sorted by group, with the permutation kept for the activations),
zero points as uint8 [groups, N], scales in the checkpoint's dtype (the layer casts them to the model's). The GPU multiplies with that
(`kernels/triton_quant.py`); other devices dequantize once to a dense weight and run the plain matmul.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvserve.model.paths import ModelLoadError

# Nibble i of an AWQ word holds column AWQ_ORDER[i] of its eight; column j sits at nibble AWQ_UNORDER[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_UNORDER = tuple(AWQ_ORDER.index(j) for j in range(8))

SUPPORTED_METHODS = ("awq", "gptq", "fp8", "compressed-tensors", "fbgemm_fp8")
# quant_method values read as fp8 checkpoints (`_parse_fp8`; llm-compressor's "compressed-tensors" only where
# its weights are float 8-bit).
FP8_CHECKPOINT_FORMATS = ("fp8", "compressed-tensors", "compressed_tensors", "fbgemm_fp8")
ACT_ORDER_WITH_TP = ("GPTQ act-order (desc_act) checkpoints are not supported with tensor parallelism yet; run them "
                     "with --tensor-parallel-size 1")
# vLLM's names of other kernels for the same checkpoints: accepted as the same formats.
_METHOD_ALIASES = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq",
                   "compressed-tensors": "fp8", "compressed_tensors": "fp8", "fbgemm_fp8": "fp8"}


@dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint's linear layers are quantized.

    method: "awq" | "gptq" | "fp8" (float8_e4m3fn weights, a float32 scale per tensor or output channel; bits 8,
    group_size -1). group_size: input rows per scale (-1: one group spanning the input).
    zero_offset: added to stored zero points (1 for GPTQ's original format, which stores z - 1).
    skip_modules: layers left unquantized: name parts (AWQ's `modules_to_not_convert`), or "re:" + a regular
    expression matched at the start of the layer's name (compressed-tensors' `ignore`).
    static_activations: the checkpoint has static activation scales (fp8; not read: tokens are quantized each
    with its own scale).
    weight_block: (rows, columns) of the weight each fp8 scale covers in a block-wise checkpoint, None for scales
    per tensor or output channel.
    only_modules: GPTQ's `modules_in_block_to_quantize` (GPTQModel, AutoRound): the layers it names (dotted name
    parts such as "self_attn.q_proj") are quantized and a decoder layer's others are stored dense; empty: all are.
    act_order: a GPTQ checkpoint quantized in activation order (`desc_act` without `static_groups`, groups of
    fewer rows than the input), so its g_idx permutes the input rows. Only checked against tensor parallelism
    before the ranks start (`distributed.check_quantized_split`); the load reads the stored g_idx itself.
    """

    method: str
    bits: int
    group_size: int
    zero_offset: int = 0
    skip_modules: tuple[str, ...] = ()
    static_activations: bool = False
    weight_block: tuple[int, int] | None = None
    act_order: bool = False
    only_modules: tuple[str, ...] = ()

    @property
    def pack(self) -> int:
        """Values per int32 word."""
        return 32 // self.bits

    def applies_to(self, prefix: str) -> bool:
        """Whether the layer at checkpoint name `prefix` (e.g. model.layers.0.mlp.down_proj) is quantized. A
        plain skip entry matches as a substring (AWQ) or, for fp8 checkpoints, as whole dotted parts of the name
        ("model.layers.1" skips layer 1, not layer 10; "down_proj" every down_proj)."""
        if self.method == "fp8":
            return not any(re.match(part[3:], prefix) if part.startswith("re:") else f".{part}." in f".{prefix}."
                           for part in self.skip_modules)
        if self.only_modules and not any(f".{part}." in f".{prefix}." for part in self.only_modules):
            return False
        return not any(part and part in prefix for part in self.skip_modules)

    def groups(self, input_size: int) -> int:
        return 1 if self.group_size == -1 else math.ceil(input_size / self.group_size)

    def group_rows(self, input_size: int) -> int:
        return input_size if self.group_size == -1 else self.group_size


def normalize_method(name: str) -> str | None:
    """`--quantization`'s value as a method of this module, None for a name it does not know."""
    return _METHOD_ALIASES.get(name.lower())


def is_kv_cache_only(raw: dict[str, Any], where: str) -> bool:
    """Whether config.json's `quantization_config` quantizes the KV cache alone: compressed-tensors (llm-compressor)
    with a `kv_cache_scheme` and no `config_groups`. Its weights are dense and the checkpoint carries per-layer
    KV-cache scales, which the model loads (`LlamaForCausalLM.load_weights`) and an fp8 KV cache uses. ModelLoadError,
    naming `where`, for a scheme vLLM's fp8 KV cache does not read either: anything but 8-bit floats, symmetric,
    one scale per tensor."""
    scheme = raw.get("kv_cache_scheme")
    if str(raw.get("quant_method", "")).lower() not in ("compressed-tensors", "compressed_tensors") or not scheme \
            or raw.get("config_groups"):
        return False
    _check_kv_cache_scheme(scheme, where)
    return True


def _check_kv_cache_scheme(scheme: Any, where: str) -> None:
    """A compressed-tensors `kv_cache_scheme` must be one vLLM's fp8 KV cache reads; ModelLoadError otherwise."""
    if not isinstance(scheme, dict):
        raise ModelLoadError(f"{where}: kv_cache_scheme must be an object, got {scheme!r}")
    found = {key: scheme.get(key) for key in ("type", "num_bits", "strategy", "symmetric")}
    if found != {"type": "float", "num_bits": 8, "strategy": "tensor", "symmetric": True}:
        raise ModelLoadError(f"{where}: kv_cache_scheme {found} is not supported: the KV-cache scales of an fp8 KV cache "
                             "are 8-bit float, symmetric, one per tensor (type 'float', num_bits 8, strategy 'tensor', "
                             "symmetric true)")


def parse_quant_config(raw: dict[str, Any], where: str) -> QuantConfig:
    """config.json's `quantization_config` (or a GPTQ `quantize_config.json`) -> QuantConfig.

    ModelLoadError, naming `where`, for methods and settings this module cannot run."""
    method = str(raw.get("quant_method", "")).lower()
    if method in FP8_CHECKPOINT_FORMATS:
        return _parse_fp8(raw, method, where)
    if method not in SUPPORTED_METHODS:
        hint = (": NVIDIA ModelOpt checkpoints are not read; an fp8 one exported for vLLM's 'fp8' or llm-compressor's "
                "'compressed-tensors' format is, or the unquantized checkpoint with --quantization fp8"
                if method == "modelopt" else "")
        raise ModelLoadError(
            f"{where}: quantization method {method or '(none given)'!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_METHODS)} (and GGUF files){hint}"
        )
    bits = raw.get("bits", raw.get("w_bit"))
    group_size = raw.get("group_size", raw.get("q_group_size"))
    if not isinstance(bits, int) or not isinstance(group_size, int):
        raise ModelLoadError(f"{where}: quantization_config needs integer 'bits' and 'group_size', got "
                             f"{bits!r} and {group_size!r}")
    if group_size != -1 and (group_size < 8 or group_size % 8):
        raise ModelLoadError(f"{where}: group_size {group_size} is not supported (a multiple of 8, or -1)")
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(f"{where}: AWQ version {version!r} is not supported (only 'gemm' packing)")
        if bits != 4:
            raise ModelLoadError(f"{where}: AWQ with {bits} bits is not supported (only 4)")
        if not raw.get("zero_point", True):
            raise ModelLoadError(f"{where}: AWQ without zero points is not supported")
        skip = raw.get("modules_to_not_convert") or []
        return QuantConfig("awq", 4, group_size, skip_modules=tuple(str(s) for s in skip))
    if bits not in (2, 4, 8):
        raise ModelLoadError(f"{where}: GPTQ with {bits} bits is not supported (2, 4 or 8)")
    if raw.get("lm_head"):
        raise ModelLoadError(f"{where}: a GPTQ-quantized lm_head is not supported")
    if raw.get("dynamic"):
        raise ModelLoadError(f"{where}: GPTQ 'dynamic' per-module settings are not supported")
    fmt = str(raw.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    # The load applies whatever order the stored g_idx says (`QuantizedWeights.finish`); desc_act only lets
    # tensor parallelism be refused before the ranks start.
    act_order = bool(raw.get("desc_act")) and not raw.get("static_groups") and group_size != -1
    return QuantConfig("gptq", bits, group_size, zero_offset=1 if fmt == "gptq" else 0, act_order=act_order,
                       only_modules=_module_names(raw.get("modules_in_block_to_quantize"), where))


def _module_names(entries: Any, where: str) -> tuple[str, ...]:
    """GPTQ's `modules_in_block_to_quantize`, a list of names or of lists of names (GPTQModel groups them by the
    order it quantized them), flattened; () for none given."""
    if entries is None:
        return ()
    names: list[str] = []
    for entry in entries if isinstance(entries, list) else [entries]:
        for name in entry if isinstance(entry, list) else [entry]:
            if not isinstance(name, str) or not name:
                raise ModelLoadError(f"{where}: modules_in_block_to_quantize must list module names such as "
                                     f"'self_attn.q_proj', got {entries!r}")
            names.append(name.strip("."))
    return tuple(names)


def _parse_fp8(raw: dict[str, Any], method: str, where: str) -> QuantConfig:
    """An fp8 checkpoint's `quantization_config` -> QuantConfig("fp8"); ModelLoadError for what it cannot run
    (weights that are not float 8-bit, block sizes that are not two positive integers, some layers quantized
    otherwise)."""
    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(f"{where}: {what} is not supported (fp8 checkpoints with a scale per tensor, per "
                              "output channel or per block are; or run the unquantized checkpoint with "
                              "--quantization fp8)")

    if method == "fp8":  # vLLM's own format (AutoFP8, transformers' fp8 exports, DeepSeek's / Qwen's FP8 releases)
        block = raw.get("weight_block_size")
        # (None or [], as some exports write it: no blocks, a scale per tensor or per output channel)
        weight_block = None if block is None or block == [] else _block_size(block, "weight_block_size", where)
        scheme = str(raw.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise refuse(f"fp8 activation_scheme {scheme!r}")
        fmt = str(raw.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise refuse(f"fp8 weights in {fmt}")
        # (transformers writes the list as modules_to_not_convert)
        skip = raw.get("ignored_layers") or raw.get("modules_to_not_convert") or []
        return QuantConfig("fp8", 8, -1, skip_modules=tuple(str(s) for s in skip),
                           static_activations=scheme == "static", weight_block=weight_block)
    if method == "fbgemm_fp8":  # per-channel weights, dynamic per-token activations
        skip = raw.get("modules_to_not_convert") or []
        return QuantConfig("fp8", 8, -1, skip_modules=tuple(str(s) for s in skip))
    # llm-compressor's compressed-tensors: one config group over every Linear with float 8-bit weights (and maybe
    # per-layer KV-cache scales, loaded by the model)
    if raw.get("kv_cache_scheme"):
        _check_kv_cache_scheme(raw["kv_cache_scheme"], where)
    sparsity = raw.get("sparsity_config") or {}
    if str(sparsity.get("format", "dense")).lower() != "dense":
        raise refuse(f"compressed-tensors sparsity format {sparsity.get('format')!r}")
    fmt = str(raw.get("format", "")).lower()
    if fmt not in ("float-quantized", "naive-quantized"):
        raise refuse(f"compressed-tensors format {fmt or '(none given)'!r}")
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise refuse(f"compressed-tensors with {len(groups) if isinstance(groups, dict) else 0} config groups "
                     "(one, over every Linear, is)")
    group = next(iter(groups.values())) or {}
    targets = group.get("targets") or []
    if list(targets) != ["Linear"]:
        raise refuse(f"compressed-tensors targets {targets!r} (['Linear'] is)")
    weights = group.get("weights") or {}
    strategy = str(weights.get("strategy", "")).lower()
    if weights.get("num_bits") != 8 or str(weights.get("type", "")).lower() != "float":
        raise refuse(f"compressed-tensors weights of {weights.get('num_bits')} bits, type {weights.get('type')!r}")
    if strategy not in ("tensor", "channel", "block") or weights.get("dynamic") or not weights.get("symmetric", True):
        raise refuse(f"compressed-tensors fp8 weights with strategy {strategy!r}"
                     + (", dynamic" if weights.get("dynamic") else "")
                     + ("" if weights.get("symmetric", True) else ", asymmetric"))
    weight_block = (_block_size(weights.get("block_structure"), "compressed-tensors block_structure", where)
                    if strategy == "block" else None)
    activations = group.get("input_activations")
    static = False
    if activations:
        if activations.get("num_bits") != 8 or str(activations.get("type", "")).lower() != "float":
            raise refuse(f"compressed-tensors activations of {activations.get('num_bits')} bits, type "
                         f"{activations.get('type')!r}")
        static = not activations.get("dynamic", False)
    skip = raw.get("ignore") or []
    return QuantConfig("fp8", 8, -1, skip_modules=tuple(str(s) for s in skip), static_activations=static,
                       weight_block=weight_block)


def _block_size(value: Any, key: str, where: str) -> tuple[int, int]:
    """A block-wise fp8 checkpoint's block size ([rows, columns] of the weight a scale covers) as a pair of
    positive ints; ModelLoadError, naming `where` and `key`, for anything else."""
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ModelLoadError(f"{where}: {key} {value!r} is not supported: block-wise fp8 scales need a block size of "
                             "two positive integers, [rows, columns] (e.g. [128, 128])")
    return int(value[0]), int(value[1])


# ---------------------------------------------------------------------------------- packing arithmetic


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] packed along rows (value p r + i at bits `bits * i` of word r) -> int32 [p R, C]."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=packed.device, dtype=torch.int32) * bits
    values = (packed.unsqueeze(1) >> shifts.view(1, pack, 1)) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0] * pack, packed.shape[1])


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `unpack_rows`: int [p R, C] with values below 2 ** bits -> int32 [R, C]. Works one value
    position at a time, so its temporaries are a few [R, C] tensors, not [p R, C] ones."""
    pack = 32 // bits
    rows, cols = values.shape
    if rows % pack:
        raise ValueError(f"{rows} rows do not pack into words of {pack}")
    grouped = values.view(rows // pack, pack, cols)
    words = torch.zeros((rows // pack, cols), dtype=torch.int64, device=values.device)
    for i in range(pack):
        words |= grouped[:, i].to(torch.int64) << (bits * i)
    # Two's complement: a word with its top bit set is negative as int32.
    words -= (words >= 1 << 31).to(torch.int64) << 32
    return words.to(torch.int32)


def unpack_columns(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] packed along columns -> int32 [R, p C]. `order` (AWQ): column j of a word's p sits at
    position order[j] (None: position j)."""
    pack = 32 // bits
    positions = torch.tensor(order if order is not None else range(pack), device=packed.device, dtype=torch.int32)
    values = (packed.unsqueeze(2) >> (positions * bits).view(1, 1, pack)) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], packed.shape[1] * pack)


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """The dense weight [N, K] of q [K, N] (integers), zeros / scales [groups, N] and g_idx [K]:
    ((q - z) * s) computed in float32, then cast. The reference every quantized path is checked against."""
    index = g_idx.long()
    z = zeros.float().index_select(0, index)
    s = scales.float().index_select(0, index)
    return ((q.float() - z) * s).to(dtype).t().contiguous()


def _tile_positions(bits: int, tile_rows: int) -> tuple[int, int]:
    pack = 32 // bits
    words = tile_rows // pack  # words a column has in one tile
    if tile_rows % pack or words % pack:
        raise ValueError(f"a tile of {tile_rows} rows does not interleave {bits}-bit values")
    return pack, words


def interleave_tiles(qweight: torch.Tensor, bits: int, tile_rows: int) -> torch.Tensor:
    """Packed rows (`unpack_rows`'s layout) -> the tile-interleaved layout: in each tile of `tile_rows` rows
    (R = tile_rows / p words a column), value j of word r is the tile's row j R + r, so a kernel that
    unpacks value j of a tile's R words gets R consecutive rows. Word-level arithmetic: its temporaries are
    a few qweight-sized tensors."""
    pack, words = _tile_positions(bits, tile_rows)
    k_words, cols = qweight.shape
    if k_words % words:
        raise ValueError(f"{k_words * pack} rows are not whole tiles of {tile_rows}")
    old = qweight.view(k_words // words, words, cols)
    r = torch.arange(words, device=qweight.device)
    mask = (1 << bits) - 1
    out = torch.zeros_like(old)
    for j in range(pack):
        # Tile row j R + r sits in the tile's word (j R + r) // p at position (j R + r) % p = r % p.
        source = old.index_select(1, (j * words + r) // pack)
        shifts = ((r % pack) * bits).to(torch.int32).view(1, words, 1)
        out |= ((source >> shifts) & mask) << (bits * j)
    return out.view(k_words, cols)


def deinterleave_tiles(qweight: torch.Tensor, bits: int, tile_rows: int) -> torch.Tensor:
    """Inverse of `interleave_tiles`."""
    pack, words = _tile_positions(bits, tile_rows)
    k_words, cols = qweight.shape
    tiled = qweight.view(k_words // words, words, cols)
    mask = (1 << bits) - 1
    out = torch.zeros_like(tiled)
    for i in range(pack):
        # Position i of the tile's plain word w is tile row p w + i = j R + r: word r = (p w + i) % R, value
        # j = (p w + i) // R.
        w = torch.arange(words, device=qweight.device)
        rows = pack * w + i
        source = tiled.index_select(1, rows % words)
        shifts = ((rows // words) * bits).to(torch.int32).view(1, words, 1)
        out |= ((source >> shifts) & mask) << (bits * i)
    return out.view(k_words, cols)


# ----------------------------------------------------------------------------------- a layer's tensors


@dataclass
class PackedWeight:
    """A quantized layer's weight as the GPU multiplies it: qweight int32 [K / pack, N] (row p r + i at bits
    `bits * i` of word r), zeros uint8 [groups, N], scales [groups, N], group_rows input rows a group
    (rows sorted by group), perm: int64 [K] input columns in the order of qweight's rows, or None.

    tile_rows T > 0: qweight is interleaved within each T-row tile instead (`interleave_tiles`: word r of a
    tile holds the tile's rows j T / p + r at position j), and zero_scale int32 [groups, N] holds each
    column's zero point << 16 | its scale's 16 bits, as the paired-dequantizing kernel reads them
    (`kernels/triton_quant.py`, `prepare_pairs`)."""

    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_rows: int
    perm: torch.Tensor | None
    tile_rows: int = 0
    zero_scale: torch.Tensor | None = None

    @property
    def input_size(self) -> int:
        return self.qweight.shape[0] * (32 // self.bits)

    @property
    def output_size(self) -> int:
        return self.qweight.shape[1]

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight [N, K] in the original input order."""
        words = self.qweight if not self.tile_rows else deinterleave_tiles(self.qweight, self.bits, self.tile_rows)
        q = unpack_rows(words, self.bits)
        g_idx = torch.arange(q.shape[0], device=q.device) // self.group_rows
        weight = dequantize(q, self.zeros, self.scales, g_idx, dtype)
        if self.perm is None:
            return weight
        out = torch.empty_like(weight)
        out[:, self.perm] = weight
        return out


class QuantizedWeights:
    """The checkpoint tensors of one quantized linear layer (this rank's part), registered on `module` as
    parameters named as the checkpoint names them (qweight, qzeros, scales and, for GPTQ, g_idx), each
    with `weight_loader(param, loaded, shard_id)`.

    `place(loaded, shard_id) -> (start, size, total, offset)` maps a shard to output columns: this rank's
    columns [start, start + size) of the checkpoint tensor's `total` go to columns [offset, offset + size)
    of the layer. `row_share` = (rank, ranks) for a layer whose input rows are split over ranks, else None.
    """

    def __init__(
        self,
        config: QuantConfig,
        module: nn.Module,
        input_size: int,
        output_size: int,
        shard_ids: tuple[Hashable, ...],
        place: Callable[[torch.Tensor, Hashable, int], tuple[int, int, int, int]],
        row_share: tuple[int, int] | None,
    ) -> None:
        self.config = config
        self.input_size = input_size
        self.output_size = output_size
        self.place = place
        self.row_share = row_share
        bits, pack = config.bits, config.pack
        full_input = input_size * (row_share[1] if row_share else 1)
        if row_share and config.group_size == -1:
            groups = 1  # the one group spans every rank's rows: each rank keeps all of its scales
        else:
            groups = config.groups(input_size)
            if row_share and input_size % config.group_rows(full_input):
                raise ModelLoadError(
                    f"input size {input_size} of a rank is not a multiple of group_size {config.group_size}: "
                    f"the checkpoint does not split into {row_share[1]} ranks")
        if output_size % pack or input_size % pack:
            raise ModelLoadError(f"a {input_size} x {output_size} layer does not pack {bits}-bit values "
                                 f"{pack} to a word")
        self.groups = groups
        # (shape, packed columns' unit, rows per input row's share) of each checkpoint tensor.
        if config.method == "awq":
            specs = {"qweight": ((input_size, output_size // pack), pack, 1),
                     "qzeros": ((groups, output_size // pack), pack, 0),
                     "scales": ((groups, output_size), 1, 0)}
        else:
            specs = {"qweight": ((input_size // pack, output_size), 1, 1),
                     "qzeros": ((groups, output_size // pack), pack, 0),
                     "scales": ((groups, output_size), 1, 0),
                     "g_idx": ((input_size,), 0, 1)}
        self.specs = specs
        self.scales_dtype: torch.dtype | None = None
        self.loaded_g_idx: dict[Hashable, torch.Tensor] = {}
        for name, (shape, _, _) in specs.items():
            dtype = torch.float32 if name == "scales" else torch.int32
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.shard_ids = shard_ids  # type: ignore[attr-defined]
            param.weight_loader = self._loader(name)  # type: ignore[attr-defined]
            param.dummy_fill = self._dummy_fill(name)  # type: ignore[attr-defined]
            module.register_parameter(name, param)
        self.module = module

    def _rank_rows(self, name: str, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a row-split layer's tensor (all of them otherwise)."""
        if self.row_share is None:
            return loaded
        rank, ranks = self.row_share
        shape, _, per_row = self.specs[name]
        if not per_row and self.config.group_size == -1:
            return loaded
        rows = shape[0]
        if loaded.shape[0] != rows * ranks:
            raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not split into {ranks} ranks "
                             f"of {rows} rows")
        return loaded.narrow(0, rank * rows, rows)

    def _loader(self, name: str) -> Callable[[nn.Parameter, torch.Tensor, Hashable], None]:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
            shape, unit, _ = self.specs[name]
            loaded = self._rank_rows(name, loaded)
            if name == "g_idx":
                if tuple(loaded.shape) != shape:
                    raise ValueError(f"g_idx: checkpoint shape {tuple(loaded.shape)} does not match {shape}")
                self.loaded_g_idx[shard_id] = loaded.to(torch.int32)
                param.data.copy_(loaded)
                return
            if name == "scales":
                self.scales_dtype = loaded.dtype
            if loaded.dim() != 2 or loaded.shape[0] != shape[0]:
                raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match {shape[0]} rows")
            start, size, total, offset = self.place(loaded, shard_id, loaded.shape[1] * unit)
            if start % unit or size % unit or offset % unit:
                raise ValueError(f"{name}: output columns [{start}, {start + size}) do not fall on "
                                 f"{unit}-column words")
            if loaded.shape[1] * unit != total:
                raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} holds {loaded.shape[1] * unit} "
                                 f"columns, expected {total}")
            part = loaded.narrow(1, start // unit, size // unit)
            target = param.data.narrow(1, offset // unit, size // unit)
            if tuple(part.shape) != tuple(target.shape):
                raise ValueError(f"{name}: checkpoint part {tuple(part.shape)} does not match {tuple(target.shape)}")
            target.copy_(part)

        return load

    def _dummy_fill(self, name: str) -> Callable[[nn.Parameter, torch.Generator], None]:
        """Random values of realistic size for benchmarks without files (`load_format="dummy"`)."""
        def fill(param: nn.Parameter, generator: torch.Generator) -> None:
            if name == "qweight":
                param.data.copy_(torch.randint(-(1 << 31), (1 << 31) - 1, param.shape, generator=generator,
                                               device=param.device, dtype=torch.int64).to(torch.int32))
            elif name == "qzeros":  # the middle of the range, as symmetric quantization stores it
                bits = self.config.bits
                value = (1 << (bits - 1)) - self.config.zero_offset
                word = sum(value << (bits * i) for i in range(self.config.pack))
                param.data.fill_(word - (1 << 32) if word >= 1 << 31 else word)
            elif name == "scales":  # (q - z) spans about +-2 ** bits; weights of std ~0.02, as dense dummies
                param.data.uniform_(0.5, 1.5, generator=generator).mul_(0.04 / (1 << self.config.bits))
                self.scales_dtype = torch.float16
            else:
                param.data.copy_(torch.arange(param.shape[0], device=param.device)
                                 // self.config.group_rows(self.input_size))
        return fill

    def finish(self) -> PackedWeight:
        """The loaded tensors in the GPU layout (see module docstring); removes the checkpoint parameters."""
        config = self.config
        module = self.module
        qweight = module.qweight.data
        qzeros = module.qzeros.data
        scales = module.scales.data.to(self.scales_dtype or torch.float16)
        if config.method == "awq":
            q = unpack_columns(qweight, 4, AWQ_UNORDER)
            zeros = unpack_columns(qzeros, 4, AWQ_UNORDER)
        else:
            q = unpack_rows(qweight, config.bits)
            zeros = unpack_columns(qzeros, config.bits)
        # GPTQ's original format stores z - 1 in `bits` bits, so a zero point of 0 reads 2 ** bits - 1: the
        # sum wraps, as the format's own dequantization computes it.
        zeros = (zeros + config.zero_offset) & ((1 << config.bits) - 1)
        rows = config.group_rows(self.input_size)
        plain = torch.arange(self.input_size, device=q.device, dtype=torch.int32) // rows
        g_idx = plain
        if config.method == "gptq" and self.loaded_g_idx:
            values = list(self.loaded_g_idx.values())
            if any(not torch.equal(v.to(q.device), values[0].to(q.device)) for v in values[1:]):
                raise ModelLoadError("the fused projections' g_idx differ")
            g_idx = values[0].to(q.device)
            if self.row_share is not None and config.group_size != -1:
                g_idx = g_idx - self.row_share[0] * (self.input_size // config.group_size)
        perm = None
        if not torch.equal(g_idx, plain):
            if self.row_share is not None:
                raise ModelLoadError(ACT_ORDER_WITH_TP)
            order = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[order], plain):
                raise ModelLoadError("g_idx does not assign group_size input rows to every group")
            q = q.index_select(0, order)
            perm = order.long()
        for name in list(self.specs):
            delattr(module, name)
        return PackedWeight(pack_rows(q, config.bits), zeros.to(torch.uint8).contiguous(), scales.contiguous(),
                            config.bits, rows, perm)
