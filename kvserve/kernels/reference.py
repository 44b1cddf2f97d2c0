"""Torch versions of every kernel: the CPU path and the oracle that GPU kernels are tested against.

Each function here has the same signature as its fast counterpart in this package; the docstring is the
contract both follow (shapes, dtypes, layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.layers.attention_metadata import AttentionMetadata
from kvserve.layers.quantization import PackedWeight

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a KV cache of this dtype holds fp8 values that kernels scale on write and read."""
    return dtype in FP8_DTYPES


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in float32, saturated to the fp8 format's finite range, then rounded (to nearest, ties to
    even) to `dtype`: what a cache write stores. Saturating first matters: torch casts values past the range
    to NaN (e4m3fn has no infinity) or infinity (e5m2)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write new K/V into the paged cache.

    key, value: [num_tokens, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_dim], key's dtype, or fp8 (float8_e4m3fn / float8_e5m2): then the cache stores
    `quantize_kv(key, k_scale)` and `quantize_kv(value, v_scale)` (the scales are ignored otherwise).
    slot_mapping: int64 [num_tokens], slot = block_id * block_size + offset. Slots < 0 are skipped (padding
    tokens).
    """
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, kv_cache.shape[3], kv_cache.shape[4])
    if is_fp8(kv_cache.dtype):
        # NOTE: torch's CPU index_copy_ has no fp8 kernel: the bytes are copied through a uint8 view.
        key = quantize_kv(key, k_scale, kv_cache.dtype).view(torch.uint8)
        value = quantize_kv(value, v_scale, kv_cache.dtype).view(torch.uint8)
        flat = flat.view(torch.uint8)
    valid = slot_mapping >= 0
    if bool(valid.all()):
        flat[0].index_copy_(0, slot_mapping, key)
        flat[1].index_copy_(0, slot_mapping, value)
    else:
        slots = slot_mapping[valid]
        flat[0].index_copy_(0, slots, key[valid])
        flat[1].index_copy_(0, slots, value[valid])


@dataclass
class _PaddedPlan:
    """Per-step index tensors shared by every layer's reference attention (built once per step)."""

    token_req: torch.Tensor  # [num_tokens] request of each flat token
    token_pos: torch.Tensor  # [num_tokens] index of each token within its request's query
    max_q: int
    max_s: int
    num_ctx_blocks: int
    mask: torch.Tensor  # float32 [num_reqs, 1, max_q, max_s]: 0 where allowed, -inf elsewhere


