"""The one place model code calls kernels through.

Every layer calls `ops.<kernel>(...)`; this module decides which implementation runs, per call, from the
tensors alone (no host sync, so the choice is CUDA-graph safe):

* CPU tensors, or no Triton installed: the torch reference (`kvserve.kernels.reference`).
* CUDA tensors: the Triton launcher of that kernel when the shapes fit its contract (power-of-two head_dim
  >= 16 and block_size for attention, power-of-two head_dim / 2 for rotary), else the reference.

The elementwise kernels (rms_norm, rotary_embedding, silu_and_mul) have a second knob,
`set_elementwise_backend`: "triton" (default), "torch" (the eager reference on the GPU) or "compile"
(`torch.compile` of the reference). The default was chosen by measurement on the H200 (see
docs/perf_notes.md): each Triton kernel is one launch and one pass over memory; the eager reference is
several launches and passes, and `torch.compile` matches Triton per call but adds compile time at start.

Signatures are exactly the reference's (see each function there for the contract: shapes, dtypes, layout).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from kvserve.kernels import reference
from kvserve.layers.attention_metadata import AttentionMetadata

ELEMENTWISE_BACKENDS = ("triton", "torch", "compile")
_elementwise_backend = "triton"


def set_elementwise_backend(name: str) -> None:
    """Choose how rms_norm / rotary_embedding / silu_and_mul run on CUDA tensors (see module docstring)."""
    global _elementwise_backend
    if name not in ELEMENTWISE_BACKENDS:
        raise ValueError(f"elementwise backend must be one of {ELEMENTWISE_BACKENDS}, got {name!r}")
    _elementwise_backend = name


def get_elementwise_backend() -> str:
    return _elementwise_backend


@functools.cache
def _triton_module(name: str) -> ModuleType | None:
    """kvserve.kernels.<name>, or None when Triton is not importable (imported on first GPU use only)."""
    try:
        import importlib

        return importlib.import_module(f"kvserve.kernels.{name}")
    except ImportError:
        return None


@functools.cache
def _compiled(name: str) -> Callable[..., Any]:
    return torch.compile(getattr(reference, name), dynamic=True)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _elementwise_impl(name: str, x: torch.Tensor) -> Callable[..., Any]:
    if not x.is_cuda or _elementwise_backend == "torch":
        return getattr(reference, name)
    if _elementwise_backend == "compile":
        return _compiled(name)
    module = _triton_module("triton_elementwise")
    return getattr(module if module is not None else reference, name)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if key.is_cuda:
        module = _triton_module("triton_cache")
        head_dim = key.shape[2]
        # The Triton kernel needs each token's heads contiguous (true for views of a fused qkv output).
        if (
            module is not None
            and key.stride(2) == 1
            and key.stride(1) == head_dim
            and value.stride(2) == 1
            and value.stride(1) == head_dim
            and kv_cache.is_contiguous()
        ):
            module.reshape_and_cache(key, value, kv_cache, slot_mapping)
            return
    reference.reshape_and_cache(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if query.is_cuda:
        module = _triton_module("triton_attention")
        head_dim, block_size = query.shape[2], kv_cache.shape[2]
        if module is not None and head_dim >= 16 and _is_pow2(head_dim) and _is_pow2(block_size):
            return module.paged_attention(query, kv_cache, metadata, scale, out)
    return reference.paged_attention(query, kv_cache, metadata, scale, out)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return _elementwise_impl("rms_norm", x)(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _elementwise_impl("rotary_embedding", query)
    if impl is not reference.rotary_embedding and not _is_pow2(query.shape[2] // 2):
        impl = reference.rotary_embedding
    return impl(positions, query, key, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _elementwise_impl("silu_and_mul", x)(x)


__all__ = [
    "ELEMENTWISE_BACKENDS",
    "get_elementwise_backend",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "set_elementwise_backend",
    "silu_and_mul",
]
