"""AWQ / GPTQ checkpoints written from a dense checkpoint, for differential tests of quantized loading.

`quantize_checkpoint(dense_dir, out_dir, ...)` quantizes every decoder projection (q/k/v/o, gate/up/down)
of a dense HF checkpoint per group of input rows (asymmetric min-max rounding), writes the packed tensors
the way the format's exporters lay them out (AWQ "gemm": columns packed in the interleaved nibble order;
GPTQ: rows packed, zero points stored minus one in the original format), and writes beside it a *dense*
checkpoint of the dequantized weights, `dequantized_dir`: HF Transformers loads that as a plain model, so a
quantized model in kvserve must reproduce its outputs.

The packing here is written independently of `kvserve.layers.quantization` (one value at a time, with
Python integers), so a layout mistake in either shows up as a mismatch.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections that read the same input (GPTQ's act-order is a property of the input's activations).
_INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp",
             "up_proj": "mlp", "down_proj": "down"}
# Nibble i of an AWQ word holds column AWQ_NIBBLE_COLUMN[i] of the word's eight (AutoAWQ's order map).
AWQ_NIBBLE_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)


def _to_int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def _pack_along_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """values [R, C] -> int32 [R / p, C]; word r of column c holds rows p r .. p r + p - 1, row p r + i at
    bits * i."""
    pack = 32 // bits
    rows, cols = values.shape
    out = np.zeros((rows // pack, cols), dtype=np.int32)
    for r in range(rows // pack):
        for c in range(cols):
            word = 0
            for i in range(pack):
                word |= int(values[r * pack + i, c]) << (bits * i)
            out[r, c] = _to_int32(word)
    return out


def _pack_along_columns(values: np.ndarray, bits: int, nibble_column: tuple[int, ...] | None) -> np.ndarray:
    """values [R, C] -> int32 [R, C / p]; position i of word w holds column p w + nibble_column[i]."""
    pack = 32 // bits
    rows, cols = values.shape
    order = nibble_column or tuple(range(pack))
    out = np.zeros((rows, cols // pack), dtype=np.int32)
    for r in range(rows):
        for w in range(cols // pack):
            word = 0
            for i in range(pack):
                word |= int(values[r, w * pack + order[i]]) << (bits * i)
            out[r, w] = _to_int32(word)
    return out


def quantize_weight(weight: torch.Tensor, bits: int, g_idx: np.ndarray) -> dict[str, np.ndarray]:
    """weight [N, K] -> q [K, N], zeros / scales [groups, N] (scales float16), and the dequantized float32
    weight [N, K], rows of K assigned to groups by g_idx [K]."""
    w = weight.detach().float().numpy().T  # [K, N]
    k, n = w.shape
    groups = int(g_idx.max()) + 1
    top = (1 << bits) - 1
    q = np.zeros((k, n), dtype=np.int64)
    zeros = np.zeros((groups, n), dtype=np.int64)
    scales = np.zeros((groups, n), dtype=np.float16)
    for g in range(groups):
        rows = np.nonzero(g_idx == g)[0]
        lo = np.minimum(w[rows].min(axis=0), 0.0)
        hi = np.maximum(w[rows].max(axis=0), 0.0)
        scale = np.maximum(hi - lo, 1e-6) / top
        scales[g] = scale.astype(np.float16)
        s = scales[g].astype(np.float32)
        zero = np.clip(np.round(-lo / s), 0, top)
        zeros[g] = zero
        q[rows] = np.clip(np.round(w[rows] / s + zero), 0, top)
    deq = (q.astype(np.float32) - zeros[g_idx].astype(np.float32)) * scales[g_idx].astype(np.float32)
    return {"q": q, "zeros": zeros, "scales": scales, "dequantized": deq.T.copy()}


def quantize_checkpoint(
    dense_dir: str,
    out_dir: str,
    dequantized_dir: str,
    method: str,
    bits: int = 4,
    group_size: int = 32,
    act_order: bool = False,
    checkpoint_format: str = "gptq",
    skip: tuple[str, ...] = (),
    seed: int = 0,
    extra_bias: bool = False,
) -> dict[str, Any]:
    """Write `out_dir` (the quantized checkpoint) and `dequantized_dir` (dense, the dequantized weights) from
    the checkpoint in `dense_dir` (tokenizer files copied to both); returns the quantization_config written.

    act_order (GPTQ): input rows go to groups in a random order (g_idx a shuffled arange // group_size), as
    GPTQ's desc_act orders them by activation size. skip: projection names left dense (AWQ's
    modules_to_not_convert; GPTQ's modules_in_block_to_quantize names the others). extra_bias: a zero `.bias` for every quantized projection that has none, as older
    GPTQ exporters write."""
    rng = np.random.default_rng(seed)
    orders: dict[tuple[str, str], np.ndarray] = {}
    tensors = load_file(os.path.join(dense_dir, "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        proj = next((p for p in PROJECTIONS if f".{p}.weight" in name), None)
        if proj is None or proj in skip:
            quantized[name] = tensor
            dense[name] = tensor
            continue
        base = name[: -len(".weight")]
        k = tensor.shape[1]
        rows_per_group = k if group_size == -1 else group_size
        g_idx = np.arange(k) // rows_per_group
        if act_order:  # one order per input: projections of the same input see the same activations
            key = (base.rsplit(".", 1)[0], _INPUT_OF[proj])
            if key not in orders:
                orders[key] = rng.permutation(k)
            g_idx = g_idx[orders[key]]
        result = quantize_weight(tensor, bits, g_idx)
        dense[name] = torch.from_numpy(result["dequantized"])
        if method == "awq":
            quantized[f"{base}.qweight"] = torch.from_numpy(_pack_along_columns(result["q"], bits, AWQ_NIBBLE_COLUMN))
            quantized[f"{base}.qzeros"] = torch.from_numpy(_pack_along_columns(result["zeros"], bits, AWQ_NIBBLE_COLUMN))
        else:
            # The original format stores z - 1 in `bits` bits: a zero point of 0 becomes 2 ** bits - 1.
            stored_zeros = (result["zeros"] - (1 if checkpoint_format == "gptq" else 0)) % (1 << bits)
            quantized[f"{base}.qweight"] = torch.from_numpy(_pack_along_rows(result["q"], bits))
            quantized[f"{base}.qzeros"] = torch.from_numpy(_pack_along_columns(stored_zeros, bits, None))
            quantized[f"{base}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        quantized[f"{base}.scales"] = torch.from_numpy(result["scales"])
        if extra_bias and f"{base}.bias" not in tensors:
            quantized[f"{base}.bias"] = torch.zeros(tensor.shape[0], dtype=torch.float16)
    with open(os.path.join(dense_dir, "config.json")) as f:
        config = json.load(f)
    if method == "awq":
        quant_config: dict[str, Any] = {"quant_method": "awq", "bits": bits, "group_size": group_size,
                                        "version": "gemm", "zero_point": True,
                                        "modules_to_not_convert": list(skip) or None}
    else:
        quant_config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
                        "sym": False, "checkpoint_format": checkpoint_format}
        if skip:  # as GPTQModel and AutoRound name the quantized ones, grouped by the input they read
            attn = [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj") if p not in skip]
            groups = [attn, [f"self_attn.{p}" for p in ("o_proj",) if p not in skip],
                      [f"mlp.{p}" for p in ("gate_proj", "up_proj") if p not in skip],
                      [f"mlp.{p}" for p in ("down_proj",) if p not in skip]]
            quant_config["modules_in_block_to_quantize"] = [group for group in groups if group]
    for directory, weights, extra in ((out_dir, quantized, {"quantization_config": quant_config}),
                                      (dequantized_dir, dense, {})):
        os.makedirs(directory, exist_ok=True)
        for entry in os.listdir(dense_dir):
            if entry not in ("model.safetensors", "config.json"):
                shutil.copy(os.path.join(dense_dir, entry), directory)
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(directory, "model.safetensors"))
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump({**config, **extra}, f)
    return quant_config
