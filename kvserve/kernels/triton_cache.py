"""Triton kernel writing this step's K/V into the paged KV cache (GPU twin of `reference.reshape_and_cache`).

Grid: one program per new token; it copies all `num_kv_heads * head_dim` K and V elements of that token
(two contiguous rows of 2 x 512 bf16 for Qwen2.5-7B) to the token's slot, or does nothing when the slot is
negative (padding tokens, e.g. CUDA-graph batch padding). The copy is memory-bound and each row is
contiguous on both sides, so one program per token keeps every access coalesced with no reuse to exploit.

An fp8 cache (float8_e4m3fn / float8_e5m2) stores x / k_scale (v_scale for values), computed in fp32,
saturated to the format's finite range and rounded to nearest even: `reference.quantize_kv`, bit for bit.
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels import triton_pdl
from kvserve.kernels.triton_elementwise import quantize_fp8
from kvserve.kernels.triton_pdl import pdl_wait_then_release

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_value_token,
    stride_cache_slot,
    k_scale,
    v_scale,
    ROW_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait_then_release(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK)
    mask = cols < ROW_SIZE
    k = tl.load(key_ptr + token * stride_key_token + cols, mask=mask)
    v = tl.load(value_ptr + token * stride_value_token + cols, mask=mask)
    if FP8_MAX > 0:  # an fp8 cache
        k = quantize_fp8(k, k_scale, FP8_MAX, key_cache_ptr.dtype.element_ty)
        v = quantize_fp8(v, v_scale, FP8_MAX, value_cache_ptr.dtype.element_ty)
    # NOTE: slot * stride can exceed 2**31 for caches of tens of GB; both are int64 here.
    tl.store(key_cache_ptr + slot * stride_cache_slot + cols, k, mask=mask)
    tl.store(value_cache_ptr + slot * stride_cache_slot + cols, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write new K/V into the paged cache (same contract as `reference.reshape_and_cache`).

    key, value: [num_tokens, num_kv_heads, head_dim], each token's heads contiguous (stride(2) == 1,
    stride(1) == head_dim; the token stride is free, so views into a fused QKV output work).
    kv_cache: contiguous [2, num_blocks, block_size, num_kv_heads, head_dim], same dtype as key/value, or fp8
    (then K / k_scale and V / v_scale are stored, saturated; compute capability 8.9+ on a GPU).
    slot_mapping: int64 (or int32) [num_tokens], contiguous; slot = block_id * block_size + offset; slots
    < 0 are skipped. Launch-only (no host sync), so it is CUDA-graph capturable for a fixed num_tokens.
    """
    assert key.dim() == 3 and value.shape == key.shape, (
        f"key/value must both be [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)} and "
        f"{tuple(value.shape)}"
    )
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, (
        f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
    )
    num_tokens, num_kv_heads, head_dim = key.shape
    assert tuple(kv_cache.shape[3:]) == (num_kv_heads, head_dim), (
        f"kv_cache heads/head_dim {tuple(kv_cache.shape[3:])} do not match key {(num_kv_heads, head_dim)}"
    )
    fp8 = kv_cache.dtype in _FP8_DTYPES
    assert key.dtype == value.dtype and key.dtype in _FLOAT_DTYPES and (fp8 or kv_cache.dtype == key.dtype), (
        f"key and value must share one float dtype, kv_cache theirs or fp8, got {key.dtype}, {value.dtype}, "
        f"{kv_cache.dtype}"
    )
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    for name, t in (("key", key), ("value", value)):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, (
            f"{name} must have contiguous heads (stride(1) == head_dim, stride(2) == 1), got {t.stride()}"
        )
    assert slot_mapping.dtype in (torch.int64, torch.int32) and slot_mapping.is_contiguous(), (
        f"slot_mapping must be a contiguous int64/int32 tensor, got {slot_mapping.dtype}"
    )
    assert slot_mapping.shape == (num_tokens,), (
        f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}"
    )
    assert key.device == value.device == kv_cache.device == slot_mapping.device, "all tensors on one device"
    if num_tokens == 0:
        return
    row_size = num_kv_heads * head_dim
    block = triton.next_power_of_2(row_size)
    pdl = triton_pdl.enabled(key.device)
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        key.stride(0),
        value.stride(0),
        row_size,
        float(k_scale),
        float(v_scale),
        ROW_SIZE=row_size,
        BLOCK=block,
        FP8_MAX=torch.finfo(kv_cache.dtype).max if fp8 else 0.0,
        PDL=pdl,
        num_warps=4 if block <= 1024 else 8,
        **triton_pdl.launch_options(pdl),
    )
