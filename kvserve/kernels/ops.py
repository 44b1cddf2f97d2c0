"""The one place model code calls kernels through.

Every layer calls `ops.<kernel>(...)`; this module decides which implementation runs, per call, from the
tensors alone (no host sync, so the choice is CUDA-graph safe):

* CPU tensors, or no Triton installed: the torch reference (`kvserve.kernels.reference`).
* CUDA tensors: the Triton launcher of that kernel when the shapes fit its contract (power-of-two head_dim
  >= 16 and block_size for attention, power-of-two head_dim / 2 for rotary), else the reference.

The elementwise kernels (rms_norm, rotary_embedding, silu_and_mul) have a second knob,
`set_elementwise_backend`: "triton" (default), "torch" (the eager reference on the GPU) or "compile"
(`torch.compile` of the reference). The default was chosen by measurement on the H200 (see
docs/perf_notes.md): each Triton kernel is one launch and one pass over memory; the eager reference is
several launches and passes, and `torch.compile` matches Triton per call but adds compile time at start.

Signatures are exactly the reference's (see each function there for the contract: shapes, dtypes, layout).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from kvserve import envs
from kvserve.kernels import reference
from kvserve.layers.attention_metadata import AttentionMetadata

ELEMENTWISE_BACKENDS = ("triton", "torch", "compile")
_elementwise_backend = "triton"


def set_elementwise_backend(name: str) -> None:
    """Choose how rms_norm / rotary_embedding / silu_and_mul run on CUDA tensors (see module docstring)."""
    global _elementwise_backend
    if name not in ELEMENTWISE_BACKENDS:
        raise ValueError(f"elementwise backend must be one of {ELEMENTWISE_BACKENDS}, got {name!r}")
    _elementwise_backend = name


def get_elementwise_backend() -> str:
    return _elementwise_backend


@functools.cache
def _triton_module(name: str) -> ModuleType | None:
    """kvserve.kernels.<name>, or None when Triton is not importable (imported on first GPU use only)."""
    try:
        import importlib

        return importlib.import_module(f"kvserve.kernels.{name}")
    except ImportError:
        return None


@functools.cache
def _compiled(name: str) -> Callable[..., Any]:
    return torch.compile(getattr(reference, name), dynamic=True)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _elementwise_impl(name: str, x: torch.Tensor) -> Callable[..., Any]:
    if not x.is_cuda or _elementwise_backend == "torch":
        return getattr(reference, name)
    if _elementwise_backend == "compile":
        return _compiled(name)
    module = _triton_module("triton_elementwise")
    return getattr(module if module is not None else reference, name)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if key.is_cuda:
        module = _triton_module("triton_cache")
        head_dim = key.shape[2]
        # The Triton kernel needs each token's heads contiguous (true for views of a fused qkv output).
        if (
            module is not None
            and key.stride(2) == 1
            and key.stride(1) == head_dim
            and value.stride(2) == 1
            and value.stride(1) == head_dim
            and kv_cache.is_contiguous()
        ):
            module.reshape_and_cache(key, value, kv_cache, slot_mapping)
            return
    reference.reshape_and_cache(key, value, kv_cache, slot_mapping)


# Decode split-K: once there are at least as many (request, KV head) programs as SMs, do not split; below
# that, split for about this many programs per SM. Measured on the H200 (benchmarks/attention_sweep.py,
# Qwen2.5-7B shape, 28 layers in a graph): batch 64 x 1k context took 37.2 us per layer unsplit (128-key
# tiles) against 41-50 us with 2-3 splits; batch 160 82.6 unsplit against 95+ split; batch 1 was fastest
# with the most splits that still had a full tile each.
DECODE_PROGRAMS_PER_SM = 2
_MAX_DECODE_SPLITS = 64
_DECODE_TILE_N = 64  # keys per tile of the Triton decode kernel: a split with fewer keys is wasted


# Matmuls of at most this many rows run on the Triton skinny kernel on CUDA (kernels/triton_gemm.py), where
# it beat cuBLAS in the H200 sweep (docs/perf_notes.md, entry 14); larger ones stay with torch (cuBLAS).
SKINNY_GEMM_MAX_ROWS = 16
_skinny_gemm_enabled = True
# The rotary embedding writes the KV cache in the same launch (`rotary_embedding_and_cache`).
_rotary_cache_fusion = True


def set_rotary_cache_fusion(enabled: bool) -> None:
    """Use the fused launch (default) or always the separate kernels (for measuring what fusion gains)."""
    global _rotary_cache_fusion
    _rotary_cache_fusion = enabled


def set_skinny_gemm(enabled: bool) -> None:
    """Route small-row CUDA matmuls to the Triton skinny kernel (default) or always to torch."""
    global _skinny_gemm_enabled
    _skinny_gemm_enabled = enabled


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias), as torch.nn.functional.linear computes it."""
    global _skinny_gemm_enabled
    if _skinny_gemm_enabled and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= SKINNY_GEMM_MAX_ROWS:
        module = _triton_module("triton_gemm")
        if module is not None:
            config = module.pick_config(
                x.shape[0], weight.shape[0], weight.shape[1], _num_sms(x.device), _max_shared_bytes(x.device)
            )
            if config is not None and module.fits(x, weight, config, bias):
                try:
                    return module.skinny_linear(x, weight, bias, config)
                except module.OutOfResources as exc:  # a GPU whose shared memory the estimate got wrong
                    import logging

                    logging.getLogger(__name__).warning("skinny matmul unavailable on this GPU (%s); using torch", exc)
                    _skinny_gemm_enabled = False
    return torch.nn.functional.linear(x, weight, bias)


