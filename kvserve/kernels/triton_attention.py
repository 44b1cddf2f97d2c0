"""Triton paged attention over the block-table KV cache (GPU twin of `reference.paged_attention`).

One entry point, `paged_attention`, serves every batch the scheduler builds; it picks one of two launches
from host ints only (never a device read):

* **Mixed / prefill batches** (`max_query_len > 1`): one program per (query tile, KV head). A tile holds
  `BLOCK_Q` consecutive query tokens of one request times the `GROUP = num_heads // num_kv_heads` query
  heads sharing that KV head, i.e. `BLOCK_M = BLOCK_Q * GROUP` rows (padded to a power of two), so each K/V
  tile is loaded once for the whole group and both products are `tl.dot`s. Programs find their request by
  a binary search over `query_start_loc`: request r owns tiles starting at `query_start_loc[r] // BLOCK_Q +
  r`, which bounds the grid by `num_tokens // BLOCK_Q + num_reqs` (a few programs exit at once). Decode
  rows in a mixed batch are tiles with one token.
* **Decode-only batches** (`max_query_len == 1`): one program per (request, KV head, split). The GROUP
  query heads of a KV head form the rows of one tile (padded to 16 for `tl.dot`), and the request's context
  is cut into `num_splits` contiguous ranges of KV tiles (flash-decoding). With one split the program
  writes the output; with more, each writes an unnormalised fp32 partial (acc, running max, running sum)
  and the last program of each (request, KV head) to finish merges them in split order (a per-(request, KV
  head) counter), or, past DECODE_FUSED_MERGE_MAX_SPLITS splits, a third launch, `_reduce_splits_kernel`,
  one program per (token, query head), merges them.

Keys are read `TILE_N` at a time whatever the cache block size: key j of request r lives at block
`block_tables[r, j // block_size]`, offset `j % block_size`, so one tile may span several (non-contiguous)
cache blocks. Softmax is online in fp32 with exp2 (log2(e) folded into the scale); P is cast to the cache
dtype for the second dot (as FlashAttention does). An fp8 cache (`--kv-cache-dtype fp8`) is widened to the
query's dtype after each load (exact), its key scale folded into the score scale and its value scale applied
to each tile's fp32 P @ V, so every launch below (mixed, decode split or not, the cascade's prefix part)
reads it. Query i of a request with context length S and Q new tokens sits at position S - Q + i and sees
keys 0..S - Q + i.

CUDA graphs (decode): a launch reads only device tensors plus host ints, never syncs, and allocates only
fixed-size scratch. The grid and the scratch size depend on `num_reqs`, `num_tokens`, the model's head
counts and `num_splits`, which `choose_num_splits` derives from `num_reqs` and `max_seq_len`. So a captured
graph is valid for replays with the same `num_reqs` (pad the batch; padding rows may have seq_len 0 and
produce zeros, or, in a cascade batch, finite values from the shared prefix that nobody reads) and any seq_lens <= the `max_seq_len` it was captured with (capture with the bucket's upper
bound). `query`, `out`, `kv_cache`, `query_start_loc`, `seq_lens` and `block_tables` must be the same
tensors (updated in place) at every replay (a cascade graph: `common_prefix_len_tensor` too), block_tables at least `max_seq_len / block_size` wide. Mixed
batches have no host sync either (grid from num_tokens, num_reqs, max_query_len), but are not meant for
capture.
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvserve.kernels import triton_pdl
from kvserve.kernels.split_counters import SplitCounters
from kvserve.kernels.triton_pdl import pdl_wait_then_release
from kvserve.layers.attention_metadata import AttentionMetadata

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_LOG2E = 1.4426950408889634

_DECODE_TILE_N = 64
# Launch parameters of the decode kernel, split (flash-decoding) or not. Measured on the H200 with
# benchmarks/attention_sweep.py (Qwen2.5-7B shape, bf16, per layer). Second session, block ids loaded in the
# tile's iteration: with one split, 128-key tiles read the cache at 3.6-4.0 TB/s (batch 64 / 160, context
# 1k) against 3.2-3.3 with 64-key tiles; with splits (small batches) 64-key tiles were as fast or faster.
# Ninth session (block ids loaded a tile ahead, docs/perf_notes.md entry 27): one split at 64-key tiles and 4
# stages (3 K/V buffers, 2 programs per SM) made the engine's batch-48 step 5.10 against 5.21-5.22 ms, batch
# 64 5.33 against 5.37-5.39 and the seeds' workload 7,072 against 6,986-6,991 tok/s, where 128-key tiles with
# 2 buffers (one program per SM) lost (5.42, 5.55). With more than DECODE_BUSY_PROGRAMS_PER_SM (request, KV
# head) programs per SM (batch > 66 at 4 KV heads on the H200) the 256-sequence workload was 3 % slower with
# it (12,524 / 12,551 against 12,996 / 12,878 tok/s), so busy launches keep 128-key tiles with the block ids
# loaded in the tile's iteration (DECODE_LAUNCH_ONE_SPLIT_BUSY: one K/V buffer, 3 programs per SM).
DECODE_LAUNCH: dict[str, int] = {"TILE_N": _DECODE_TILE_N, "num_warps": 4, "num_stages": 3}
DECODE_LAUNCH_ONE_SPLIT: dict[str, int] = {"TILE_N": 64, "num_warps": 4, "num_stages": 4}
DECODE_LAUNCH_ONE_SPLIT_BUSY: dict[str, int] = {"TILE_N": 128, "num_warps": 4, "num_stages": 3}
DECODE_BUSY_PROGRAMS_PER_SM = 2
# A non-busy one-split launch over an fp8 cache: 128-key tiles carry the bytes a bf16 launch's 64-key tiles
# do. On an H100 (attention_sweep.py --kv-dtype fp8, Qwen2.5-7B shape, per layer; docs/perf_notes.md entry
# 68) the bf16 tiling read an fp8 cache at 1.42-1.58 TB/s (batch 64, context 1k / 4k: 47.8 / 170.9 us against
# bf16's 51.8 / 185.2), this one at 1.92 / 2.31 TB/s (35.4 / 116.5 us).
DECODE_LAUNCH_ONE_SPLIT_FP8: dict[str, int] = {"TILE_N": 128, "num_warps": 4, "num_stages": 3}
# Cascade decode (a prefix shared by every request of the batch; see `_shared_prefix_kernel`): tile shapes
# of the shared part, as the mixed kernel's 128-row tiles. Not yet tuned on a GPU.
CASCADE_PREFIX_TILE_N = 64
CASCADE_PREFIX_MAX_BLOCK_M = 128
CASCADE_MAX_PREFIX_SPLITS = 16
# Split decode launches of at most DECODE_FUSED_MERGE_MAX_SPLITS splits: the last program of each (request,
# KV head) merges the splits (one launch fewer per layer) instead of `_reduce_splits_kernel`. That program
# reads the splits one after another, a cost that grows with their number, while the reduce kernel reads
# them in parallel. On the H200 (Qwen2.5-7B shape, decode graphs, docs/perf_notes.md entry 26) the merge in
# the last program saved 0.14-0.26 ms a step at 5 splits (batch 32) and 0.06-0.14 at 9 (batch 16), cost
# 0-0.03 at 16 (batch 8) and 0.5 at 64 (batch 1). 0: always the reduce launch.
DECODE_FUSED_MERGE_MAX_SPLITS = 12
# Launches load each K/V tile's block ids one iteration ahead (`_paged_attention_kernel`'s PREFETCH_IDS), which
# lets num_stages - 1 K/V tiles be in flight: split and non-busy one-split decode launches (a decode launch
# whose buffers would pass DECODE_MAX_KV_BUFFER_BYTES of shared memory runs fewer stages), and the mixed /
# prefill launch, whose 2 stages keep one buffer either way. False: every launch loads them in the iteration.
DECODE_PREFETCH_IDS = True
DECODE_MAX_KV_BUFFER_BYTES = 160 * 1024
# Stand-in multiprocessor count for the CPU interpreter (small, so tests reach the split path cheaply).
_INTERPRETER_NUM_SMS = 4


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, kv_offset, dims, k_valid, allowed, m_i, l_i, acc, scale_log2,
                 v_scale, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr):
    """One K/V tile of online softmax: keys at `kv_offset` (masked by k_valid), scores kept where `allowed`
    ([rows, keys]); returns the updated running max, sum and unnormalised output (log2 domain).

    KV_FP8: the cache holds fp8; K and V are widened exactly to q's dtype for the dots, k_scale is part of
    scale_log2 (the launcher folds it in) and each tile's P @ V is multiplied by v_scale in fp32."""
    k = tl.load(k_cache_ptr + kv_offset[None, :] + dims[:, None], mask=k_valid[None, :], other=0.0)
    if KV_FP8:  # through fp32: exact, and the CPU interpreter's direct e5m2 -> fp16 rounds subnormals
        k = k.to(tl.float32).to(q.dtype)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N], log2 domain
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with no allowed key yet keeps m = -inf; shift by 0 so exp2 gives 0 instead of NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_offset[:, None] + dims[None, :], mask=k_valid[:, None], other=0.0)
    if KV_FP8:
        v = v.to(tl.float32).to(q.dtype)
        pv = tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION) * v_scale
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


