"""Paged attention as a layer over the KV cache, which already holds this step's K/V."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import ops
from kvserve.layers.attention_metadata import AttentionMetadata


class Attention(nn.Module):
    """Causal GQA attention of a flat batch over the paged KV cache (see `attention_metadata` for layout).

    Query head h reads KV head h // (num_heads // num_kv_heads); scores are scaled by `scale`
    (head_dim ** -0.5 for Llama/Qwen).

    k_scale / v_scale: this layer's fp8 KV cache scales (the cache stores x / scale and is read back as
    value * scale; ignored for a cache in the model's dtype). Plain floats, which the kernels take as launch
    arguments (CUDA graphs bake them at capture, after loading): 1.0, vLLM's default for a checkpoint without
    scales, or this layer's checkpoint scales (`checkpoint_kv_scales`) once `use_kv_cache_scales` is told the
    cache is fp8.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_scale = 1.0
        self.v_scale = 1.0
        # (k_scale, v_scale) as the checkpoint gives them for this layer (the model's `load_weights`), None
        # where it has none.
        self.checkpoint_kv_scales: tuple[float, float] | None = None

    def use_kv_cache_scales(self, fp8_cache: bool) -> None:
        """Sets k_scale / v_scale for the KV cache the layer will run over: the checkpoint's scales (else 1.0)
        for an fp8 cache, 1.0 for a cache in the model's dtype, whatever the checkpoint carries (as vLLM)."""
        scales = self.checkpoint_kv_scales if fp8_cache else None
        self.k_scale, self.v_scale = scales or (1.0, 1.0)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim]; key/value [num_tokens, num_kv_heads, head_dim] (or all
        three padded with zero rows as `ops.prefill_attention_padding` asks);
        kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] in the same dtype or fp8, already holding
        this step's key/value (the paged kernel reads every key from there; the model writes them together with
        the rotary embedding, `ops.rotary_embedding_and_cache`).
        Returns [num_tokens, num_heads, head_dim] in query's dtype, written into `out` (that shape, contiguous)
        when given."""
        # Fresh prompts only (GPU): flash attention over this step's own K/V, no cache reads (in the model's
        # dtype even over an fp8 cache). Every cache read is fp8, the last layer's sampled rows included
        # (`forward_cached`, under last-layer pruning).
        result = ops.prefill_attention(query, key, value, attn_metadata, self.scale)
        if result is not None:
            return result if out is None else out.copy_(result)
        return ops.paged_attention(query[: attn_metadata.num_tokens], kv_cache, attn_metadata, self.scale, out,
                                   k_scale=self.k_scale, v_scale=self.v_scale)

    def forward_cached(self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Attention of query [num_tokens, num_heads, head_dim] over the cache alone (every key the metadata
        names is already there): [num_tokens, num_heads, head_dim]."""
        return ops.paged_attention(query, kv_cache, attn_metadata, self.scale, k_scale=self.k_scale,
                                   v_scale=self.v_scale)
