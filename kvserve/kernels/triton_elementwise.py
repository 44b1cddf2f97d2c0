"""Triton twins of the per-token elementwise kernels in `reference.py`: rms_norm, rotary_embedding, silu_and_mul.

All three are memory-bound: one program per token row (plus a column split for silu_and_mul, whose rows are
long), every load contiguous. Each kernel rounds to the activation dtype at the same points the torch
reference does, so that in bf16/fp16 the results match the reference (and HF Transformers) to the last bit
in almost every element rather than drifting by one ulp where an fp32 kernel would round once.
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001, ANN201

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels import triton_pdl
from kvserve.kernels.triton_pdl import pdl_wait_then_release

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _num_warps(block: int) -> int:
    """Warps for a row of `block` elements: ~8-16 elements per thread keeps loads 16-byte wide."""
    if block <= 512:
        return 2
    if block <= 2048:
        return 4
    if block <= 8192:
        return 8
    return 16


# ------------------------------------------------------- the rounding-exact math (shared with triton_gemm)


@triton.jit
def rotate_pair(x1, x2, cos, sin, dtype: tl.constexpr):
    """Neox rotation of the pair (x1, x2) (float32) by cos/sin (float32 table values), rounding where the
    reference does: cos/sin cast to the activation dtype, then x * cos, rotate_half(x) * sin and their sum
    each rounded to it. Returns float32 (o1, o2) holding dtype values. Launch with enable_fp_fusion=False:
    an FMA would skip the rounding of the products."""
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    o1 = (x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)
    o2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    return o1, o2


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in dtype, from float32 gate/up holding dtype values: silu(gate) is rounded to the
    activation dtype before the multiply, as `F.silu(gate) * up` is."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


# --------------------------------------------------------------------------------------------- rms_norm


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_new_residual,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # The sum is rounded to x's dtype before the norm, as the reference's `x + residual` is.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_new_residual + cols, x, mask=mask)
    h = x.to(tl.float32)
    mean_sq = tl.sum(h * h, axis=0) / hidden_size
    normed = (h * tl.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, optionally after adding `residual` (contract of `reference.rms_norm`).

    x: [..., hidden] float16/bfloat16/float32 with stride(-1) == 1; weight: [hidden]; residual: like x.
    Returns (normed, new_residual): new_residual = x + residual rounded to x's dtype (x itself when residual
    is None, no copy); normed = weight * (norm in float32, cast to x's dtype), in the dtype torch promotion
    of (weight, x) gives, as in the reference. Outputs are new contiguous tensors; inputs are not modified.
    """
    hidden = x.shape[-1]
    assert x.dtype in _FLOAT_DTYPES and weight.dtype in _FLOAT_DTYPES, (
        f"x and weight must be float16/bfloat16/float32, got {x.dtype}, {weight.dtype}"
    )
    assert weight.shape == (hidden,) and weight.is_contiguous(), (
        f"weight must be contiguous [{hidden}], got {tuple(weight.shape)}"
    )
    assert x.stride(-1) == 1, f"x's last dim must be contiguous, got strides {x.stride()}"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (
            f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(residual.shape)}, {residual.dtype}"
        )
        assert residual.stride(-1) == 1, f"residual's last dim must be contiguous, got {residual.stride()}"
    assert x.device == weight.device, "x and weight must be on one device"
    x2 = x.reshape(-1, hidden)
    num_rows = x2.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        residual2 = residual.reshape(-1, hidden)
        new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        new_residual2 = new_residual.view(-1, hidden)
    else:
        residual2 = new_residual2 = x2  # never read or written: HAS_RESIDUAL is False
        new_residual = x
    if num_rows == 0:
        return out, new_residual
    block = triton.next_power_of_2(hidden)
    pdl = triton_pdl.enabled(x.device)
    _rms_norm_kernel[(num_rows,)](
        x2,
        residual2,
        weight,
        out2,
        new_residual2,
        x2.stride(0),
        residual2.stride(0),
        out2.stride(0),
        new_residual2.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        PDL=pdl,
        num_warps=_num_warps(block),
        **triton_pdl.launch_options(pdl),
    )
    return out, new_residual


