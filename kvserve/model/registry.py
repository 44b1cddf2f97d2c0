"""The `CausalLM` contract every model implements, and the table from HF architecture name to class.

Entries are (module, class name) strings imported on first use, so listing the supported architectures
(config validation, error messages) does not import every model.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from kvserve.layers.attention_metadata import AttentionMetadata
    from kvserve.model.arch import ArchConfig


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over a paged KV cache.

    Constructed as ``cls(arch, dtype)`` with uninitialised parameters on the current default device
    (the loader wraps construction in ``with torch.device(device)``), then filled by `load_weights`.
    """

    arch: ArchConfig
    # The model's dtype (activations, weights of dense layers); the KV cache may be fp8 (--kv-cache-dtype).
    dtype: torch.dtype
    # The shapes of this rank's layers (heads, MLP width): `arch` itself without tensor parallelism.
    layer_arch: ArchConfig

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step over a flat batch.

        input_ids, positions: int64 [num_tokens]; kv_caches: one tensor per layer shaped
        [2, num_blocks, block_size, num_kv_heads, head_dim] in the model dtype or fp8 (this step's K/V are
        written into it); returns the final hidden states [num_tokens, hidden_size] in the model dtype. With
        output_rows (int64 [n] token indices on the model's device), only those rows' states [n,
        hidden_size], in that order: the model may then skip the work no other row needs (the last layer
        past its cache write); the cache is written for every token either way.
        """

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden_size] -> logits [n, vocab_size] in the model dtype."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors named as in HF Transformers into the parameters (casting dtype/device).

        Raises `ModelLoadError` on an unknown name, a shape mismatch, or a parameter left unloaded. Ends with
        `finish_loading`.
        """

    def finish_loading(self) -> None:  # noqa: B027 - optional hook, nothing to do for dense models
        """Called once every parameter holds its values (after `load_weights`, or the dummy fill): layers
        that convert what they loaded (quantized weights) do it here."""


# HF `architectures[0]` -> (module, class). Qwen2/Qwen3 differ from Llama only in flags carried by
# ArchConfig (qkv bias, q/k norm), and Qwen3-MoE / Qwen2-MoE / Mixtral in their layers' MLP (a mixture of experts,
# Qwen2-MoE's with a shared expert), so one decoder implementation serves all six.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("kvserve.model.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("kvserve.model.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("kvserve.model.llama", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("kvserve.model.llama", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("kvserve.model.llama", "Qwen2MoeForCausalLM"),
    "MixtralForCausalLM": ("kvserve.model.llama", "MixtralForCausalLM"),
}


def supported_architectures() -> list[str]:
    """HF architecture names kvserve can load, sorted."""
    return sorted(_MODELS)


def is_supported_architecture(architecture: str) -> bool:
    return architecture in _MODELS


def get_model_class(architecture: str) -> type[CausalLM]:
    """The class implementing `architecture`; `ModelLoadError` naming the supported ones otherwise."""
    entry = _MODELS.get(architecture)
    if entry is None:
        from kvserve.model.paths import ModelLoadError

        raise ModelLoadError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())}"
        )
    module_name, class_name = entry
    cls = getattr(importlib.import_module(module_name), class_name)
    if not issubclass(cls, CausalLM):
        raise TypeError(f"{module_name}.{class_name} does not implement CausalLM")
    return cls
