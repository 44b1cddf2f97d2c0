"""The one-prompt prefill attention call (`ops._sdpa_prefill`): layout, GQA without repeated KV heads, and
the backend-order wrapper, against the torch reference. On CPU SDPA runs its CPU kernels; which CUDA backend
the order picks is checked on the GPU (tests/gpu/test_gpu_ops.py)."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import ops, reference
from kvserve.layers.attention_metadata import AttentionMetadata


@pytest.mark.parametrize("tokens", [7, ops.SDPA_CUDNN_MIN_TOKENS + 5])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_sdpa_prefill_matches_reference(tokens: int, heads: tuple[int, int]) -> None:
    num_heads, num_kv_heads = heads
    head_dim, block_size = 16, 16
    gen = torch.Generator().manual_seed(tokens)
    query = torch.randn(tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    num_blocks = -(-tokens // block_size)
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
        seq_lens=torch.tensor([tokens], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(tokens, dtype=torch.int64),
        max_query_len=tokens, max_seq_len=tokens, query_start_loc_cpu=[0, tokens], seq_lens_cpu=[tokens],
    )
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    reference.reshape_and_cache(key, value, kv_cache, md.slot_mapping)
    scale = 0.3
    out = ops._sdpa_prefill(query, key, value, scale)
    assert out.shape == query.shape
    torch.testing.assert_close(out, reference.paged_attention(query, kv_cache, md, scale), atol=1e-5, rtol=1e-4)
