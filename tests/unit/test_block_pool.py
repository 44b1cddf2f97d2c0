"""BlockPool: exact block ids, ref counts, free-list order, LRU eviction, invariant checking (full and incremental)."""

from __future__ import annotations

import random

import pytest

from kvserve.core import block_pool
from kvserve.core.block_pool import BlockPool, KVCacheBlock


def h(name: str) -> bytes:
    """A stand-in block hash (the pool treats hashes as opaque bytes)."""
    return name.encode().ljust(16, b".")


def free_ids(pool: BlockPool) -> list[int]:
    """Block ids of the free list, head (next handed out) first."""
    return [b.block_id for b in pool.free_queue]


def test_new_blocks_come_in_id_order():
    pool = BlockPool(5)
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 4]
    assert all(b.ref_cnt == 1 for b in pool.blocks)
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0
    pool.check_invariants()


def test_asking_for_more_blocks_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="asked for 2 blocks, only 1 free"):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [2]
    pool.check_invariants()


def test_num_blocks_must_be_positive():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_ref_counts_after_touch_and_free():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, h("a"))
    pool.touch([block])  # a second request hits it
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert free_ids(pool) == [1, 2, 3]  # still in use by the other request
    pool.check_invariants()
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert free_ids(pool) == [1, 2, 3, 0]
    assert pool.usage == 0.0
    pool.check_invariants()


def test_double_free_raises():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.num_free_blocks == 2
    pool.check_invariants()


def test_freed_blocks_with_hash_go_to_tail_without_hash_to_head():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_block(blocks[0], h("x"))
    pool.cache_block(blocks[1], h("y"))
    pool.free_blocks([blocks[0], blocks[2], blocks[1], blocks[3]])
    # 0 (hash) -> [0]; 2 (none) -> [2, 0]; 1 (hash) -> [2, 0, 1]; 3 (none) -> [3, 2, 0, 1]
    assert free_ids(pool) == [3, 2, 0, 1]
    pool.check_invariants()
    # The uncached blocks are handed out first and nothing is evicted.
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]
    assert pool.num_evictions == 0
    assert set(pool.cached) == {h("x"), h("y")}
    # The next one evicts the hash of block 0.
    (block,) = pool.get_new_blocks(1)
    assert block.block_id == 0 and block.block_hash is None
    assert pool.num_evictions == 1
    assert set(pool.cached) == {h("y")}
    pool.check_invariants()


def _evict_one(pool: BlockPool) -> tuple[int, bytes]:
    """Hand out one block; return its id and the hash it lost."""
    before = {blk.block_id: blk.block_hash for blk in pool.blocks}
    (block,) = pool.get_new_blocks(1)
    lost = before[block.block_id]
    assert lost is not None and lost not in pool.cached
    return block.block_id, lost


def _cache_two_requests(pool: BlockPool) -> tuple[list, list]:
    a = pool.get_new_blocks(3)
    for i, block in enumerate(a):
        pool.cache_block(block, h(f"A{i}"))
    b = pool.get_new_blocks(3)
    for i, block in enumerate(b):
        pool.cache_block(block, h(f"B{i}"))
    return a, b


def test_eviction_is_least_recently_used_first():
    pool = BlockPool(6)
    a, b = _cache_two_requests(pool)
    # Free A, then B, each tail-first as the KV cache manager does.
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    assert free_ids(pool) == [2, 1, 0, 5, 4, 3]
    evicted = [_evict_one(pool) for _ in range(6)]
    assert evicted == [
        (2, h("A2")),
        (1, h("A1")),
        (0, h("A0")),
        (5, h("B2")),
        (4, h("B1")),
        (3, h("B0")),
    ]
    assert pool.num_evictions == 6
    assert pool.cached == {}
    pool.check_invariants()


def test_a_hit_makes_a_block_most_recently_used():
    pool = BlockPool(6)
    a, b = _cache_two_requests(pool)
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    # A later request hits A's first block and releases it again: it becomes the newest.
    block = pool.get_cached_block(h("A0"))
    assert block is a[0]
    pool.touch([block])
    pool.free_blocks([block])
    evicted = [_evict_one(pool)[1] for _ in range(6)]
    assert evicted == [h("A2"), h("A1"), h("B2"), h("B1"), h("B0"), h("A0")]


