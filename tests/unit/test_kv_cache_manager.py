"""KVCacheManager: prefix hits, the last-token rule, salts, all-or-nothing allocation, stats, n>1 groups, the
batched block hashing, and block caching deferred to `flush`."""

from __future__ import annotations

import pytest

from kvserve.core import kv_cache_manager
from kvserve.core.kv_cache_manager import KVCacheManager, hash_block, hash_blocks
from kvserve.core.request import Request
from kvserve.protocol.sampling_params import SamplingParams

BS = 4


def make_request(req_id: str, token_ids: list[int], cache_salt: str | None = None) -> Request:
    return Request(req_id, token_ids, SamplingParams(), cache_salt=cache_salt)


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> tuple[list[int], int]:
    """Do what the scheduler does for a waiting request: look up hits, allocate, advance.

    Returns (the request's block ids, number of hit tokens)."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - num_hit_tokens
    assert kv.allocate_slots(request, num_new, hits) is not None
    kv.record_admission(request, num_hit_tokens)
    request.num_computed_tokens = num_hit_tokens + num_new
    kv.check_invariants()
    return kv.get_block_ids(request.req_id), num_hit_tokens


def test_second_request_with_the_same_prompt_gets_the_first_ones_full_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(100, 110))  # 10 tokens: two full blocks and a partial one
    a_blocks, a_hits = admit(kv, make_request("a", prompt))
    assert (a_blocks, a_hits) == ([0, 1, 2], 0)

    b = make_request("b", prompt)
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert num_hit_tokens == 8
    new_blocks = kv.allocate_slots(b, 2, hits)
    assert [blk.block_id for blk in new_blocks] == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    kv.check_invariants()


@pytest.mark.parametrize(
    ("num_prompt_tokens", "expected_hit_tokens"),
    # Rule (get_computed_blocks): at most (n - 1) // block_size blocks may hit, so the last token always
    # runs through the model. With block size 4: n=8 -> 1 block, 9 -> 2, 12 -> 2, 13 -> 3.
    [(8, 4), (9, 8), (12, 8), (13, 12), (4, 0), (1, 0)],
)
def test_a_full_prompt_hit_leaves_the_last_token_to_compute(num_prompt_tokens, expected_hit_tokens):
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(1, num_prompt_tokens + 1))
    admit(kv, make_request("a", prompt))
    b_blocks, b_hits = admit(kv, make_request("b", prompt))
    assert b_hits == expected_hit_tokens
    num_hit_blocks = expected_hit_tokens // BS
    assert b_blocks[:num_hit_blocks] == kv.get_block_ids("a")[:num_hit_blocks]
    assert len(b_blocks) == -(-num_prompt_tokens // BS)


@pytest.mark.parametrize(
    ("b_prompt", "expected_hit_tokens"),
    [
        (list(range(100, 105)) + [7, 7, 7, 7, 7], 4),  # shares 5 tokens: one full block
        ([100, 101, 999] + list(range(103, 110)), 0),  # differs inside the first block
        (list(range(100, 108)) + [0, 0, 0], 8),  # shares two full blocks, then diverges
        ([0] + list(range(100, 110)), 0),  # shifted by one: nothing lines up
    ],
)
def test_partial_prefix_hits(b_prompt, expected_hit_tokens):
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    admit(kv, make_request("a", list(range(100, 110))))
    _, hits = admit(kv, make_request("b", b_prompt))
    assert hits == expected_hit_tokens


def test_a_different_cache_salt_gets_no_hit():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(9))
    admit(kv, make_request("a", prompt, cache_salt="alice"))
    assert admit(kv, make_request("b", prompt, cache_salt="bob"))[1] == 0
    assert admit(kv, make_request("c", prompt))[1] == 0
    assert admit(kv, make_request("d", prompt, cache_salt="alice"))[1] == 8


def test_hash_chains_parent_tokens_and_extra_keys():
    base = hash_block(None, [1, 2, 3, 4])
    assert len(base) == 16
    assert base == hash_block(None, [1, 2, 3, 4])
    assert base != hash_block(None, [1, 2, 3, 5])
    assert base != hash_block(base, [1, 2, 3, 4])
    assert base != hash_block(None, [1, 2, 3, 4], ("salt:x",))
    assert hash_block(None, [1], ("salt:x",)) != hash_block(None, [1], ("salt:y",))


def test_allocate_slots_returns_none_and_changes_nothing_when_short():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    admit(kv, make_request("a", list(range(8))))  # blocks 0, 1
    b = make_request("b", list(range(50, 58)))
    assert kv.allocate_slots(b, 8) is None
    assert kv.get_block_ids("b") == []
    assert "b" not in kv.req_to_blocks
    assert [blk.block_id for blk in kv.pool.free_queue] == [2]
    assert [blk.ref_cnt for blk in kv.pool.blocks] == [1, 1, 0]
    kv.check_invariants()


def test_free_cached_hits_do_not_count_as_allocatable():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(8)))
    admit(kv, a)  # blocks 0, 1, both full and cached
    kv.free(a)
    kv.forget(a)
    assert [blk.block_id for blk in kv.pool.free_queue] == [2, 1, 0]

    # 13 tokens: hits blocks 0 and 1 (both sitting in the free list) and needs 2 more; only block 2 is
    # free besides the hits, so the request must be refused without touching anything.
    b = make_request("b", list(range(8)) + [9, 9, 9, 9, 9])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit_tokens == 8
    assert kv.allocate_slots(b, 5, hits) is None
    assert "b" not in kv.req_to_blocks
    assert [blk.block_id for blk in kv.pool.free_queue] == [2, 1, 0]
    assert set(kv.pool.cached) == set(a.block_hashes)
    assert [blk.ref_cnt for blk in kv.pool.blocks] == [0, 0, 0]
    kv.check_invariants()

    # 12 tokens: same two hits, one new block: fits exactly.
    c = make_request("c", list(range(8)) + [9, 9, 9, 9])
    hits, num_hit_tokens = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in kv.allocate_slots(c, 4, hits)] == [2]
    assert kv.get_block_ids("c") == [0, 1, 2]
    assert kv.pool.num_evictions == 0
    kv.check_invariants()


def test_prefix_cache_stats_count_tokens_per_admission():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(10))
    admit(kv, make_request("a", prompt))
    assert (kv.stats.num_queries, kv.stats.num_hits) == (10, 0)
    admit(kv, make_request("b", prompt))
    assert (kv.stats.num_queries, kv.stats.num_hits) == (20, 8)
    admit(kv, make_request("c", prompt[:6]))  # 6 tokens: one block may hit
    assert (kv.stats.num_queries, kv.stats.num_hits) == (26, 12)


def test_caching_off_no_hits_across_requests_but_samples_of_one_request_share():
    kv = KVCacheManager(num_blocks=20, block_size=BS, enable_caching=False)
    prompt = list(range(10))
    admit(kv, make_request("a", prompt))
    assert admit(kv, make_request("b", prompt))[1] == 0
    assert kv.pool.cached == {}

    s0, s1 = make_request("s0", prompt), make_request("s1", prompt)
    kv.set_group(s0, "group-1")
    kv.set_group(s1, "group-1")
    s0_blocks, s0_hits = admit(kv, s0)
    s1_blocks, s1_hits = admit(kv, s1)
    assert s0_hits == 0
    assert s1_hits == 8
    assert s1_blocks[:2] == s0_blocks[:2]
    assert s1_blocks[2] != s0_blocks[2]

    # Neither another group nor an ungrouped request sees the group's blocks.
    other = make_request("other", prompt)
    kv.set_group(other, "group-2")
    assert admit(kv, other)[1] == 0
    assert admit(kv, make_request("plain", prompt))[1] == 0
    # Stats count prefix caching only, which is off.
    assert (kv.stats.num_queries, kv.stats.num_hits) == (0, 0)


def test_free_releases_tail_first_so_the_prefix_is_evicted_last():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(12)))
    admit(kv, a)  # blocks 0, 1, 2
    kv.free(a)
    assert [blk.block_id for blk in kv.pool.free_queue] == [3, 4, 2, 1, 0]
    # An unrelated request of 3 blocks takes the two uncached ones, then A's last block.
    assert admit(kv, make_request("x", list(range(50, 62))))[0] == [3, 4, 2]
    # A's first two blocks still hit.
    hits, num_hit_tokens = kv.get_computed_blocks(make_request("b", list(range(9))))
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit_tokens == 8


def test_only_full_blocks_are_cached_chunk_by_chunk():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    probe_tokens = list(range(10)) + [99]

    def probe_hits() -> int:
        return kv.get_computed_blocks(make_request("probe", probe_tokens))[1]

    admit(kv, a, num_new=3)  # tokens 0..2: no full block
    assert kv.get_block_ids("a") == [0] and probe_hits() == 0
    assert kv.allocate_slots(a, 3) is not None  # tokens 3..5: block 0 full
    a.num_computed_tokens = 6
    assert kv.get_block_ids("a") == [0, 1] and probe_hits() == 4
    assert kv.allocate_slots(a, 4) is not None  # tokens 6..9: block 1 full
    a.num_computed_tokens = 10
    assert kv.get_block_ids("a") == [0, 1, 2] and probe_hits() == 8
    # Output tokens complete block 2: it is cached once the tokens that fill it are scheduled.
    a.append_output_token_ids([99, 5])
    assert kv.allocate_slots(a, 1) == []  # token 99 at position 10 fits in block 2
    a.num_computed_tokens = 11
    assert probe_hits() == 8  # block 2 holds 3 of 4 tokens
    assert kv.allocate_slots(a, 1) == []  # token 5 at position 11 fills it
    a.num_computed_tokens = 12
    probe_tokens = list(range(10)) + [99, 5, 0]
    assert probe_hits() == 12
    kv.check_invariants()


def test_can_fit():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    assert kv.can_fit(12)
    assert not kv.can_fit(13)


@pytest.mark.parametrize("incremental", [False, True])
def test_check_invariants_catches_a_reference_mismatch(incremental: bool):
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    admit(kv, make_request("a", list(range(6))))
    kv.pool.blocks[0].ref_cnt += 1  # a reference nobody holds
    with pytest.raises(AssertionError, match="number of requests holding it"):
        kv.check_invariants(incremental=incremental)


@pytest.mark.parametrize("incremental", [False, True])
def test_check_invariants_catches_a_block_in_use_that_no_request_holds(incremental: bool):
    """Sound for the pool (taken from its free list, one reference), but nobody's: the blocks in use outnumber the
    held ones. The manager checks the held blocks only (O(held)), the count stands for the others."""
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    kv.pool.FULL_CHECK_SPREAD = 1  # the pool's incremental check stays incremental
    admit(kv, make_request("a", list(range(6))))
    kv.check_invariants(incremental=incremental)
    kv.pool.get_new_blocks(1)
    kv.pool.check_invariants(incremental=incremental)
    with pytest.raises(AssertionError, match="ref count is nobody's"):
        kv.check_invariants(incremental=incremental)


def test_check_invariants_catches_a_held_block_of_another_pool():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    admit(kv, make_request("a", list(range(6))))
    stranger = KVCacheManager(num_blocks=4, block_size=BS).pool.get_new_blocks(2)[1]
    kv.req_to_blocks["a"][1] = stranger  # the pool's block 1 (still in use) is nobody's, a stranger has its id
    with pytest.raises(AssertionError, match="not the pool's"):
        kv.check_invariants()


@pytest.mark.parametrize("incremental", [False, True])
def test_check_invariants_catches_a_request_holding_a_block_twice(incremental: bool):
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    admit(kv, make_request("a", list(range(6))))
    block = kv.req_to_blocks["a"][0]
    kv.req_to_blocks["a"].append(block)
    block.ref_cnt += 1
    with pytest.raises(AssertionError):
        kv.check_invariants(incremental=incremental)


def _flushed(prompt_len: int, num_new: int | None = None) -> tuple[KVCacheManager, Request]:
    """A manager whose one request "a" has its full computed blocks in the prefix cache; the checks given the
    live requests pass."""
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(1, prompt_len + 1)))
    admit(kv, a, num_new)
    kv.flush()
    kv.check_invariants({"a": a})
    return kv, a


def test_check_invariants_catches_a_block_keyed_by_another_blocks_hash():
    """Block 0 re-keyed with block 1's hash: a later prompt hitting block 1's prefix would read block 0's K/V."""
    kv, a = _flushed(10)
    b0, b1 = kv.req_to_blocks["a"][:2]
    del kv.pool.cached[b0.block_hash], kv.pool.cached[b1.block_hash]
    b1.block_hash = None
    b0.block_hash = a.block_hashes[1]
    kv.pool.cached[b0.block_hash] = b0
    kv.check_invariants()  # the map and the blocks agree: only the request's tokens tell
    with pytest.raises(AssertionError, match="hash of other tokens"):
        kv.check_invariants({"a": a})


