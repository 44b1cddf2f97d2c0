"""Per-request block tables on top of the block pool, with prefix-cache lookup.

A full block's hash chains its parent's hash, its token ids and extra keys (the request's `cache_salt`,
and for n>1 samples with prefix caching off, the sample group), so equal hashes mean equal prefixes.

Hashing a long prompt's blocks takes milliseconds of host time (512 blocks of an 8,192-token prompt: about
2 ms on the CI machine's CPU). With `DEFERRED_BLOCK_CACHING`, `allocate_slots` records the blocks to cache
and `flush` hashes them and offers them to the hash map. The engine core flushes right after it launches
a step (`Scheduler.cache_scheduled_blocks`), so the hashing of the step's last allocations runs while the
GPU computes, instead of delaying the launch (a one-prompt TTFT used to pay it in full). A lookup, a free,
`cache_computed_blocks` and an allocation that takes free blocks (it may evict) flush before they act, and
a deferred request is cached only up to the tokens it had when it was scheduled. So the map each of them
meets is the one caching at allocation would have left, and the engine's scheduling is unchanged (a
property test compares both). A lookup hashes a request's blocks only up to its first miss.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvserve.core.block_pool import BlockPool, KVCacheBlock
from kvserve.core.request import Request

_NO_PARENT = b"\x00" * 16

# False: hash and cache scheduled blocks inside schedule() (for measuring; see the module docstring). Read
# when a KVCacheManager is made.
DEFERRED_BLOCK_CACHING = True


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> bytes:
    """128-bit digest of (parent hash, block token ids, extra keys). Collisions would silently reuse the
    wrong K/V, so a cryptographic-strength hash is used rather than Python's `hash`."""
    data = (parent_hash or _NO_PARENT) + array("q", token_ids).tobytes() + _key_bytes(extra_keys)
    return hashlib.blake2b(data, digest_size=16).digest()


def hash_blocks(
    parent_hash: bytes | None, token_ids: Sequence[int], block_size: int, extra_keys: tuple[str, ...] = ()
) -> list[bytes]:
    """`hash_block` of each consecutive block of `block_size` tokens of token_ids (a whole number of blocks),
    each chained to the one before: one conversion of the ids and one digest call per block."""
    if block_size <= 0 or len(token_ids) % block_size:
        raise ValueError(f"{len(token_ids)} tokens are not whole blocks of {block_size}")
    data = array("q", token_ids).tobytes()
    suffix = _key_bytes(extra_keys)
    step = block_size * 8  # bytes per block ("q" is 8 bytes)
    parent = parent_hash or _NO_PARENT
    out: list[bytes] = []
    for start in range(0, len(data), step):
        parent = hashlib.blake2b(parent + data[start : start + step] + suffix, digest_size=16).digest()
        out.append(parent)
    return out


