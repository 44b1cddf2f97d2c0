"""llama.cpp's RoPE-scaling metadata in a GGUF file, read back as the HF rope parameters of the checkpoint it
was converted from.

llama.cpp's converter (convert_hf_to_gguf.py) writes a checkpoint's `rope_scaling` / `rope_parameters` as
`{arch}.rope.scaling.*` keys (the names are gguf-py's `Keys.Rope`). HF Transformers' own GGUF loader reads
none of them for Llama, Qwen2 or Qwen3 files, so mapping them back is ours. Key by key, under
`{arch}.rope.scaling.`:

* `type`: "none", "linear", "yarn" or "longrope" (gguf-py's `RopeScalingType`). Absent, llama.cpp takes
  "linear", which without a factor is plain RoPE. Llama 3.1 scaling has no type: the converter writes its
  per-frequency divisors as the `rope_freqs.weight` tensor instead (`ArchConfig.rope_freq_factors`).
* `factor`: HF `factor` (llama.cpp's freq_scale is its inverse); llama.cpp falls back to the older key
  `{arch}.rope.scale_linear`, and so do we. Absent or 0: no scaling.
* `original_context_length`: HF `original_max_position_embeddings`. Absent, `{arch}.context_length`:
  llama.cpp's default, as HF's is `max_position_embeddings`.
* `yarn_beta_fast`, `yarn_beta_slow`: HF `beta_fast`, `beta_slow` (defaults 32 and 1, in llama.cpp as in HF).
* `yarn_attn_factor`: the converter writes HF's `attention_factor` here, so we read it back as that: the
  total factor multiplying cos and sin.
* `yarn_ext_factor`: llama.cpp's weight of the ramp between extrapolated and interpolated frequencies. HF's
  YaRN is weight 1, llama.cpp's value when unset (stored negative); any other weight has no HF equivalent.
* `yarn_log_multiplier`: DeepSeek's 0.1 x `mscale_all_dim` (llama.cpp assumes `mscale` 1 beside it); HF's
  attention factor needs both, and the file holds one, so only 0 (unset) is accepted.
* `attn_factor`: a factor llama.cpp multiplies cos and sin by under every scaling type (set for LongRoPE
  models); HF has none for linear or Llama 3 scaling, so only 1 is accepted.
* `alpha`: the NTK alpha of HunYuan's XD-RoPE; only 0 (unset) is accepted.
* `finetuned`: informational; it changes no number.

Any other key under `{arch}.rope.scaling.` is refused by name: a key we do not know may change the numbers.

NOTE: llama.cpp's own hyper-parameter loaders for Llama and Qwen2 read none of the `yarn_*` keys (its YaRN
attention factor is moreover recomputed as 0.1 ln(factor) + 1 whenever YaRN is on, since its PR 17945), so
llama.cpp runs such a file with HF's default betas and attention factor whatever the keys say. We follow the
converter's source, the HF checkpoint, as the safetensors loader does; the two agree wherever the keys are
absent or hold HF's defaults, as in Qwen2.5's and Qwen3's exports, which carry type, factor and
original_context_length only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvserve.model.paths import ModelLoadError

_SCALING = "rope.scaling."
# YaRN keys read into HF rope parameters: GGUF key (under rope.scaling.) -> HF name.
_YARN_PARAMETERS = {
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "yarn_attn_factor": "attention_factor",
}
# key -> (the only value accepted, why another has no HF equivalent)
_NEUTRAL_VALUES: dict[str, tuple[float, str]] = {
    "attn_factor": (
        1.0,
        "llama.cpp multiplies cos and sin by it under every scaling type (on top of YaRN's own factor), "
        "and HF's rope types have no such factor",
    ),
    "alpha": (0.0, "it is XD-RoPE's NTK alpha, which HF's rope types do not have"),
    "yarn_log_multiplier": (
        0.0,
        "it is DeepSeek's 0.1 x mscale_all_dim, and HF's YaRN attention factor needs mscale beside it, which "
        "the file does not hold",
    ),
}
_KNOWN_KEYS = frozenset(
    {"type", "factor", "original_context_length", "finetuned", "yarn_ext_factor", *_YARN_PARAMETERS,
     *_NEUTRAL_VALUES}
)
_SUPPORTED_TYPES = ("none", "linear", "yarn")


def rope_scaling_from_gguf(
    metadata: Mapping[str, Any], arch: str, context_length: int
) -> dict[str, Any] | None:
    """HF rope parameters ({"rope_type": ..., ...}, as `ArchConfig.rope_scaling`) from a GGUF file's metadata
    (`GGUFInfo.metadata`) for `general.architecture` `arch`; None for plain RoPE. `context_length`: the
    file's `{arch}.context_length`. Raises ModelLoadError naming the key whose value HF's rope types cannot
    express."""
    prefix = f"{arch}.{_SCALING}"
    keys = {name[len(prefix):]: value for name, value in metadata.items() if name.startswith(prefix)}
    unknown = sorted(set(keys) - _KNOWN_KEYS)
    if unknown:
        raise ModelLoadError(
            f"GGUF key {prefix}{unknown[0]} is not supported (kvserve reads {prefix}"
            f"{{{', '.join(sorted(_KNOWN_KEYS))}}})"
        )
    for name, (neutral, reason) in _NEUTRAL_VALUES.items():
        if name in keys and float(keys[name]) != neutral:
            raise ModelLoadError(
                f"GGUF key {prefix}{name} = {_float32_decimal(keys[name])} is not supported: {reason} (only "
                f"{neutral} is accepted)"
            )

    scaling_type = keys.get("type", "linear")
    if scaling_type not in _SUPPORTED_TYPES:
        raise ModelLoadError(
            f"GGUF rope scaling type {scaling_type!r} ({prefix}type) is not supported (supported: "
            f"{', '.join(_SUPPORTED_TYPES)})"
        )
    if scaling_type != "yarn":
        yarn_keys = sorted(name for name in keys if name.startswith("yarn_"))
        if yarn_keys:
            raise ModelLoadError(
                f"GGUF key {prefix}{yarn_keys[0]} applies to YaRN only, but {prefix}type is {scaling_type!r}"
            )
    factor = keys.get("factor") or metadata.get(f"{arch}.rope.scale_linear") or 1.0
    if scaling_type == "none" or (scaling_type == "linear" and factor == 1.0):
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": _float32_decimal(factor)}

    ext_factor = keys.get("yarn_ext_factor")
    if ext_factor is not None and ext_factor >= 0 and float(ext_factor) != 1.0:
        raise ModelLoadError(
            f"GGUF key {prefix}yarn_ext_factor = {_float32_decimal(ext_factor)} is not supported: HF "
            f"Transformers' YaRN mixes the extrapolated frequencies in with weight 1 (only 1, or a negative "
            f"value for unset, is accepted)"
        )
    params: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": _float32_decimal(factor),
        "original_max_position_embeddings": int(keys.get("original_context_length") or context_length),
    }
    for gguf_name, hf_name in _YARN_PARAMETERS.items():
        if keys.get(gguf_name) is not None:
            params[hf_name] = _float32_decimal(keys[gguf_name])
    return params


def _float32_decimal(value: float) -> float:
    """The shortest decimal that reads back as float32 `value`: GGUF stores these parameters as float32, and
    the converter wrote them from the checkpoint's decimals (4.0, 1.1, ...), which this recovers so that the
    numbers derived from them (YaRN's attention factor, the longest position) are computed as from
    config.json. Values not representable in float32 (a float64 field) are returned unchanged."""
    value = float(value)
    as_float32 = np.float32(value)
    if float(as_float32) != value:
        return value
    return float(str(as_float32))
