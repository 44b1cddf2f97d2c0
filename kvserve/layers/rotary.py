"""Rotary position embedding (neox / rotate-half layout, as HF Llama and Qwen apply it).

The cos/sin table is computed once, in float32 on the CPU, with the same operations HF Transformers uses
(inverse frequencies from `rope_theta`, then ``position * inv_freq``), so the rotated q/k are bit-identical
to HF's in float32. Scaling variants only change the inverse frequencies; each is one function in a table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvserve.kernels import ops

InvFreqFn = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]


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


# rope_type -> (inverse-frequency transform, parameters it requires)
_ROPE_TYPES: dict[str, tuple[InvFreqFn, tuple[str, ...]]] = {
    "default": (_no_scaling, ()),
    "linear": (_linear_scaling, ("factor",)),
    "llama3": (
        _llama3_scaling,
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    ),
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
    missing = [key for key in _ROPE_TYPES[rope_type][1] if key not in rope_scaling]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs {', '.join(missing)} in the rope parameters")


def compute_inv_freq(
    head_dim: int,
    theta: float,
    rope_scaling: dict[str, Any] | None = None,
    freq_factors: tuple[float, ...] | None = None,
) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies on the CPU.

    `freq_factors` (GGUF `rope_freqs`) divide the frequencies as llama.cpp does; they stand in for a
    scaling type the GGUF metadata does not name.
    """
    check_rope_scaling(rope_scaling)
    inv_freq = _default_inv_freq(head_dim, theta)
    if rope_scaling is not None:
        transform, _ = _ROPE_TYPES[rope_scaling["rope_type"]]
        inv_freq = transform(inv_freq, rope_scaling)
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32, device="cpu")
    return inv_freq


def compute_cos_sin_cache(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """float32 [max_position, head_dim]: cos of every frequency in the first half, sin in the second."""
    positions = torch.arange(max_position, dtype=torch.int64, device=inv_freq.device).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


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
        inv_freq = compute_inv_freq(head_dim, theta, rope_scaling, freq_factors)
        # NOTE: computed on the CPU (as HF does at init) so the table does not depend on the device's
        # transcendental functions, then moved to wherever the model is being built.
        cache = compute_cos_sin_cache(inv_freq, max_position)
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the rotated key and `value` written into `kv_cache` at `slot_mapping` (the
        contract of `ops.reshape_and_cache`). Returns the rotated (query, key)."""
        return ops.rotary_embedding_and_cache(
            positions, query, key, value, self.cos_sin_cache, kv_cache, slot_mapping
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward_and_cache`, returning (query, key, value) padded with zero rows to pad_to rows, contiguous
        (`ops.rotary_embedding_and_cache_padded`)."""
        return ops.rotary_embedding_and_cache_padded(
            positions, query, key, value, self.cos_sin_cache, kv_cache, slot_mapping, pad_to
        )
