"""ops dispatch on the GPU (skipped without CUDA): the flash prefill path against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import ops, reference
from kvserve.layers.attention_metadata import AttentionMetadata

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("lens", [[2048], [300, 64, 1000]])
@pytest.mark.parametrize("heads", [(28, 4, 128), (9, 3, 64)])
def test_prefill_fast_path_matches_reference(lens: list[int], heads: tuple[int, int, int]) -> None:
    num_heads, num_kv_heads, head_dim = heads
    block_size, dtype, device = 16, torch.bfloat16, "cuda"
    num_tokens = sum(lens)
    query = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    # Each request's blocks in shuffled order, so the reference reads them through the table.
    blocks_per_req = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(blocks_per_req)).tolist()
    tables, slots, start = [], [], 0
    for n, nb in zip(lens, blocks_per_req, strict=True):
        table = perm[start : start + nb]
        start += nb
        tables.append(table + [0] * (max(blocks_per_req) - nb))
        slots += [table[t // block_size] * block_size + t % block_size for t in range(n)]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(lens), max_seq_len=max(lens), query_start_loc_cpu=qsl, seq_lens_cpu=list(lens),
    )
    kv_cache = torch.zeros(2, len(perm), block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    reference.reshape_and_cache(key, value, kv_cache, md.slot_mapping)
    scale = head_dim**-0.5
    out = ops.prefill_attention(query, key, value, md, scale)
    assert out is not None, "the fast path did not apply"
    expected = reference.paged_attention(query, kv_cache, md, scale)
    err = (out.float() - expected.float()).norm() / expected.float().norm()
    assert err < 1e-2, f"relative error {err:.2e}"
