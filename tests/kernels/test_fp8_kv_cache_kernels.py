"""The Triton cache write and paged attention over an fp8 KV cache (`--kv-cache-dtype fp8`) against the torch
reference, compiled on a GPU or under Triton's interpreter on the CPU; and the fp8 launches compiled ahead of
time for sm_89 and sm_90 (CPU runs: type errors and shared memory the interpreter lets through).

The interpreter widens fp8 to fp32 exactly for every finite value, so attention runs there over random fp8
caches. Its fp32 -> fp8 rounding is not a GPU's (it drops the carry of a round-up into the exponent: 31.6
becomes 16 in e4m3, where torch and the GPU give 32), so under the interpreter the cache-write test feeds
values already on the fp8 grid (times the scale), where the cast is exact, plus values past the format's
range; on a GPU it feeds arbitrary values and compares the bytes with torch's rounding.

Batches come from `test_triton_attention.make_batch`: non-contiguous shuffled blocks, block tables padded
past each request's blocks, partial last blocks, chunks over a cached prefix, GQA groups 1, 3 and 7.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # set by conftest.py without a GPU
from test_triton_attention import (  # noqa: E402
    MIXED_QUERY_LENS,
    MIXED_SEQ_LENS,
    SHAPES,
    TOLERANCES,
    make_batch,
    share_prefix,
)

from kvserve.kernels import reference, triton_attention, triton_cache, triton_elementwise, triton_gemm  # noqa: E402
from kvserve.kernels.triton_attention import launch_paged_attention  # noqa: E402
from kvserve.layers.attention_metadata import AttentionMetadata  # noqa: E402
from kvserve.layers.rotary import RotaryEmbedding  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = {"unit": (1.0, 1.0), "scaled": (0.5, 0.25)}  # (k_scale, v_scale)


def _fp8_cache(kv_cache: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """make_batch's random cache rounded to fp8 (values of order 1: normal numbers of both formats)."""
    return reference.quantize_kv(kv_cache.float(), 1.0, cache_dtype)


def _check(query: torch.Tensor, kv8: torch.Tensor, metadata: AttentionMetadata, scales: tuple[float, float],
           num_splits: int | None = None) -> torch.Tensor:
    """One launch into a NaN-filled output, against the reference reading the same fp8 cache."""
    k_scale, v_scale = scales
    scale = query.shape[-1] ** -0.5
    out = torch.full_like(query, float("nan"))
    launch_paged_attention(query, kv8, metadata, scale, out, num_splits, k_scale, v_scale)
    expected = reference.paged_attention(query, kv8, metadata, scale, None, k_scale, v_scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[query.dtype])
    return out


# ----------------------------------------------------------------------------------------- cache write