def _key_bytes(extra_keys: tuple[str, ...]) -> bytes:
    return b"".join(b"\xff" + key.encode("utf-8") for key in extra_keys)


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
        # Requests with blocks scheduled but not yet offered to the hash map: req_id -> (request, the token
        # count its full blocks are to be cached up to). Emptied by `flush`.
        self._deferred: dict[str, tuple[Request, int]] = {}
        self.defers_caching = DEFERRED_BLOCK_CACHING
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

    def _update_block_hashes(self, request: Request, max_blocks: int | None = None) -> None:
        """Extend request.block_hashes to cover every full block of its current tokens (the first
        `max_blocks` of them at most, when given)."""
        bs = self.block_size
        hashes = request.block_hashes
        num_full = request.num_tokens // bs
        if max_blocks is not None:
            num_full = min(num_full, max_blocks)
        # Called for every scheduled request every step; most steps complete no new block.
        if len(hashes) >= num_full or not self._hashes_blocks(request):
            return
        start = len(hashes)
        hashes.extend(hash_blocks(hashes[-1] if hashes else None, request.all_token_ids[start * bs : num_full * bs],
                                  bs, self._extra_keys(request)))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        Returns (blocks, num_computed_tokens). NOTE: when every token hits, the last block is not taken:
        the last token must still run through the model to produce logits. Hashes the request's blocks up
        to the first miss only; caching its blocks hashes the rest.
        """
        self.flush()
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for i in range(max_hit_blocks):
            self._update_block_hashes(request, i + 1)
            if len(request.block_hashes) <= i:
                break  # this request's blocks are not hashed (no caching, no sample group)
            block = self.pool.get_cached_block(request.block_hashes[i])
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
        blocks = self.req_to_blocks.get(request.req_id)
        num_held = len(blocks) if blocks is not None else 0
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        num_needed = cdiv(num_computed + num_new_tokens, bs) - num_held - len(new_computed_blocks)
        # Hits sitting in the free list stop being allocatable once we take them.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if new_computed_blocks else 0
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            return None
        if blocks is None:
            blocks = self.req_to_blocks[request.req_id] = []
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        if num_needed > 0:
            if self._deferred:
                # Taking free blocks may evict cached hashes; deferred blocks enter the map first, as they
                # would have without the deferral.
                self.flush()
            new_blocks = self.pool.get_new_blocks(num_needed)
            blocks.extend(new_blocks)
        else:  # a decode step inside the last block: the common case
            new_blocks = []
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's blocks that will be full after `num_tokens` tokens to the hash map, now or
        (deferring) at the next `flush`.

        Blocks enter the map once scheduled, before this step's forward writes them: a request admitted
        later in the same step may hit them, which is safe because every layer writes this step's K/V
        before any attention reads the cache. Only blocks of tokens known now are cached: a block that a
        placeholder (a token still being sampled) completes waits for `cache_computed_blocks`, even if the
        token has arrived by the flush, as it would without the deferral.
        """
        if not self._hashes_blocks(request):
            return  # its blocks are never offered (no hashes): nothing to defer
        if self.defers_caching:
            num_tokens = min(num_tokens, len(request.all_token_ids))
            if num_tokens // self.block_size <= self._num_cached_blocks.get(request.req_id, 0):
                return  # no block past those already offered: offering would change nothing
            earlier = self._deferred.get(request.req_id)
            self._deferred[request.req_id] = (request, num_tokens if earlier is None else max(earlier[1], num_tokens))
            return
        self._offer_full_blocks(request, num_tokens)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's `reset_prefix_cache`): only while no request holds blocks.
        Returns whether it was done."""
        if self.req_to_blocks or self._deferred:
            return False
        return self.pool.reset_prefix_cache()

    def flush(self) -> None:
        """Hash the deferred requests' scheduled blocks and offer them to the hash map."""
        while self._deferred:
            deferred, self._deferred = self._deferred, {}
            for request, num_tokens in deferred.values():
                if request.req_id in self.req_to_blocks:
                    self._offer_full_blocks(request, num_tokens)

    def _offer_full_blocks(self, request: Request, num_tokens: int) -> None:
        self._update_block_hashes(request, num_tokens // self.block_size)
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
        # Flush first even when this request offers nothing: the deferred blocks must enter the map before any
        # later allocation's, whether or not the caller flushed after scheduling.
        self.flush()
        num_full = min(request.num_computed_tokens, len(request.all_token_ids)) // self.block_size
        if num_full <= self._num_cached_blocks.get(request.req_id, 0) or request.req_id not in self.req_to_blocks:
            return
        self._offer_full_blocks(request, request.num_computed_tokens)

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        if not self.enable_caching:
            return
        self.stats.num_queries += request.num_tokens
        self.stats.num_hits += num_hit_tokens

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so its prefix stays cached longest)."""
        self.flush()  # its blocks enter the hash map first, as without the deferral
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

    def check_invariants(self, requests: Mapping[str, Request] | None = None, incremental: bool = False) -> None:
        """The pool's checks (`incremental`: see `BlockPool.check_invariants`) and the block tables' ref counts;
        given the live requests (the scheduler's), also each held block against its request's tokens. Besides the
        pool's, O(blocks held): run by tests (`check_invariants_every_step`), not by production steps."""
        pool = self.pool
        pool.check_invariants(incremental)
        for req_id, (request, _) in self._deferred.items():
            assert request.req_id == req_id and req_id in self.req_to_blocks, f"deferred caching of {req_id}, which holds no blocks"
        refs: dict[KVCacheBlock, int] = {}
        for blocks in self.req_to_blocks.values():
            assert len({b.block_id for b in blocks}) == len(blocks), "a request holds a block twice"
            for block in blocks:
                refs[block] = refs.get(block, 0) + 1
        for block, num_holders in refs.items():
            assert pool._owns(block), f"{block} held by a request is not the pool's"
            assert block.ref_cnt == num_holders, \
                f"{block} ref count differs from the number of requests holding it ({num_holders})"
        # The pool's blocks in use (ref count > 0) are the ones out of its free list (its invariants): as many as
        # the held blocks, each with its holders as references, so no other block has references.
        num_in_use = pool.num_blocks - pool.num_free_blocks
        assert len(refs) == num_in_use, \
            f"{num_in_use} blocks in use, {len(refs)} held by requests: a block's ref count is nobody's"
        for req_id, num_offered in self._num_cached_blocks.items():
            # Left behind by a freed request, it would skip offering the blocks of a later request of that id.
            blocks = self.req_to_blocks.get(req_id)
            assert blocks is not None, f"{req_id} holds no blocks but counts {num_offered} offered to the cache"
            assert num_offered <= len(blocks), f"{req_id} counts {num_offered} blocks offered, holds {len(blocks)}"
        if requests is not None:
            self._check_blocks_match_requests(requests)

    def _check_blocks_match_requests(self, requests: Mapping[str, Request]) -> None:
        """A later request's prefix hit reads a hashed block's K/V as those of its hash's tokens: block i of a
        request carries no hash or the request's i-th block hash (a re-keyed block serves another prefix), and
        only once the request has computed (or scheduled) all its tokens (else the hit reads K/V never written).
        Per-request bookkeeping is kept for live requests only."""
        assert set(self._group_keys) <= set(requests), "a sample-group key of a request that is not live"
        for req_id, (request, _) in self._deferred.items():
            assert requests.get(req_id) is request, f"deferred caching of {request}, which is not the live one"
        bs = self.block_size
        for req_id, blocks in self.req_to_blocks.items():
            request = requests.get(req_id)
            assert request is not None, f"{req_id} holds blocks but is not live"
            hashes = request.block_hashes
            for i, block in enumerate(blocks):
                if block.block_hash is None:
                    continue
                assert i < len(hashes) and block.block_hash == hashes[i], \
                    f"block {i} of {request} ({block}) carries the hash of other tokens"
                assert (i + 1) * bs <= request.num_computed_tokens, \
                    f"block {i} of {request} ({block}) is in the prefix cache but not full of computed tokens"