def test_touch_takes_a_free_cached_block_out_of_the_middle_of_the_free_list():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_block(blocks[0], h("a"))
    pool.cache_block(blocks[1], h("b"))
    pool.free_blocks(blocks)
    assert free_ids(pool) == [2, 0, 1]

    hit = pool.get_cached_block(h("a"))
    assert hit is not None and hit.block_id == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert hit.block_hash == h("a")  # reused as is: its K/V are still valid
    assert free_ids(pool) == [2, 1]  # unlinked from between its neighbours
    assert hit.prev_free is None and hit.next_free is None
    assert pool.num_free_blocks == 2
    assert pool.num_evictions == 0
    pool.check_invariants()
    # The remaining free blocks are handed out around it.
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 1]
    assert pool.get_cached_block(h("a")) is hit
    assert pool.get_cached_block(h("b")) is None
    pool.check_invariants()


def test_touch_of_a_block_in_use_only_adds_a_reference():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    assert free_ids(pool) == [1]
    pool.check_invariants()


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(3)
    first, second, _ = pool.get_new_blocks(3)
    pool.cache_block(first, h("same"))
    pool.cache_block(second, h("same"))
    assert pool.get_cached_block(h("same")) is first
    assert first.block_hash == h("same")
    assert second.block_hash is None
    # A block that already carries a hash keeps it.
    pool.cache_block(first, h("other"))
    assert first.block_hash == h("same")
    assert pool.get_cached_block(h("other")) is None
    pool.check_invariants()


def test_cache_block_is_a_no_op_when_caching_is_off():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, h("a"))
    assert block.block_hash is None and pool.cached == {}


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, h("a"))
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h("a")) is block
    pool.free_blocks([block])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert all(b.block_hash is None for b in pool.blocks)
    pool.check_invariants()


def _written(pool: BlockPool, *blocks: KVCacheBlock) -> None:
    """Record `blocks` as the pool's methods record the blocks they write, for the incremental check: the
    corruption that follows is then one a pool method made. Without it, it comes from outside the pool's methods
    (which only the full walk finds)."""
    if pool._touched is not None:
        block_pool._note(pool._touched, *blocks)


def _corrupt_free_block_with_refs(pool: BlockPool, note: bool) -> None:
    block = next(iter(pool.free_queue))
    if note:
        _written(pool, block)
    block.ref_cnt = 1


def _corrupt_leak(pool: BlockPool, note: bool) -> None:
    if note:
        _written(pool, pool.blocks[0])
    pool.blocks[0].ref_cnt = 0  # in use, so not in the free list


def _corrupt_negative_ref(pool: BlockPool, note: bool) -> None:
    if note:
        _written(pool, pool.blocks[0])
    pool.blocks[0].ref_cnt = -1


def _corrupt_free_count(pool: BlockPool, note: bool) -> None:
    pool.free_queue.num_free_blocks += 1


def _corrupt_map_entry(pool: BlockPool, note: bool) -> None:
    if note:
        _written(pool, pool.blocks[0])
    pool.blocks[0].block_hash = h("not-the-key")


def _corrupt_unmapped_hash(pool: BlockPool, note: bool) -> None:
    if note:
        _written(pool, pool.blocks[1])
    pool.blocks[1].block_hash = h("unmapped")


def _corrupt_unmapped_hash_of_a_free_block(pool: BlockPool, note: bool) -> None:
    if note:
        _written(pool, pool.blocks[3])
    pool.blocks[3].block_hash = h("unmapped")


def _corrupt_map_entry_without_block(pool: BlockPool, note: bool) -> None:
    if note:
        pool._touched_keys.add(h("stray"))
    pool.cached[h("stray")] = pool.blocks[2]  # block 2 carries no hash


def _corrupt_map_entry_of_another_pool(pool: BlockPool, note: bool) -> None:
    stranger = BlockPool(4).blocks[2]
    stranger.block_hash = h("stray")
    if note:
        pool._touched_keys.add(h("stray"))
    pool.cached[h("stray")] = stranger


def _corrupt_in_use_and_free(pool: BlockPool, note: bool) -> None:
    pool.free_queue.append(pool.blocks[1])  # block 1 is in use (the queue records the blocks it writes)


def _corrupt_back_link(pool: BlockPool, note: bool) -> None:
    # The forward walk still sees a sound list; a `remove` of block 3 would relink block 0 (in use) instead.
    if note:
        _written(pool, pool.blocks[3])
    pool.blocks[3].prev_free = pool.blocks[0]