def test_check_invariants_catches_a_cached_block_not_yet_computed():
    """10 tokens, 6 of them scheduled: block 1 holds tokens 4..7, of which 6 and 7 are not computed. Carrying
    its own (correct) hash, it would serve a prefix hit K/V never written."""
    kv, a = _flushed(10, num_new=6)
    kv._update_block_hashes(a)  # hash every full block of the tokens, as a later chunk would
    block = kv.req_to_blocks["a"][1]
    assert block.block_hash is None and len(a.block_hashes) == 2
    block.block_hash = a.block_hashes[1]
    kv.pool.cached[block.block_hash] = block
    kv.check_invariants()
    with pytest.raises(AssertionError, match="not full of computed tokens"):
        kv.check_invariants({"a": a})


def test_check_invariants_catches_offered_block_counts_past_the_blocks_held():
    kv, a = _flushed(10)
    kv._num_cached_blocks["a"] = 4  # holds 3
    with pytest.raises(AssertionError, match="offered"):
        kv.check_invariants()
    kv._num_cached_blocks["a"] = 2
    kv.free(a)
    kv.check_invariants({})
    kv._num_cached_blocks["a"] = 2  # left by the freed request: a new "a" would skip offering its first 2 blocks
    with pytest.raises(AssertionError, match="holds no blocks"):
        kv.check_invariants({})


