"""The pool of KV cache blocks: ref counts, an O(1) LRU free list, and the prefix-cache hash map.

Rules:
* A block is either in use (ref_cnt > 0, not in the free list) or free (ref_cnt == 0, in the free list).
* A free block may still carry a block hash: its K/V stay valid and a later request can take it back from
  the middle of the free list in O(1) (`touch`). It loses the hash only when it is handed out as a new block.
* New blocks come from the head of the free list. Freed blocks that carry a hash go to the tail (evicted
  last: least-recently-used first); freed blocks without a hash go to the head (nothing to lose).
* The hash map holds at most one block per hash, and every block in it carries that hash.

`check_invariants` walks the whole pool (O(blocks): ~32 ms for 131,072 blocks); tests run it after every engine
step, where the incremental form checks only the blocks the pool's methods wrote since the last check and walks
the whole pool when it is due (see `BlockPool.check_invariants`).
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


# A block's links and hash when the pool's change tracking first notes it after a check: (prev_free, next_free,
# block_hash) before the pool's first write to it.
BlockBefore = tuple[KVCacheBlock | None, KVCacheBlock | None, bytes | None]


def _note(touched: dict[KVCacheBlock, BlockBefore], *blocks: KVCacheBlock) -> None:
    """Record, before a write, each block not yet recorded since the last check, with its state then."""
    for block in blocks:
        if block not in touched:
            touched[block] = (block.prev_free, block.next_free, block.block_hash)


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) push at either end, pop at the head and removal."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: never handed out
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        # While the pool tracks changes (between its invariant checks, in tests): each block, sentinels included,
        # whose links a push or a removal writes, with its state before. The pool's dict; None: not tracking.
        self.touched: dict[KVCacheBlock, BlockBefore] | None = None
        for block in blocks:
            self.append(block)

    def _insert_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = anchor.next_free
        assert nxt is not None
        if self.touched is not None:
            _note(self.touched, anchor, block, nxt)
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
        if self.touched is not None:
            _note(self.touched, prev, block, nxt)
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
        of the list or splice them back in. A block met twice (a loop) fails the back-link check: its back link
        would be two blocks, so its predecessor too was met twice, and so on back to the head, which is never
        met (its back link is None)."""
        head, tail = self._head, self._tail
        assert head.prev_free is None and tail.next_free is None, "a sentinel links outside the list"
        out: list[KVCacheBlock] = []
        prev, block = head, head.next_free
        while block is not tail:
            assert block is not None, "the free list breaks off before its tail"
            assert block.prev_free is prev, f"{block}'s back link skips the block before it ({prev})"
            out.append(block)
            prev, block = block, block.next_free
        assert tail.prev_free is prev, "the tail's back link is not the last free block"
        return out


