"""Triton rms_norm, rotary_embedding and silu_and_mul against the torch reference.

Outputs are allocated by the kernels' launchers; `poison_allocations` makes those allocations start as
NaN, so an element a kernel leaves unwritten fails the comparison.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import reference, triton_elementwise  # noqa: E402
from kvserve.kernels.triton_elementwise import rms_norm, rotary_embedding, silu_and_mul  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The kernels round to the activation dtype at the same steps as the reference, so they agree to within two
# ulps: fp32 intrinsics (rsqrt, exp) may differ from torch's in the last fp32 bit and flip one intermediate
# rounding, which the final rounding can at most double.
TWO_ULPS = {
    torch.float32: dict(atol=1e-6, rtol=2**-21),
    torch.float16: dict(atol=1e-5, rtol=2**-9),
    torch.bfloat16: dict(atol=1e-4, rtol=2**-6),
}


@pytest.fixture(autouse=True)
def _poison(poison_allocations):
    poison_allocations(triton_elementwise)


def randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------------------ rms_norm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [96, 576])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_reference(dtype, hidden, with_residual, device, skip_bf16_on_interpreter):
    skip_bf16_on_interpreter(dtype)
    x = randn(7, hidden, dtype=dtype, device=device) * 3
    weight = randn(hidden, dtype=dtype, device=device, seed=1)
    residual = randn(7, hidden, dtype=dtype, device=device, seed=2) if with_residual else None
    x_before = x.clone()
    out, new_residual = rms_norm(x, weight, 1e-5, residual)
    expected_out, expected_residual = reference.rms_norm(x, weight, 1e-5, residual)
    assert out.dtype == expected_out.dtype and new_residual.dtype == expected_residual.dtype
    torch.testing.assert_close(out, expected_out, **TWO_ULPS[dtype])
    torch.testing.assert_close(new_residual, expected_residual, **TWO_ULPS[dtype])
    assert torch.equal(x, x_before)
    if not with_residual:
        assert new_residual is x  # as the reference: no copy


def test_rms_norm_takes_views_leading_dims_and_fp32_weight(device):
    """qk-norm shape [tokens, heads, head_dim]; x a strided view; fp32 weight promotes the output."""
    wide = randn(5, 4, 128, dtype=torch.float16, device=device)
    x = wide[:, 1:3, :64]  # non-contiguous rows
    weight = randn(64, dtype=torch.float32, device=device, seed=1)
    out, new_residual = rms_norm(x, weight, 1e-6)
    expected, _ = reference.rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == torch.float32
    # The norm is rounded to x's dtype before the fp32 weight multiply: fp16 precision.
    torch.testing.assert_close(out, expected, **TWO_ULPS[torch.float16])
    assert new_residual is x


def test_rms_norm_rejects_mismatched_residual(device):
    x = randn(3, 64, dtype=torch.float16, device=device)
    with pytest.raises(AssertionError, match="residual must match x"):
        rms_norm(x, randn(64, dtype=torch.float16, device=device), 1e-6, x.float())


# ------------------------------------------------------------------------------------------- rotary


def cos_sin_cache(max_position: int, head_dim: int, theta: float = 1e5) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (7, 1, 128)])
def test_rotary_embedding_matches_reference(
    dtype, num_heads, num_kv_heads, head_dim, device, skip_bf16_on_interpreter
):
    """query/key as views into a fused QKV output (token stride > heads * head_dim)."""
    skip_bf16_on_interpreter(dtype)
    num_tokens = 6
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
    query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    positions = torch.tensor([0, 1, 17, 4095, 2, 300], dtype=torch.int64, device=device)
    cache = cos_sin_cache(4096, head_dim).to(device)
    qkv_before = qkv.clone()
    q_out, k_out = rotary_embedding(positions, query, key, cache)
    q_expected, k_expected = reference.rotary_embedding(positions, query, key, cache)
    torch.testing.assert_close(q_out, q_expected, **TWO_ULPS[dtype])
    torch.testing.assert_close(k_out, k_expected, **TWO_ULPS[dtype])
    assert torch.equal(qkv, qkv_before)


def qkv_views(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key and value as views into one random fused q/k/v matmul output (strided rows, as the model
    passes them)."""
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device, seed=seed)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    return (qkv[:, :q_end].view(num_tokens, num_heads, head_dim),
            qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim),
            qkv[:, k_end:].view(num_tokens, num_kv_heads, head_dim))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=str)