def _grid_values(shape: tuple[int, ...], cache_dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """float32 values that are fp8 values of `cache_dtype` (finite, random bytes)."""
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(cache_dtype).float()
    return torch.where(raw.isfinite(), raw, torch.zeros_like(raw))


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scales", list(SCALES))
def test_cache_write_stores_what_the_reference_stores(cache_dtype, dtype, scales, device, skip_bf16_on_interpreter):
    """K/V as views into a fused QKV output, padding slots (-1) skipped, values past the format's range
    saturated (not NaN / inf), every other slot untouched: the same bytes as `reference.reshape_and_cache`."""
    skip_bf16_on_interpreter(dtype)
    k_scale, v_scale = SCALES[scales]
    num_tokens, num_blocks, block_size, num_heads, num_kv_heads, head_dim = 11, 6, 16, 4, 2, 64
    gen = torch.Generator().manual_seed(4)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if INTERPRET:  # on the fp8 grid once divided by the scale (see the module docstring)
        qkv = _grid_values((num_tokens, width), cache_dtype, gen)
        qkv[:, : (num_heads + num_kv_heads) * head_dim] *= k_scale
        qkv[:, (num_heads + num_kv_heads) * head_dim :] *= v_scale
    else:
        qkv = torch.randn(num_tokens, width, generator=gen) * 40
    qkv[0, num_heads * head_dim] = 60000.0  # past both formats' ranges, and float16's own limit is 65504
    qkv[1, -1] = -60000.0
    qkv = qkv.to(device=device, dtype=dtype)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(-1, num_kv_heads, head_dim)
    value = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(-1, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1
    slot_mapping = slots.to(device)
    poison = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), 0x7F, dtype=torch.uint8)  # NaN
    kv_cache = poison.view(cache_dtype).to(device)
    expected = kv_cache.cpu().clone()
    triton_cache.reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    reference.reshape_and_cache(key.cpu(), value.cpu(), expected, slots, k_scale, v_scale)
    assert torch.equal(kv_cache.cpu().view(torch.uint8), expected.view(torch.uint8))
    written = kv_cache.cpu().float().view(2, -1, num_kv_heads, head_dim)[:, slots[slots >= 0]]
    assert bool(written.isfinite().all())
    limit = torch.finfo(cache_dtype).max
    assert written[0, 0, 0, 0] == limit and written[1, 1, -1, -1] == -limit
    assert int((~kv_cache.cpu().float().isnan()).all(-1).all(-1).sum()) == 2 * (num_tokens - 2)


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cache_write_keeps_nan_and_saturates_inf(cache_dtype, dtype, device, skip_bf16_on_interpreter):
    """A NaN in K or V is stored as a NaN, as the reference stores it (not +-max: a huge finite key that
    attention would collapse onto); +-inf is stored as +-max; the other values as the reference stores them.
    NaN encodings may differ (torch keeps the sign), so NaN is compared by position.

    Under the interpreter e4m3fn's NaN is not checked: the interpreter's fp32 -> fp8 cast turns NaN into 384
    in that format (a GPU's cvt.rn.satfinite gives NaN); e5m2 runs the same clamp and is checked."""
    skip_bf16_on_interpreter(dtype)
    k_scale, v_scale = SCALES["scaled"]
    num_tokens, num_blocks, block_size, num_kv_heads, head_dim = 5, 2, 16, 2, 64
    gen = torch.Generator().manual_seed(9)
    key = _grid_values((num_tokens, num_kv_heads, head_dim), cache_dtype, gen) * k_scale
    value = _grid_values((num_tokens, num_kv_heads, head_dim), cache_dtype, gen) * v_scale
    nan, inf = float("nan"), float("inf")
    key[0, 0, :4] = torch.tensor([nan, -nan, inf, -inf])
    value[3, 1, -4:] = torch.tensor([-inf, inf, -nan, nan])
    key[4] = nan  # a whole token
    key, value = key.to(device=device, dtype=dtype), value.to(device=device, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype, device=device)
    expected = kv_cache.cpu().clone()
    triton_cache.reshape_and_cache(key, value, kv_cache, slots.to(device), k_scale, v_scale)
    reference.reshape_and_cache(key.cpu(), value.cpu(), expected, slots, k_scale, v_scale)
    stored, wanted = kv_cache.cpu().float(), expected.float()
    assert int(wanted.isnan().sum()) == 4 + num_kv_heads * head_dim
    limit = torch.finfo(cache_dtype).max
    flat = wanted.view(2, -1, num_kv_heads, head_dim)
    assert flat[0, slots[0], 0, 2] == limit and flat[0, slots[0], 0, 3] == -limit
    assert flat[1, slots[3], 1, -4] == -limit and flat[1, slots[3], 1, -3] == limit
    if not (INTERPRET and cache_dtype == torch.float8_e4m3fn):
        assert torch.equal(stored.isnan(), wanted.isnan())
    not_nan = ~wanted.isnan()
    assert torch.equal(stored[not_nan], wanted[not_nan])


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pad_to", [0, 16], ids=["plain", "padded"])
def test_fused_rotary_cache_write_stores_what_the_separate_ops_store(
    cache_dtype, dtype, pad_to, device, skip_bf16_on_interpreter
):
    """The rotary launch that also writes the cache: the rotated key and the value stored as
    `reshape_and_cache` stores the unfused rotary's output (scaled, saturated, padding slots skipped); its
    own outputs unchanged by the fp8 cache. Under the interpreter at position 0 (the rotation is the
    identity), so that the stored values are on the fp8 grid (see the module docstring)."""
    skip_bf16_on_interpreter(dtype)
    k_scale, v_scale = SCALES["scaled"]
    num_tokens, num_heads, num_kv_heads, head_dim, num_blocks, block_size = 11, 6, 2, 64, 4, 16
    gen = torch.Generator().manual_seed(6)
    rope = RotaryEmbedding(head_dim, 256, 10000.0)
    if INTERPRET:
        positions = torch.zeros(num_tokens, dtype=torch.int64)
        key = _grid_values((num_tokens, num_kv_heads, head_dim), cache_dtype, gen) * k_scale
        value = _grid_values((num_tokens, num_kv_heads, head_dim), cache_dtype, gen) * v_scale
    else:
        positions = torch.randint(0, 256, (num_tokens,), generator=gen)
        key, value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 40 for _ in range(2))
    key[0, 0, 0], value[1, 1, -1] = 60000.0, -60000.0  # saturate (past both formats, within float16)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    query, key, value, positions = (t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                                    for t in (query, key, value, positions))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), 0x7F, dtype=torch.uint8)
    cache = cache.view(cache_dtype).to(device)
    expected = cache.cpu().clone()
    cos_sin = rope.cos_sin_cache.to(device)
    plain_q, plain_k = triton_elementwise.rotary_embedding(positions, query, key, cos_sin)
    if pad_to:
        q, k, v = triton_elementwise.rotary_embedding_padded(positions, query, key, cos_sin, value, cache,
                                                             slots.to(device), pad_to, k_scale, v_scale)
        assert torch.equal(v[:num_tokens], value) and not bool(v[num_tokens:].any())
        q, k = q[:num_tokens], k[:num_tokens]
    else:
        q, k = triton_elementwise.rotary_embedding(positions, query, key, cos_sin, value, cache, slots.to(device),
                                                   k_scale, v_scale)
    assert torch.equal(q, plain_q) and torch.equal(k, plain_k)
    reference.reshape_and_cache(plain_k.cpu(), value.cpu(), expected, slots, k_scale, v_scale)
    assert torch.equal(cache.cpu().view(torch.uint8), expected.view(torch.uint8))
    assert int((~cache.cpu().float().isnan()).all(-1).all(-1).sum()) == 2 * (num_tokens - 2)


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", [triton_gemm.GemmConfig(32, 32, 1, 2), triton_gemm.GemmConfig(32, 32, 4, 3)],
                         ids=["one-split", "split-k"])