class BlockPool:
    # The incremental invariant check walks the whole pool after num_blocks // FULL_CHECK_SPREAD incremental
    # checks at most (each check pays for about FULL_CHECK_SPREAD blocks of walking, amortized): at every check
    # for pools of fewer than FULL_CHECK_SPREAD blocks, at every 65th for 131,072 blocks.
    FULL_CHECK_SPREAD = 2048

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0
        # Change tracking for the incremental invariant check, on from the first check: the blocks written since
        # the last check (with their state before: `BlockBefore`) and the hash-map keys set or deleted. None:
        # not tracking (never checked, or since a change the tracking does not follow), the next check is full.
        self._touched: dict[KVCacheBlock, BlockBefore] | None = None
        self._touched_keys: set[bytes] = set()
        # The free count and hash-map size the last check found sound, and the incremental checks left before
        # the next full one.
        self._checked_num_free = 0
        self._checked_num_cached = 0
        self._checks_until_full = 0

    def _track(self, touched: dict[KVCacheBlock, BlockBefore] | None) -> None:
        self._touched = self.free_queue.touched = touched
        self._touched_keys = set()

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (free-but-cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _bound_tracking(self) -> None:
        """Stop tracking once as much was written as makes the next check a full walk anyway (`_full_check_due`):
        with checks no longer run (a test that turned them off), what is tracked would otherwise grow without end."""
        if self._touched is not None and 8 * (len(self._touched) + len(self._touched_keys)) > self.num_blocks:
            self._track(None)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free list (evicting their cached hashes)."""
        self._bound_tracking()
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()  # noted by the queue when tracking
            if block.block_hash is not None:
                if self._touched is not None:
                    self._touched_keys.add(block.block_hash)
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
        touched = self._touched
        for block in blocks:
            if touched is not None:
                _note(touched, block)
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free list in the given
        order (callers pass a request's blocks tail-first so its prefix is evicted last)."""
        self._bound_tracking()
        touched = self._touched
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            if touched is not None:
                _note(touched, block)
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
        if self._touched is not None:
            _note(self._touched, block)
            self._touched_keys.add(block_hash)
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use. Returns success."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self._track(None)  # writes every block: the next check walks them all
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def check_invariants(self, incremental: bool = False) -> None:
        """Check the rules of the module docstring over the whole pool (O(blocks)); `incremental`: check in full
        only the blocks and hash-map keys the pool's methods wrote since the last check, and the whole pool only
        when due.

        The pool tracks, from its first check on, every block its methods write (ref count, links, hash; a free
        list push or removal also writes the neighbours' links, sentinels included) with the block's state
        before the first write, and every hash-map key set or deleted. The last check found the pool sound and
        nothing else has changed since, so checking each written block and its old neighbours against the rules,
        each written key's entry, and the free count and the map's size against the last check's plus the
        written blocks' changes, checks the pool (`_check_touched` says what each property comes down to). The
        one exception: written blocks relinked into a loop of their own, cut off from the free list with
        consistent links and free count, are found by the full walk only.

        What the tracking cannot see is a write from outside the pool's methods (a bug elsewhere, a test's
        corruption): the full walk finds it, and an incremental check walks the whole pool (`_full_check_due`)
        when no check has yet or `reset_prefix_cache` rewrote every block, after num_blocks // FULL_CHECK_SPREAD
        incremental ones (so at every check for a pool of fewer than FULL_CHECK_SPREAD blocks), when an eighth of
        the pool was written (walking costs about as much), and when the pool has gone idle (no block in use
        after changes: a run's end)."""
        touched = self._touched
        if incremental and touched is not None and not self._full_check_due(touched):
            self._check_touched(touched)
            self._checks_until_full -= 1
        else:
            self._track(None)  # should the walk fail, the next check walks again
            self._check_all()
            self._checks_until_full = self.num_blocks // self.FULL_CHECK_SPREAD
        self._checked_num_free = self.num_free_blocks
        self._checked_num_cached = len(self.cached)
        self._track({})

    def _full_check_due(self, touched: dict[KVCacheBlock, BlockBefore]) -> bool:
        return (self._checks_until_full <= 0 or 8 * len(touched) > self.num_blocks
                or (self.num_free_blocks == self.num_blocks and bool(touched)))

    def _owns(self, block: KVCacheBlock) -> bool:
        return 0 <= block.block_id < self.num_blocks and self.blocks[block.block_id] is block

    def _check_touched(self, touched: dict[KVCacheBlock, BlockBefore]) -> None:
        """The incremental check: each property of `_check_all`, over what can have changed since the last check.

        * Sentinels outside the list; each end's link back: checked (O(1)).
        * A block belongs to the pool; no negative ref count; in use (ref > 0) iff out of the free list and then
          unlinked; free iff linked both ways and each neighbour links back to it (so no block is in the list
          twice, in use and free, or leaked, and `remove` relinks the right blocks): checked for each written
          block and each of its neighbours before the writes (a block the writes left pointing at a relinked one).
        * The free count: the last check's plus the written blocks that joined the list, less those that left.
        * Every hash-map entry maps a block of the pool carrying its key: checked for each written key, the old
          key of each written block, and each written block's hash (which the map must give to that block).
          The map's size: the last check's plus the written blocks that gained a hash, less those that lost one
          (with the entries' check: the map and the blocks carrying a hash match one to one)."""
        queue = self.free_queue
        head, tail = queue._head, queue._tail
        assert head.prev_free is None and tail.next_free is None, "a sentinel links outside the list"
        first, last = head.next_free, tail.prev_free
        assert first is not None and first.prev_free is head, "the first free block's back link is not the head"
        assert last is not None and last.next_free is tail, "the tail's back link is not the last free block"
        free_delta = cached_delta = 0
        for block, (prev, nxt, block_hash) in touched.items():
            # A written block's old neighbours, a sentinel's too (a relinked head or tail must not cut blocks out).
            for old in (prev, nxt):
                if old is not None and old is not head and old is not tail and old not in touched:
                    self._check_block(old)
            if block is head or block is tail:
                continue
            self._check_block(block)
            free_delta += (block.prev_free is not None) - (prev is not None)
            cached_delta += (block.block_hash is not None) - (block_hash is not None)
            if block_hash is not None:
                self._check_entry(block_hash)
        for block_hash in self._touched_keys:
            self._check_entry(block_hash)
        assert self.num_free_blocks == self._checked_num_free + free_delta, "free count does not match the free list"
        assert len(self.cached) == self._checked_num_cached + cached_delta, \
            "the hash map's size differs from the number of blocks carrying a hash"

    def _check_block(self, block: KVCacheBlock) -> None:
        """One block's part of the rules (`_check_touched`)."""
        assert self._owns(block), f"{block} is not this pool's"
        assert block.ref_cnt >= 0, f"{block} has a negative ref count"
        prev, nxt = block.prev_free, block.next_free
        if block.ref_cnt > 0:
            # `remove` takes a block with links for a free one: an in-use block must have none.
            assert prev is None and nxt is None, f"{block} in use but linked into the free list"
        else:
            assert prev is not None and nxt is not None, f"{block} unreferenced but not free (leaked)"
            assert prev.next_free is block, f"{block}'s back link skips the block before it ({prev})"
            assert nxt.prev_free is block, f"{block} is not the back link of the block after it ({nxt})"
            assert prev is self.free_queue._head or self._owns(prev), f"{prev} in the free list is not this pool's"
            assert nxt is self.free_queue._tail or self._owns(nxt), f"{nxt} in the free list is not this pool's"
        if block.block_hash is not None:
            assert self.cached.get(block.block_hash) is block, f"{block} carries a hash the map gives another block"

    def _check_entry(self, block_hash: bytes) -> None:
        block = self.cached.get(block_hash)
        if block is not None:
            assert block.block_hash == block_hash, f"hash map entry points to {block} not carrying it"
            assert self._owns(block), f"hash map entry points to {block}, not this pool's"

    def _check_all(self) -> None:
        """The full walk: the free list, every block, the hash map. The properties of every block are counts over
        lists of the blocks' fields (`list.count`, quicker than a loop over the blocks); a count that is off is
        explained block by block."""
        free = self.free_queue.check_links()  # each linked both ways, none twice
        blocks, num_blocks = self.blocks, self.num_blocks
        for block in free:
            assert block.ref_cnt == 0, f"{block} in free list with references"
            assert 0 <= block.block_id < num_blocks and blocks[block.block_id] is block, \
                f"{block} in the free list is not this pool's"
        assert len(free) == self.num_free_blocks, "free count does not match the free list"
        # The free blocks are distinct blocks of the pool, unreferenced and linked both ways: as many unreferenced
        # blocks, and as many with each link, as free ones leaves no block leaked (unreferenced, not free) and
        # none in use with a link.
        refs = [b.ref_cnt for b in blocks]
        prevs = [b.prev_free for b in blocks]
        nexts = [b.next_free for b in blocks]
        if (min(refs) < 0 or refs.count(0) != len(free) or num_blocks - prevs.count(None) != len(free)
                or num_blocks - nexts.count(None) != len(free)):
            self._explain_blocks(free)
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"hash map entry points to {block} not carrying it"
            assert 0 <= block.block_id < num_blocks and blocks[block.block_id] is block, \
                f"hash map entry points to {block}, not this pool's"
        num_carrying = num_blocks - [b.block_hash for b in blocks].count(None)
        assert num_carrying == len(self.cached), "a block carries a hash missing from the map"

    def _explain_blocks(self, free: list[KVCacheBlock]) -> None:
        """Fail on the block that breaks the rules, which `_check_all`'s counts found one does."""
        free_ids = {block.block_id for block in free}
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            if block.ref_cnt > 0:
                # `remove` takes a block with links for a free one: an in-use block must have none.
                assert block.prev_free is None and block.next_free is None, \
                    f"{block} in use but linked into the free list"
            else:
                assert block.block_id in free_ids, f"{block} unreferenced but not free (leaked)"
        raise AssertionError("the blocks' ref counts or links do not match the free list")