def test_rotary_embedding_with_cache_write(dtype, slot_dtype, device, skip_bf16_on_interpreter):
    """The fused launch returns what `rotary_embedding` returns, and leaves the cache as `reshape_and_cache`
    of the rotated key and the value would: written slots hold them bit for bit, a negative slot (padding)
    writes nothing, every other slot is untouched."""
    skip_bf16_on_interpreter(dtype)
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 5, 6, 2, 64, 4
    query, key, value = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, seed=4)
    positions = torch.tensor([3, 0, 9, 1, 7], dtype=torch.int64, device=device)
    slots = torch.tensor([13, 2, -1, 7, 30], dtype=slot_dtype, device=device)
    table = cos_sin_cache(16, head_dim).to(device)
    kv_cache = randn(2, 8, block_size, num_kv_heads, head_dim, dtype=dtype, device=device, seed=5)
    expected_cache = kv_cache.clone()
    q_out, k_out = rotary_embedding(positions, query, key, table, value, kv_cache, slots)
    q_plain, k_plain = rotary_embedding(positions, query, key, table)
    assert torch.equal(q_out, q_plain) and torch.equal(k_out, k_plain)
    reference.reshape_and_cache(k_plain, value, expected_cache, slots.long())
    assert torch.equal(kv_cache, expected_cache)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pad_to", [5, 8, 16])
def test_rotary_embedding_padded(dtype, pad_to, device, skip_bf16_on_interpreter):
    """The padded launch (a one-prompt cuDNN prefill's layout): its first rows are what the unpadded fused
    launch returns (and a copy of value), the rows past num_tokens zeros, contiguous; the cache is written
    exactly as by the unpadded launch, and padding rows write no slot."""
    skip_bf16_on_interpreter(dtype)
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 5, 6, 2, 64, 4
    query, key, value = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, seed=6)
    positions = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int64, device=device)
    slots = torch.tensor([0, 1, 2, -1, 4], dtype=torch.int64, device=device)
    table = cos_sin_cache(16, head_dim).to(device)
    kv_cache = randn(2, 8, block_size, num_kv_heads, head_dim, dtype=dtype, device=device, seed=7)
    expected_cache = kv_cache.clone()
    q_pad, k_pad, v_pad = triton_elementwise.rotary_embedding_padded(
        positions, query, key, table, value, kv_cache, slots, pad_to
    )
    q_plain, k_plain = rotary_embedding(positions, query, key, table, value, expected_cache, slots)
    for out, plain in ((q_pad, q_plain), (k_pad, k_plain), (v_pad, value)):
        assert out.shape == (pad_to, *plain.shape[1:]) and out.is_contiguous()
        assert torch.equal(out[:num_tokens], plain)
        assert torch.equal(out[num_tokens:], torch.zeros_like(out[num_tokens:]))
    assert torch.equal(kv_cache, expected_cache)
    with pytest.raises(AssertionError, match="pad_to must be"):
        triton_elementwise.rotary_embedding_padded(positions, query, key, table, value, kv_cache, slots, 4)


