"""The one-prompt prefill attention call (`ops._sdpa_prefill`): layout, GQA without repeated KV heads and
the cuDNN-first order (on CPU torch skips the CUDA backends and runs its CPU kernels), against the torch
reference. tests/gpu/test_gpu_ops.py runs the same path on the GPU."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import ops, reference
from kvserve.layers.attention_metadata import AttentionMetadata


def _case(tokens: int, num_heads: int, num_kv_heads: int):
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
    return query, key, value, reference.paged_attention(query, kv_cache, md, 0.3)


@pytest.mark.parametrize("tokens", [7, 300])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("cudnn_min_tokens", [0, 200])
def test_sdpa_prefill_matches_reference(
    tokens: int, heads: tuple[int, int], cudnn_min_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ops, "SDPA_CUDNN_MIN_TOKENS", cudnn_min_tokens)
    query, key, value, expected = _case(tokens, *heads)
    out = ops._sdpa_prefill(query, key, value, 0.3)
    assert out.shape == query.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)