def test_qkv_matmul_rope_epilogue_stores_what_the_rotary_launch_stores(
    cache_dtype, dtype, config, device, skip_bf16_on_interpreter
):
    """The small-batch q/k/v matmul whose epilogue rotates and writes the cache: with an fp8 cache, the same
    output and cache bytes as the plain matmul then the rotary launch that writes the cache (itself checked
    against the reference above), padding slot skipped. Under the interpreter x is one-hot rows and the
    weight fp8 values times the scales at position 0, so that every stored value is on the fp8 grid."""
    skip_bf16_on_interpreter(dtype)
    k_scale, v_scale = SCALES["scaled"]
    m, heads, kv_heads, head_dim, k_dim, block_size = 5, 4, 2, 64, 256, 4
    n = (heads + 2 * kv_heads) * head_dim
    gen = torch.Generator().manual_seed(8)
    if INTERPRET:
        x = torch.zeros(m, k_dim)
        x[torch.arange(m), torch.randint(0, k_dim, (m,), generator=gen)] = 1.0
        w = _grid_values((n, k_dim), cache_dtype, gen) * 2.0**-4  # within float16 for e5m2 too
        w[(heads + kv_heads) * head_dim:] *= v_scale / k_scale  # v rows: on the grid times v_scale
        w *= k_scale
        positions = torch.zeros(m, dtype=torch.int64)
    else:
        x = torch.randn(m, k_dim, generator=gen)
        w = torch.randn(n, k_dim, generator=gen) * 3
        positions = torch.randint(0, 100, (m,), generator=gen)
    x, w, positions = x.to(device, dtype), w.to(device, dtype), positions.to(device)
    slots = torch.randperm(8 * block_size, generator=gen)[:m].to(device)
    slots[1] = -1
    cos_sin = RotaryEmbedding(head_dim, 128, 10000.0).cos_sin_cache.to(device)
    poison = torch.full((2, 8, block_size, kv_heads, head_dim), 0x7F, dtype=torch.uint8).view(cache_dtype)
    fused_cache, expected_cache = poison.clone().to(device), poison.clone().to(device)
    rope = triton_gemm.RopeCache(positions, cos_sin, fused_cache, slots, heads, kv_heads, head_dim, k_scale, v_scale)
    assert triton_gemm.fits(x, w, config, None, rope=rope)
    fused = triton_gemm.skinny_linear(x, w, None, config, rope=rope)
    plain = triton_gemm.skinny_linear(x, w, None, config)
    q, k, v = plain.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_rot, k_rot = triton_elementwise.rotary_embedding(
        positions, q.view(m, heads, head_dim), k.view(m, kv_heads, head_dim), cos_sin, v.view(m, kv_heads, head_dim),
        expected_cache, slots, k_scale, v_scale)
    assert torch.equal(fused, torch.cat([q_rot.view(m, -1), k_rot.view(m, -1), v], dim=-1))
    assert torch.equal(fused_cache.view(torch.uint8), expected_cache.view(torch.uint8))
    assert int((~fused_cache.float().isnan()).all(-1).all(-1).sum()) == 2 * (m - 1)