# ------------------------------------------------------------------------------------------- rotary


@triton.jit
def quantize_fp8(x, scale, FP8_MAX: tl.constexpr, cache_dtype: tl.constexpr):
    """x / scale, saturated to +-FP8_MAX, rounded to nearest even into the fp8 cache_dtype: what every cache
    write stores in an fp8 cache, `reference.quantize_kv` bit for bit (a NaN's sign and payload aside). The
    division is IEEE (`div_rn`), as torch's: Triton's `/` may compile to an approximate one.

    NOTE: a NaN stays NaN (both formats have one), as torch's clamp keeps it: `tl.clamp`'s default turns it
    into +-FP8_MAX, a huge finite key that attention would collapse onto, and the GPU would then store what
    the CPU path does not. +-inf saturates like any value past the range."""
    clamped = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
    return clamped.to(cache_dtype, fp_downcast_rounding="rtne")


# num_tokens and write_v_out vary with the batch (and the padded path): unspecialised, so that the padded
# launch of a one-prompt prefill runs the variant every other launch compiled (no compile mid-serving).
@triton.jit(do_not_specialize=["num_tokens", "write_v_out", "stride_v_out_token"])
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    q_out_ptr,
    k_out_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_q_token,
    stride_k_token,
    stride_q_out_token,
    stride_k_out_token,
    stride_cos_sin,
    stride_value_token,
    stride_cache_slot,
    num_heads,
    num_kv_heads,
    num_tokens,
    v_out_ptr,
    stride_v_out_token,
    write_v_out,
    k_scale,
    v_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    PDL: tl.constexpr = False,
    FP8_MAX: tl.constexpr = 0.0,
):
    pdl_wait_then_release(PDL)
    # Program (token, 0) rotates the token's query heads, (token, 1) its key heads.
    token = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        x_ptr = q_ptr + token * stride_q_token
        out_ptr = q_out_ptr + token * stride_q_out_token
        n_heads = num_heads
    else:
        x_ptr = k_ptr + token * stride_k_token
        out_ptr = k_out_ptr + token * stride_k_out_token
        n_heads = num_kv_heads
    half: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, half)
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < n_heads)[:, None]
    offs = heads[:, None] * HEAD_DIM + cols[None, :]
    dtype = q_ptr.dtype.element_ty
    if token >= num_tokens:
        # Padding rows of a padded launch (the grid covers the padded length): zeros in the outputs, no
        # cache write.
        zero = tl.zeros([BLOCK_H, half], dtype=dtype)
        tl.store(out_ptr + offs, zero, mask=mask)
        tl.store(out_ptr + offs + half, zero, mask=mask)
        if (tl.program_id(1) == 1) & (write_v_out != 0):
            v_out = v_out_ptr + token * stride_v_out_token
            tl.store(v_out + offs, zero, mask=mask)
            tl.store(v_out + offs + half, zero, mask=mask)
        return
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + cols)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + half + cols)[None, :]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + half, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rotate_pair(x1, x2, cos, sin, dtype)
    tl.store(out_ptr + offs, o1.to(dtype), mask=mask)
    tl.store(out_ptr + offs + half, o2.to(dtype), mask=mask)
    if WRITE_CACHE:
        # The key program also writes the rotated key and the value row into the token's cache slot (the
        # cache holds [num_kv_heads, head_dim] per slot, the layout of `offs`); negative slots are padding.
        # A padded launch also copies the value row into v_out (the layout of q_out and k_out).
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if tl.program_id(1) == 1:
            v_row = value_ptr + token * stride_value_token
            v1 = tl.load(v_row + offs, mask=mask)
            v2 = tl.load(v_row + offs + half, mask=mask)
            if slot >= 0:
                k1 = o1.to(dtype)
                k2 = o2.to(dtype)
                c1 = v1
                c2 = v2
                if FP8_MAX > 0:  # an fp8 cache: what `triton_cache.reshape_and_cache` stores
                    cache_dtype = key_cache_ptr.dtype.element_ty
                    k1 = quantize_fp8(k1, k_scale, FP8_MAX, cache_dtype)
                    k2 = quantize_fp8(k2, k_scale, FP8_MAX, cache_dtype)
                    c1 = quantize_fp8(c1, v_scale, FP8_MAX, cache_dtype)
                    c2 = quantize_fp8(c2, v_scale, FP8_MAX, cache_dtype)
                k_slot = key_cache_ptr + slot * stride_cache_slot
                tl.store(k_slot + offs, k1, mask=mask)
                tl.store(k_slot + offs + half, k2, mask=mask)
                v_slot = value_cache_ptr + slot * stride_cache_slot
                tl.store(v_slot + offs, c1, mask=mask)
                tl.store(v_slot + offs + half, c2, mask=mask)
            if write_v_out != 0:
                v_out = v_out_ptr + token * stride_v_out_token
                tl.store(v_out + offs, v1, mask=mask)
                tl.store(v_out + offs + half, v2, mask=mask)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    value: torch.Tensor | None = None,
    kv_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding (contract of `reference.rotary_embedding`).

    With value / kv_cache / slot_mapping (the contract of `reshape_and_cache`, value laid out like key),
    the rotated key and the value are also written into the cache, in the same launch; an fp8 cache gets
    them divided by k_scale / v_scale and saturated, as `reshape_and_cache` stores them.

    positions: int64/int32 [num_tokens], contiguous, each < max_position; query: [num_tokens, num_heads,
    head_dim]; key: [num_tokens, num_kv_heads, head_dim]; both with contiguous heads (stride(2) == 1,
    stride(1) == head_dim; any token stride, so views into a fused QKV output work), same float dtype.
    head_dim even with head_dim / 2 a power of two (64, 128, ...). cos_sin_cache: contiguous float32
    [max_position, head_dim], cos in the first head_dim/2 columns, sin in the rest. Returns new contiguous
    (query, key); the inputs are not modified.
    """
    q_out, k_out, _ = _rotary(positions, query, key, cos_sin_cache, value, kv_cache, slot_mapping, 0, k_scale,
                              v_scale)
    return q_out, k_out


def rotary_embedding_padded(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    pad_to: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rotary_embedding` with the cache written, whose outputs are padded: (query, key, value) as new
    contiguous [pad_to, heads, head_dim] tensors, the first num_tokens rows the rotated query and key and a
    copy of value, the rest zeros (pad_to >= num_tokens). One launch: the layout a padded one-prompt
    prefill attention reads (`ops.prefill_attention`) without copying q, k and v into it."""
    q_out, k_out, v_out = _rotary(positions, query, key, cos_sin_cache, value, kv_cache, slot_mapping, pad_to,
                                  k_scale, v_scale)
    assert v_out is not None
    return q_out, k_out, v_out


