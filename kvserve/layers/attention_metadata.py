"""The per-step description of a batch that every attention backend reads.

One step's batch is a flat list of `num_tokens` query tokens belonging to `num_reqs` requests, each
request's tokens contiguous and in order. A request contributes `query_len = query_start_loc[i+1] -
query_start_loc[i]` new tokens (a prefill chunk, or 1 for decode) whose absolute positions are
`seq_lens[i] - query_len ... seq_lens[i] - 1`; the earlier `seq_lens[i] - query_len` tokens are already in
the KV cache (computed in earlier steps or found by prefix caching).

KV cache layout (one tensor per layer): ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` where index
0 is K and 1 is V. Token ``t`` of request ``i`` lives in block ``block_tables[i, t // block_size]`` at
offset ``t % block_size``. The new tokens' K/V are written at ``slot_mapping`` (``block_id * block_size +
offset``) before attention reads the cache, so a request may attend to blocks another request of the same
step writes (prefix-cache hits on blocks computed in this very step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Tensors on the model's device unless named `*_cpu`.

    query_start_loc: int32 [num_reqs + 1], cumulative query lengths, query_start_loc[0] = 0.
    seq_lens: int32 [num_reqs], context length after this step (cached + new tokens).
    block_tables: int32 [num_reqs, max_num_blocks_per_req], padded with 0 past a request's blocks.
    slot_mapping: int64 [num_tokens], cache slot of each new token.
    max_query_len / max_seq_len: host ints (kernel grid sizing, no device sync needed).
    query_start_loc_cpu / seq_lens_cpu: host copies for backends that loop on the host.
    common_prefix_len: decode-only batches: how many leading tokens every request shares in the same
        cache blocks (> 0 only when the runner chose cascade attention; then < every request's seq_len).
        Backends may attend to those keys once for the whole batch; the result is the same attention.
    common_prefix_len_tensor: the same number, int32 [1] on the device (what the kernels read, so that a
        CUDA graph captured for cascade serves any prefix length); set whenever common_prefix_len > 0.
    sampled: for a step where not every token samples, the same step seen from its sampling tokens alone
        (each request's last new token, in the order of `logits_indices`) as a decode batch: one query per
        such request over its whole context, `last_token_metadata(self, those requests)`. The model's last
        layer attends only for them once every token's K/V is in the cache. None: not built (attend for
        every token and select).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    common_prefix_len: int = 0
    common_prefix_len_tensor: torch.Tensor | None = None
    sampled: AttentionMetadata | None = None
    # Per-step derived data a backend builds once and reuses in every layer (keyed by backend name).
    backend_cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def last_token_metadata(metadata: AttentionMetadata, req_indices: list[int]) -> AttentionMetadata:
    """Decode-style metadata for the last new token of each of `metadata`'s requests named in req_indices
    (in that order): one query each, over the request's seq_len tokens and its block-table row. The
    last token of a request attends to every key of its context, so its attention under this metadata
    equals its row of the whole step's attention once the step's K/V are in the cache. Allocates new
    tensors (the runner fills the same from persistent buffers, `InputBuffers.prepare`)."""
    device = metadata.seq_lens.device
    index = torch.tensor(req_indices, dtype=torch.int64, device=device)
    seq_lens = [metadata.seq_lens_cpu[i] for i in req_indices]
    starts = list(range(len(req_indices) + 1))
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=metadata.seq_lens.index_select(0, index),
        block_tables=metadata.block_tables.index_select(0, index),
        slot_mapping=metadata.slot_mapping.new_empty(0),  # the step's writes are done: none here
        max_query_len=1,
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