# ----------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", ["mha", "group3"])
def test_mixed_batch_over_fp8_cache(cache_dtype, dtype, shape, device, skip_bf16_on_interpreter):
    """Prefill chunks over cached prefixes, a fresh prompt and decode rows in one launch; scaled."""
    skip_bf16_on_interpreter(dtype)
    num_heads, num_kv_heads = SHAPES[shape]
    query, kv_cache, metadata = make_batch(
        MIXED_QUERY_LENS, MIXED_SEQ_LENS, num_heads, num_kv_heads, 64, 16, dtype, device
    )
    _check(query, _fp8_cache(kv_cache, cache_dtype), metadata, SCALES["scaled"])


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=lambda s: f"splits={s}")
@pytest.mark.parametrize("scales", list(SCALES))
def test_decode_over_fp8_cache(cache_dtype, num_splits, scales, device, poison_allocations):
    """Decode one split and split-K (partials merged in the kernel); the split scratch starts as NaN."""
    poison_allocations(triton_attention)
    query, kv_cache, metadata = make_batch([1, 1, 1], [300, 77, 260], 7, 1, 64, 16, torch.float16, device, seed=2)
    _check(query, _fp8_cache(kv_cache, cache_dtype), metadata, SCALES[scales], num_splits)


def test_one_split_decode_over_fp8_takes_the_fp8_tiling(device, monkeypatch, poison_allocations):
    """A non-busy one-split decode over an fp8 cache runs DECODE_LAUNCH_ONE_SPLIT_FP8 (128-key tiles: the
    bytes of a bf16 launch's 64-key tiles), one over a bf16-width cache DECODE_LAUNCH_ONE_SPLIT, and a busy one
    DECODE_LAUNCH_ONE_SPLIT_BUSY whatever the cache; each matches the reference. Contexts end inside, at and
    just past a 128-key tile."""
    poison_allocations(triton_attention)
    kernel = triton_attention._paged_attention_kernel
    seen: list[tuple[int, int]] = []

    class Spy:
        def __getitem__(self, grid: object) -> object:
            def launch(*args: object, **kwargs: object) -> object:
                seen.append((kwargs["TILE_N"], kwargs["num_warps"]))
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", Spy())
    query, kv_cache, metadata = make_batch([1] * 4, [100, 128, 129, 300], 6, 2, 64, 16, torch.float32, device,
                                           seed=8)
    _check(query, _fp8_cache(kv_cache, torch.float8_e4m3fn), metadata, SCALES["scaled"], 1)
    fp8 = triton_attention.DECODE_LAUNCH_ONE_SPLIT_FP8
    assert seen[-1] == (fp8["TILE_N"], fp8["num_warps"]) and fp8["TILE_N"] == 128
    launch_paged_attention(query, kv_cache, metadata, 0.125, num_splits=1)
    one = triton_attention.DECODE_LAUNCH_ONE_SPLIT
    assert seen[-1] == (one["TILE_N"], one["num_warps"])
    monkeypatch.setattr(triton_attention, "DECODE_BUSY_PROGRAMS_PER_SM", 0)  # every launch busy
    _check(query, _fp8_cache(kv_cache, torch.float8_e4m3fn), metadata, SCALES["unit"], 1)
    busy = triton_attention.DECODE_LAUNCH_ONE_SPLIT_BUSY
    assert seen[-1] == (busy["TILE_N"], busy["num_warps"])


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits={s}")
def test_cascade_decode_over_fp8_cache(cache_dtype, num_splits, device, poison_allocations):
    """The shared-prefix kernel reads the fp8 prefix once for all requests; the own part the rest."""
    poison_allocations(triton_attention)
    query, kv_cache, metadata = make_batch([1] * 4, [300, 77, 260, 150], 6, 2, 64, 16, torch.float32, device, seed=5)
    _check(query, _fp8_cache(kv_cache, cache_dtype), share_prefix(metadata, 5, 76), SCALES["scaled"], num_splits)


