"""Checks on KV caches written by a padded step against the unpadded step's."""

from __future__ import annotations

import torch


def assert_only_slots_written(got_caches: list[torch.Tensor], want_caches: list[torch.Tensor],
                              slots: torch.Tensor) -> None:
    """Each layer's cache ([2, blocks, block_size, kv_heads, head_dim], zeroed before the step) holds the wanted
    K/V at `slots` (flat slot indices; close, not equal: a matmul over more rows may round differently) and
    zeros everywhere else: padding tokens wrote nothing."""
    for got, want in zip(got_caches, want_caches, strict=True):
        flat_got, flat_want = got.flatten(1, 2), want.flatten(1, 2)
        torch.testing.assert_close(flat_got[:, slots], flat_want[:, slots], rtol=1e-5, atol=1e-5)
        others = torch.ones(flat_got.shape[1], dtype=torch.bool)
        others[slots] = False
        assert flat_got[:, slots].abs().sum() > 0
        assert not flat_got[:, others].any(), "padding tokens must write nothing to the cache"