def _rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    pad_to: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`rotary_embedding` (pad_to 0: value out None) and `rotary_embedding_padded` (pad_to > 0)."""
    assert query.dim() == 3 and key.dim() == 3, "query/key must be [num_tokens, heads, head_dim]"
    num_tokens, num_heads, head_dim = query.shape
    assert key.shape[0] == num_tokens and key.shape[2] == head_dim, (
        f"key {tuple(key.shape)} does not match query {tuple(query.shape)}"
    )
    num_kv_heads = key.shape[1]
    assert head_dim % 2 == 0 and triton.next_power_of_2(head_dim // 2) == head_dim // 2, (
        f"head_dim / 2 must be a power of two, got head_dim={head_dim}"
    )
    assert query.dtype == key.dtype and query.dtype in _FLOAT_DTYPES, (
        f"query/key must share a float dtype, got {query.dtype}, {key.dtype}"
    )
    for name, t in (("query", query), ("key", key)):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, (
            f"{name} must have contiguous heads (stride(1) == head_dim, stride(2) == 1), got {t.stride()}"
        )
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous(), (
        f"cos_sin_cache must be contiguous float32, got {cos_sin_cache.dtype}"
    )
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim, (
        f"cos_sin_cache must be [max_position, {head_dim}], got {tuple(cos_sin_cache.shape)}"
    )
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int64, torch.int32), (
        f"positions must be int64/int32 [{num_tokens}], got {positions.dtype} {tuple(positions.shape)}"
    )
    assert positions.is_contiguous(), "positions must be contiguous"
    assert pad_to == 0 or (pad_to >= num_tokens and kv_cache is not None), (
        f"pad_to must be 0 or at least num_tokens ({num_tokens}) with the cache written, got {pad_to}"
    )
    rows = pad_to or num_tokens
    q_out = torch.empty((rows, *query.shape[1:]), dtype=query.dtype, device=query.device)
    k_out = torch.empty((rows, *key.shape[1:]), dtype=key.dtype, device=key.device)
    v_out = torch.empty((rows, *key.shape[1:]), dtype=key.dtype, device=key.device) if pad_to else None
    if rows == 0:
        return q_out, k_out, v_out
    write_cache = kv_cache is not None
    if write_cache:
        assert value is not None and slot_mapping is not None, "writing the cache needs value and slot_mapping"
        assert value.shape == key.shape and value.dtype == key.dtype, (
            f"value must match key ({tuple(key.shape)}, {key.dtype}), got {tuple(value.shape)}, {value.dtype}"
        )
        assert value.stride(2) == 1 and value.stride(1) == head_dim, (
            f"value must have contiguous heads (stride(1) == head_dim, stride(2) == 1), got {value.stride()}"
        )
        assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and tuple(kv_cache.shape[3:]) == (
            num_kv_heads, head_dim
        ), f"kv_cache must be [2, blocks, block_size, {num_kv_heads}, {head_dim}], got {tuple(kv_cache.shape)}"
        assert kv_cache.dtype in (key.dtype, *_FP8_DTYPES) and kv_cache.is_contiguous(), (
            f"kv_cache: key's dtype or fp8, contiguous; got {kv_cache.dtype}")
        assert slot_mapping.shape == (num_tokens,) and slot_mapping.is_contiguous(), (
            f"slot_mapping must be contiguous [{num_tokens}], got {tuple(slot_mapping.shape)}"
        )
        assert slot_mapping.dtype in (torch.int64, torch.int32), f"slot_mapping dtype {slot_mapping.dtype}"
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        value_stride, slot_stride = value.stride(0), num_kv_heads * head_dim
    else:
        value = key_cache = value_cache = key  # never read or written: WRITE_CACHE is False
        slot_mapping = positions
        value_stride, slot_stride = 0, 0
    block_h = triton.next_power_of_2(max(num_heads, num_kv_heads))
    pdl = triton_pdl.enabled(query.device)
    _rotary_kernel[(rows, 2)](
        positions,
        query,
        key,
        cos_sin_cache,
        q_out,
        k_out,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        query.stride(0),
        key.stride(0),
        q_out.stride(0),
        k_out.stride(0),
        cos_sin_cache.stride(0),
        value_stride,
        slot_stride,
        num_heads,
        num_kv_heads,
        num_tokens,
        q_out if v_out is None else v_out,
        0 if v_out is None else v_out.stride(0),
        int(v_out is not None),
        float(k_scale),
        float(v_scale),
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        WRITE_CACHE=write_cache,
        FP8_MAX=torch.finfo(kv_cache.dtype).max if write_cache and kv_cache.dtype in _FP8_DTYPES else 0.0,
        PDL=pdl,
        num_warps=_num_warps(block_h * head_dim),
        enable_fp_fusion=False,  # each product is rounded before the sum, as the reference's are
        **triton_pdl.launch_options(pdl),
    )
    return q_out, k_out, v_out


# ------------------------------------------------------------------------------------- silu_and_mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, silu_mul(gate, up, dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] (gate then up; stride(1) == 1), float16/bfloat16/float32.

    Returns a new contiguous [num_tokens, d] tensor, silu(gate) * up, in x's dtype.
    """
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [num_tokens, 2 * d], got {tuple(x.shape)}"
    assert x.dtype in _FLOAT_DTYPES, f"x must be float16/bfloat16/float32, got {x.dtype}"
    assert x.stride(1) == 1, f"x's last dim must be contiguous, got strides {x.stride()}"
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or d == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    grid = (num_tokens, triton.cdiv(d, block))
    pdl = triton_pdl.enabled(x.device)
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), d, BLOCK=block, PDL=pdl, num_warps=4, **triton_pdl.launch_options(pdl)
    )
    return out
