"""The Triton skinny matmul against a float32 matmul, its tiling rule, and the ops dispatch around it.

The launcher's scratch (split partials) and output come from `torch.empty`, made NaN by
`poison_allocations`: a partial left unwritten or an output tile never stored fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import ops, triton_gemm  # noqa: E402
from kvserve.kernels.triton_gemm import GemmConfig, fits, pick_config, skinny_linear  # noqa: E402

CONFIGS = [
    GemmConfig(32, 32, 1, 2),
    GemmConfig(32, 32, 4, 3),  # split-K, the last program of a tile reduces
    GemmConfig(32, 32, 4, 3, fused_reduce=False),  # split-K, a second kernel reduces
    GemmConfig(16, 64, 2, 2),
    GemmConfig(64, 32, 8, 2),
    GemmConfig(32, 32, 3, 2),  # 8 chunks in 3 splits: 2, 3 and 3 chunks
]


@pytest.fixture(autouse=True)
def _poison(poison_allocations):
    poison_allocations(triton_gemm)


def operands(m: int, n: int, k: int, bias: bool, dtype: torch.dtype, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=gen).to(device=device, dtype=dtype) if bias else None
    return x, w, b


def float32_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("m", [1, 5, 16, 70])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_float32_matmul(dtype, config, m, bias, device, skip_bf16_on_interpreter):
    skip_bf16_on_interpreter(dtype)
    x, w, b = operands(m, 128, 256, bias, dtype, device)
    out = skinny_linear(x, w, b, config)
    assert out.shape == (m, 128) and out.dtype == dtype
    # float32 accumulation rounded once: within one unit in the last place of the rounded float32 result.
    expected = float32_linear(x, w, b)
    torch.testing.assert_close(out.float(), expected.to(dtype).float(), rtol=2**-7 if dtype == torch.bfloat16
                               else 2**-10, atol=1e-3)


def test_row_slices_of_a_wider_tensor(device):
    """x may be a row-strided view (stride(0) > K), as the rows of a fused projection's output are."""
    x_wide, w, _ = operands(3, 64, 192, False, torch.float16, device)
    x = x_wide[:, :128]
    w = w[:, :128].contiguous()
    out = skinny_linear(x, w, None, GemmConfig(32, 32, 2, 2))
    torch.testing.assert_close(out.float(), float32_linear(x, w, None).half().float(), rtol=2**-10, atol=1e-3)


