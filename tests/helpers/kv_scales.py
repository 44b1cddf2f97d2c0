"""Checkpoints that carry KV-cache scales, as exported for vLLM's fp8 KV cache, built from a tiny random checkpoint.

`write_scaled_checkpoint(src, dst, k_factors, v_factors, names)` writes a copy of the checkpoint `src` (config
and tokenizer files as they are) in which layer i's k_proj is multiplied by k_factors[i] and q_proj divided by
it, v_proj multiplied by v_factors[i] and o_proj divided by it (biases alike), and which carries the factors as
the layer's KV-cache scales under the names of the export `names` picks (a key of `SCALE_NAMES`; None for none).

With powers of two as factors the copy computes the same function bit for bit in float32 / bfloat16 (every
product q' . k' and o_proj(attention' ) is the original's, exactly), while its K and V are the factors times
larger: an fp8 cache that divides them by the scales stores exactly the original's values, one that ignores the
scales saturates.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Sequence

import torch
from safetensors.torch import load_file, save_file

# export -> the names of layer N's (k_scale, v_scale); a single name scales both (the older `kv_scale`).
SCALE_NAMES: dict[str, tuple[str, ...]] = {
    "k_v_scale": ("self_attn.k_scale", "self_attn.v_scale"),  # llm-compressor, AutoFP8
    "kv_scale": ("self_attn.kv_scale",),  # older exports: one for both
    "modelopt": ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
    "output_scale": ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),  # compressed-tensors
    "qkv_proj": ("self_attn.qkv_proj.k_scale", "self_attn.qkv_proj.v_scale"),
}


def write_scaled_checkpoint(src: str, dst: str, k_factors: Sequence[float], v_factors: Sequence[float],
                            names: str | None = "k_v_scale", scale_dtype: torch.dtype = torch.float32) -> str:
    """See the module docstring; returns `dst`. `kv_scale` needs k_factors == v_factors."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        weights.update(load_file(file))
    for i, (k, v) in enumerate(zip(k_factors, v_factors, strict=True)):
        attn = f"model.layers.{i}.self_attn"
        for suffix in ("weight", "bias"):
            for proj, factor in (("q_proj", 1.0 / k), ("k_proj", k), ("v_proj", v)):
                if f"{attn}.{proj}.{suffix}" in weights:
                    weights[f"{attn}.{proj}.{suffix}"] = weights[f"{attn}.{proj}.{suffix}"] * factor
        weights[f"{attn}.o_proj.weight"] = weights[f"{attn}.o_proj.weight"] / v  # its bias adds after: as it is
        if names is None:
            continue
        scale_names = SCALE_NAMES[names]
        if len(scale_names) == 1:
            assert k == v, "one kv_scale scales K and V alike"
        for name, factor in zip(scale_names, (k, v)):  # noqa: B905 - kv_scale: one name
            weights[f"model.layers.{i}.{name}"] = torch.tensor(factor, dtype=scale_dtype)
    save_file(weights, os.path.join(dst, "model.safetensors"))
    return dst