def test_ops_rotary_embedding_and_cache_padded_off_the_fused_launch():
    """Where the fused launch does not apply (the CPU here): the two ops, then the outputs padded."""
    from kvserve.kernels import ops

    query = randn(3, 4, 32, dtype=torch.float32, device=torch.device("cpu"))
    key = randn(3, 2, 32, dtype=torch.float32, device=torch.device("cpu"), seed=1)
    value = randn(3, 2, 32, dtype=torch.float32, device=torch.device("cpu"), seed=2)
    positions = torch.tensor([0, 1, 2])
    slots = torch.tensor([4, 5, 6])
    table = cos_sin_cache(8, 32)
    kv_cache = torch.zeros(2, 2, 4, 2, 32)
    expected_cache = kv_cache.clone()
    q_pad, k_pad, v_pad = ops.rotary_embedding_and_cache_padded(
        positions, query, key, value, table, kv_cache, slots, 8
    )
    q_ref, k_ref = reference.rotary_embedding(positions, query, key, table)
    reference.reshape_and_cache(k_ref, value, expected_cache, slots)
    for out, ref in ((q_pad, q_ref), (k_pad, k_ref), (v_pad, value)):
        assert out.shape[0] == 8 and torch.equal(out[:3], ref) and not out[3:].any()
    assert torch.equal(kv_cache, expected_cache)


def test_ops_rotary_embedding_and_cache_on_cpu_is_the_two_ops():
    """CPU (and any case the fused launch does not take): rotary_embedding, then reshape_and_cache."""
    from kvserve.kernels import ops

    query = randn(3, 4, 32, dtype=torch.float32, device=torch.device("cpu"))
    key = randn(3, 2, 32, dtype=torch.float32, device=torch.device("cpu"), seed=1)
    value = randn(3, 2, 32, dtype=torch.float32, device=torch.device("cpu"), seed=2)
    positions = torch.tensor([0, 5, 2])
    slots = torch.tensor([4, -1, 0])
    table = cos_sin_cache(8, 32)
    kv_cache = torch.zeros(2, 2, 4, 2, 32)
    expected_cache = kv_cache.clone()
    q_out, k_out = ops.rotary_embedding_and_cache(positions, query, key, value, table, kv_cache, slots)
    q_ref, k_ref = reference.rotary_embedding(positions, query, key, table)
    reference.reshape_and_cache(k_ref, value, expected_cache, slots)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(kv_cache, expected_cache)


def test_rotary_embedding_position_zero_is_identity(device):
    query = randn(2, 4, 64, dtype=torch.float32, device=device)
    key = randn(2, 2, 64, dtype=torch.float32, device=device, seed=1)
    positions = torch.zeros(2, dtype=torch.int64, device=device)
    q_out, k_out = rotary_embedding(positions, query, key, cos_sin_cache(8, 64).to(device))
    assert torch.equal(q_out, query) and torch.equal(k_out, key)


