"""Shared test helpers: paged-attention batches built by hand.

* `make_kv_caches(arch, num_blocks, block_size, dtype)`: one zeroed cache per layer, in the layout of
  `kvserve.layers.attention_metadata` ([2, num_blocks, block_size, num_kv_heads, head_dim]).
* `make_attn_metadata(requests, block_size)`: an `AttentionMetadata` for a batch described per request as
  `RequestSlice(block_ids, num_cached_tokens, num_new_tokens)`; slot mapping derived from the block ids.
* `run_model(model, requests, token_ids, kv_caches, block_size)`: one forward of a batch, returning float32
  logits for every new token, request after request.

Tiny HF checkpoints live in `helpers.tiny_models`; session fixtures in `tests/conftest.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.layers.attention_metadata import AttentionMetadata
from kvserve.model.arch import ArchConfig


@dataclass(frozen=True)
class RequestSlice:
    """One request's part of a step: its blocks (in token order), tokens already in the cache, new tokens."""

    block_ids: tuple[int, ...]
    num_cached_tokens: int
    num_new_tokens: int

    @property
    def seq_len(self) -> int:
        return self.num_cached_tokens + self.num_new_tokens


def make_kv_caches(
    arch: ArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(arch.num_hidden_layers)]


def make_attn_metadata(requests: list[RequestSlice], block_size: int) -> AttentionMetadata:
    """Metadata for `requests` in batch order; raises if a request's blocks cannot hold its tokens."""
    query_start_loc = [0]
    slots: list[int] = []
    for req in requests:
        if len(req.block_ids) * block_size < req.seq_len:
            raise ValueError(f"{len(req.block_ids)} blocks cannot hold {req.seq_len} tokens")
        for pos in range(req.num_cached_tokens, req.seq_len):
            slots.append(req.block_ids[pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(query_start_loc[-1] + req.num_new_tokens)
    width = max(len(req.block_ids) for req in requests)
    tables = [list(req.block_ids) + [0] * (width - len(req.block_ids)) for req in requests]
    seq_lens = [req.seq_len for req in requests]
    return AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(req.num_new_tokens for req in requests),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )


def run_model(
    model: torch.nn.Module,
    requests: list[RequestSlice],
    token_ids: list[list[int]],
    kv_caches: list[torch.Tensor],
    block_size: int,
) -> list[torch.Tensor]:
    """Forward the new tokens of each request (token_ids[i] = request i's full sequence so far).

    Returns, per request, float32 logits [num_new_tokens, vocab_size].
    """
    input_ids: list[int] = []
    positions: list[int] = []
    for req, ids in zip(requests, token_ids, strict=True):
        input_ids += ids[req.num_cached_tokens : req.seq_len]
        positions += range(req.num_cached_tokens, req.seq_len)
    metadata = make_attn_metadata(requests, block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(input_ids), torch.tensor(positions), kv_caches, metadata)
        logits = model.compute_logits(hidden)
    return list(logits.split([req.num_new_tokens for req in requests]))
