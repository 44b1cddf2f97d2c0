"""Triton paged attention and reshape_and_cache against the torch reference (kvserve/kernels/reference.py).

Every batch is built with shuffled, non-contiguous cache blocks, padded block tables and partial last
blocks; outputs start as NaN so an element the kernel skips fails the comparison.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import reference, triton_attention, triton_cache  # noqa: E402
from kvserve.kernels.triton_attention import choose_num_splits, launch_paged_attention, paged_attention  # noqa: E402
from kvserve.layers.attention_metadata import AttentionMetadata  # noqa: E402

TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    # P is rounded to the cache dtype before the second product (as FlashAttention does).
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
SHAPES = {  # (num_heads, num_kv_heads): GQA group 1, 3 (SmolLM2-like) and 7 (Qwen2.5-7B-like)
    "mha": (2, 2),
    "group3": (6, 2),
    "group7": (7, 1),
}
# A mixed step: a prefill chunk over a cached prefix, a fresh prompt, a chunk ending on a block boundary,
# and decode rows (one of them the first token of its context).
MIXED_QUERY_LENS = [13, 20, 1, 9, 1]
MIXED_SEQ_LENS = [45, 20, 33, 64, 1]


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random query and KV cache with each request's blocks scattered over a shuffled pool.

    Block tables are two columns wider than needed and padded with 0 (block 0 belongs to some request or
    to nobody), so a kernel that reads past a request's blocks reads real, wrong data.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_req) + 2, dtype=torch.int32)
    slots: list[int] = []
    for r, n in enumerate(blocks_per_req):
        block_tables[r, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
        for pos in range(seq_lens[r] - query_lens[r], seq_lens[r]):
            slots.append(int(block_tables[r, pos // block_size]) * block_size + pos % block_size)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    query_start_loc = [0]
    for q in query_lens:
        query_start_loc.append(query_start_loc[-1] + q)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=list(seq_lens),
    )
    return query.to(device=device, dtype=dtype), kv_cache.to(device=device, dtype=dtype), metadata


def check_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One launch into a NaN-filled output, compared with the reference; returns that output."""
    scale = query.shape[-1] ** -0.5
    out = torch.full_like(query, float("nan"))
    returned = launch_paged_attention(query, kv_cache, metadata, scale, out, num_splits=num_splits)
    assert returned is out
    expected = reference.paged_attention(query, kv_cache, metadata, scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[query.dtype])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_reference(dtype, head_dim, shape, block_size, device, skip_bf16_on_interpreter):
    skip_bf16_on_interpreter(dtype)
    num_heads, num_kv_heads = SHAPES[shape]
    query, kv_cache, metadata = make_batch(
        MIXED_QUERY_LENS, MIXED_SEQ_LENS, num_heads, num_kv_heads, head_dim, block_size, dtype, device
    )
    check_attention(query, kv_cache, metadata)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [
        ([150], [200]),  # several query tiles over a cached prefix
        ([70, 3, 41], [70, 90, 41]),  # fresh prompts and a short chunk over a long prefix
        ([2, 2, 2], [2, 17, 40]),  # tiny chunks (spec-decode-like): smallest tile
    ],
    ids=["multi_tile_prefix", "fresh_and_chunk", "tiny_chunks"],
)
def test_prefill_tiling_matches_reference(shape, query_lens, seq_lens, device):
    num_heads, num_kv_heads = SHAPES[shape]
    query, kv_cache, metadata = make_batch(
        query_lens, seq_lens, num_heads, num_kv_heads, 64, 16, torch.float32, device, seed=1
    )
    check_attention(query, kv_cache, metadata)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [None, 1, 2, 3, 7, 16], ids=lambda s: f"splits={s}")
def test_decode_split_k_matches_reference(
    dtype, num_splits, device, skip_bf16_on_interpreter, poison_allocations
):
    """Long-ish decode contexts (5 tiles of 64 keys); 16 splits leave most splits empty. The split scratch
    starts as NaN, so every split, empty or not, must write its partial."""
    skip_bf16_on_interpreter(dtype)
    poison_allocations(triton_attention)
    seq_lens = [300, 77, 260]
    query, kv_cache, metadata = make_batch([1, 1, 1], seq_lens, 6, 2, 64, 16, dtype, device, seed=2)
    check_attention(query, kv_cache, metadata, num_splits=num_splits)