def _corrupt_forward_link(pool: BlockPool, note: bool) -> None:
    # Block 2 skips block 3, whose back link still points to it: block 3 is cut out of the walk from the head.
    if note:
        _written(pool, pool.blocks[2])
    pool.blocks[2].next_free = pool.blocks[3].next_free


def _corrupt_tail_back_link(pool: BlockPool, note: bool) -> None:
    # An `append` would link the new block after block 2, cutting block 3 out of the list.
    pool.free_queue._tail.prev_free = pool.blocks[2]


def _corrupt_in_use_block_linked(pool: BlockPool, note: bool) -> None:
    # `remove` would take block 1 (in use) for a free one and splice it out of a list it is not in.
    if note:
        _written(pool, pool.blocks[1])
    pool.blocks[1].prev_free = pool.blocks[2]


def _corrupt_foreign_block_in_the_free_list(pool: BlockPool, note: bool) -> None:
    # A block of another pool linked in after block 2: its id is one of this pool's.
    stranger = BlockPool(4).blocks[1]
    stranger.prev_free, stranger.next_free = pool.blocks[2], pool.blocks[3]
    if note:
        _written(pool, pool.blocks[2], pool.blocks[3])
    pool.blocks[2].next_free = pool.blocks[3].prev_free = stranger
    pool.free_queue.num_free_blocks += 1


CORRUPTIONS = [
    _corrupt_back_link,
    _corrupt_forward_link,
    _corrupt_tail_back_link,
    _corrupt_in_use_block_linked,
    _corrupt_free_block_with_refs,
    _corrupt_leak,
    _corrupt_negative_ref,
    _corrupt_free_count,
    _corrupt_map_entry,
    _corrupt_unmapped_hash,
    _corrupt_unmapped_hash_of_a_free_block,
    _corrupt_map_entry_without_block,
    _corrupt_map_entry_of_another_pool,
    _corrupt_in_use_and_free,
    _corrupt_foreign_block_in_the_free_list,
]


def _checked_pool(num_blocks: int = 4) -> BlockPool:
    """Blocks 0 and 1 in use (0 cached as "a"), the others free (2 first); checked, so tracking changes."""
    pool = BlockPool(num_blocks)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], h("a"))
    pool.check_invariants()
    assert free_ids(pool)[:2] == [2, 3]
    return pool


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
def test_check_invariants_catches_corruption(corrupt):
    pool = _checked_pool()
    corrupt(pool, False)
    with pytest.raises(AssertionError):
        pool.check_invariants()


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
def test_the_incremental_check_catches_corruption_by_the_pools_methods(corrupt, monkeypatch):
    """A corruption of the blocks (or hash-map keys) a pool method recorded writing, or of the counts: caught by
    the incremental check itself, not a walk of the whole pool."""
    pool = _checked_pool(num_blocks=64)
    monkeypatch.setattr(pool, "FULL_CHECK_SPREAD", 1)
    pool.check_invariants(incremental=True)  # a full walk (none yet since tracking): from here, incremental
    assert pool._checks_until_full == 64

    def no_walk() -> None:
        raise AssertionError("walked the whole pool")

    monkeypatch.setattr(pool, "_check_all", no_walk)
    pool.check_invariants(incremental=True)  # nothing changed
    pool.touch([pool.blocks[1]])  # a valid change, checked incrementally
    pool.free_blocks([pool.blocks[1]])
    pool.check_invariants(incremental=True)
    corrupt(pool, True)
    with pytest.raises(AssertionError) as caught:
        pool.check_invariants(incremental=True)
    assert "walked the whole pool" not in str(caught.value)
    with pytest.raises(AssertionError):  # a failed check leaves the tracking: the next one fails as well
        pool.check_invariants(incremental=True)


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
def test_a_corruption_the_pool_did_not_record_is_caught_by_the_next_full_walk(corrupt, monkeypatch):
    """A write from outside the pool's methods, to a block no method touches after it: the incremental checks may
    miss it; the full walk, due every num_blocks // FULL_CHECK_SPREAD incremental checks, finds it."""
    pool = _checked_pool(num_blocks=64)
    other = pool.blocks[40]
    pool.touch([other])  # held: the valid changes below write it only
    monkeypatch.setattr(pool, "FULL_CHECK_SPREAD", 16)  # a full walk every 64 // 16 = 4 incremental checks
    pool.check_invariants(incremental=True)
    pool.check_invariants(incremental=True)  # the first incremental one of the 4 (no change)
    corrupt(pool, False)
    caught_at = None
    for i in range(2, 6):  # checks 2 to 4 incremental, the 5th the due full walk
        pool.free_blocks([other]) if i % 2 else pool.touch([other])  # a valid change elsewhere: its ref count
        try:
            pool.check_invariants(incremental=True)
        except AssertionError:
            caught_at = i
            break
    assert caught_at is not None and caught_at <= 5