def test_rotary_embedding_rejects_wrong_cache_width(device):
    query = randn(2, 4, 64, dtype=torch.float32, device=device)
    with pytest.raises(AssertionError, match="cos_sin_cache must be"):
        rotary_embedding(
            torch.zeros(2, dtype=torch.int64, device=device), query, query, cos_sin_cache(8, 128).to(device)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_embedding_with_a_yarn_table(dtype, head_dim, device):
    """YaRN only changes the table's values (frequencies, and cos/sin scaled by its attention factor): the
    Triton kernel, alone and writing the cache, agrees with the torch reference on the model's YaRN table,
    and in float32 with HF Transformers' rotation (its own YaRN cos/sin and apply_rotary_pos_emb)."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb

    from kvserve.layers.rotary import RotaryEmbedding

    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    table = RotaryEmbedding(head_dim, 256, 1e6, params).cos_sin_cache.to(device)
    num_heads, num_kv_heads, num_tokens = 3, 1, 5
    query, key, value = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, seed=7)
    positions = torch.tensor([0, 3, 63, 64, 255], dtype=torch.int64, device=device)
    q_out, k_out = rotary_embedding(positions, query, key, table)
    q_ref, k_ref = reference.rotary_embedding(positions, query, key, table)
    torch.testing.assert_close(q_out, q_ref, **TWO_ULPS[dtype])
    torch.testing.assert_close(k_out, k_ref, **TWO_ULPS[dtype])
    kv_cache = torch.zeros(2, 4, 4, num_kv_heads, head_dim, dtype=dtype, device=device)
    slots = torch.tensor([5, 0, 9, 15, 2], dtype=torch.int64, device=device)
    q_cached, k_cached = rotary_embedding(positions, query, key, table, value, kv_cache, slots)
    assert torch.equal(q_cached, q_out) and torch.equal(k_cached, k_out)
    assert torch.equal(kv_cache[0].view(-1, num_kv_heads, head_dim)[slots], k_out)

    if dtype == torch.float32:
        config = Qwen2Config(hidden_size=head_dim * num_heads, num_attention_heads=num_heads, head_dim=head_dim,
                             max_position_embeddings=256, rope_parameters={"rope_theta": 1e6, **params})
        cos, sin = Qwen2RotaryEmbedding(config)(query.cpu(), positions.cpu()[None, :])
        # HF's layout: [batch, heads, tokens, head_dim].
        q_hf, k_hf = apply_rotary_pos_emb(query.cpu().transpose(0, 1)[None], key.cpu().transpose(0, 1)[None],
                                          cos, sin)
        torch.testing.assert_close(q_out.cpu(), q_hf[0].transpose(0, 1), **TWO_ULPS[dtype])
        torch.testing.assert_close(k_out.cpu(), k_hf[0].transpose(0, 1), **TWO_ULPS[dtype])


# ------------------------------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [40, 1500])  # 1500: two column blocks, the second partial
def test_silu_and_mul_matches_reference(dtype, d, device, skip_bf16_on_interpreter):
    skip_bf16_on_interpreter(dtype)
    x = randn(5, 2 * d, dtype=dtype, device=device) * 4
    out = silu_and_mul(x)
    torch.testing.assert_close(out, reference.silu_and_mul(x), **TWO_ULPS[dtype])


def test_silu_and_mul_takes_a_strided_view(device):
    wide = randn(3, 300, dtype=torch.float32, device=device)
    x = wide[:, :200]
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul(x), **TWO_ULPS[torch.float32])


def test_elementwise_kernels_compile_for_hopper(device, hopper_compiler):
    hidden, num_heads, num_kv_heads, head_dim, intermediate = 3584, 28, 4, 128, 18944  # Qwen2.5-7B
    for dtype in (torch.bfloat16, torch.float16):
        x = randn(2, hidden, dtype=dtype, device=device)
        weight = randn(hidden, dtype=dtype, device=device)
        query = randn(2, num_heads, head_dim, dtype=dtype, device=device)
        key = randn(2, num_kv_heads, head_dim, dtype=dtype, device=device)
        positions = torch.zeros(2, dtype=torch.int64, device=device)
        cache = cos_sin_cache(4, head_dim).to(device)
        gate_up = randn(2, 2 * intermediate, dtype=dtype, device=device)
        module = triton_elementwise
        hopper_compiler.record(module, ["_rms_norm_kernel"], partial(rms_norm, x, weight, 1e-6))
        hopper_compiler.record(module, ["_rms_norm_kernel"], partial(rms_norm, x, weight, 1e-6, x))
        hopper_compiler.record(
            module, ["_rotary_kernel"], partial(rotary_embedding, positions, query, key, cache)
        )
        kv_cache = torch.zeros(2, 4, 16, num_kv_heads, head_dim, dtype=dtype, device=device)
        hopper_compiler.record(
            module,
            ["_rotary_kernel"],
            partial(rotary_embedding, positions, query, key, cache, key, kv_cache, positions),
        )
        hopper_compiler.record(module, ["_silu_and_mul_kernel"], partial(silu_and_mul, gate_up))
    for result in hopper_compiler.compile_all():
        assert result["shared_bytes"] <= 227 * 1024, result