def test_split_reductions_agree_bitwise_and_counters_reset(device):
    """Both reductions add the partials in split order: same bits. The tile counters are back at zero after
    each launch, so the next launch (a graph replay) reduces again."""
    x, w, b = operands(9, 96, 512, True, torch.float16, device, seed=3)
    fused = GemmConfig(32, 64, 8, 2)
    first = skinny_linear(x, w, b, fused)
    second = skinny_linear(x, w, b, fused)
    separate = skinny_linear(x, w, b, GemmConfig(32, 64, 8, 2, fused_reduce=False))
    assert torch.equal(first, second)
    assert torch.equal(first, separate)
    assert int(triton_gemm._LOCKS.buffers[x.device].abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", [c for c in CONFIGS if c.split_k == 1 or c.fused_reduce], ids=str)
@pytest.mark.parametrize("m", [1, 6, 70])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_silu_mul_epilogue_equals_the_two_kernels(dtype, config, m, bias, device, skip_bf16_on_interpreter):
    """The fused gate/up matmul gives bitwise what the plain matmul then the Triton SiLU-and-mul kernel give,
    for every tiling: (gate, up) pairs meet in the right tile row and round at the same points."""
    from kvserve.kernels.triton_elementwise import silu_and_mul

    skip_bf16_on_interpreter(dtype)
    x, w, b = operands(m, 256, 256, bias, dtype, device, seed=m)
    fused = skinny_linear(x, w, b, config, silu_mul=True)
    assert fused.shape == (m, 128) and fused.dtype == dtype
    assert torch.equal(fused, silu_and_mul(skinny_linear(x, w, b, config)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", [c for c in CONFIGS if c.split_k == 1 or c.fused_reduce], ids=str)
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_rope_cache_epilogue_equals_the_two_kernels(dtype, config, m, bias, device, skip_bf16_on_interpreter):
    """The fused q/k/v matmul with the rotary + cache-write epilogue gives bitwise the plain matmul followed by
    the Triton rotary kernel that writes the cache: rotated q and k, v untouched, every k/v row in its slot,
    and nothing written for a padding slot (-1). The cache starts as NaN, so a missed write shows."""

    skip_bf16_on_interpreter(dtype)
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 4
    n = (heads + 2 * kv_heads) * head_dim
    x, w, b = operands(m, n, 256, bias, dtype, device, seed=10 + m)
    gen = torch.Generator().manual_seed(m)
    positions = torch.randint(0, 100, (m,), generator=gen).to(device)
    slots = torch.randperm(8 * block_size, generator=gen)[:m].to(device)
    slots[0] = -1
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(100, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
    fused_cache = torch.full((2, 8, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    expected_cache = fused_cache.clone()

    _assert_epilogue_is_matmul_then_rotary(x, w, b, config, positions, cos_sin, fused_cache, expected_cache, slots,
                                           (heads, kv_heads, head_dim))


def _assert_epilogue_is_matmul_then_rotary(x, w, b, config, positions, cos_sin, fused_cache, expected_cache,
                                           slots, shape):
    """The q/k/v matmul with the rope epilogue (writing `fused_cache`) equals, bitwise, the plain matmul followed
    by the rotary kernel (writing `expected_cache`), outputs and cache slots (NaN where neither writes)."""
    from kvserve.kernels.triton_elementwise import rotary_embedding
    from kvserve.kernels.triton_gemm import RopeCache

    heads, kv_heads, head_dim = shape
    m = x.shape[0]
    rope = RopeCache(positions, cos_sin, fused_cache, slots, heads, kv_heads, head_dim)
    assert fits(x, w, config, b, rope=rope)
    fused = skinny_linear(x, w, b, config, rope=rope)
    plain = skinny_linear(x, w, b, config)
    q, k, v = plain.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_rot, k_rot = rotary_embedding(positions, q.view(m, heads, head_dim), k.view(m, kv_heads, head_dim),
                                    cos_sin, v.view(m, kv_heads, head_dim), expected_cache, slots)
    assert torch.equal(fused, torch.cat([q_rot.view(m, -1), k_rot.view(m, -1), v], dim=-1))
    assert torch.equal(fused_cache.isnan(), expected_cache.isnan())
    assert torch.equal(fused_cache.nan_to_num(), expected_cache.nan_to_num())


def test_rope_cache_epilogue_with_a_yarn_table(device):
    """The q/k/v matmul's rope epilogue reads the same table as the rotary kernel: with the model's YaRN table
    (cos/sin scaled by the attention factor) it still gives bitwise the matmul followed by that kernel."""
    from kvserve.layers.rotary import RotaryEmbedding

    dtype, config, m = torch.float16, GemmConfig(32, 32, 1, 2), 3
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 4
    n = (heads + 2 * kv_heads) * head_dim
    x, w, b = operands(m, n, 256, True, dtype, device, seed=21)
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    cos_sin = RotaryEmbedding(head_dim, 256, 1e6, params).cos_sin_cache.to(device)
    positions = torch.tensor([1, 64, 250], dtype=torch.int64, device=device)
    slots = torch.tensor([3, 0, 17], dtype=torch.int64, device=device)
    fused_cache = torch.full((2, 8, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    expected_cache = fused_cache.clone()
    _assert_epilogue_is_matmul_then_rotary(x, w, b, config, positions, cos_sin, fused_cache, expected_cache, slots,
                                           (heads, kv_heads, head_dim))


def test_rope_cache_epilogue_declines_what_it_cannot_do(device):
    from kvserve.kernels.triton_gemm import RopeCache

    x, w, _ = operands(2, 512, 256, False, torch.float16, device)
    cache = torch.zeros(2, 4, 4, 2, 64, dtype=torch.float16, device=device)
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    table = torch.zeros(16, 64, device=device)
    rope = RopeCache(pos, table, cache, pos, 4, 2, 64)
    assert fits(x, w, GemmConfig(64, 32, 1, 2), rope=rope)
    assert not fits(x, w, GemmConfig(128, 32, 1, 2), rope=rope)  # a tile wider than one head
    assert not fits(x, w, GemmConfig(32, 32, 4, 2, fused_reduce=False), rope=rope)  # no epilogue there
    assert not fits(x, w[:448], GemmConfig(64, 32, 1, 2), rope=rope)  # rows are not q + k + v heads
    assert not fits(x, w, GemmConfig(64, 32, 1, 2), rope=RopeCache(pos, table, cache.float(), pos, 4, 2, 64))


def test_silu_mul_needs_the_fused_split_reduction(device):
    x, w, _ = operands(2, 128, 256, False, torch.float16, device)
    assert fits(x, w, GemmConfig(32, 32, 4, 2), silu_mul=True)
    assert not fits(x, w, GemmConfig(32, 32, 4, 2, fused_reduce=False), silu_mul=True)
    assert fits(x, w, GemmConfig(32, 32, 4, 2, fused_reduce=False))
    assert not fits(x, w[:127], GemmConfig(1, 32, 1, 2), silu_mul=True)  # odd row count: no gate/up halves


def test_ops_linear_rope_cache_declines_off_the_skinny_path(monkeypatch):
    """The q/k/v epilogue is a GPU small-batch path: on the CPU, or with the elementwise kernels not Triton, or
    with the fusion switched off, the caller gets None and runs the separate ops."""
    x, w, b = operands(2, 512, 256, True, torch.float16, torch.device("cpu"))
    cache = torch.zeros(2, 4, 4, 2, 64, dtype=torch.float16)
    pos = torch.zeros(2, dtype=torch.int64)
    args = (x, w, b, pos, torch.zeros(16, 64), cache, pos, 4, 2, 64)
    assert ops.linear_rope_cache(*args) is None  # CPU
    monkeypatch.setattr(ops, "_skinny", lambda *a, **k: pytest.fail("the skinny path was asked"))
    monkeypatch.setattr(ops, "_elementwise_backend", "torch")
    assert ops.linear_rope_cache(*args) is None
    monkeypatch.setattr(ops, "_elementwise_backend", "triton")
    ops.set_qkv_rope_fusion(False)
    try:
        assert ops.linear_rope_cache(*args) is None
    finally:
        ops.set_qkv_rope_fusion(True)


def test_ops_linear_silu_mul_on_cpu_is_the_two_ops():
    x, w, b = operands(3, 64, 128, True, torch.float32, torch.device("cpu"))
    assert torch.equal(ops.linear_silu_mul(x, w, b), ops.silu_and_mul(torch.nn.functional.linear(x, w, b)))


@pytest.mark.parametrize("splits", [2, 4, 5, 7])  # 9 chunks: 4 + 5, 2-3, 1-2, 1-2 per split
def test_uneven_splits_cover_every_chunk_once(splits, device):
    """A split count that does not divide K's chunks: every chunk is summed exactly once. Row r of x is ones
    over chunk r and zeros elsewhere, so output row r is the sum of that chunk's weight slice: a chunk dropped
    or summed twice changes it. The fused and the separate reduction give the same bits."""
    chunks, block_k = 9, 32
    x = torch.zeros(chunks, chunks * block_k, device=device, dtype=torch.float16)
    for chunk in range(chunks):
        x[chunk, chunk * block_k:(chunk + 1) * block_k] = 1.0
    gen = torch.Generator().manual_seed(splits)
    w = torch.randint(-2, 3, (64, chunks * block_k), generator=gen).to(device=device, dtype=torch.float16)
    expected = w.float().reshape(64, chunks, block_k).sum(-1).t()  # [chunk, n], small integers: exact
    fused = skinny_linear(x, w, None, GemmConfig(32, block_k, splits, 2))
    separate = skinny_linear(x, w, None, GemmConfig(32, block_k, splits, 2, fused_reduce=False))
    assert torch.equal(fused.float(), expected)
    assert torch.equal(fused, separate)


@pytest.mark.parametrize(
    ("n", "k", "config", "why"),
    [
        (96, 256, GemmConfig(64, 32, 1, 2), "N not a multiple of block_n"),
        (128, 96, GemmConfig(32, 64, 1, 2), "K not a multiple of block_k"),
        (128, 256, GemmConfig(32, 64, 5, 2), "more splits than K has chunks"),
    ],
)
def test_fits_rejects(n, k, config, why, device):
    x, w, _ = operands(2, n, k, False, torch.float16, device)
    assert not fits(x, w, config), why
    with pytest.raises(AssertionError, match="do not fit"):
        skinny_linear(x, w, None, config)


def test_fits_rejects_float32_and_column_strided_input(device):
    x, w, _ = operands(2, 64, 128, False, torch.float16, device)
    config = GemmConfig(32, 32, 1, 2)
    assert fits(x, w, config)
    assert not fits(x.float(), w.float(), config)
    assert not fits(x.t().contiguous().t(), w, config)  # stride(1) != 1


# ------------------------------------------------------------------------------ the tiling rule

QWEN_7B = {"qkv": (4608, 3584), "o_proj": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944),
           "lm_head": (152064, 3584)}


def test_pick_config_at_the_measured_shapes():
    """The H200 sweeps' best tilings at 1-16 rows (docs/perf_notes.md, entries 14 and 26): split-K as far
    as the programs stay resident at once (3 per SM at 60 KiB of shared memory each, 396 in all)."""
    got = {name: pick_config(1, n, k, 132) for name, (n, k) in QWEN_7B.items()}
    assert got["gate_up"] == GemmConfig(64, 128, 1, 3, 4)
    assert got["o_proj"] == GemmConfig(64, 128, 7, 3, 4)  # 56 tiles x 7 = 392 programs
    assert got["down"] == GemmConfig(64, 128, 7, 3, 4)  # 148 chunks: 21 or 22 per split
    assert got["lm_head"] == GemmConfig(128, 128, 1, 4, 8)
    assert got["qkv"] == GemmConfig(64, 128, 5, 3, 4)  # 72 tiles x 5 = 360 programs
    assert triton_gemm.resident_programs(got["qkv"], 132, 227 * 1024) == 396


def test_pick_config_counts_wider_activation_tiles():
    """At 64 rows the activation tile is 64 rows: 2 programs of the 3-stage tiling per SM, not 3, so fewer
    splits (o_proj: 56 tiles x 4 = 224 <= 264)."""
    assert pick_config(64, 3584, 3584, 132).split_k == 4
    assert pick_config(16, 3584, 3584, 132).split_k == 7
    assert pick_config(32, 3584, 3584, 132).split_k == 7  # 32-row tiles: 72 KiB, still 3 per SM
    assert pick_config(1, 64, 64, 132) is None  # K shorter than one chunk


def test_pick_config_split_never_exceeds_the_resident_programs_or_the_chunks():
    for n, k, num_sms in ((4608, 3584, 132), (3584, 18944, 78), (512, 256, 132), (64, 1024, 4)):
        config = pick_config(1, n, k, num_sms)
        assert config is not None
        programs = n // config.block_n * config.split_k
        assert config.split_k <= k // config.block_k
        resident = triton_gemm.resident_programs(config, num_sms, 227 * 1024, triton_gemm.launch_block_m(1))
        assert config.split_k == 1 or programs <= resident


def test_pick_config_respects_the_shared_memory_limit():
    """An sm_86 / sm_89 GPU allows 99 KiB per block: the LM head's 128-row, 4-stage tiling (144 KiB) must not
    be chosen there, even with few SMs."""
    hopper = pick_config(1, 152064, 3584, 132, max_shared=227 * 1024)
    assert hopper is not None and hopper.block_n == 128
    small = pick_config(1, 152064, 3584, 58, max_shared=99 * 1024)
    assert small is not None and small.block_n == 64
    assert triton_gemm.shared_bytes(small) <= 99 * 1024
    assert pick_config(1, 4096, 4096, 58, max_shared=8 * 1024) is None


@pytest.mark.parametrize("n", [64, 576, 1536, 49152, 152064])
@pytest.mark.parametrize("k", [128, 576, 1536, 8960])
@pytest.mark.parametrize("num_sms", [4, 132])
def test_pick_config_always_fits_or_declines(n, k, num_sms):
    config = pick_config(4, n, k, num_sms)
    if k % 128:
        assert config is None
        return
    assert config is not None
    assert n % config.block_n == 0 and k % config.block_k == 0
    assert 1 <= config.split_k <= min(16, k // config.block_k)


# ------------------------------------------------------------------------------ ops.linear dispatch


def test_ops_linear_on_cpu_is_torch_linear():
    x, w, b = operands(3, 64, 128, True, torch.float32, torch.device("cpu"))
    assert torch.equal(ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_kernels_compile_for_hopper(device, hopper_compiler):
    """The tilings `pick_config` gives at the Qwen2.5-7B shapes (and a bf16 / fp16 mix of row counts and
    bias) compile for sm_90 within its shared memory."""
    names = ["_skinny_gemm_kernel", "split_reduce_kernel"]
    for dtype in (torch.bfloat16, torch.float16):
        for m, config, bias in (
            (1, GemmConfig(64, 128, 1, 3, 4), False),
            (8, GemmConfig(64, 128, 5, 3, 4), True),  # 8 chunks in 5 splits
            (16, GemmConfig(128, 128, 1, 4, 8), False),
            (3, GemmConfig(64, 128, 7, 3, 4, fused_reduce=False), True),
            (32, GemmConfig(64, 128, 7, 3, 4), True),  # the most rows ops sends here: 32-row activation tiles
        ):
            x = torch.empty(m, 1024, dtype=dtype, device=device)
            w = torch.empty(256, 1024, dtype=dtype, device=device)
            b = torch.empty(256, dtype=dtype, device=device) if bias else None
            kernels = names if config.split_k > 1 and not config.fused_reduce else names[:1]
            hopper_compiler.record(triton_gemm, kernels, lambda x=x, w=w, b=b, c=config: skinny_linear(x, w, b, c))
            if config.fused_reduce:  # the gate/up matmul with its SiLU-and-mul epilogue, q/k/v with rotary
                hopper_compiler.record(
                    triton_gemm, names[:1], lambda x=x, w=w, b=b, c=config: skinny_linear(x, w, b, c, silu_mul=True)
                )
                w_qkv = torch.empty(36 * 128, 1024, dtype=dtype, device=device)
                b_qkv = torch.empty(36 * 128, dtype=dtype, device=device)
                ints = torch.zeros(m, dtype=torch.int64, device=device)
                cache = torch.empty(2, 4, 16, 4, 128, dtype=dtype, device=device)
                rope = triton_gemm.RopeCache(ints, torch.empty(64, 128, device=device), cache, ints, 28, 4, 128)
                hopper_compiler.record(
                    triton_gemm, names[:1], lambda x=x, w=w_qkv, b=b_qkv, c=config, r=rope: skinny_linear(x, w, b, c, rope=r)
                )
    for result in hopper_compiler.compile_all():
        assert result["shared_bytes"] <= 227 * 1024, result
        if result["kernel"] == "_skinny_gemm_kernel" and result["num_warps"] == 4 and result["block_m"] <= 32:
            # resident_programs counts 3 programs of the 3-stage 64-row tiling per SM with 16- and 32-row
            # activation tiles: its real footprint must allow that.
            assert 3 * (result["shared_bytes"] + 1024) <= 228 * 1024, result  # 1 KiB reserved per block



# ------------------------------------------------------------------------------ fp8 weights (weight-only)

FP8_CONFIGS = [
    GemmConfig(32, 32, 1, 2),
    GemmConfig(32, 32, 4, 3),  # split-K, the last program of a tile reduces
    GemmConfig(32, 32, 4, 3, fused_reduce=False),  # split-K, a second kernel reduces
    GemmConfig(32, 32, 3, 2),  # 8 chunks in 3 splits
]


def fp8_operands(m: int, n: int, k: int, bias: bool, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """x, an fp8 weight and its per-row scales (`reference.quantize_rows_fp8` on the CPU: already on the fp8
    grid, so the interpreter's own fp8 rounding is not involved), bias. The rows' magnitudes span 2^-4..2^4,
    so their scales differ: a scale applied to the wrong row, twice or not at all shows."""
    from kvserve.kernels import reference

    x, w, b = operands(m, n, k, bias, torch.float32, torch.device("cpu"), seed)
    w = w * torch.exp2(torch.linspace(-4, 4, n))[:, None]
    w8, w_scale = reference.quantize_rows_fp8(w)
    return (x.to(device, dtype), w8.to(device), w_scale.to(device),
            None if b is None else b.to(device, dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", FP8_CONFIGS, ids=str)
@pytest.mark.parametrize("m", [1, 5, 70])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_fp8_weight_matches_the_weight_only_reference(dtype, config, m, bias, device, skip_bf16_on_interpreter):
    """An fp8 weight converted in registers, the accumulator scaled per row before the split partials and the
    bias: `reference.fp8_linear_weight_only` (float32 sums in another order: one unit in the last place)."""
    from kvserve.kernels import reference

    skip_bf16_on_interpreter(dtype)
    x, w8, w_scale, b = fp8_operands(m, 128, 256, bias, dtype, device, seed=m)
    assert fits(x, w8, config, b, w_scale=w_scale)
    out = skinny_linear(x, w8, b, config, w_scale=w_scale)
    assert out.shape == (m, 128) and out.dtype == dtype
    expected = reference.fp8_linear_weight_only(x, w8, w_scale, b)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7 if dtype == torch.bfloat16 else 2**-10,
                               atol=1e-3)


@pytest.mark.parametrize("fp16_dot", [True, False], ids=["fp16_dot", "bf16_dot"])
@pytest.mark.parametrize("config", [GemmConfig(32, 64, 1, 2), GemmConfig(32, 64, 4, 2),
                                    GemmConfig(64, 128, 2, 2, fused_reduce=False)], ids=str)
def test_fp8_weight_bf16_activations_keep_their_range(fp16_dot, config, device, monkeypatch,
                                                      skip_bf16_on_interpreter):
    """bf16 activations against an fp8 weight, the dot in fp16 (`FP8_FP16_DOT`) or in bf16: rows past fp16's
    65,504 (3e5), in fp16's subnormals (1e-6), all zero and ordinary all give the weight-only reference's
    float32 sums, then rounded once to bf16. In fp16 unscaled, the first would be inf and the second lose bits.
    (The interpreter has no bf16 dot: the bf16 way runs on a GPU only.)"""
    from kvserve.kernels import reference

    if not fp16_dot:
        skip_bf16_on_interpreter(torch.bfloat16)
    monkeypatch.setattr(triton_gemm, "FP8_FP16_DOT", fp16_dot)
    m, n, k = 5, 64, 512
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(n, k, generator=gen) * 0.02 * torch.exp2(torch.linspace(-4, 4, n))[:, None]
    w8, w_scale = reference.quantize_rows_fp8(w)
    x = torch.randn(m, k, generator=gen)
    x[0] *= 1e-6
    x[1, 3] = 3e5
    x[2] = 0
    x[3] *= 1e4
    x = x.to(torch.bfloat16)
    want = reference.fp8_linear_weight_only(x, w8, w_scale, None).float()
    out = skinny_linear(x.to(device), w8.to(device), None, config, w_scale=w_scale.to(device)).float().cpu()
    assert torch.isfinite(out).all()
    # One bf16 rounding of the float32 sum (the interpreter truncates: up to one unit in the last place).
    bound = 2**-7 * want.abs() + 2**-20 * want.abs().amax(dim=1, keepdim=True)
    assert ((out - want).abs() <= bound).all(), ((out - want).abs() / bound).amax(dim=1)
    assert torch.equal(out[2], torch.zeros(n))


def test_the_fp16_dot_is_for_fp8_weights_bf16_activations_and_16_row_tiles(monkeypatch):
    assert triton_gemm.fp8_fp16_dot(torch.bfloat16, True, triton_gemm.launch_block_m(1))
    assert triton_gemm.fp8_fp16_dot(torch.bfloat16, True, triton_gemm.launch_block_m(16))
    assert not triton_gemm.fp8_fp16_dot(torch.bfloat16, True, triton_gemm.launch_block_m(17))
    assert not triton_gemm.fp8_fp16_dot(torch.float16, True, 16)  # already fp16: the plain conversion
    assert not triton_gemm.fp8_fp16_dot(torch.bfloat16, False, 16)  # a bf16 weight
    monkeypatch.setattr(triton_gemm, "FP8_FP16_DOT", False)  # KVSERVE_FP8_FP16_DOT=0
    assert not triton_gemm.fp8_fp16_dot(torch.bfloat16, True, 16)


def test_pdl_is_off_for_fp8_weights_converted_to_bf16(monkeypatch):
    """PDL launches stay on for bf16 weights and the fp16 dot; an fp8 weight converted to bf16 launches without
    it unless KVSERVE_FP8_CONVERT_PDL=1 (and nothing launches with it where PDL is off)."""
    assert not triton_gemm.FP8_CONVERT_PDL  # the default
    assert triton_gemm.launch_pdl(True, fp8_weight=False, fp16_dot=False)
    assert triton_gemm.launch_pdl(True, fp8_weight=True, fp16_dot=True)
    assert not triton_gemm.launch_pdl(True, fp8_weight=True, fp16_dot=False)
    assert not any(triton_gemm.launch_pdl(False, w, d) for w in (False, True) for d in (False, True))
    monkeypatch.setattr(triton_gemm, "FP8_CONVERT_PDL", True)
    assert triton_gemm.launch_pdl(True, fp8_weight=True, fp16_dot=False)


def test_fp8_weight_split_reductions_agree_bitwise(device):
    x, w8, w_scale, b = fp8_operands(9, 96, 512, True, torch.float16, device, seed=3)
    fused = skinny_linear(x, w8, b, GemmConfig(32, 64, 8, 2), w_scale=w_scale)
    separate = skinny_linear(x, w8, b, GemmConfig(32, 64, 8, 2, fused_reduce=False), w_scale=w_scale)
    assert torch.equal(fused, separate)
    assert int(triton_gemm._LOCKS.buffers[x.device].abs().sum()) == 0


@pytest.mark.parametrize("config", [c for c in FP8_CONFIGS if c.split_k == 1 or c.fused_reduce], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_fp8_weight_silu_mul_epilogue_equals_the_two_kernels(config, bias, device):
    from kvserve.kernels import reference
    from kvserve.kernels.triton_elementwise import silu_and_mul

    x, w8, w_scale, b = fp8_operands(6, 256, 256, bias, torch.float16, device, seed=7)
    assert fits(x, w8, config, b, silu_mul=True, w_scale=w_scale)
    fused = skinny_linear(x, w8, b, config, silu_mul=True, w_scale=w_scale)
    assert fused.shape == (6, 128)
    assert torch.equal(fused, silu_and_mul(skinny_linear(x, w8, b, config, w_scale=w_scale)))
    want = reference.silu_and_mul(reference.fp8_linear_weight_only(x, w8, w_scale, b).float())
    torch.testing.assert_close(fused.float(), want, rtol=2**-9, atol=2e-3)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("config", [GemmConfig(32, 32, 1, 2), GemmConfig(32, 32, 4, 3)], ids=str)
def test_fp8_weight_rope_cache_epilogue_equals_the_two_kernels(cache_dtype, config, device):
    """The q/k/v matmul of an fp8 weight with the rotary + cache epilogue (an fp16 or an fp8 KV cache, scaled):
    bitwise the plain fp8-weight matmul then the rotary launch that writes the cache; a padding slot (-1)
    untouched. (Both sides round to fp8 with the same code: under the interpreter its rounding, whatever it is,
    is the same on both.)"""
    from kvserve.kernels.triton_elementwise import rotary_embedding
    from kvserve.kernels.triton_gemm import RopeCache

    m, heads, kv_heads, head_dim, block_size = 5, 4, 2, 64, 4
    k_scale, v_scale = (0.5, 2.0) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    n = (heads + 2 * kv_heads) * head_dim
    x, w8, w_scale, b = fp8_operands(m, n, 256, True, torch.float16, device, seed=12)
    gen = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 100, (m,), generator=gen).to(device)
    slots = torch.randperm(8 * block_size, generator=gen)[:m].to(device)
    slots[1] = -1
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(100, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
    shape = (2, 8, block_size, kv_heads, head_dim)
    if cache_dtype == torch.float8_e4m3fn:
        poison = torch.full(shape, 0x7F, dtype=torch.uint8).view(cache_dtype)  # NaN in e4m3fn
    else:
        poison = torch.full(shape, float("nan"), dtype=cache_dtype)
    fused_cache, expected_cache = poison.clone().to(device), poison.clone().to(device)
    rope = RopeCache(positions, cos_sin, fused_cache, slots, heads, kv_heads, head_dim, k_scale, v_scale)
    assert fits(x, w8, config, b, rope=rope, w_scale=w_scale)
    fused = skinny_linear(x, w8, b, config, rope=rope, w_scale=w_scale)
    plain = skinny_linear(x, w8, b, config, w_scale=w_scale)
    q, k, v = plain.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_rot, k_rot = rotary_embedding(positions, q.view(m, heads, head_dim), k.view(m, kv_heads, head_dim), cos_sin,
                                    v.view(m, kv_heads, head_dim), expected_cache, slots, k_scale, v_scale)
    assert torch.equal(fused, torch.cat([q_rot.view(m, -1), k_rot.view(m, -1), v], dim=-1))
    assert torch.equal(fused_cache.view(torch.uint8), expected_cache.view(torch.uint8))
    assert int((~fused_cache.float().isnan()).all(-1).all(-1).sum()) == 2 * (m - 1)


def test_fits_takes_an_fp8_weight_only_with_its_scales(device):
    x, w8, w_scale, b = fp8_operands(2, 64, 128, True, torch.float16, device)
    config = GemmConfig(32, 32, 1, 2)
    assert fits(x, w8, config, b, w_scale=w_scale)
    assert not fits(x, w8, config, b)  # fp8 weight, no scales
    assert not fits(x, w8.to(torch.float16), config, b, w_scale=w_scale)  # scales for a 16-bit weight
    assert not fits(x, w8, config, b, w_scale=w_scale.half())
    assert not fits(x, w8, config, b, w_scale=w_scale[:32])
    assert not fits(x, w8.view(torch.float8_e5m2), config, b, w_scale=w_scale)
    assert not fits(x.float(), w8, config, None, w_scale=w_scale)  # float32 activations: _scaled_mm's
    assert not fits(x, w8, config, b.float(), w_scale=w_scale)  # the bias is in x's dtype


def test_pick_config_for_fp8_weights():
    """The contract for fp8 weights: weight_bytes=1 takes the bf16 weight's tiling (the H100 sweep's finding,
    docs/perf_notes.md entry 69), which fits the shared memory with the smaller fp8 stages too."""
    for m in (1, 8, 17, 32, 64, 256):
        for name, (n, k) in QWEN_7B.items():
            for sms, shared in ((132, 227 * 1024), (58, 99 * 1024)):
                fp8 = pick_config(m, n, k, sms, shared, weight_bytes=1)
                assert fp8 == pick_config(m, n, k, sms, shared), (m, name, sms)
                assert fp8 is None or triton_gemm.shared_bytes(fp8, triton_gemm.launch_block_m(m),
                                                               weight_bytes=1) <= shared
    assert pick_config(1, 3584, 3584, 132, weight_bytes=1).block_k == 128


def test_fp8_weight_kernels_compile_for_hopper(device, hopper_compiler, monkeypatch):
    """The fp8-weight variants (e4m3 -> bf16 / fp16 in registers, the rows' scales) of the tilings `pick_config`
    gives fp8 weights at the 7B shapes compile for sm_90, plain and with each epilogue, within the shared memory
    `shared_bytes` counts (plus Triton's reserve); 64-row activation tiles too (FP8_SKINNY_MAX_ROWS may go past
    32), and the 128-row, 8-warp tiling (the LM head's in bf16). With PDL, the bf16-converting launches too
    (KVSERVE_FP8_CONVERT_PDL=1: without it they launch as the no-PDL case compiles them)."""
    monkeypatch.setattr(triton_gemm, "FP8_CONVERT_PDL", True)
    cases = [(m, pick_config(m, *QWEN_7B[name], 132, weight_bytes=1))
             for m, name in ((1, "qkv"), (8, "o_proj"), (32, "gate_up"), (64, "down"))]
    cases.append((16, GemmConfig(128, 128, 1, 4, 8)))
    assert all(config is not None for _, config in cases)
    recorded: list[tuple[GemmConfig, int]] = []  # one launch a record, in order
    for dtype in (torch.bfloat16, torch.float16):
        for m, config in cases:
            recorded.append((config, triton_gemm.launch_block_m(m)))
            x = torch.empty(m, 2048, dtype=dtype, device=device)
            w8 = torch.empty(256, 2048, dtype=torch.float8_e4m3fn, device=device)
            scale = torch.empty(256, dtype=torch.float32, device=device)
            b = torch.empty(256, dtype=dtype, device=device)
            hopper_compiler.record(triton_gemm, ["_skinny_gemm_kernel"],
                                   lambda x=x, w=w8, s=scale, b=b, c=config: skinny_linear(x, w, b, c, w_scale=s))
            if dtype == torch.bfloat16 and m == 8:
                recorded += [(config, triton_gemm.launch_block_m(m))] * 2
                hopper_compiler.record(triton_gemm, ["_skinny_gemm_kernel"], lambda x=x, w=w8, s=scale, c=config:
                                       skinny_linear(x, w, None, c, silu_mul=True, w_scale=s))
                w_qkv = torch.empty(36 * 128, 2048, dtype=torch.float8_e4m3fn, device=device)
                s_qkv = torch.empty(36 * 128, dtype=torch.float32, device=device)
                ints = torch.zeros(m, dtype=torch.int64, device=device)
                cache = torch.empty(2, 4, 16, 4, 128, dtype=torch.float8_e4m3fn, device=device)
                rope = triton_gemm.RopeCache(ints, torch.empty(64, 128, device=device), cache, ints, 28, 4, 128)
                hopper_compiler.record(triton_gemm, ["_skinny_gemm_kernel"], lambda x=x, w=w_qkv, s=s_qkv, c=config,
                                       r=rope: skinny_linear(x, w, None, c, rope=r, w_scale=s))
    results = hopper_compiler.compile_all()
    assert len(results) == len(recorded)
    for result, (config, block_m) in zip(results, recorded, strict=True):
        assert result["shared_bytes"] <= 227 * 1024, result
        estimate = triton_gemm.shared_bytes(config, block_m, weight_bytes=1)
        print(f"fp8 weight {config} block_m {block_m}: {result['shared_bytes']} B, estimate {estimate}")
        assert result["shared_bytes"] <= estimate + 1024, (result, config, estimate)