def test_decode_heuristic_splits_a_small_batch(device, poison_allocations):
    """paged_attention itself splits batch-1 long-context decode; split scratch starts as NaN."""
    poison_allocations(triton_attention)
    num_kv_heads, seq_len = 2, 700
    num_sms = triton_attention._num_sms(device)
    assert choose_num_splits(1, num_kv_heads, seq_len, num_sms) > 1  # the path under test
    query, kv_cache, metadata = make_batch([1], [seq_len], 4, num_kv_heads, 128, 32, torch.float32, device)
    scale = 128**-0.5
    out = paged_attention(query, kv_cache, metadata, scale)
    expected = reference.paged_attention(query, kv_cache, metadata, scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_block_ids_loaded_ahead_give_the_same_bits(num_splits, device, poison_allocations, monkeypatch):
    """Decode with each tile's block ids loaded one tile ahead (DECODE_PREFETCH_IDS) against loaded in the tile's
    iteration: same keys, same order, so the same bits; both match the reference. Contexts of 1, 64, 65 and
    300 keys end the last tile at and just past a tile boundary. (The look-ahead load past the last tile is
    masked; an unmasked one would read ids that no valid key uses, which no output shows.)"""
    poison_allocations(triton_attention)
    query, kv_cache, metadata = make_batch([1] * 4, [1, 64, 65, 300], 6, 2, 64, 16, torch.float32, device, seed=5)
    outs = []
    for ahead in (True, False):
        monkeypatch.setattr(triton_attention, "DECODE_PREFETCH_IDS", ahead)
        outs.append(launch_paged_attention(query, kv_cache, metadata, 0.125, num_splits=num_splits))
    assert torch.equal(outs[0], outs[1])
    expected = reference.paged_attention(query, kv_cache, metadata, 0.125)
    torch.testing.assert_close(outs[0], expected, **TOLERANCES[torch.float32])


def test_busy_one_split_launch_takes_its_own_tiling(device, monkeypatch):
    """Past DECODE_BUSY_PROGRAMS_PER_SM (request, KV head) programs per SM a one-split decode runs
    DECODE_LAUNCH_ONE_SPLIT_BUSY with the block ids loaded in the tile's iteration; both tilings match the
    reference."""
    num_sms = triton_attention._num_sms(device)
    kv_heads = 2
    few = num_sms * triton_attention.DECODE_BUSY_PROGRAMS_PER_SM // kv_heads
    assert not triton_attention.decode_launch_is_busy(few, kv_heads, num_sms)
    assert triton_attention.decode_launch_is_busy(few + 1, kv_heads, num_sms)
    seen: list[tuple[int, bool]] = []
    kernel = triton_attention._paged_attention_kernel

    class Spy:
        def __getitem__(self, grid: object) -> object:
            def launch(*args: object, **kwargs: object) -> object:
                seen.append((kwargs["TILE_N"], kwargs["PREFETCH_IDS"], kwargs["num_stages"]))
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", Spy())
    for num_reqs in (few, few + 1):
        query, kv_cache, metadata = make_batch([1] * num_reqs, [70 + 9 * r for r in range(num_reqs)], 6, kv_heads, 64,
                                               16, torch.float32, device, seed=num_reqs)
        check_attention(query, kv_cache, metadata, num_splits=1)
    one, busy = triton_attention.DECODE_LAUNCH_ONE_SPLIT, triton_attention.DECODE_LAUNCH_ONE_SPLIT_BUSY
    assert seen[0] == (one["TILE_N"], True, one["num_stages"])  # fp32 64-key tiles of 64 dims: 4 stages fit
    assert seen[-1] == (busy["TILE_N"], False, busy["num_stages"])


def test_ops_reports_the_launch_the_kernel_takes(monkeypatch):
    """ops.decode_attention_launch (what CUDA-graph padding must keep) gives the launcher's split count and
    busy choice on both sides of the busy limit, for a CUDA cache (stood in for by its shape and flag)."""
    from types import SimpleNamespace

    from kvserve.kernels import ops

    num_sms, kv_heads, max_len = 132, 4, 32768
    monkeypatch.setattr(ops, "_num_sms", lambda device: num_sms)
    cache = SimpleNamespace(is_cuda=True, shape=(2, 8, 16, kv_heads, 128), device=torch.device("cpu"))
    limit = triton_attention.DECODE_BUSY_PROGRAMS_PER_SM * num_sms // kv_heads
    for num_reqs in (1, 8, 32, 33, limit, limit + 1, 256):
        expected = (choose_num_splits(num_reqs, kv_heads, max_len, num_sms),
                    triton_attention.decode_launch_is_busy(num_reqs, kv_heads, num_sms))
        assert ops.decode_attention_launch(num_reqs, cache, max_len) == expected, num_reqs  # type: ignore[arg-type]
    assert ops.decode_attention_launch(limit, cache, max_len) == (1, False)  # type: ignore[arg-type]
    assert ops.decode_attention_launch(limit + 1, cache, max_len) == (1, True)  # type: ignore[arg-type]


def test_decode_launch_shapes_cover_every_decode_variant():
    """The warm-up's decode shapes (one per kernel variant and merge) cover every launch a decode batch of 1 to
    256 requests at any context up to 32k takes on an H200-sized GPU (132 SMs, 4 KV heads), each exactly once:
    one split busy and not, the merge in the kernel, and the reduce kernel at 16, 32 and 64 padded splits (a
    5-request batch's 14 splits: the 16 the decode graphs at 32k never launch)."""
    from kvserve.kernels import ops

    num_sms, kv_heads, max_len = 132, 4, 32768
    shapes = ops.decode_launch_shapes(256, max_len, kv_heads, num_sms)

    def variant(num_reqs: int, seq_len: int) -> tuple[object, ...]:
        splits = choose_num_splits(num_reqs, kv_heads, seq_len, num_sms)
        return triton_attention.decode_launch_variant(num_reqs, kv_heads, splits, num_sms)

    covered = [variant(n, length) for n, length in shapes]
    assert len(set(covered)) == len(covered)
    everything = {variant(n, length) for n in range(1, 257) for length in (1, 63, 64, 700, 1000, 4096, 9000, max_len)}
    assert set(covered) == everything
    assert {v for v in everything if v[0] == "reduce"} == {("reduce", 16), ("reduce", 32), ("reduce", 64)}
    assert ("one split", True) in everything and ("one split", False) in everything
    assert variant(5, max_len) == ("reduce", 16)
    assert all(1 <= n <= 256 and 1 <= length <= max_len for n, length in shapes)
    assert all(length <= 100 for _, length in ops.decode_launch_shapes(4, 100, kv_heads, num_sms))


def test_decode_stages_keep_the_kv_buffers_in_shared_memory():
    """num_stages - 1 buffers of a K and a V tile: bf16 128-key tiles of 128 dims keep 3 stages (128 KiB);
    fp32 drops to 2 (one buffer), as do stages that would pass the limit; never below 2."""
    assert triton_attention.decode_stages(3, 128, 128, 2) == 3
    assert triton_attention.decode_stages(4, 128, 128, 2) == 3
    assert triton_attention.decode_stages(3, 128, 128, 4) == 2
    assert triton_attention.decode_stages(4, 64, 128, 2) == 4
    assert triton_attention.decode_stages(2, 256, 256, 4) == 2


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_padding_rows_give_zeros(num_splits, device):
    """CUDA-graph batch padding: rows with seq_len 0 produce zeros and leave real rows untouched."""
    query, kv_cache, metadata = make_batch([1, 1, 1], [130, 0, 5], 6, 2, 64, 16, torch.float32, device)
    check_attention(query, kv_cache, metadata, num_splits=num_splits)
    out = launch_paged_attention(query, kv_cache, metadata, 0.125, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("case", ["splits", "cascade_splits", "padding_rows"])
def test_fused_merge_matches_the_reduce_kernel(case, device, poison_allocations, monkeypatch):
    """The last split program's merge against the separate reduce launch: both match the reference, agree
    to float32 rounding, give the same bits launch after launch, and leave every counter at zero (so the
    next launch, a graph replay, merges again)."""
    poison_allocations(triton_attention)
    seq_lens = [300, 77, 260, 0] if case == "padding_rows" else [300, 77, 260, 150]
    query, kv_cache, metadata = make_batch([1] * 4, seq_lens, 14, 2, 64, 16, torch.float32, device, seed=8)
    if case == "cascade_splits":
        metadata = share_prefix(metadata, 4, 64)
    scale = 0.125
    expected = reference.paged_attention(query, kv_cache, metadata, scale)
    outs = {}
    reduce_launches = spy_on_reduce_launches(monkeypatch)
    for fused in (True, False):
        # 64: every split count here, a cascade's prefix splits too; 0: the reduce launch always.
        monkeypatch.setattr(triton_attention, "DECODE_FUSED_MERGE_MAX_SPLITS", 64 if fused else 0)
        reduce_launches.clear()
        first = launch_paged_attention(query, kv_cache, metadata, scale, num_splits=3)
        second = launch_paged_attention(query, kv_cache, metadata, scale, num_splits=3)
        assert len(reduce_launches) == (0 if fused else 2)  # the path under test ran
        assert torch.equal(first, second)
        torch.testing.assert_close(first, expected, **TOLERANCES[torch.float32])
        outs[fused] = first
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-6, atol=1e-6)
    assert int(triton_attention._MERGE_COUNTERS.buffers[query.device].abs().sum()) == 0
    if case == "padding_rows":
        assert torch.equal(outs[True][3], torch.zeros_like(outs[True][3]))


@pytest.mark.parametrize(("max_splits", "reduce_launches"), [(3, 0), (2, 1)])
def test_fused_merge_only_up_to_its_split_count(max_splits, reduce_launches, device, monkeypatch):
    """Past DECODE_FUSED_MERGE_MAX_SPLITS splits the reduce kernel merges (its reads run in parallel)."""
    query, kv_cache, metadata = make_batch([1, 1], [300, 77], 6, 2, 64, 16, torch.float32, device, seed=9)
    monkeypatch.setattr(triton_attention, "DECODE_FUSED_MERGE_MAX_SPLITS", max_splits)
    launches = spy_on_reduce_launches(monkeypatch)
    check_attention(query, kv_cache, metadata, num_splits=3)
    assert len(launches) == reduce_launches


def spy_on_reduce_launches(monkeypatch) -> list:
    """The grids `_reduce_splits_kernel` is launched with from now on (the launches still run)."""
    launches: list = []
    reduce_kernel = triton_attention._reduce_splits_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return reduce_kernel[grid]

    monkeypatch.setattr(triton_attention, "_reduce_splits_kernel", Spy())
    return launches


def share_prefix(metadata: AttentionMetadata, shared_blocks: int, prefix_len: int) -> AttentionMetadata:
    """The batch's requests share their first `shared_blocks` cache blocks (row 0's), and the metadata asks
    for cascade attention over the first `prefix_len` keys."""
    block_tables = metadata.block_tables.clone()
    block_tables[:, :shared_blocks] = block_tables[0, :shared_blocks]
    return AttentionMetadata(
        **{
            **vars(metadata),
            "block_tables": block_tables,
            "common_prefix_len": prefix_len,
            "common_prefix_len_tensor": torch.tensor([prefix_len], dtype=torch.int32, device=block_tables.device),
        }
    )


def check_cascade(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                  num_splits: int | None = None) -> torch.Tensor:
    """Cascade output equals the reference (which ignores the shared prefix) and the plain kernel."""
    # The output check_attention compared with the reference (launched once: under the interpreter a launch
    # costs about as much as the rest of the test).
    cascade_out = check_attention(query, kv_cache, metadata, num_splits=num_splits)
    plain = AttentionMetadata(**{**vars(metadata), "common_prefix_len": 0, "common_prefix_len_tensor": None})
    plain_out = launch_paged_attention(query, kv_cache, plain, query.shape[-1] ** -0.5, num_splits=num_splits)
    torch.testing.assert_close(cascade_out, plain_out, **TOLERANCES[query.dtype])
    return cascade_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_splits", [None, 1, 3], ids=lambda s: f"splits={s}")
@pytest.mark.parametrize(
    "prefix_len", [64, 50, 76], ids=["tile_boundary", "mid_block", "up_to_a_query"]
)
def test_cascade_decode_matches_reference(
    dtype, shape, num_splits, prefix_len, device, skip_bf16_on_interpreter, poison_allocations
):
    """Decode rows sharing 5 blocks (80 tokens) of 16; the prefix attended once ends on a tile boundary,
    inside a block, or right before the shortest request's own query token. Split scratch starts as NaN."""
    skip_bf16_on_interpreter(dtype)
    poison_allocations(triton_attention)
    num_heads, num_kv_heads = SHAPES[shape]
    seq_lens = [300, 77, 260, 150]
    query, kv_cache, metadata = make_batch([1] * 4, seq_lens, num_heads, num_kv_heads, 64, 16, dtype, device, seed=5)
    check_cascade(query, kv_cache, share_prefix(metadata, 5, prefix_len), num_splits)


def test_cascade_many_rows_and_padding(device, poison_allocations):
    """20 requests x 7 query heads per KV head: the shared part spans two 128-row tiles; padding rows
    (seq_len 0, CUDA-graph batches) stay finite and real rows are exact."""
    poison_allocations(triton_attention)
    gen = torch.Generator().manual_seed(6)
    seq_lens = [int(x) for x in torch.randint(70, 200, (20,), generator=gen)] + [0, 0]
    query, kv_cache, metadata = make_batch([1] * 22, seq_lens, 14, 2, 64, 16, torch.float32, device, seed=6)
    metadata = share_prefix(metadata, 4, 64)
    scale = 0.125
    out = launch_paged_attention(query, kv_cache, metadata, scale)
    expected = reference.paged_attention(query, kv_cache, metadata, scale)
    torch.testing.assert_close(out[:20], expected[:20], **TOLERANCES[torch.float32])
    assert torch.isfinite(out).all()


def test_cascade_prefix_splits_are_graph_stable():
    # Host ints only, never the prefix length; enough programs for the H200's SMs, within the cap.
    for num_reqs in (1, 8, 64, 256):
        splits = triton_attention.cascade_prefix_splits(num_reqs, 7, 4, 132)
        assert 1 <= splits <= triton_attention.CASCADE_MAX_PREFIX_SPLITS
        block_m = triton_attention.cascade_block_m(num_reqs, 7)
        programs = -(-num_reqs * 7 // block_m) * 4 * splits
        assert programs >= 2 * 132 or splits == triton_attention.CASCADE_MAX_PREFIX_SPLITS


def test_query_and_out_may_be_views(device):
    """query as a slice of a fused QKV projection, out as a slice of a wider buffer."""
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    query, kv_cache, metadata = make_batch(
        MIXED_QUERY_LENS, MIXED_SEQ_LENS, num_heads, num_kv_heads, head_dim, 16, torch.float32, device
    )
    qkv = torch.randn(query.shape[0], (num_heads + 2 * num_kv_heads) * head_dim, device=device)
    qkv[:, : num_heads * head_dim] = query.reshape(query.shape[0], -1)
    query_view = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    wide = torch.full((query.shape[0], num_heads + 1, head_dim), float("nan"), device=device)
    out_view = wide[:, :num_heads]
    paged_attention(query_view, kv_cache, metadata, 0.125, out=out_view)
    expected = reference.paged_attention(query, kv_cache, metadata, 0.125)
    torch.testing.assert_close(out_view, expected, **TOLERANCES[torch.float32])
    assert torch.isnan(wide[:, num_heads]).all()  # nothing written outside the view


def test_out_none_allocates_a_fully_written_result(device, poison_allocations):
    poison_allocations(triton_attention)
    query, kv_cache, metadata = make_batch(
        MIXED_QUERY_LENS, MIXED_SEQ_LENS, 6, 2, 64, 16, torch.float16, device
    )
    out = paged_attention(query, kv_cache, metadata, 0.125)
    expected = reference.paged_attention(query, kv_cache, metadata, 0.125)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float16])


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_match_reference(seed, device):
    gen = torch.Generator().manual_seed(100 + seed)
    num_reqs = int(torch.randint(1, 6, (1,), generator=gen))
    query_lens, seq_lens = [], []
    for _ in range(num_reqs):
        q = 1 if torch.rand(1, generator=gen) < 0.5 else int(torch.randint(1, 40, (1,), generator=gen))
        query_lens.append(q)
        seq_lens.append(q + int(torch.randint(0, 80, (1,), generator=gen)))
    block_size = 16 if seed % 2 else 32
    query, kv_cache, metadata = make_batch(
        query_lens, seq_lens, 6, 2, 64, block_size, torch.float32, device, seed=seed
    )
    check_attention(query, kv_cache, metadata)