def test_prefill_then_decode_through_an_fp8_cache(device):
    """The Triton cache write then attention, step by step (prompt, decode, decode, chunk), against the
    reference pipeline; the two caches hold the same bytes after every write."""
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 16
    k_scale, v_scale = SCALES["scaled"]
    gen = torch.Generator().manual_seed(3)
    block_table = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32, device=device)
    kv_triton = torch.zeros(2, 8, block_size, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn, device=device)
    kv_reference = kv_triton.cpu().clone()
    seq_len = 0
    for query_len in (37, 1, 1, 9):
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
        q = torch.randn(query_len, num_heads, head_dim, generator=gen)
        k, v = (torch.randn(query_len, num_kv_heads, head_dim, generator=gen) for _ in range(2))
        if INTERPRET:  # order-1 values on the fp8 grid (times the scale): see the module docstring
            k = reference.quantize_kv(k, 1.0, torch.float8_e4m3fn).float() * k_scale
            v = reference.quantize_kv(v, 1.0, torch.float8_e4m3fn).float() * v_scale
        triton_cache.reshape_and_cache(k.to(device), v.to(device), kv_triton, metadata.slot_mapping, k_scale, v_scale)
        reference.reshape_and_cache(k, v, kv_reference, metadata.slot_mapping.cpu(), k_scale, v_scale)
        assert torch.equal(kv_triton.cpu().view(torch.uint8), kv_reference.view(torch.uint8))
        _check(q.to(device), kv_triton, metadata, (k_scale, v_scale))


def test_fp8_cache_contract(device):
    query, kv_cache, metadata = make_batch([3], [10], 2, 2, 64, 16, torch.float32, device)
    kv8 = _fp8_cache(kv_cache, torch.float8_e4m3fn)
    with pytest.raises(AssertionError, match="share a float dtype"):
        launch_paged_attention(kv8[0, :3, 0], kv8, metadata, 0.1)  # an fp8 query
    with pytest.raises(AssertionError, match="kv_cache theirs or fp8"):
        triton_cache.reshape_and_cache(query[:, :2].half(), query[:, :2].half(), kv_cache, metadata.slot_mapping)


# ------------------------------------------------------------------------------ ahead-of-time compile


