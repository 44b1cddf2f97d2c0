"""The pool of KV cache blocks: ref counts, an O(1) LRU free list, and the prefix-cache hash map.

Rules:
* A block is either in use (ref_cnt > 0, not in the free list) or free (ref_cnt == 0, in the free list).
* A free block may still carry a block hash: its K/V stay valid and a later request can take it back from
  the middle of the free list in O(1) (`touch`). It loses the hash only when it is handed out as a new block.
* New blocks come from the head of the free list. Freed blocks that carry a hash go to the tail (evicted
  last: least-recently-used first); freed blocks without a hash go to the head (nothing to lose).
* The hash map holds at most one block per hash, and every block in it carries that hash.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) push at either end, pop at the head and removal."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: never handed out
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def _insert_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = anchor.next_free
        assert nxt is not None
        block.prev_free = anchor
        block.next_free = nxt
        anchor.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        prev = self._tail.prev_free
        assert prev is not None
        self._insert_after(prev, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self):  # noqa: ANN204 - generator of blocks, head (next evicted) first
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def check_links(self) -> list[KVCacheBlock]:
        """The free blocks, head first, after checking both directions of every link: `remove` (a prefix hit
        taking a block back) relinks through `prev_free`, so a stale back link would silently cut blocks out
        of the list or splice them back in. Stops at a repeated block (a cycle)."""
        assert self._head.prev_free is None and self._tail.next_free is None, "a sentinel links outside the list"
        out: list[KVCacheBlock] = []
        seen: set[int] = set()
        prev, block = self._head, self._head.next_free
        while block is not self._tail:
            assert block is not None, "the free list breaks off before its tail"
            assert id(block) not in seen, f"{block} twice in the free list"
            assert block.prev_free is prev, f"{block}'s back link skips the block before it ({prev})"
            seen.add(id(block))
            out.append(block)
            prev, block = block, block.next_free
        assert self._tail.prev_free is prev, "the tail's back link is not the last free block"
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (free-but-cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free list (evicting their cached hashes)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the free list in O(1)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free list in the given
        order (callers pass a request's blocks tail-first so its prefix is evicted last)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Record that `block` holds the K/V of the full block identified by `block_hash`.

        When another block already holds that hash (two requests computed the same prefix at once), the
        first one stays the cached copy and this block remains uncached.
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use. Returns success."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def check_invariants(self) -> None:
        free_ids = set()
        for block in self.free_queue.check_links():
            assert block.ref_cnt == 0, f"{block} in free list with references"
            assert block.block_id not in free_ids, f"{block} twice in the free list"
            assert 0 <= block.block_id < self.num_blocks and self.blocks[block.block_id] is block, \
                f"{block} in the free list is not this pool's"
            free_ids.add(block.block_id)
        assert len(free_ids) == self.num_free_blocks, "free count does not match the free list"
        num_used = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            if block.ref_cnt > 0:
                num_used += 1
                assert block.block_id not in free_ids, f"{block} in use and free"
                # `remove` takes a block with links for a free one: an in-use block must have none.
                assert block.prev_free is None and block.next_free is None, \
                    f"{block} in use but linked into the free list"
            else:
                assert block.block_id in free_ids, f"{block} unreferenced but not free (leaked)"
        assert num_used + self.num_free_blocks == self.num_blocks, "free + used != total"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"hash map entry points to {block} not carrying it"
        num_carrying = sum(1 for b in self.blocks if b.block_hash is not None)
        assert num_carrying == len(self.cached), "a block carries a hash missing from the map"