def test_an_explicit_full_check_walks_the_pool_even_while_tracking(monkeypatch):
    pool = _checked_pool(num_blocks=64)
    monkeypatch.setattr(pool, "FULL_CHECK_SPREAD", 1)
    pool.check_invariants(incremental=True)
    pool.blocks[40].block_hash = h("unmapped")  # outside the pool's methods: not recorded
    pool.check_invariants(incremental=True)  # not due yet: only the recorded writes are looked at
    with pytest.raises(AssertionError, match="carries a hash missing from the map"):
        pool.check_invariants()


def test_an_idle_pool_walks_in_full_at_the_next_incremental_check(monkeypatch):
    """The end of a run (no block in use after changes): the incremental check walks the whole pool, so an
    unrecorded corruption is found before the pool idles."""
    pool = _checked_pool(num_blocks=64)
    monkeypatch.setattr(pool, "FULL_CHECK_SPREAD", 1)
    pool.check_invariants(incremental=True)
    pool.blocks[40].block_hash = h("unmapped")
    pool.check_invariants(incremental=True)
    pool.free_blocks(pool.blocks[:2])
    assert pool.num_free_blocks == pool.num_blocks
    with pytest.raises(AssertionError, match="carries a hash missing from the map"):
        pool.check_invariants(incremental=True)