def test_check_invariants_catches_a_group_key_left_by_a_finished_request():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(1, 11)))
    kv.set_group(a, "g")
    admit(kv, a)
    kv.check_invariants({"a": a})
    kv.free(a)  # without `forget`: a later "a" would share the old group's blocks
    with pytest.raises(AssertionError, match="sample-group key"):
        kv.check_invariants({})
    kv.forget(a)
    kv.check_invariants({})


def test_check_invariants_catches_deferred_caching_of_a_stale_request():
    """A deferred entry must be the live request: an earlier one of the same id would offer its own hashes for
    the live one's blocks."""
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(1, 11)))
    admit(kv, a)
    assert "a" in kv._deferred
    kv.check_invariants({"a": a})
    kv._deferred["a"] = (make_request("a", list(range(20, 30))), 8)
    kv.check_invariants()
    with pytest.raises(AssertionError, match="not the live one"):
        kv.check_invariants({"a": a})


@pytest.mark.parametrize("extra", [(), ("salt:s",), ("salt:s", "group:g")])
@pytest.mark.parametrize("parent", [None, b"p" * 16])
def test_hash_blocks_equals_chained_hash_block(parent: bytes | None, extra: tuple[str, ...]) -> None:
    tokens = [7, 0, 151_000, -3, 2**40, 5, 6, -(2**63)]
    expected, last = [], parent
    for i in range(0, len(tokens), 2):
        last = hash_block(last, tokens[i : i + 2], extra)
        expected.append(last)
    assert hash_blocks(parent, tokens, 2, extra) == expected
    assert hash_blocks(parent, [], 2, extra) == []
    assert len(hash_block(parent, [], extra)) == 16
    with pytest.raises(ValueError, match="whole blocks"):
        hash_blocks(parent, tokens[:3], 2, extra)


