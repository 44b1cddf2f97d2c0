"""Per-request block tables on top of the block pool, with prefix-cache lookup.

A full block's hash chains its parent's hash, its token ids and extra keys (the request's `cache_salt`,
and for n>1 samples with prefix caching off, the sample group), so equal hashes mean equal prefixes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.core.block_pool import BlockPool, KVCacheBlock
from kvserve.core.request import Request


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> bytes:
    """128-bit digest of (parent hash, block token ids, extra keys). Collisions would silently reuse the
    wrong K/V, so a cryptographic-strength hash is used rather than Python's `hash`."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"\x00" * 16)
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\xff" + key.encode("utf-8"))
    return h.digest()


@dataclass
class PrefixCacheStats:
    """Counted per admission of a request (incl. resumption after preemption)."""

    num_queries: int = 0  # tokens looked up
    num_hits: int = 0  # tokens found


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Hashing stays on when caching is off so that n>1 samples still share their prompt blocks
        # (their hashes carry a group key no other request has).
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request have been offered to the hash map.
        self._num_cached_blocks: dict[str, int] = {}
        # Sample-group key per request, used only when prefix caching is off.
        self._group_keys: dict[str, str] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def set_group(self, request: Request, group_key: str | None) -> None:
        """Mark `request` as one sample of an n>1 request, so siblings share prompt blocks."""
        if group_key is not None:
            self._group_keys[request.req_id] = group_key

    def _extra_keys(self, request: Request) -> tuple[str, ...]:
        keys: list[str] = []
        if request.cache_salt:
            keys.append("salt:" + request.cache_salt)
        if not self.enable_caching:
            group = self._group_keys.get(request.req_id)
            keys.append("group:" + str(group))
        return tuple(keys)

    def _hashes_blocks(self, request: Request) -> bool:
        return self.enable_caching or request.req_id in self._group_keys

    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its current tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        num_full = request.num_tokens // bs
        # Called for every scheduled request every step; most steps complete no new block.
        if len(hashes) >= num_full or not self._hashes_blocks(request):
            return
        extra = self._extra_keys(request)
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, request.all_token_ids[i * bs : (i + 1) * bs], extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        Returns (blocks, num_computed_tokens). NOTE: when every token hits, the last block is not taken:
        the last token must still run through the model to produce logits.
        """
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens could ever hold its blocks (an empty pool's worth)."""
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Give `request` blocks for `num_new_tokens` more tokens after its computed ones (and after
        `new_computed_blocks`, prefix hits being adopted now). Returns the newly allocated blocks, or None
        (and changes nothing) when the pool cannot supply them."""
        bs = self.block_size
        blocks = self.req_to_blocks.get(request.req_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        num_needed = cdiv(num_computed + num_new_tokens, bs) - len(blocks) - len(new_computed_blocks)
        # Hits sitting in the free list stop being allocatable once we take them.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            return None
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        self.req_to_blocks[request.req_id] = blocks
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's blocks that will be full after `num_tokens` tokens to the hash map.

        Blocks enter the map when scheduled, before this step's forward writes them: a request admitted
        later in the same step may hit them, which is safe because every layer writes this step's K/V
        before any attention reads the cache.
        """
        self._update_block_hashes(request)
        blocks = self.req_to_blocks[request.req_id]
        start = self._num_cached_blocks.get(request.req_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.req_id] = max(start, end)

    def cache_computed_blocks(self, request: Request) -> None:
        """Offer the blocks that are full of known, computed (or in-flight) tokens to the hash map. With
        async scheduling a block completed by a placeholder token is hashable only once the token arrives;
        the scheduler calls this then, so the block is cached even if the request is never scheduled
        again (it may finish on that very token)."""
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= self._num_cached_blocks.get(request.req_id, 0) or request.req_id not in self.req_to_blocks:
            return
        self._cache_full_blocks(request, request.num_computed_tokens)

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        if not self.enable_caching:
            return
        self.stats.num_queries += request.num_tokens
        self.stats.num_hits += num_hit_tokens

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so its prefix stays cached longest)."""
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self._num_cached_blocks.pop(request.req_id, None)
        self.pool.free_blocks(reversed(blocks))

    def forget(self, request: Request) -> None:
        """Drop per-request bookkeeping of a finished request (after `free`)."""
        self._group_keys.pop(request.req_id, None)

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, [])]

    def num_blocks_of(self, req_id: str) -> int:
        return len(self.req_to_blocks.get(req_id, ()))

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            assert len({b.block_id for b in blocks}) == len(blocks), "a request holds a block twice"
            for block in blocks:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"{block} ref count differs from the number of requests holding it "
                f"({refs.get(block.block_id, 0)})"
            )