@functools.cache
def _max_shared_bytes(device: torch.device) -> int:
    """Shared memory one block may use on this GPU (the opt-in maximum; 99 KiB when torch does not say)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 99 * 1024))


def decode_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """KV splits of a decode-only batch: 1 when the (request, KV head) programs already cover the SMs,
    else enough splits for DECODE_PROGRAMS_PER_SM programs per SM, at most one per 64-key tile and 64. Host ints only, so a
    CUDA graph captured at (batch size, max_model_len) keeps its grid at every replay."""
    base = max(num_reqs * num_kv_heads, 1)
    if base >= num_sms:
        return 1
    wanted = -(-DECODE_PROGRAMS_PER_SM * num_sms // base)
    by_length = max(1, max_seq_len // _DECODE_TILE_N)
    return max(1, min(wanted, by_length, _MAX_DECODE_SPLITS))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if query.is_cuda:
        module = _triton_module("triton_attention")
        head_dim, block_size = query.shape[2], kv_cache.shape[2]
        if module is not None and head_dim >= 16 and _is_pow2(head_dim) and _is_pow2(block_size):
            num_splits = None
            if metadata.is_decode_only:
                num_splits = decode_num_splits(
                    metadata.num_reqs, kv_cache.shape[3], metadata.max_seq_len, _num_sms(query.device)
                )
            return module.launch_paged_attention(query, kv_cache, metadata, scale, out, num_splits)
    return reference.paged_attention(query, kv_cache, metadata, scale, out)


# Pure-prefill batches (no request has cached context) at least this long go to flash attention inside
# torch (`varlen_attn`, or SDPA for a single request): the Triton kernel reaches ~200 TFLOP/s on long
# causal prompts (benchmarks/gpu_kernels.py), flash attention about twice that.
PREFILL_FAST_MIN_QUERY_LEN = 64
_prefill_fast_enabled = True


def set_prefill_fast_path(enabled: bool) -> None:
    global _prefill_fast_enabled
    _prefill_fast_enabled = enabled


def _is_pure_prefill(metadata: AttentionMetadata) -> bool:
    cached = metadata.backend_cache.get("pure_prefill")
    if cached is None:
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        cached = metadata.max_query_len >= PREFILL_FAST_MIN_QUERY_LEN and all(
            seq_lens[i] == qsl[i + 1] - qsl[i] for i in range(len(seq_lens))
        )
        metadata.backend_cache["pure_prefill"] = cached
    return cached


@functools.cache
def _varlen_attn() -> tuple[Callable[..., Any], set[str]] | None:
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor | None:
    """Causal attention of a batch where every request is a fresh prompt (no cached context), over this
    step's own key/value; None when that does not apply (CPU, decode or cached context, short queries):
    the caller then uses `paged_attention` over the cache (which must already hold key/value).

    query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads, head_dim], same dtype
    (fp16/bf16). Returns [num_tokens, num_heads, head_dim].
    """
    global _prefill_fast_enabled
    if not (_prefill_fast_enabled and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)):
        return None
    if not _is_pure_prefill(metadata):
        return None
    try:
        return _flash_prefill(query, key, value, metadata, scale)
    except Exception:  # an API this torch lacks: fall back for good, the Triton kernel is correct too
        import logging

        logging.getLogger(__name__).exception("flash prefill attention failed; using the Triton kernel")
        _prefill_fast_enabled = False
        return None


# One prompt: SDPA with the KV heads shared across their query group (no repeat), flash first. cuDNN's kernel
# ran an 8k-token layer in 0.85 ms against flash's 1.54 on the H200 (benchmarks/prefill_attention_backends.py,
# docs/perf_notes.md entry 15), but torch builds a cuDNN graph for every new sequence length (hundreds of ms
# reported), which a server with prompts of every length would pay again and again; not measured here, so
# cuDNN is opt-in: prompts of at least SDPA_CUDNN_MIN_TOKENS tokens (0: never) try it first.
SDPA_CUDNN_MIN_TOKENS = envs.KVSERVE_SDPA_CUDNN_MIN_TOKENS


@functools.cache
def _cudnn_first() -> Callable[[], Any]:
    """A context-manager factory that makes SDPA try cuDNN first (torch's own order puts it last)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]
    try:
        sdpa_kernel(order, set_priority=True)
        return functools.partial(sdpa_kernel, order, set_priority=True)
    except TypeError:  # a torch without set_priority: its own order
        return functools.partial(sdpa_kernel, order)


def _sdpa_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one prompt: [T, H, D] in, [T, H, D] out."""
    q = query.transpose(0, 1).unsqueeze(0)
    k = key.transpose(0, 1).unsqueeze(0)
    v = value.transpose(0, 1).unsqueeze(0)
    cudnn_first = 0 < SDPA_CUDNN_MIN_TOKENS <= query.shape[0]
    with _cudnn_first()() if cudnn_first else contextlib.nullcontext():
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
        )
    return out.squeeze(0).transpose(0, 1)


def _flash_prefill(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    varlen = _varlen_attn()
    if metadata.num_reqs == 1 or varlen is None:
        if metadata.num_reqs != 1:
            raise RuntimeError("varlen_attn is not available for a multi-request prefill")
        return _sdpa_prefill(query, key, value, scale)
    fn, params = varlen
    kwargs: dict[str, Any] = {}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = group > 1
    elif group > 1:
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - query.shape[2] ** -0.5) > 1e-12:
        raise RuntimeError("this torch's varlen_attn has no scale argument")
    qsl = metadata.query_start_loc
    max_len = metadata.max_query_len
    out = fn(query, key.contiguous(), value.contiguous(), qsl, qsl, max_len, max_len, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return _elementwise_impl("rms_norm", x)(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _elementwise_impl("rotary_embedding", query)
    if impl is not reference.rotary_embedding and not _is_pow2(query.shape[2] // 2):
        impl = reference.rotary_embedding
    return impl(positions, query, key, cos_sin_cache)


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding`, then `reshape_and_cache` of the rotated key and the value: one Triton launch on
    CUDA where both kernels would be Triton (one graph node per layer fewer at decode), else the two ops."""
    impl = _elementwise_impl("rotary_embedding", query)
    module = _triton_module("triton_elementwise")
    head_dim = query.shape[2]
    if (
        _rotary_cache_fusion
        and module is not None
        and impl is module.rotary_embedding
        and _is_pow2(head_dim // 2)
        and value.stride(2) == 1
        and value.stride(1) == head_dim
        and kv_cache.is_contiguous()
    ):
        return impl(positions, query, key, cos_sin_cache, value, kv_cache, slot_mapping)
    query, key = rotary_embedding(positions, query, key, cos_sin_cache)
    reshape_and_cache(key, value, kv_cache, slot_mapping)
    return query, key


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _elementwise_impl("silu_and_mul", x)(x)


__all__ = [
    "DECODE_PROGRAMS_PER_SM",
    "ELEMENTWISE_BACKENDS",
    "SKINNY_GEMM_MAX_ROWS",
    "decode_num_splits",
    "prefill_attention",
    "set_prefill_fast_path",
    "get_elementwise_backend",
    "linear",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "set_elementwise_backend",
    "set_rotary_cache_fusion",
    "set_skinny_gemm",
    "silu_and_mul",
]