def test_scheduled_blocks_are_hashed_and_cached_at_flush() -> None:
    """A fresh prompt's lookup hashes its first block only (the first miss); its allocation defers the rest
    of the hashing and the caching to `flush`, after which every full block is cached as before."""
    assert kv_cache_manager.DEFERRED_BLOCK_CACHING
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(100, 110))  # two full blocks and a partial one
    a = make_request("a", prompt)
    hits, _ = kv.get_computed_blocks(a)
    assert hits == [] and len(a.block_hashes) == 1
    assert kv.allocate_slots(a, len(prompt)) is not None
    a.num_computed_tokens = len(prompt)
    kv.check_invariants()
    assert len(a.block_hashes) == 1 and kv.pool.cached == {}
    kv.flush()
    kv.check_invariants()
    assert a.block_hashes == [hash_block(None, prompt[:4]), hash_block(a.block_hashes[0], prompt[4:8])]
    assert {h: b.block_id for h, b in kv.pool.cached.items()} == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}


def test_a_lookup_or_a_free_flushes_deferred_blocks_first() -> None:
    """A request admitted after another in the same step still hits the other's scheduled blocks (the
    lookup flushes), and a request freed before any flush leaves its blocks cached."""
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(100, 110))
    admit(kv, make_request("a", prompt))
    assert kv.pool.cached == {}
    b_blocks, b_hits = admit(kv, make_request("b", prompt))
    assert b_hits == 8 and b_blocks[:2] == [0, 1]
    c = make_request("c", list(range(200, 209)))
    admit(kv, c)
    kv.free(c)
    assert kv.get_computed_blocks(make_request("d", list(range(200, 209))))[1] == 8


