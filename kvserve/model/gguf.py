"""GGUF files: metadata, tensor-name mapping to HF names, dequantization and llama.cpp's Q/K row order.

Everything is read with `gguf.GGUFReader` (a memory map) and dequantized with `gguf.quants.dequantize`, the
same functions HF Transformers' GGUF loader uses, so the float32 weights are bit-identical to HF's.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from kvserve.model.paths import ModelLoadError

SUPPORTED_TENSOR_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)

# Whole-model tensors and per-block tensors ("blk.N.<name>.<weight|bias>"), GGUF name -> HF name.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # A mixture-of-experts layer's router [E, H], and its experts stacked per projection (ffn_gate_exps /
    # ffn_up_exps [E, I, H], ffn_down_exps [E, H, I] in PyTorch order), named as HF's fused experts are (no
    # ".weight"), which the model's loader places whole (`kvserve.layers.moe.FUSED_GATE` / `FUSED_UP` / `FUSED`).
    "ffn_gate_inp": "mlp.gate",
}
_STACKED_EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Older llama.cpp files (Mixtral converted before the experts were stacked) hold each expert apart:
# blk.N.ffn_gate.E.weight.
_PER_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")

# Tensors that are not parameters: llama3-style RoPE frequency factors, read into ArchConfig instead.
ROPE_FREQS_TENSOR = "rope_freqs.weight"
_NON_PARAMETER_TENSORS = frozenset({ROPE_FREQS_TENSOR})

# Metadata arrays longer than this (the tokenizer's vocabulary, merges, scores) are left out of
# `GGUFInfo.metadata`; the tokenizer reads them through transformers.
_MAX_METADATA_ARRAY = 1024


@dataclass(frozen=True)
class GGUFInfo:
    """What the model config needs from a GGUF file, without touching tensor data.

    metadata: key -> str | int | float | bool | list (long arrays left out);
    tensor_types: tensor name -> GGML type name ("Q4_1", "F32", ...);
    tensor_shapes: tensor name -> shape in PyTorch order (rows first, i.e. GGUF's reversed);
    rope_freqs: the values of `rope_freqs.weight` when the file has it.
    """

    metadata: dict[str, Any]
    tensor_types: dict[str, str]
    tensor_shapes: dict[str, tuple[int, ...]]
    rope_freqs: tuple[float, ...] | None


def read_gguf_info(path: str) -> GGUFInfo:
    """Metadata and tensor directory of a GGUF file. Raises `ModelLoadError` for unreadable files."""
    reader = _open_reader(path)
    metadata = {}
    for key, field in reader.fields.items():
        value = _field_value(field)
        if value is not None:
            metadata[key] = value
    tensor_types = {t.name: t.tensor_type.name for t in reader.tensors}
    tensor_shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    rope_freqs = None
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            values = dequantize(tensor.data, tensor.tensor_type).reshape(-1)
            rope_freqs = tuple(float(v) for v in values)
    return GGUFInfo(metadata, tensor_types, tensor_shapes, rope_freqs)


def has_tokenizer(path: str) -> bool:
    """Whether the GGUF file carries a tokenizer (llama.cpp's `tokenizer.ggml.model` and its token list)."""
    fields = _open_reader(path).fields
    return "tokenizer.ggml.model" in fields and "tokenizer.ggml.tokens" in fields


def quantized_types(info: GGUFInfo) -> list[str]:
    """The file's GGML tensor types by how many parameters each holds, most first, leaving out F32 (norms),
    unless the file holds nothing else: ["Q4_K", "Q6_K"] for a Q4_K_M file."""
    counts: dict[str, int] = {}
    for name, type_name in info.tensor_types.items():
        if name in _NON_PARAMETER_TENSORS:
            continue
        counts[type_name] = counts.get(type_name, 0) + math.prod(info.tensor_shapes.get(name, ()))
    ordered = sorted(counts, key=lambda t: -counts[t])
    return [t for t in ordered if t != "F32"] or ordered


def _size_text(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.1f} GiB" if num_bytes >= 1 << 30 else f"{num_bytes / (1 << 20):.0f} MiB"


def dequantization_summary(path: str, weights_bytes: int, dtype: str) -> str:
    """One line on what loading a GGUF file costs in memory: kvserve dequantizes its weights at load, so a
    4-bit file takes its dtype's full size on the device ("GGUF Q4_K/Q6_K weights dequantized to bfloat16
    at load: 4.4 GiB file -> 14.2 GiB in memory"). `weights_bytes`: the loaded parameters' bytes."""
    types = "/".join(quantized_types(read_gguf_info(path)))
    return (f"GGUF {types} weights dequantized to {dtype} at load: {_size_text(os.path.getsize(path))} file -> "
            f"{_size_text(weights_bytes)} in memory")


def check_tensor_types(path: str, tensor_types: dict[str, str]) -> None:
    """Refuse files holding a tensor type we cannot dequantize, naming the type and one tensor."""
    supported = {t.name for t in SUPPORTED_TENSOR_TYPES}
    for name, type_name in tensor_types.items():
        if type_name not in supported:
            raise ModelLoadError(
                f"{os.path.basename(path)}: tensor {name!r} has GGUF type {type_name}, which kvserve cannot "
                f"load; supported types: {', '.join(sorted(supported))} "
                f"(re-quantize the model to one of them)"
            )


def gguf_to_hf_name(name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None for tensors that are not parameters."""
    if name in _NON_PARAMETER_TENSORS:
        return None
    match = _PER_EXPERT_RE.match(name)
    if match is not None:
        layer, part, expert = match.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
    match = _BLOCK_RE.match(name)
    if match is not None:
        layer, part, kind = match.groups()
        if part in _STACKED_EXPERT_NAMES and kind == "weight":
            return f"model.layers.{layer}.{_STACKED_EXPERT_NAMES[part]}"
        hf_part = _BLOCK_NAMES.get(part)
        if hf_part is None:
            raise ModelLoadError(f"unknown GGUF tensor {name!r}")
        return f"model.layers.{layer}.{hf_part}.{kind}"
    match = _GLOBAL_RE.match(name)
    if match is not None and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    raise ModelLoadError(f"unknown GGUF tensor {name!r}")


def unpermute_qk_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the row permutation llama.cpp's HF->GGUF converter applies to Llama's q/k projections.

    The converter reorders each head's rows from HF's rotate-half layout (first half of the head, then the
    second half) to interleaved pairs, which is what llama.cpp's rotary kernel expects; our rotary uses
    HF's layout, so we put the halves back. `num_heads` is the number of heads the rows belong to (query
    heads for q, KV heads for k). Works for weights [rows, cols] and biases [rows].
    """
    rows = weight.shape[0]
    half_head = rows // num_heads // 2
    # Stored: head, pair index, (even, odd); HF: head, (first half, second half), index.
    return weight.reshape(num_heads, half_head, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_weights(
    path: str, *, unpermute_qk: bool, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 CPU tensor) for every parameter tensor in the file, dequantized.

    `unpermute_qk` is true for the llama architecture (Llama, and Mixtral, which llama.cpp writes as llama),
    whose q/k rows the converter permuted (Qwen2/Qwen3/Qwen3-MoE GGUFs are written in HF's order). A
    mixture-of-experts layer's stacked experts come as one 3-D tensor per projection (`gguf_to_hf_name`).
    """
    reader = _open_reader(path)
    check_tensor_types(path, {t.name: t.tensor_type.name for t in reader.tensors})
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        # dequantize() returns [..., rows, cols] for block types (a 3-D experts tensor: [E, rows, cols]) but
        # keeps F32/F16 in the reader's shape, which is already in PyTorch order; reshape to the logical shape
        # either way.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        weights = weights.reshape(shape)
        if unpermute_qk and ".self_attn.q_proj." in hf_name:
            weights = unpermute_qk_rows(weights, num_heads)
        elif unpermute_qk and ".self_attn.k_proj." in hf_name:
            weights = unpermute_qk_rows(weights, num_kv_heads)
        # A copy: the F32 path returns a read-only view of the memory map, and torch wants ownership.
        yield hf_name, torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))


@functools.lru_cache(maxsize=2)
def _open_reader_cached(path: str, mtime_ns: int, size: int) -> GGUFReader:
    # Parsing the header (the whole vocabulary) takes seconds; the config and the loader both need it.
    del mtime_ns, size  # part of the cache key only: a rewritten file is parsed again
    try:
        return GGUFReader(path, "r")
    except (ValueError, OSError, IndexError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc


def _open_reader(path: str) -> GGUFReader:
    stat = os.stat(path)
    return _open_reader_cached(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


def _field_value(field: Any) -> Any:
    """Decode one metadata field; None for arrays too long to be config (the vocabulary)."""
    if not field.types:
        return None
    main_type = field.types[0]
    if main_type == GGUFValueType.ARRAY:
        if len(field.data) > _MAX_METADATA_ARRAY:
            return None
        sub_type = field.types[-1]
        return [_scalar(field.parts[i], sub_type) for i in field.data]
    return _scalar(field.parts[field.data[0]], main_type)


def _scalar(part: np.ndarray, value_type: GGUFValueType) -> Any:
    if value_type == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    value = part[0].item()
    return bool(value) if value_type == GGUFValueType.BOOL else value