def test_prefill_then_decode_through_the_cache(device):
    """reshape_and_cache then paged_attention (both Triton) equals the reference pipeline, step by step."""
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 16
    gen = torch.Generator().manual_seed(3)
    block_table = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32, device=device)
    kv_triton = torch.zeros(2, 8, block_size, num_kv_heads, head_dim, device=device)
    kv_reference = kv_triton.clone()
    seq_len = 0
    for query_len in (37, 1, 1, 9):  # prompt, two decode steps, a chunk
        positions = range(seq_len, seq_len + query_len)
        seq_len += query_len
        slots = [int(block_table[0, p // block_size]) * block_size + p % block_size for p in positions]
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, query_len], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
            block_tables=block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=query_len,
            max_seq_len=seq_len,
            query_start_loc_cpu=[0, query_len],
            seq_lens_cpu=[seq_len],
        )
        q, k, v = (
            torch.randn(query_len, h, head_dim, generator=gen).to(device)
            for h in (num_heads, num_kv_heads, num_kv_heads)
        )
        triton_cache.reshape_and_cache(k, v, kv_triton, metadata.slot_mapping)
        reference.reshape_and_cache(k, v, kv_reference, metadata.slot_mapping)
        assert torch.equal(kv_triton, kv_reference)
        out = paged_attention(q, kv_triton, metadata, 0.125)
        expected = reference.paged_attention(q, kv_reference, metadata, 0.125)
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


# ------------------------------------------------------------------------------- reshape_and_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (3, 128)])
def test_reshape_and_cache_matches_reference(dtype, num_kv_heads, head_dim, device):
    """K/V as views into a fused QKV output; padding slots (-1) are skipped; no other slot changes."""
    num_tokens, num_blocks, block_size, num_heads = 11, 6, 16, 4
    gen = torch.Generator().manual_seed(4)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(device=device, dtype=dtype)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        -1, num_kv_heads, head_dim
    )
    value = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(-1, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1
    slot_mapping = slots.to(device)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    kv_cache = kv_cache.to(device)
    expected = kv_cache.clone()
    triton_cache.reshape_and_cache(key, value, kv_cache, slot_mapping)
    reference.reshape_and_cache(key, value, expected, slot_mapping)
    torch.testing.assert_close(kv_cache, expected, atol=0, rtol=0, equal_nan=True)
    assert int((~torch.isnan(kv_cache[0])).all(-1).all(-1).sum()) == num_tokens - 2


# ------------------------------------------------------------------------------------- contracts


def test_launcher_rejects_what_the_kernel_cannot_handle(device):
    query, kv_cache, metadata = make_batch([3], [10], 2, 2, 64, 16, torch.float32, device)
    with pytest.raises(AssertionError, match="head_dim must be a power of two"):
        paged_attention(query[..., :48], kv_cache[..., :48], metadata, 0.1)
    with pytest.raises(AssertionError, match="share a float dtype"):
        paged_attention(query.half(), kv_cache, metadata, 0.1)
    with pytest.raises(AssertionError, match="block_tables must be an int32"):
        metadata_i64 = AttentionMetadata(**{**vars(metadata), "block_tables": metadata.block_tables.long()})
        paged_attention(query, kv_cache, metadata_i64, 0.1)
    with pytest.raises(AssertionError, match="query has 2 tokens"):
        paged_attention(query[:2], kv_cache, metadata, 0.1)
    with pytest.raises(AssertionError, match="contiguous heads"):
        triton_cache.reshape_and_cache(
            query[:, :, ::2], query[:, :, ::2], kv_cache[..., :32].contiguous(), metadata.slot_mapping
        )


def test_choose_num_splits_fills_the_gpu_only_when_needed():
    # Qwen2.5-7B decode at batch 1 with a 4k context on an H200 (132 SMs): enough programs for every SM.
    splits = choose_num_splits(num_reqs=1, num_kv_heads=4, max_seq_len=4096, num_sms=132)
    assert 4 * splits >= 132 and 4096 / splits >= 64
    # Enough requests already fill the GPU; short contexts are not worth splitting.
    assert choose_num_splits(num_reqs=64, num_kv_heads=4, max_seq_len=4096, num_sms=132) == 1
    assert choose_num_splits(num_reqs=1, num_kv_heads=4, max_seq_len=100, num_sms=132) == 1
    # More context never means fewer splits (CUDA-graph buckets stay ordered).
    counts = [choose_num_splits(2, 4, n, 132) for n in range(1, 20000, 97)]
    assert counts == sorted(counts)


def test_kernels_compile_for_hopper(device, hopper_compiler):
    """The launch configurations used at Qwen2.5-7B-like (bf16, fp32) and SmolLM2-like (fp16) shapes compile
    for sm_90: decode with and without splits, the split reduce, large and small prefill tiles, the cache write."""
    attention_kernels = ["_paged_attention_kernel", "_reduce_splits_kernel"]
    for (num_heads, num_kv_heads, head_dim), dtype in (
        ((28, 4, 128), torch.bfloat16),
        ((28, 4, 128), torch.float32),
        ((9, 3, 64), torch.float16),
    ):
        decode = make_batch([1, 1], [900, 40], num_heads, num_kv_heads, head_dim, 16, dtype, device)
        prefill = make_batch([40, 1], [50, 9], num_heads, num_kv_heads, head_dim, 16, dtype, device)
        tiny_chunks = make_batch([2, 1], [50, 9], num_heads, num_kv_heads, head_dim, 16, dtype, device)
        cascade = (decode[0], decode[1], share_prefix(decode[2], 2, 32))
        # 12 and 40 requests: the shared-prefix kernel's 64- and 128-row tiles (at GQA group 7).
        cascade_wide = [
            (b[0], b[1], share_prefix(b[2], 2, 32))
            for b in (make_batch([1] * n, [40] * n, num_heads, num_kv_heads, head_dim, 16, dtype, device)
                      for n in (12, 40))
        ]
        for batch, kernels, splits in (
            (decode, attention_kernels[:1], 1),
            (decode, attention_kernels, -4),  # separate reduce launch (DECODE_FUSED_MERGE_MAX_SPLITS 0)
            (decode, attention_kernels[:1], 4),
            # A one-split own part merges the prefix partials itself; with splits the last split program does,
            # or the reduce kernel (a negative count here: DECODE_FUSED_MERGE_MAX_SPLITS 0).
            (cascade, ["_shared_prefix_kernel", attention_kernels[0]], 1),
            (cascade, ["_shared_prefix_kernel", *attention_kernels], -3),
            (cascade, ["_shared_prefix_kernel", attention_kernels[0]], 3),
            *((b, ["_shared_prefix_kernel", attention_kernels[0]], 1) for b in cascade_wide),
            (prefill, attention_kernels[:1], None),
            (tiny_chunks, attention_kernels[:1], None),
            (decode, attention_kernels[:1], "busy"),  # one split past DECODE_BUSY_PROGRAMS_PER_SM
        ):
            busy = splits == "busy"
            splits = 1 if busy else splits
            fused_merge = splits is None or splits > 0
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(triton_attention, "DECODE_FUSED_MERGE_MAX_SPLITS", 64 if fused_merge else 0)
                if busy:
                    patch.setattr(triton_attention, "DECODE_BUSY_PROGRAMS_PER_SM", 0)
                hopper_compiler.record(
                    triton_attention,
                    kernels,
                    lambda b=batch, s=None if splits is None else abs(splits): launch_paged_attention(
                        *b, 0.1, num_splits=s
                    ),
                )
        key = decode[0][:, :num_kv_heads]
        slot_mapping = torch.zeros(2, dtype=torch.int64, device=device)
        hopper_compiler.record(
            triton_cache,
            ["_reshape_and_cache_kernel"],
            lambda k=key, kv=decode[1], s=slot_mapping: triton_cache.reshape_and_cache(k, k, kv, s),
        )
    merges = {spec["constexprs"].get("FUSED_MERGE") for spec in hopper_compiler.specs
              if spec["kernel"] == "_paged_attention_kernel" and spec["constexprs"].get("USE_SPLITS")}
    assert merges == {True, False}  # split launches merged in the kernel and by the reduce launch
    resident = set()
    for spec, result in zip(hopper_compiler.specs, hopper_compiler.compile_all(), strict=True):
        assert result["shared_bytes"] <= 227 * 1024, result  # Hopper's per-block shared memory limit
        c = spec["constexprs"]
        if (spec["kernel"] == "_paged_attention_kernel" and c["IS_DECODE"] and not c["USE_SPLITS"]
                and not c["CASCADE"] and spec["signature"]["q_ptr"] == "*bf16"):
            # The one-split tilings' footprints as the busy rule counts them (1 KiB reserved per block): 2
            # programs per SM with block ids ahead (64-key tiles, 3 buffers), 3 for the busy tiling.
            per_sm = 2 if c["PREFETCH_IDS"] else 3
            assert per_sm * (result["shared_bytes"] + 1024) <= 228 * 1024, (c, result)
            resident.add((c["TILE_N"], c["PREFETCH_IDS"]))
    assert resident == {(64, True), (128, False)}  # both one-split tilings were compiled


# ------------------------------------------------------------------------------------ GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_cuda_graph_replays_with_new_lengths():
    """Capture split-K decode once for a (batch, max_seq_len bucket), replay with other seq_lens/tables."""
    device = torch.device("cuda")
    num_heads, num_kv_heads, head_dim, block_size, bucket = 28, 4, 128, 16, 1024
    query, kv_cache, metadata = make_batch(
        [1] * 4, [1000, 700, 3, 1024], num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, device
    )
    metadata.max_seq_len = bucket
    assert choose_num_splits(4, num_kv_heads, bucket, triton_attention._num_sms(device)) > 1
    out = torch.full_like(query, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention(query, kv_cache, metadata, 0.1, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(query, kv_cache, metadata, 0.1, out=out)

    new_query, _, new_metadata = make_batch(
        [1] * 4,
        [17, 1024, 512, 1],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.bfloat16,
        device,
        seed=9,
    )
    query.copy_(new_query)
    metadata.seq_lens.copy_(new_metadata.seq_lens)
    metadata.block_tables.zero_()
    width = new_metadata.block_tables.shape[1]
    metadata.block_tables[:, :width].copy_(new_metadata.block_tables)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    new_metadata.block_tables = metadata.block_tables
    expected = reference.paged_attention(query, kv_cache, new_metadata, 0.1)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.bfloat16])


def test_gpu_tests_skip_cleanly_without_cuda():
    """With no visible GPU, the gpu-marked tests of this file are collected and skipped, not errored."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(Path(__file__)),
            "-m",
            "gpu",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parents[2],
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 skipped" in result.stdout and "needs a CUDA GPU" in result.stdout, result.stdout


@pytest.mark.parametrize("stale", [0.0, float("inf"), float("nan")], ids=["zero", "inf", "nan"])
def test_padding_request_of_no_length_reads_no_unwritten_slot(stale: float) -> None:
    """The cache prefill graphs pad a step with a second request of seq_len 0: the real request's rows equal
    the unpadded step's, whatever the never-written slots after its end hold (a stale inf or NaN would
    reach them through a zero attention weight if its tiles loaded those slots), and the padding rows are
    0."""
    gen = torch.Generator().manual_seed(0)
    block_size, heads, dim = 16, 2, 16
    context, real, padded = 20, 5, 32
    kv_cache = torch.randn(2, 8, block_size, heads, dim, generator=gen)
    table = torch.tensor([[3, 5, 1, 6, 0, 0, 0, 0], [0] * 8], dtype=torch.int32)
    flat = kv_cache.view(2, -1, heads, dim)
    for pos in range(context + real, context + padded):  # what the request's tiles must not read
        flat[:, int(table[0, pos // block_size]) * block_size + pos % block_size] = stale
    query = torch.randn(padded, heads, dim, generator=gen)

    def metadata(starts: list[int], seq_lens: list[int]) -> AttentionMetadata:
        n = starts[-1]
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=table[: len(seq_lens)],
            slot_mapping=torch.full((n,), -1),
            # host lengths as a cache graph captures them (CUDAGraphRunner._prefill_forward), not the real ones
            max_query_len=n,
            max_seq_len=128,
            query_start_loc_cpu=[0, n - 1, n] if len(starts) == 3 else [0, n],
            seq_lens_cpu=[n, 0][: len(seq_lens)],
        )

    want = launch_paged_attention(query[:real].contiguous(), kv_cache, metadata([0, real], [context + real]),
                                  dim**-0.5)
    got = launch_paged_attention(query, kv_cache, metadata([0, real, padded], [context + real, 0]), dim**-0.5)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got[:real], want, **TOLERANCES[torch.float32])
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