@pytest.mark.parametrize("deferred", [True, False])
def test_an_allocation_that_evicts_sees_the_deferred_blocks_cached(deferred: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A running request's new block completes a hash that a free cached block already holds; a later
    allocation in the same step evicts that free block. The new block must stay uncached, as when it is
    cached at once (the first holder keeps the hash, and the eviction then drops it); flushing only after
    the eviction would cache it instead, and the two settings would go on to schedule differently."""
    monkeypatch.setattr(kv_cache_manager, "DEFERRED_BLOCK_CACHING", deferred)
    kv = KVCacheManager(num_blocks=4, block_size=2)
    x = make_request("x", [5, 6, 7, 8])
    admit(kv, x)
    kv.free(x)  # blocks 0 (hash of 5 6) and 1 (5 6 7 8) cached and free, behind the never used 2 and 3
    r = make_request("r", [5, 6])
    assert kv.allocate_slots(r, 2) is not None  # block 2, full with 5 6: the hash block 0 holds
    r.num_computed_tokens = 2
    z = make_request("z", [1] * 6)
    assert kv.allocate_slots(z, 6) is not None  # blocks 3, 1 and 0: both cached hashes evicted
    kv.flush()
    kv.check_invariants()
    z_hashes = hash_blocks(None, [1] * 6, 2)
    assert {h: b.block_id for h, b in kv.pool.cached.items()} == dict(zip(z_hashes, [3, 1, 0], strict=True))
    assert kv.get_computed_blocks(make_request("y", [5, 6, 9]))[1] == 0