def test_a_full_walk_is_due_by_pool_size_and_writes(monkeypatch):
    walks = []
    pool = _checked_pool(num_blocks=8192)  # FULL_CHECK_SPREAD 2048: a walk every 4 incremental checks
    check_all = pool._check_all
    monkeypatch.setattr(pool, "_check_all", lambda: walks.append(1) or check_all())
    for _ in range(10):
        pool.check_invariants(incremental=True)
    assert len(walks) == 2  # the 5th and the 10th
    pool.get_new_blocks(8192 // 8 + 1)  # as many writes as an eighth of the pool: walking is as cheap
    pool.check_invariants(incremental=True)
    assert len(walks) == 3
    assert _checked_pool(num_blocks=2047)._checks_until_full == 0  # walked in full at every check


def test_reset_prefix_cache_makes_the_next_check_a_full_walk():
    pool = _checked_pool(num_blocks=64)
    pool.free_blocks(pool.blocks[:2])
    pool.check_invariants(incremental=True)
    assert pool.reset_prefix_cache()
    assert pool._touched is None  # the tracking stopped: the next check walks every block it rewrote
    pool.check_invariants(incremental=True)
    assert pool._touched == {}


def test_a_detached_loop_of_free_blocks_is_caught_by_the_full_walk():
    """Written blocks relinked into a loop of their own, with consistent links and free count: the one corruption
    the incremental check leaves to the full walk (see BlockPool.check_invariants)."""
    pool = _checked_pool(num_blocks=8)
    pool.check_invariants(incremental=True)
    b2, b3, b4 = pool.blocks[2:5]
    _written(pool, pool.free_queue._head, b2, b3, b4)
    pool.free_queue._head.next_free, b4.prev_free = b4, pool.free_queue._head
    b2.prev_free = b2.next_free = b3
    b3.prev_free = b3.next_free = b2
    with pytest.raises(AssertionError, match="free count does not match the free list"):
        pool.check_invariants()


def _random_operations(pool: BlockPool, seed: int, incremental: bool, num_ops: int = 600) -> int | None:
    """Random valid operations of requests on `pool` (allocations, prefix hits, caching, frees), each followed by
    the check (`incremental`: never a full walk). Returns the operation after which the check failed, if any."""
    rng = random.Random(seed)
    if incremental:
        pool._full_check_due = lambda touched: False  # type: ignore[method-assign]
    held: list[KVCacheBlock] = []
    for step in range(num_ops):
        op = rng.random()
        if op < 0.35 and pool.num_free_blocks:
            held += pool.get_new_blocks(rng.randint(1, min(3, pool.num_free_blocks)))
        elif op < 0.55 and pool.cached:
            hit = pool.cached[rng.choice(sorted(pool.cached))]
            pool.touch([hit])
            held.append(hit)
        elif op < 0.7 and held:
            pool.cache_block(rng.choice(held), h(f"k{rng.randint(0, 40)}"))
        elif held:
            rng.shuffle(held)
            n = rng.randint(1, min(3, len(held)))
            pool.free_blocks(held[:n])
            del held[:n]
        try:
            pool.check_invariants(incremental=incremental)
        except AssertionError:
            return step
    return None


def test_random_operations_pass_the_incremental_check(monkeypatch):
    """No false alarm: after each of many random valid operations, the incremental check (only what changed) and
    a full walk pass."""
    pool = BlockPool(48)
    pool.check_invariants()
    check_all = pool._check_all
    walks = []

    def counted_walk() -> None:
        walks.append(1)
        check_all()

    check_touched = pool._check_touched

    def incremental_then_walk(touched: dict) -> None:
        check_touched(touched)
        check_all()

    # Each incremental check is followed by a full walk; the pool's own checks never walk.
    monkeypatch.setattr(pool, "_check_touched", incremental_then_walk)
    monkeypatch.setattr(pool, "_check_all", counted_walk)
    assert _random_operations(pool, seed=0, incremental=True) is None
    assert not walks


def _evicts_without_unmapping(pool: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
    out = []
    for _ in range(num_blocks):
        block = pool.free_queue.popleft()
        block.block_hash = None  # and forgets `del pool.cached[...]`
        block.ref_cnt = 1
        out.append(block)
    return out


def _evicts_without_clearing_the_hash(pool: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
    out = []
    for _ in range(num_blocks):
        block = pool.free_queue.popleft()
        if block.block_hash is not None:
            pool._touched_keys.add(block.block_hash)
            del pool.cached[block.block_hash]  # and forgets `block.block_hash = None`
        block.ref_cnt = 1
        out.append(block)
    return out


def _touch_leaving_free_hits_linked(pool: BlockPool, blocks: list[KVCacheBlock]) -> None:
    for block in blocks:
        block_pool._note(pool._touched, block)
        block.ref_cnt += 1  # forgets `pool.free_queue.remove(block)` for a free one


def _free_linking_held_blocks(pool: BlockPool, blocks: list[KVCacheBlock]) -> None:
    for block in blocks:
        block_pool._note(pool._touched, block)
        block.ref_cnt -= 1
        if block.ref_cnt == 0 or (block.block_hash is not None and block.ref_cnt == 1):  # still held: not free
            pool.free_queue.append(block)


def _cache_a_second_block_under_a_hash(pool: BlockPool, block: KVCacheBlock, block_hash: bytes) -> None:
    if block.block_hash is None:  # forgets `block_hash in pool.cached`: the first block keeps the hash, unmapped
        block_pool._note(pool._touched, block)
        pool._touched_keys.add(block_hash)
        block.block_hash = block_hash
        pool.cached[block_hash] = block


def _cache_without_giving_the_hash(pool: BlockPool, block: KVCacheBlock, block_hash: bytes) -> None:
    if block.block_hash is None and block_hash not in pool.cached:
        block_pool._note(pool._touched, block)
        pool._touched_keys.add(block_hash)
        pool.cached[block_hash] = block  # forgets `block.block_hash = block_hash`


def _remove_keeping_links(queue: block_pool.FreeBlockQueue, block: KVCacheBlock) -> None:
    prev, nxt = block.prev_free, block.next_free
    assert prev is not None and nxt is not None and queue.touched is not None
    block_pool._note(queue.touched, prev, block, nxt)
    prev.next_free, nxt.prev_free = nxt, prev  # forgets clearing the block's own links
    queue.num_free_blocks -= 1


def _remove_without_counting(queue: block_pool.FreeBlockQueue, block: KVCacheBlock) -> None:
    prev, nxt = block.prev_free, block.next_free
    assert prev is not None and nxt is not None and queue.touched is not None
    block_pool._note(queue.touched, prev, block, nxt)
    prev.next_free, nxt.prev_free = nxt, prev
    block.prev_free = block.next_free = None  # forgets `num_free_blocks -= 1`


def _insert_without_the_back_link(queue: block_pool.FreeBlockQueue, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
    nxt = anchor.next_free
    assert nxt is not None and queue.touched is not None
    block_pool._note(queue.touched, anchor, block, nxt)
    block.prev_free, block.next_free, anchor.next_free = anchor, nxt, block  # forgets `nxt.prev_free = block`
    queue.num_free_blocks += 1


def _insert_before_the_tail_dropping_the_rest(queue: block_pool.FreeBlockQueue, anchor: KVCacheBlock,
                                              block: KVCacheBlock) -> None:
    nxt = queue._tail  # should be anchor.next_free: the blocks between them are cut out of the list
    assert queue.touched is not None
    block_pool._note(queue.touched, anchor, block, nxt)
    block.prev_free, block.next_free, anchor.next_free, nxt.prev_free = anchor, nxt, block, block
    queue.num_free_blocks += 1


@pytest.mark.parametrize(
    ("owner", "method", "bug"),
    [
        (block_pool.FreeBlockQueue, "_insert_after", _insert_before_the_tail_dropping_the_rest),
        (BlockPool, "get_new_blocks", _evicts_without_unmapping),
        (BlockPool, "get_new_blocks", _evicts_without_clearing_the_hash),
        (BlockPool, "touch", _touch_leaving_free_hits_linked),
        (BlockPool, "free_blocks", _free_linking_held_blocks),
        (BlockPool, "cache_block", _cache_a_second_block_under_a_hash),
        (BlockPool, "cache_block", _cache_without_giving_the_hash),
        (block_pool.FreeBlockQueue, "remove", _remove_keeping_links),
        (block_pool.FreeBlockQueue, "remove", _remove_without_counting),
        (block_pool.FreeBlockQueue, "_insert_after", _insert_without_the_back_link),
    ],
)
@pytest.mark.parametrize("seed", [1, 2])
def test_a_bug_in_the_pools_methods_is_caught_incrementally_as_soon_as_by_a_full_walk(owner, method, bug, seed,
                                                                                      monkeypatch):
    """Bugs planted in the pool's methods (which record what they write, as the real ones do): with only
    incremental checks, the operation that breaks an invariant fails its check, as with a full walk after each."""
    caught = {}
    for incremental in (True, False):
        pool = BlockPool(48)
        pool.check_invariants()
        with monkeypatch.context() as patch:
            patch.setattr(owner, method, bug)
            caught[incremental] = _random_operations(pool, seed, incremental)
    assert caught[False] is not None
    assert caught[True] == caught[False]


def test_the_pools_methods_note_every_block_they_rewrite():
    """The real methods record each block whose links, ref count or hash they write, the neighbours and
    sentinels whose links a free-list insert or removal rewrites included, and the hash-map keys they set or
    delete (what the incremental check relies on)."""
    pool = BlockPool(8)
    head, tail = pool.free_queue._head, pool.free_queue._tail
    pool.check_invariants()
    first, second = pool.get_new_blocks(2)  # blocks 0 and 1 leave the head of the list
    assert set(pool._touched) == {head, first, second, pool.blocks[2]}
    pool.check_invariants(incremental=True)
    pool.cache_block(first, b"h0")
    assert set(pool._touched) == {first} and pool._touched_keys == {b"h0"}
    pool.check_invariants(incremental=True)
    last_free = tail.prev_free
    pool.free_blocks([first])  # a cached block joins the tail
    assert set(pool._touched) == {first, last_free, tail}
    pool.check_invariants(incremental=True)
    pool.free_blocks([second])  # an uncached one joins the head
    assert set(pool._touched) == {second, head, pool.blocks[2]}
    pool.check_invariants(incremental=True)
    before, after = first.prev_free, first.next_free
    pool.touch([first])  # a prefix hit on a free cached block
    assert set(pool._touched) == {first, before, after}
    pool.check_invariants(incremental=True)
    pool.free_blocks([first])
    pool.check_invariants(incremental=True)
    taken = pool.get_new_blocks(8)  # every block, the cached one evicted
    assert set(taken) <= set(pool._touched) and pool._touched_keys == {b"h0"}
    pool.check_invariants(incremental=True)


def test_tracking_stops_when_checks_stop():
    """A pool whose checks stopped (a test turned them off) keeps no growing record: once the writes would make
    the next check a full walk anyway, tracking ends, and the next check walks the pool and tracks again."""
    pool = BlockPool(64)
    pool.check_invariants()
    for i in range(200):
        blocks = pool.get_new_blocks(4)
        pool.cache_block(blocks[0], i.to_bytes(4, "little"))
        pool.free_blocks(blocks)
    assert pool._touched is None and pool._touched_keys == set()
    pool.check_invariants(incremental=True)
    assert pool._touched == {}