# num_reqs / num_splits vary from step to step: left unspecialised, so that a batch of 16 or 32 requests
# (Triton specialises ints equal to 1 or divisible by 16) does not compile another variant mid-serving.
@triton.jit(do_not_specialize=["num_reqs", "num_splits", "split_offset", "total_splits"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    kv_start_ptr,
    merge_count_ptr,
    scale_log2,
    v_scale,
    num_reqs,
    num_splits,
    split_offset,
    total_splits,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_block_table,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    IS_DECODE: tl.constexpr,
    USE_SPLITS: tl.constexpr,
    CASCADE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
    FUSED_MERGE: tl.constexpr = False,
    PREFETCH_IDS: tl.constexpr = True,
    KV_FP8: tl.constexpr = False,
):
    pdl_wait_then_release(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if IS_DECODE:
        req = tile
        local_tile = 0
    else:
        # Binary search: the largest r with query_start_loc[r] // BLOCK_Q + r <= tile (r's first tile).
        lo = 0
        hi = num_reqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
                lo = mid + 1
            else:
                hi = mid
        req = lo - 1
        local_tile = tile - (tl.load(query_start_loc_ptr + req) // BLOCK_Q + req)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if local_tile * BLOCK_Q >= q_len:
        return
    # Later query blocks see more keys (causal): hand them to the lowest program ids, which the hardware
    # schedules first, so the longest tiles do not form the tail of the launch.
    q_block = tl.cdiv(q_len, BLOCK_Q) - 1 - local_tile
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    # Row m of the tile is query token q_block * BLOCK_Q + m // GROUP, head kv_head * GROUP + m % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_len + q_idx
    dims = tl.arange(0, HEAD_DIM)
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )

    # Keys this tile needs: up to the position of its last valid query (causal), at most seq_len.
    kv_end = tl.minimum(seq_len, ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len))
    num_tiles = tl.cdiv(kv_end, TILE_N)
    # Cascade (decode only): keys before kv_start, the prefix every request of the batch shares, are
    # `_shared_prefix_kernel`'s; this program takes the rest.
    if CASCADE:
        kv_start = tl.load(kv_start_ptr)
    else:
        kv_start = 0
    first_tile = kv_start // TILE_N
    if USE_SPLITS:
        tiles_per_split = tl.cdiv(tl.maximum(num_tiles - first_tile, 0), num_splits)
        tile_begin = first_tile + split * tiles_per_split
        tile_end = tl.minimum(num_tiles, tile_begin + tiles_per_split)
    else:
        tile_begin = first_tile
        tile_end = num_tiles

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    cols = tl.arange(0, TILE_N)
    block_table_row = block_tables_ptr + req.to(tl.int64) * stride_block_table
    head_offset = kv_head.to(tl.int64) * stride_cache_head
    # PREFETCH_IDS: the block ids of a tile are loaded one iteration ahead, so the K/V addresses come from the
    # loop's carried state rather than from a load of the same iteration; the pipeliner then gives the K/V
    # tiles num_stages - 1 buffers (with the ids loaded in the iteration it kept one at 3 and 4 stages).
    if PREFETCH_IDS:
        first_pos = tile_begin * TILE_N + cols
        next_ids = tl.load(block_table_row + first_pos // BLOCK_SIZE, mask=first_pos < kv_end, other=0)
    for t in range(tile_begin, tile_end):
        k_pos = t * TILE_N + cols
        k_valid = k_pos < kv_end
        if CASCADE:
            k_valid = k_valid & (k_pos >= kv_start)
        if PREFETCH_IDS:
            block_id = next_ids.to(tl.int64)
            after = k_pos + TILE_N
            next_ids = tl.load(block_table_row + after // BLOCK_SIZE, mask=after < kv_end, other=0)
        else:
            block_id = tl.load(block_table_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        kv_offset = block_id * stride_cache_block + (k_pos % BLOCK_SIZE) * stride_cache_offset + head_offset
        allowed = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        m_i, l_i, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, kv_offset, dims, k_valid, allowed, m_i, l_i, acc, scale_log2, v_scale,
            DOT_PRECISION, KV_FP8,
        )

    out_ptrs = out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :]
    if USE_SPLITS:
        # Partials are [num_tokens, NUM_HEADS, total_splits(, HEAD_DIM)], fp32, unnormalised; this launch
        # owns splits split_offset .. split_offset + num_splits - 1 (a cascade's prefix part has the first).
        part = (token * NUM_HEADS + head) * total_splits + split_offset + split
        tl.store(partial_max_ptr + part, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + part, l_i, mask=row_valid)
        tl.store(partial_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])
        if FUSED_MERGE:
            # Count this (request, KV head)'s finished splits; the last one to finish merges all partials
            # (the same result whichever program comes last) and resets the counter for the next launch.
            tl.debug_barrier()
            counter = merge_count_ptr + req * tl.num_programs(1) + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel")
            if done == num_splits - 1:
                base = (token * NUM_HEADS + head) * total_splits
                _merge_partials(partial_acc_ptr, partial_max_ptr, partial_sum_ptr, out_ptrs, base, total_splits,
                                dims, row_valid, BLOCK_M, HEAD_DIM)
                tl.atomic_xchg(counter, 0)
    else:
        if CASCADE:
            # Unsplit own part of a cascade: merge the prefix partials (splits 0 .. split_offset - 1, written
            # by `_shared_prefix_kernel` earlier on the stream) into this program's state, so no reduce
            # launch follows.
            base = (token * NUM_HEADS + head) * total_splits
            for s in range(0, split_offset):
                m_s = tl.load(partial_max_ptr + base + s, mask=row_valid, other=float("-inf"))
                l_s = tl.load(partial_sum_ptr + base + s, mask=row_valid, other=0.0)
                a_s = tl.load(partial_acc_ptr + (base + s)[:, None] * HEAD_DIM + dims[None, :],
                              mask=row_valid[:, None], other=0.0)
                m_new = tl.maximum(m_i, m_s)
                m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.math.exp2(m_i - m_shift)
                beta = tl.math.exp2(m_s - m_shift)
                l_i = l_i * alpha + l_s * beta
                acc = acc * alpha[:, None] + a_s * beta[:, None]
                m_i = m_new
        # Rows with no key at all (seq_len 0 padding rows) give 0, as the reference's nan_to_num does.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _merge_partials(partial_acc_ptr, partial_max_ptr, partial_sum_ptr, out_ptrs, base, total_splits, dims,
                    row_valid, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Merge the split partials of BLOCK_M rows (row r's splits at base[r] .. base[r] + total_splits - 1) into
    the output: weights exp2(m_s - max m), in split order, as `_reduce_splits_kernel` computes them. Reads
    bypass L1: other programs wrote the partials."""
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in range(0, total_splits):
        m_s = tl.load(partial_max_ptr + base + s, mask=row_valid, other=float("-inf"), cache_modifier=".cg")
        m = tl.maximum(m, m_s)
    # Empty splits carry m = -inf and weigh 0; a row with no keys at all (m = -inf everywhere) gives 0.
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for s in range(0, total_splits):
        w = tl.math.exp2(
            tl.load(partial_max_ptr + base + s, mask=row_valid, other=float("-inf"), cache_modifier=".cg") - m_shift
        )
        total += w * tl.load(partial_sum_ptr + base + s, mask=row_valid, other=0.0, cache_modifier=".cg")
        a_s = tl.load(partial_acc_ptr + (base + s)[:, None] * HEAD_DIM + dims[None, :], mask=row_valid[:, None],
                      other=0.0, cache_modifier=".cg")
        acc += w[:, None] * a_s
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_reqs", "num_prefix_splits", "total_splits"])
def _shared_prefix_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_start_loc_ptr,
    block_tables_ptr,
    prefix_len_ptr,
    scale_log2,
    v_scale,
    num_reqs,
    num_prefix_splits,
    total_splits,
    stride_q_token,
    stride_q_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
    KV_FP8: tl.constexpr = False,
):
    """Cascade, first part: every decode query of the batch against the keys 0..prefix_len - 1 that all
    requests share (the same cache blocks; read through block-table row 0). One program per (tile of
    BLOCK_M (request, query head) rows, KV head, split of the prefix): each K/V tile is loaded once for
    BLOCK_M rows of many requests, instead of once per request. No causal mask: every query sits after
    the prefix. Writes partials at splits 0..num_prefix_splits - 1, which the own part's programs (or the
    reduce kernel) merge."""
    pdl_wait_then_release(PDL)
    row_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    req = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = req < num_reqs
    token = tl.load(query_start_loc_ptr + req, mask=row_valid, other=0).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    prefix_len = tl.load(prefix_len_ptr)
    num_tiles = tl.cdiv(prefix_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_prefix_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(num_tiles, tile_begin + tiles_per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    cols = tl.arange(0, TILE_N)
    head_offset = kv_head.to(tl.int64) * stride_cache_head
    for t in range(tile_begin, tile_end):
        k_pos = t * TILE_N + cols
        k_valid = k_pos < prefix_len
        block_id = tl.load(block_tables_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        kv_offset = block_id * stride_cache_block + (k_pos % BLOCK_SIZE) * stride_cache_offset + head_offset
        m_i, l_i, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, kv_offset, dims, k_valid, k_valid[None, :], m_i, l_i, acc, scale_log2,
            v_scale, DOT_PRECISION, KV_FP8,
        )

    part = (token * NUM_HEADS + head) * total_splits + split
    tl.store(partial_max_ptr + part, m_i, mask=row_valid)
    tl.store(partial_sum_ptr + part, l_i, mask=row_valid)
    tl.store(partial_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    out_ptr,
    num_splits,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait_then_release(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    base = (token * NUM_HEADS + head) * num_splits
    m_s = tl.load(partial_max_ptr + base + splits, mask=split_valid, other=float("-inf"))
    l_s = tl.load(partial_sum_ptr + base + splits, mask=split_valid, other=0.0)
    m = tl.max(m_s, axis=0)
    # Empty splits carry m = -inf and weigh 0; a row with no keys at all (m = -inf everywhere) gives 0.
    w = tl.math.exp2(m_s - tl.where(m == float("-inf"), 0.0, m))
    total = tl.sum(w * l_s, axis=0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(
        partial_acc_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_valid[:, None],
        other=0.0,
    )
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims, out.to(out_ptr.dtype.element_ty)
    )


# Per-(request, KV head) counters of finished splits (zero between launches; each group's merging program
# resets its own).
_MERGE_COUNTERS = SplitCounters("the decode attention's split counters")


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    # Looked up on first use, not at import: the same module serves the CPU interpreter and the GPU.
    if device.type != "cuda":
        return _INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Number of KV splits for a decode-only batch, from host ints only: `ops.decode_num_splits` (the one
    rule; see it for the measurements). Deterministic in its arguments, so a CUDA graph captured for a
    (batch size, max_seq_len bucket) pair always replays with the grid it was captured with."""
    from kvserve.kernels.ops import decode_num_splits

    return decode_num_splits(num_reqs, num_kv_heads, max_seq_len, num_sms)


def cascade_block_m(num_reqs: int, group: int) -> int:
    """Rows ((request, query head) pairs) per program of the cascade's shared-prefix part."""
    return min(CASCADE_PREFIX_MAX_BLOCK_M, max(16, triton.next_power_of_2(num_reqs * group)))


def cascade_prefix_splits(num_reqs: int, group: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits of the shared prefix: enough programs for DECODE_PROGRAMS_PER_SM per SM, at most
    CASCADE_MAX_PREFIX_SPLITS. Host ints only, and not the prefix length (a CUDA graph reads that from the
    device): a split past the prefix's last tile writes an empty partial."""
    from kvserve.kernels.ops import DECODE_PROGRAMS_PER_SM

    programs = triton.cdiv(num_reqs * group, cascade_block_m(num_reqs, group)) * num_kv_heads
    wanted = triton.cdiv(DECODE_PROGRAMS_PER_SM * num_sms, programs)
    return max(1, min(wanted, CASCADE_MAX_PREFIX_SPLITS))


def _check_contract(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
    assert query.dim() == 3, f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, (
        f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
    )
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    assert kv_cache.shape[4] == head_dim, (
        f"kv_cache head_dim {kv_cache.shape[4]} != query head_dim {head_dim}"
    )
    assert num_heads % num_kv_heads == 0, (
        f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}"
    )
    assert head_dim >= 16 and triton.next_power_of_2(head_dim) == head_dim, (
        f"head_dim must be a power of two >= 16, got {head_dim}"
    )
    assert triton.next_power_of_2(block_size) == block_size, (
        f"block_size must be a power of two, got {block_size}"
    )
    assert query.dtype in _FLOAT_DTYPES and kv_cache.dtype in (query.dtype, *_FP8_DTYPES), (
        f"query and kv_cache must share a float dtype (or kv_cache be fp8), got {query.dtype} and {kv_cache.dtype}"
    )
    assert query.stride(2) == 1, f"query's head_dim must be contiguous, got strides {query.stride()}"
    assert kv_cache.stride(4) == 1, f"kv_cache's head_dim must be contiguous, got strides {kv_cache.stride()}"
    assert num_tokens == metadata.num_tokens, (
        f"query has {num_tokens} tokens but metadata.query_start_loc_cpu ends at {metadata.num_tokens}"
    )
    for name, t, dim in (
        ("query_start_loc", metadata.query_start_loc, 1),
        ("seq_lens", metadata.seq_lens, 1),
        ("block_tables", metadata.block_tables, 2),
    ):
        assert t.dtype == torch.int32 and t.dim() == dim and t.stride(-1) == 1, (
            f"metadata.{name} must be an int32 {dim}-d tensor with a contiguous last dim, got {t.dtype} "
            f"{tuple(t.shape)} strides {t.stride()}"
        )
        assert t.device == query.device, f"metadata.{name} is on {t.device}, query on {query.device}"
    assert metadata.query_start_loc.shape[0] >= metadata.num_reqs + 1, "query_start_loc too short"
    assert metadata.seq_lens.shape[0] >= metadata.num_reqs, "seq_lens too short"
    assert metadata.block_tables.shape[0] >= metadata.num_reqs, "block_tables has fewer rows than num_reqs"
    assert metadata.block_tables.shape[1] * block_size >= metadata.max_seq_len, (
        f"block_tables width {metadata.block_tables.shape[1]} x block_size {block_size} < max_seq_len "
        f"{metadata.max_seq_len}"
    )


def launch_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """`paged_attention` with the decode split count exposed (None: `choose_num_splits`).

    num_splits only applies to decode-only batches (metadata.max_query_len == 1); must be >= 1.
    """
    _check_contract(query, kv_cache, metadata)
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    else:
        assert out.shape == query.shape and out.dtype == query.dtype and out.device == query.device, (
            f"out must be {tuple(query.shape)} {query.dtype} on {query.device}, got {tuple(out.shape)} "
            f"{out.dtype} on {out.device}"
        )
        assert out.stride(2) == 1, f"out's head_dim must be contiguous, got strides {out.stride()}"
    num_reqs = metadata.num_reqs
    if num_tokens == 0 or num_reqs == 0:
        return out
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    is_decode = metadata.max_query_len == 1
    dot_precision = "ieee" if query.dtype == torch.float32 else "tf32"
    kv_fp8 = kv_cache.dtype in _FP8_DTYPES
    if not kv_fp8:  # the scales are an fp8 cache's
        k_scale = v_scale = 1.0
    pdl = triton_pdl.enabled(query.device)
    common = dict(
        PDL=pdl,
        **triton_pdl.launch_options(pdl),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        DOT_PRECISION=dot_precision,
        KV_FP8=kv_fp8,
    )
    strides = (
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        metadata.block_tables.stride(0),
    )
    # q . (k8 * k_scale) == (q . k8) * k_scale: the key scale joins the score scale (1.0 unless fp8).
    log2_scale = scale * _LOG2E * float(k_scale)
    v_scale = float(v_scale)

    if not is_decode:
        # Rows per tile: enough for the longest query (times the group), at most 128 (register budget).
        block_m = min(128, max(16, triton.next_power_of_2(metadata.max_query_len * group)))
        block_m = max(block_m, triton.next_power_of_2(group))
        block_q = block_m // group
        grid = (num_tokens // block_q + num_reqs, num_kv_heads, 1)
        _paged_attention_kernel[grid](
            query, k_cache, v_cache, out, out, out, out,
            metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, metadata.seq_lens, metadata.seq_lens,
            log2_scale, v_scale, num_reqs, 1, 0, 1, *strides,
            BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=64,
            IS_DECODE=False, USE_SPLITS=False, CASCADE=False, PREFETCH_IDS=DECODE_PREFETCH_IDS,
            num_warps=8 if block_m >= 128 else 4, num_stages=2,
            **common,
        )  # fmt: skip
        return out

    num_sms = _num_sms(query.device)
    if num_splits is None:
        num_splits = choose_num_splits(num_reqs, num_kv_heads, metadata.max_seq_len, num_sms)
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    cascade = metadata.common_prefix_len > 0
    block_m = max(16, triton.next_power_of_2(group))
    one_split = num_splits == 1 and not cascade
    busy = one_split and decode_launch_is_busy(num_reqs, num_kv_heads, num_sms)
    if not one_split:
        launch = dict(DECODE_LAUNCH)
    elif busy:
        launch = dict(DECODE_LAUNCH_ONE_SPLIT_BUSY)
    else:
        launch = dict(DECODE_LAUNCH_ONE_SPLIT_FP8 if kv_fp8 else DECODE_LAUNCH_ONE_SPLIT)
    prefetch = DECODE_PREFETCH_IDS and not busy
    if prefetch:
        launch["num_stages"] = decode_stages(launch["num_stages"], launch["TILE_N"], head_dim, k_cache.element_size())
    decode_kwargs = dict(BLOCK_M=block_m, BLOCK_Q=1, IS_DECODE=True, PREFETCH_IDS=prefetch, **launch, **common)
    if one_split:
        _paged_attention_kernel[(num_reqs, num_kv_heads, 1)](
            query, k_cache, v_cache, out, out, out, out,
            metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, metadata.seq_lens, metadata.seq_lens,
            log2_scale, v_scale, num_reqs, 1, 0, 1, *strides,
            USE_SPLITS=False, CASCADE=False, **decode_kwargs,
        )  # fmt: skip
        return out

    prefix_splits = 0
    prefix_block_m = 0
    if cascade:
        prefix_len = metadata.common_prefix_len_tensor
        assert prefix_len is not None and prefix_len.device == query.device and prefix_len.dtype == torch.int32, (
            "a cascade batch needs metadata.common_prefix_len_tensor, int32 on the query's device"
        )
        prefix_block_m = cascade_block_m(num_reqs, group)
        prefix_splits = cascade_prefix_splits(num_reqs, group, num_kv_heads, num_sms)
    # A cascade whose own part is one split merges the prefix partials in that launch (no own partial, no
    # reduce launch); otherwise every part writes partials and the reduce kernel merges them.
    merge_in_own = cascade and num_splits == 1
    total_splits = prefix_splits + (0 if merge_in_own else num_splits)
    # Otherwise the last split program of each (request, KV head) merges (up to DECODE_FUSED_MERGE_MAX_SPLITS
    # splits), or a third launch does.
    fused_merge = not merge_in_own and total_splits <= DECODE_FUSED_MERGE_MAX_SPLITS
    counters = _MERGE_COUNTERS.get(query.device, num_reqs * num_kv_heads) if fused_merge else metadata.seq_lens
    partial_acc = torch.empty(
        num_tokens, num_heads, total_splits, head_dim, dtype=torch.float32, device=query.device
    )
    partial_max = torch.empty(num_tokens, num_heads, total_splits, dtype=torch.float32, device=query.device)
    partial_sum = torch.empty(num_tokens, num_heads, total_splits, dtype=torch.float32, device=query.device)
    if cascade:
        _shared_prefix_kernel[(triton.cdiv(num_reqs * group, prefix_block_m), num_kv_heads, prefix_splits)](
            query, k_cache, v_cache, partial_acc, partial_max, partial_sum,
            metadata.query_start_loc, metadata.block_tables, prefix_len,
            log2_scale, v_scale, num_reqs, prefix_splits, total_splits,
            query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            BLOCK_M=prefix_block_m, TILE_N=CASCADE_PREFIX_TILE_N,
            num_warps=8 if prefix_block_m >= 128 else 4, num_stages=2,
            **common,
        )  # fmt: skip
    _paged_attention_kernel[(num_reqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, partial_acc, partial_max, partial_sum,
        metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
        prefix_len if cascade else metadata.seq_lens, counters,
        log2_scale, v_scale, num_reqs, num_splits, prefix_splits, total_splits, *strides,
        USE_SPLITS=not merge_in_own, CASCADE=cascade, FUSED_MERGE=fused_merge, **decode_kwargs,
    )  # fmt: skip
    if merge_in_own or fused_merge:
        return out
    _reduce_splits_kernel[(num_tokens, num_heads)](
        partial_acc, partial_max, partial_sum, out,
        total_splits, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(total_splits),
        PDL=pdl, num_warps=4, **triton_pdl.launch_options(pdl),
    )  # fmt: skip
    return out


def decode_launch_variant(num_reqs: int, num_kv_heads: int, num_splits: int, num_sms: int) -> tuple[object, ...]:
    """What selects the kernel variants of a decode launch without a shared prefix (host ints only): with one
    split, whether it is busy; with a few, the merge in the kernel; else the reduce kernel's padded split
    count (a constexpr of its own)."""
    if num_splits == 1:
        return ("one split", decode_launch_is_busy(num_reqs, num_kv_heads, num_sms))
    if num_splits <= DECODE_FUSED_MERGE_MAX_SPLITS:
        return ("fused merge",)
    return ("reduce", triton.next_power_of_2(num_splits))


def decode_launch_is_busy(num_reqs: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether a one-split decode launch of num_reqs requests runs DECODE_LAUNCH_ONE_SPLIT_BUSY (more than
    DECODE_BUSY_PROGRAMS_PER_SM (request, KV head) programs per SM). Host ints only: fixed per CUDA graph."""
    return num_reqs * num_kv_heads > DECODE_BUSY_PROGRAMS_PER_SM * num_sms


def decode_stages(num_stages: int, tile_n: int, head_dim: int, elem_bytes: int) -> int:
    """Pipeline stages of a decode launch whose block ids are prefetched: num_stages - 1 buffers of a K and a V
    tile each, fewer stages (at least 2) while those pass DECODE_MAX_KV_BUFFER_BYTES (an fp32 cache at 64-key
    tiles of 128 dims and 4 stages would take 192 KiB: it runs 3)."""
    tile_pair = 2 * tile_n * head_dim * elem_bytes
    while num_stages > 2 and (num_stages - 1) * tile_pair > DECODE_MAX_KV_BUFFER_BYTES:
        num_stages -= 1
    return num_stages


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached context (contract of the reference).

    query: [num_tokens, num_heads, head_dim], float16/bfloat16/float32, stride(2) == 1; kv_cache:
    [2, num_blocks, block_size, num_kv_heads, head_dim], same dtype or fp8 (read as values * k_scale /
    v_scale; the scales are ignored otherwise), stride(4) == 1, already holding this step's K/V; head_dim and block_size powers of two (head_dim >= 16); num_heads a multiple of
    num_kv_heads. metadata: query_start_loc / seq_lens / block_tables int32 on query's device (see
    AttentionMetadata); only its host ints size the launch. Returns [num_tokens, num_heads, head_dim] in
    query's dtype, written into `out` (same shape/dtype, stride(2) == 1) when given.
    """
    return launch_paged_attention(query, kv_cache, metadata, scale, out, None, k_scale, v_scale)