@pytest.mark.parametrize("arch", [89, 90])
def test_fp8_kernels_compile(device, compiler_for, arch):
    """The fp8 launches (bf16 and fp32 queries, both formats) compile for the first GPUs that run them (sm_89)
    and for Hopper: decode one split (both tilings) and split, the cascade's two kernels, prefill tiles, the
    cache write, the rotary launch that writes the cache and the q/k/v matmul's rope epilogue; within the
    per-block shared memory."""
    compiler = compiler_for(arch)
    kernels = ["_paged_attention_kernel"]
    for (num_heads, num_kv_heads, head_dim), dtype, cache_dtype in (
        ((28, 4, 128), torch.bfloat16, torch.float8_e4m3fn),
        ((9, 3, 64), torch.float32, torch.float8_e5m2),
    ):
        decode = make_batch([1, 1], [900, 40], num_heads, num_kv_heads, head_dim, 16, dtype, device)
        prefill = make_batch([40, 1], [50, 9], num_heads, num_kv_heads, head_dim, 16, dtype, device)
        batches = {name: (b[0], _fp8_cache(b[1], cache_dtype), b[2]) for name, b in
                   (("decode", decode), ("prefill", prefill))}
        cascade = (*batches["decode"][:2], share_prefix(decode[2], 2, 32))
        for batch, names, splits, busy in (
            (batches["decode"], kernels, 1, False),
            (batches["decode"], kernels, 1, True),
            (batches["decode"], kernels, 4, False),
            (cascade, ["_shared_prefix_kernel", *kernels], 1, False),
            (batches["prefill"], kernels, None, False),
        ):
            with pytest.MonkeyPatch.context() as patch:
                if busy:
                    patch.setattr(triton_attention, "DECODE_BUSY_PROGRAMS_PER_SM", 0)
                compiler.record(triton_attention, names, lambda b=batch, s=splits: launch_paged_attention(
                    *b, 0.1, None, s, 0.5, 2.0))
        key = decode[0][:, :num_kv_heads]
        slot_mapping = torch.zeros(2, dtype=torch.int64, device=device)
        kv8 = batches["decode"][1]
        compiler.record(triton_cache, ["_reshape_and_cache_kernel"],
                        lambda k=key, kv=kv8, s=slot_mapping: triton_cache.reshape_and_cache(k, k, kv, s, 0.5, 2.0))
        cos_sin = RotaryEmbedding(head_dim, 64, 10000.0).cos_sin_cache.to(device)
        if dtype == torch.bfloat16:  # the q/k/v matmul's rope epilogue (fp16 / bf16 models only)
            x = torch.zeros(2, 256, dtype=dtype, device=device)
            w_qkv = torch.zeros((num_heads + 2 * num_kv_heads) * head_dim, 256, dtype=dtype, device=device)
            for config in (triton_gemm.GemmConfig(32, 64, 1, 2), triton_gemm.GemmConfig(32, 64, 4, 3)):
                rope = triton_gemm.RopeCache(slot_mapping, cos_sin, kv8, slot_mapping, num_heads, num_kv_heads,
                                             head_dim, 0.5, 2.0)
                compiler.record(triton_gemm, ["_skinny_gemm_kernel"],
                                lambda x=x, w=w_qkv, c=config, r=rope: triton_gemm.skinny_linear(x, w, None, c, rope=r))
        compiler.record(triton_elementwise, ["_rotary_kernel"],
                        lambda q=decode[0], k=key, kv=kv8, s=slot_mapping, cs=cos_sin: triton_elementwise.rotary_embedding(
                            s, q, k, cs, k, kv, s, 0.5, 2.0))
    assert {spec["constexprs"].get("KV_FP8") for spec in compiler.specs if "KV_FP8" in spec["constexprs"]} == {True}
    assert all(spec["constexprs"]["FP8_MAX"] > 0 for spec in compiler.specs if "FP8_MAX" in spec["constexprs"])
    for result in compiler.compile_all():
        assert result["shared_bytes"] <= (99 if arch == 89 else 227) * 1024, result
