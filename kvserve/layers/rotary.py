"""Rotary position embedding (neox / rotate-half layout, as HF Llama and Qwen apply it).

The cos/sin table is computed once, in float32 on the CPU, with the same operations HF Transformers uses
(inverse frequencies from `rope_theta`, then ``position * inv_freq``), so the rotated q/k are bit-identical
to HF's in float32. Scaling variants only change the inverse frequencies and, for YaRN, an attention factor
that multiplies cos and sin; each is one function in a table. Every rotary path (the torch reference, the
Triton rotary kernel, the q/k/v matmul's rope epilogue) reads this one table, so a scaling type never
reaches a kernel: it only changes the table's values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvserve.kernels import ops

InvFreqFn = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]
# (head_dim, theta, params) -> (inverse frequencies, attention factor multiplying cos and sin)
RopeFn = Callable[[int, float, dict[str, Any]], tuple[torch.Tensor, float]]


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # Same expression as HF: exponent computed from int64 steps cast to float32, then float base ** it.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta**exponents)


def _no_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    del params
    return inv_freq


def _linear_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Position interpolation: positions divided by `factor`, i.e. every frequency divided by it.
    return inv_freq / float(params["factor"])


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor (its paper's eq. 21): 0.1 * mscale * ln(factor) + 1, and 1 for factor <= 1."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _yarn(head_dim: int, theta: float, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (NTK-by-parts): frequencies that turn more than `beta_fast` times over the pre-training length
    are kept (extrapolated), those turning fewer than `beta_slow` times are divided by `factor`
    (interpolated), with a linear ramp over the dimensions in between; cos and sin are multiplied by the
    attention factor. Static, as HF Transformers and vLLM apply it: the same table at every length.

    The operations and their order follow HF Transformers' `_compute_yarn_parameters`, so the table is
    bit-identical to the one HF's rotary embedding computes in float32.
    """
    factor = params["factor"]
    original_len = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    # 0 or None mean the defaults, as in HF.
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The (fractional) dimension whose frequency turns `num_rotations` times over the pre-training length.
        return (head_dim * math.log(original_len / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid dividing by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)

    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, float(attention_factor)


def _from_inv_freq_transform(transform: InvFreqFn) -> RopeFn:
    """A RopeFn for a type that only transforms the default frequencies (attention factor 1)."""

    def rope(head_dim: int, theta: float, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
        return transform(_default_inv_freq(head_dim, theta), params), 1.0

    return rope


# rope_type -> (frequencies and attention factor, parameters it requires)
_ROPE_TYPES: dict[str, tuple[RopeFn, tuple[str, ...]]] = {
    "default": (_from_inv_freq_transform(_no_scaling), ()),
    "linear": (_from_inv_freq_transform(_linear_scaling), ("factor",)),
    "llama3": (
        _from_inv_freq_transform(_llama3_scaling),
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    ),
    "yarn": (_yarn, ("factor", "original_max_position_embeddings")),
}


def supported_rope_types() -> list[str]:
    return sorted(_ROPE_TYPES)


def check_rope_scaling(rope_scaling: dict[str, Any] | None) -> None:
    """Raise ValueError when `rope_scaling` names an unknown type or lacks a parameter its type needs."""
    if rope_scaling is None:
        return
    rope_type = rope_scaling.get("rope_type")
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(supported_rope_types())}"
        )
    missing = [key for key in _ROPE_TYPES[rope_type][1] if rope_scaling.get(key) is None]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs {', '.join(missing)} in the rope parameters")


def compute_rope_parameters(
    head_dim: int,
    theta: float,
    rope_scaling: dict[str, Any] | None = None,
    freq_factors: tuple[float, ...] | None = None,
) -> tuple[torch.Tensor, float]:
    """(float32 [head_dim // 2] inverse frequencies on the CPU, attention factor multiplying cos and sin).

    `freq_factors` (GGUF `rope_freqs`) divide the frequencies as llama.cpp does; they stand in for a
    scaling type the GGUF metadata does not name.
    """
    check_rope_scaling(rope_scaling)
    rope_type = "default" if rope_scaling is None else rope_scaling["rope_type"]
    rope_fn, _ = _ROPE_TYPES[rope_type]
    inv_freq, attention_factor = rope_fn(head_dim, theta, rope_scaling or {})
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32, device="cpu")
    return inv_freq, attention_factor


def compute_inv_freq(
    head_dim: int,
    theta: float,
    rope_scaling: dict[str, Any] | None = None,
    freq_factors: tuple[float, ...] | None = None,
) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies on the CPU (`compute_rope_parameters` without the
    attention factor)."""
    return compute_rope_parameters(head_dim, theta, rope_scaling, freq_factors)[0]


def compute_cos_sin_cache(inv_freq: torch.Tensor, max_position: int, attention_factor: float = 1.0) -> torch.Tensor:
    """float32 [max_position, head_dim]: cos of every frequency in the first half, sin in the second, both
    multiplied by `attention_factor` (YaRN's; HF multiplies by it always, and by 1.0 exactly otherwise)."""
    positions = torch.arange(max_position, dtype=torch.int64, device=inv_freq.device).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q/k for absolute positions < `max_position`.

    The table is a float32 non-persistent buffer: it follows `.to(device)` but is not a weight, and must stay
    float32 (never call `.half()` on the model; the loader builds parameters in their dtype directly).
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        rope_scaling: dict[str, Any] | None = None,
        freq_factors: tuple[float, ...] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq, attention_factor = compute_rope_parameters(head_dim, theta, rope_scaling, freq_factors)
        # NOTE: computed on the CPU (as HF does at init) so the table does not depend on the device's
        # transcendental functions, then moved to wherever the model is being built.
        cache = compute_cos_sin_cache(inv_freq, max_position, attention_factor)
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_device()), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 [num_tokens]; query [num_tokens, num_heads, head_dim]; key [num_tokens,
        num_kv_heads, head_dim]. Returns the rotated (query, key) in their dtype."""
        return ops.rotary_embedding(positions, query, key, self.cos_sin_cache)

    def forward_and_cache(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the rotated key and `value` written into `kv_cache` at `slot_mapping` (the
        contract of `ops.reshape_and_cache`; the scales are an fp8 cache's). Returns the rotated (query, key)."""
        return ops.rotary_embedding_and_cache(
            positions, query, key, value, self.cos_sin_cache, kv_cache, slot_mapping, k_scale=k_scale,
            v_scale=v_scale,
        )

    def forward_and_cache_padded(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        pad_to: int,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward_and_cache`, returning (query, key, value) padded with zero rows to pad_to rows, contiguous
        (`ops.rotary_embedding_and_cache_padded`)."""
        return ops.rotary_embedding_and_cache_padded(
            positions, query, key, value, self.cos_sin_cache, kv_cache, slot_mapping, pad_to, k_scale=k_scale,
            v_scale=v_scale,
        )
