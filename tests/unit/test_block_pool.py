"""BlockPool: exact block ids, ref counts, free-list order, LRU eviction, invariant checking."""

from __future__ import annotations

import pytest

from kvserve.core.block_pool import BlockPool


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


def _corrupt_free_block_with_refs(pool: BlockPool) -> None:
    next(iter(pool.free_queue)).ref_cnt = 1


def _corrupt_leak(pool: BlockPool) -> None:
    pool.blocks[0].ref_cnt = 0  # in use, so not in the free list


def _corrupt_negative_ref(pool: BlockPool) -> None:
    pool.blocks[0].ref_cnt = -1


def _corrupt_free_count(pool: BlockPool) -> None:
    pool.free_queue.num_free_blocks += 1


def _corrupt_map_entry(pool: BlockPool) -> None:
    pool.blocks[0].block_hash = h("not-the-key")


def _corrupt_unmapped_hash(pool: BlockPool) -> None:
    pool.blocks[1].block_hash = h("unmapped")


def _corrupt_in_use_and_free(pool: BlockPool) -> None:
    pool.free_queue.append(pool.blocks[1])  # block 1 is in use


def _corrupt_back_link(pool: BlockPool) -> None:
    # The forward walk still sees a sound list; a `remove` of block 3 would relink block 0 (in use) instead.
    pool.blocks[3].prev_free = pool.blocks[0]


def _corrupt_tail_back_link(pool: BlockPool) -> None:
    # An `append` would link the new block after block 2, cutting block 3 out of the list.
    pool.free_queue._tail.prev_free = pool.blocks[2]


def _corrupt_in_use_block_linked(pool: BlockPool) -> None:
    # `remove` would take block 1 (in use) for a free one and splice it out of a list it is not in.
    pool.blocks[1].prev_free = pool.blocks[2]


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_back_link,
        _corrupt_tail_back_link,
        _corrupt_in_use_block_linked,
        _corrupt_free_block_with_refs,
        _corrupt_leak,
        _corrupt_negative_ref,
        _corrupt_free_count,
        _corrupt_map_entry,
        _corrupt_unmapped_hash,
        _corrupt_in_use_and_free,
    ],
)
def test_check_invariants_catches_corruption(corrupt):
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], h("a"))
    pool.check_invariants()
    assert free_ids(pool) == [2, 3]
    corrupt(pool)
    with pytest.raises(AssertionError):
        pool.check_invariants()