def _padded_plan(metadata: AttentionMetadata, block_size: int, device: torch.device) -> _PaddedPlan:
    cached = metadata.backend_cache.get("reference")
    if cached is not None:
        return cached
    num_reqs = metadata.num_reqs
    qsl = torch.tensor(metadata.query_start_loc_cpu, dtype=torch.int64)
    query_lens = qsl[1:] - qsl[:-1]
    seq_lens = torch.tensor(metadata.seq_lens_cpu, dtype=torch.int64)
    max_q = int(query_lens.max())
    max_s = int(seq_lens.max())
    token_req = torch.repeat_interleave(torch.arange(num_reqs), query_lens)
    token_pos = torch.arange(int(qsl[-1])) - qsl[:-1][token_req]
    # Query i of request r sits at absolute position seq_len - query_len + i and sees keys <= it.
    q_abs = (seq_lens - query_lens)[:, None] + torch.arange(max_q)[None, :]
    k_idx = torch.arange(max_s)
    allowed = (k_idx[None, None, :] <= q_abs[:, :, None]) & (k_idx[None, None, :] < seq_lens[:, None, None])
    mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed, float("-inf"))
    plan = _PaddedPlan(
        token_req=token_req.to(device),
        token_pos=token_pos.to(device),
        max_q=max_q,
        max_s=max_s,
        num_ctx_blocks=(max_s + block_size - 1) // block_size,
        mask=mask[:, None].to(device),
    )
    metadata.backend_cache["reference"] = plan
    return plan


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached context.

    query: [num_tokens, num_heads, head_dim]; kv_cache as in `reshape_and_cache` (already holding this
    step's K/V; an fp8 cache is read back as its values times k_scale / v_scale, in float32); num_heads must
    be a multiple of num_kv_heads (GQA: query head h reads KV head h // (num_heads // num_kv_heads)).
    Returns [num_tokens, num_heads, head_dim] in query's dtype, written into `out` when given.

    The batch is padded to [num_reqs, max_query_len] queries over [num_reqs, max_seq_len] keys gathered
    through the block tables, masked per request, and handed to torch's SDPA in float32 (HF Transformers'
    default attention on CPU too).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    num_reqs = metadata.num_reqs
    plan = _padded_plan(metadata, block_size, query.device)
    max_q, max_s = plan.max_q, plan.max_s

    # Each request's context, K and V in one gather: [2, num_reqs, max_s, num_kv_heads, head_dim].
    tables = metadata.block_tables[:num_reqs, : plan.num_ctx_blocks].long()
    span = plan.num_ctx_blocks * block_size
    kv = kv_cache[:, tables].reshape(2, num_reqs, span, num_kv_heads, head_dim)[:, :, :max_s]
    keys = kv[0].float().transpose(1, 2)  # [R, Hkv, S, D]
    values = kv[1].float().transpose(1, 2)
    if is_fp8(kv_cache.dtype):
        keys = keys * k_scale
        values = values * v_scale

    if max_q == 1:
        padded_q = query.view(num_reqs, 1, num_heads, head_dim)
    else:
        padded_q = query.new_zeros(num_reqs, max_q, num_heads, head_dim)
        padded_q[plan.token_req, plan.token_pos] = query
    # GQA: query head h reads KV head h // group (enable_gqa), without materialising repeated KV.
    attn = F.scaled_dot_product_attention(
        padded_q.float().transpose(1, 2), keys, values, attn_mask=plan.mask, scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [R, H, Q, D]; padded query rows (no allowed key) come out NaN and are dropped below
    attn = attn.transpose(1, 2)
    if max_q == 1:
        result = attn.reshape(num_tokens, num_heads, head_dim).to(query.dtype)
    else:
        result = attn[plan.token_req, plan.token_pos].to(query.dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, optionally after adding `residual`.

    Returns (normed, new_residual) where new_residual = x + residual (or x when residual is None), computed
    in x's dtype; the normalisation runs in float32 and is cast back before the weight multiply (as HF
    Transformers' Llama/Qwen RMSNorm does).
    """
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding (rotate halves), as HF Llama/Qwen apply it.

    positions: int64 [num_tokens]; query: [num_tokens, num_heads, head_dim]; key: [num_tokens,
    num_kv_heads, head_dim]; cos_sin_cache: float32 [max_position, head_dim] holding cos in the first
    head_dim/2 columns and sin in the last (per frequency). Returns rotated (query, key) in their dtype.
    """
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos = torch.cat([cos_sin[:, :half], cos_sin[:, :half]], dim=-1)[:, None, :].to(query.dtype)
    sin = torch.cat([cos_sin[:, half:], cos_sin[:, half:]], dim=-1)[:, None, :].to(query.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    return rotate(query), rotate(key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] holding gate then up; returns silu(gate) * up, [num_tokens, d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts router's choice: softmax over the experts in float32, the `top_k` largest, their
    weights renormalised to sum to 1 when `renormalize` (Mixtral always; Qwen3-MoE's `norm_topk_prob`).

    router_logits: ``[T, E]``; returns (weights float32 ``[T, top_k]``, expert ids int32 ``[T, top_k]``).
    Graph-safe (no host sync)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The experts of a mixture-of-experts MLP with SiLU gating, for every token's chosen experts.

    x ``[T, H]``; w13 ``[E, 2 * I, H]`` (each expert's gate rows, then its up rows); w2 ``[E, H, I]``;
    topk_weights ``[T, k]`` float32 or x's dtype; topk_ids int32 or int64 ``[T, k]`` in [0, E). Returns ``[T, H]``
    in x's dtype: ``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e x[t]) * up_e x[t])`` with
    ``e = topk_ids[t, j]``. Rounding as HF's sparse MoE blocks: each expert's matmuls and activation in x's
    dtype, its output times the weight as given (the product in float32, rounded once to x's dtype: Mixtral's
    router keeps its weights in float32, Qwen3-MoE's rounds them to x's dtype first, which its caller does),
    summed in x's dtype in expert order. (Host syncs: a CPU path and the GPU kernels' oracle, not a graph-safe
    one.)"""
    num_experts = w13.shape[0]
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    ids = topk_ids.to(torch.int64)
    weights = topk_weights.float()
    hit = torch.zeros(num_experts, dtype=torch.bool, device=x.device)
    hit[ids.reshape(-1)] = True
    for expert in hit.nonzero().reshape(-1).tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        rows = x.index_select(0, token)
        gate_up = F.linear(rows, w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = (F.linear(act, w2[expert]).float() * weights[token, slot].unsqueeze(1)).to(x.dtype)
        out.index_add_(0, token, y)
    return out


def quantized_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) for a quantized layer's packed weight (`layers.quantization.PackedWeight`):
    its dense weight, dequantized in float32 and rounded to x's dtype, times x as `F.linear` computes it."""
    return F.linear(x, weight.dense(x.dtype), bias)


# fp8 e4m3 (torch.float8_e4m3fn): the largest finite value. Online fp8 weights (`--quantization fp8`) scale each
# row of a matrix so that its largest magnitude maps onto it.
FP8_E4M3_MAX = 448.0


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (dynamic) fp8 quantization: x [M, K] (any float dtype) -> (x8 float8_e4m3fn [M, K] contiguous,
    scale float32 [M]) with scale[m] = max(|x[m, :]|) / FP8_E4M3_MAX in float32 (1.0 for a row of zeros, so
    it stays zeros and no division by zero happens) and x8 = x / scale[m] in float32, saturated to the
    format's range and rounded to nearest even; x8 * scale approximates x with e4m3's relative error (2^-4 at
    most for normal values).

    The same function quantizes a linear layer's weight [N, K] per output channel at load and activations per
    token in `fp8_linear`."""
    assert x.dim() == 2, f"x must be [M, K], got {tuple(x.shape)}"
    amax = x.abs().amax(dim=1).float() if x.shape[1] else x.new_zeros(x.shape[0], dtype=torch.float32)
    # NOTE: divided by a tensor, not the Python float: CUDA torch divides by a scalar as a multiply by its
    # rounded reciprocal, which differs from IEEE division (the Triton kernel's `div_rn`) in the last bit for
    # some values (an H100 run of the GPU test found scales one unit apart); tensor by tensor is IEEE on both.
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    # NOTE: a zero row (or one whose largest magnitude / 448 underflows to 0) gets scale 1: its values quantize
    # to zero (or to the subnormals they are) instead of 0 / 0 = NaN.
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    x8 = (x.float() / scale[:, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return x8.contiguous(), scale


def fp8_linear(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) for an fp8 weight: w8 float8_e4m3fn [N, K] (row-major) and w_scale float32
    [N], W ~ w8 * w_scale[:, None] (`quantize_rows_fp8` of the layer's weight). The activations are quantized
    per token the same way (a8, a_scale = quantize_rows_fp8(x's rows)); then

        out[m, n] = (sum_k a8[m, k] w8[n, k]) * a_scale[m] * w_scale[n]

    accumulated in float32, cast to x's dtype, and the bias (x's dtype) added after the cast, as the GPU path
    (`torch._scaled_mm`, then a separate add) rounds it. Returns [..., N] in x's dtype."""
    num_out, k = w8.shape
    rows = x.reshape(-1, k)
    a8, a_scale = quantize_rows_fp8(rows)
    acc = a8.float() @ w8.float().t()
    out = (acc * a_scale[:, None] * w_scale[None, :]).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], num_out)


def fp8_linear_weight_only(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) for an fp8 weight (`fp8_linear`'s w8 / w_scale) with x NOT quantized
    ("W8A16", what the Triton skinny matmul computes for small row counts):

        out[m, n] = (sum_k x[m, k] w8[n, k]) * w_scale[n] (+ bias[n])

    in float32 (x's values and the e4m3 values are exact there), the bias (x's dtype) added in float32, then
    rounded once to x's dtype, as the kernel's epilogue rounds. Returns [..., N] in x's dtype."""
    num_out, k = w8.shape
    rows = x.reshape(-1, k)
    out = (rows.float() @ w8.float().t()) * w_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], num_out)


def apply_penalties(
    logits: torch.Tensor,
    prompt_counts: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """Penalised copy of `logits` (float32 ``[R, V]``).

    `prompt_counts`/`output_counts`: float32 ``[R, V]`` token counts; the penalties: float32 ``[R]``.
    ``repetition_penalty`` r applies to tokens seen in prompt or output (logit > 0: ``/ r``, else ``* r``);
    then ``logit -= frequency * output_count + presence * [output_count > 0]``.
    """
    seen = (prompt_counts > 0) | (output_counts > 0)
    rep = repetition_penalties.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(seen, penalised, logits)
    out = out - frequency_penalties.unsqueeze(1) * output_counts
    out = out - presence_penalties.unsqueeze(1) * (output_counts > 0).to(out.dtype)
    return out


def penalise_rows_(
    logits: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor,
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> None:
    """Penalise rows of `logits` (float32 ``[R, V]``) in place: row ``rows[j]`` by the prompt marks
    ``seen[slots[j]]`` (bool ``[S, V]``), the output counts ``counts[slots[j]]`` (float32 ``[S, V]``) and the
    j-th penalties (float32), as `apply_penalties` computes them. `rows`/`slots`: int64 ``[N]``, rows
    distinct."""
    logits[rows] = apply_penalties(
        logits[rows],
        seen[slots].to(torch.float32),
        counts[slots],
        repetition_penalties,
        frequency_penalties,
        presence_penalties,
    )
