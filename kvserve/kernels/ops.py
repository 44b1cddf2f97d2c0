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

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from kvserve import envs
from kvserve.kernels import cublaslt, reference
from kvserve.layers.attention_metadata import AttentionMetadata
from kvserve.layers.quantization import PackedWeight

logger = logging.getLogger(__name__)

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
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
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
            module.reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)
            return
    reference.reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)


# Decode split-K: once there are at least as many (request, KV head) programs as SMs, do not split; below
# that, split for about this many programs per SM. Measured on the H200 (benchmarks/attention_sweep.py,
# Qwen2.5-7B shape, 28 layers in a graph; the second session, with the tilings of then): batch 64 x 1k
# context took 37.2 us per layer unsplit (128-key tiles) against 41-50 us with 2-3 splits; batch 160 82.6
# unsplit against 95+ split; batch 1 was fastest with the most splits that still had a full tile each.
DECODE_PROGRAMS_PER_SM = 2
_MAX_DECODE_SPLITS = 64
_DECODE_TILE_N = 64  # keys per tile of the Triton decode kernel: a split with fewer keys is wasted


# Matmuls of at most this many rows run on the Triton skinny kernel on CUDA (kernels/triton_gemm.py), where
# it beat cuBLAS on the H200 (docs/perf_notes.md, entries 14 and 27: a decode step at batch 24-32 is 0.16 ms
# faster with it; at 48-64 rows cuBLAS is faster); larger ones stay with torch (cuBLAS).
SKINNY_GEMM_MAX_ROWS = 32
_skinny_gemm_enabled = True
# An fp8 layer (--quantization fp8) of at most this many rows runs the skinny matmul with its fp8 weight
# converted in registers (weight-only fp8: x is not quantized); more rows quantize x per token and run
# torch._scaled_mm (`fp8_linear`). Read at each call (benchmarks/fp8_matmul_bench.py sets it to time the
# skinny path at more rows); the choice depends on the row count alone, so a CUDA graph and an eager step of
# the same (padded) rows take the same path.
FP8_SKINNY_MAX_ROWS = SKINNY_GEMM_MAX_ROWS
# Cleared when a tiling of the fp8 weights fails to launch (`_skinny`), leaving the bf16 skinny matmul on.
_fp8_skinny_enabled = True
# The rotary embedding writes the KV cache in the same launch (`rotary_embedding_and_cache`).
_rotary_cache_fusion = True


def fp8_numerics(rows: int) -> tuple[bool, bool]:
    """What an fp8 layer's matmul of `rows` rows computes, as far as the row count decides it: whether only the
    weight is fp8 (`fp8_linear`: up to FP8_SKINNY_MAX_ROWS rows), and whether the skinny matmul may run its
    dot in fp16 on scaled bf16 activations there (`triton_gemm.fp8_fp16_dot`: up to 16 rows a program). The
    two dots' sums are rounded differently: CUDA-graph padding keeps a batch's (`CUDAGraphRunner`)."""
    weight_only = rows <= FP8_SKINNY_MAX_ROWS
    module = _triton_module("triton_gemm") if weight_only else None
    # (as for bf16 activations: with fp16 ones the key only splits sizes that would agree anyway)
    return weight_only, module is not None and module.fp8_fp16_dot(torch.bfloat16, True, module.launch_block_m(rows))


def set_rotary_cache_fusion(enabled: bool) -> None:
    """Use the fused launch (default) or always the separate kernels (for measuring what fusion gains)."""
    global _rotary_cache_fusion
    _rotary_cache_fusion = enabled


def set_skinny_gemm(enabled: bool) -> None:
    """Route small-row CUDA matmuls to the Triton skinny kernel (default) or always to torch."""
    global _skinny_gemm_enabled
    _skinny_gemm_enabled = enabled


def _skinny(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool, rope: Any = None,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The Triton skinny matmul's result where it applies (CUDA, at most SKINNY_GEMM_MAX_ROWS rows, or
    FP8_SKINNY_MAX_ROWS for an fp8 weight with its `w_scale`; a tiling that fits, with the asked epilogue),
    else None."""
    global _skinny_gemm_enabled, _fp8_skinny_enabled
    fp8 = w_scale is not None
    max_rows = FP8_SKINNY_MAX_ROWS if fp8 else SKINNY_GEMM_MAX_ROWS
    if not (_skinny_gemm_enabled and (_fp8_skinny_enabled or not fp8) and x.is_cuda and x.dim() == 2
            and 0 < x.shape[0] <= max_rows):
        return None
    module = _triton_module("triton_gemm")
    if module is None:
        return None
    config = module.pick_config(
        x.shape[0], weight.shape[0], weight.shape[1], _num_sms(x.device), _max_shared_bytes(x.device),
        weight_bytes=weight.element_size(),
    )
    if rope is not None:
        rope = module.RopeCache(*rope)
    if config is None or not module.fits(x, weight, config, bias, silu_mul, rope, w_scale):
        return None
    try:
        return module.skinny_linear(x, weight, bias, config, silu_mul, rope, w_scale)
    except module.OutOfResources as exc:  # a GPU whose shared memory the estimate got wrong
        logger.warning("skinny matmul unavailable on this GPU for %s weights (%s); using torch",
                       weight.dtype, exc)
        if fp8:
            _fp8_skinny_enabled = False
        else:
            _skinny_gemm_enabled = False
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias), as torch.nn.functional.linear computes it. CUDA: the Triton
    skinny matmul for small row counts, the tuned cuBLASLt algorithm where start-up tuning registered one
    for these rows and shapes (`cublaslt.tune`), else torch."""
    out = _skinny(x, weight, bias, silu_mul=False)
    if out is not None:
        return out
    if x.is_cuda:
        plan = cublaslt.tuned_plan(x, weight, bias)
        if plan is not None:
            try:
                return plan.run(x, weight, bias, torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype,
                                                             device=x.device))
            except cublaslt.LtUnavailable:
                pass  # a failed call: torch's linear computes the same
    return torch.nn.functional.linear(x, weight, bias)


# A quantized layer at this many rows or more dequantizes its weight and runs the dense matmul (cuBLAS):
# past it the fused kernel's dequantization per row block costs more than one pass writing the weight
# (on the H200 at the 7B shapes the dense path wins every projection from 256 rows, and two of four at 128:
# docs/perf_notes.md entry 52).
QUANT_DENSE_MIN_ROWS = 129


def quantized_kernel_fits(weight: PackedWeight) -> bool:
    """Whether the GPU's quantized matmul can run this weight (Triton present, its groups fit a K tile)."""
    module = _triton_module("triton_quant")
    return module is not None and module.block_k_for(weight) is not None


def prepare_quantized(weight: PackedWeight, dtype: torch.dtype) -> PackedWeight:
    """A CUDA layer's packed weight in the layout its matmul reads: the paired-dequantizing kernel's for 4-bit
    weights in 128-row groups in a half-precision model (scales rounded to `dtype`), else as loaded."""
    module = _triton_module("triton_quant")
    capability = torch.cuda.get_device_capability(weight.qweight.device) if weight.qweight.is_cuda else None
    if module is not None and module.pairs_fit(weight, dtype, capability):
        return module.prepare_pairs(weight, dtype)
    return weight


def quantized_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) of a quantized layer (`reference.quantized_linear`). CUDA: below
    QUANT_DENSE_MIN_ROWS rows a Triton quantized matmul (the paired-dequantizing one for weights
    `prepare_quantized` laid out for it), the dense weight from the Triton dequantizer and torch's matmul from
    there; the reference where the weight's groups fit no kernel tile."""
    module = _triton_module("triton_quant") if x.is_cuda else None
    if module is not None:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] >= QUANT_DENSE_MIN_ROWS:
            dense = module.dequantize(weight, x.dtype)
            if dense is not None:
                if weight.perm is not None:
                    rows = rows.index_select(1, weight.perm)
                return torch.nn.functional.linear(rows, dense, bias).view(*x.shape[:-1], weight.output_size)
        if weight.zero_scale is not None:
            # x's columns in the weight's sorted order: the kernel reads them contiguously.
            rows = rows.index_select(1, weight.perm) if weight.perm is not None else rows.contiguous()
            config = module.pick_pairs_config(rows.shape[0], weight, _num_sms(x.device))
            return module.quant_matmul_pairs(rows, weight, bias, config).view(*x.shape[:-1], weight.output_size)
        config = module.pick_config(rows.shape[0], weight, _num_sms(x.device))
        if config is not None:
            out = module.quant_matmul(rows.contiguous(), weight, bias, config)
            return out.view(*x.shape[:-1], weight.output_size)
    return reference.quantized_linear(x, weight, bias)


# ------------------------------------------------------------------ online fp8 weights (--quantization fp8)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 quantization (`reference.quantize_rows_fp8`): one Triton launch on CUDA, the reference
    elsewhere."""
    module = _triton_module("triton_fp8") if x.is_cuda else None
    if module is not None and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.stride(1) == 1:
        return module.quantize_rows_fp8(x)
    return reference.quantize_rows_fp8(x)


def fp8_matmul_fits(w8: torch.Tensor) -> bool:
    """Whether `torch._scaled_mm` can multiply by this fp8 weight [N, K]: both dims multiples of 16 (its
    contract for the second operand and the shared dim). Layers whose shapes do not fit run
    `reference.fp8_linear` (checked and logged once at load, `layers.linear.quantize_fp8_layers`)."""
    return w8.dim() == 2 and w8.shape[0] % 16 == 0 and w8.shape[1] % 16 == 0


@functools.cache
def scaled_mm_out_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The output dtype `fp8_linear` asks `torch._scaled_mm` for, for a model of `dtype` on `device`: `dtype`
    itself where this torch and GPU take it with row-wise scales, else bfloat16 (then cast to `dtype`).

    NOTE: row-wise scaling runs cuBLAS on sm_90 with cuBLAS >= 12.9 (any of bf16 / fp16 / fp32 out), else
    torch's CUTLASS kernel, which takes bf16 and, in some torch versions, fp16 only. One tiny call per
    (device, dtype) finds out; the loader makes it at load (`layers.linear.quantize_fp8_layers`), outside
    any CUDA-graph capture. bfloat16 output then cast keeps 8 bits of mantissa: far below fp8's own rounding.
    RuntimeError, naming what was refused, when neither output dtype runs."""
    a8 = torch.zeros((16, 16), dtype=torch.float8_e4m3fn, device=device)
    ones_a = torch.ones((16, 1), dtype=torch.float32, device=device)
    ones_b = torch.ones((1, 16), dtype=torch.float32, device=device)
    refused: list[str] = []
    for out_dtype in dict.fromkeys((dtype, torch.bfloat16)):
        try:
            torch._scaled_mm(a8, a8.t(), scale_a=ones_a, scale_b=ones_b, out_dtype=out_dtype)
        except (RuntimeError, ValueError) as exc:
            refused.append(f"{out_dtype}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            continue
        if out_dtype != dtype:
            logger.info("torch._scaled_mm refused %s output with row-wise scales (%s): fp8 matmuls return bfloat16 "
                        "and are cast to %s", dtype, refused[0], dtype)
        return out_dtype
    # NOTE: a GPU that passes the compute-capability check can still lack row-wise scaled fp8 matmuls in this
    # torch / cuBLAS build: say so at load rather than at the first large batch (the memory profile's).
    raise RuntimeError(f"this torch and GPU cannot run fp8 matmuls with row-wise scales (torch._scaled_mm refused "
                       f"{'; '.join(refused)}): --quantization fp8 cannot run here")


def fp8_linear(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) of an fp8 layer (w8 float8_e4m3fn [N, K] row-major, w_scale float32 [N],
    bias in x's dtype). On CUDA two numerics, chosen by the row count alone:

    * at most FP8_SKINNY_MAX_ROWS rows (fp16 / bf16 x, a tiling that fits): weight-only fp8, the Triton skinny
      matmul reading the fp8 weight (`reference.fp8_linear_weight_only`: x unquantized, float32 sums scaled
      per output row, the bias added before the one rounding);
    * more rows (or where the skinny matmul does not apply), where `fp8_matmul_fits`: weights and activations
      in fp8 (`reference.fp8_linear`): the Triton per-token quantization of x, then `torch._scaled_mm` with
      row-wise scales (x's scale per row, the weight's per column of w8.t(), a column-major view), then the
      bias added in x's dtype.

    No host sync: CUDA-graph capturable. Elsewhere `reference.fp8_linear` (weights and activations)."""
    module = _triton_module("triton_fp8") if x.is_cuda else None
    if module is None or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return reference.fp8_linear(x, w8, w_scale, bias)
    num_out, k = w8.shape
    rows = x.reshape(-1, k)
    if rows.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], num_out))
    out = _skinny(rows, w8, bias, silu_mul=False, w_scale=w_scale)
    if out is not None:
        return out.view(*x.shape[:-1], num_out)
    if not fp8_matmul_fits(w8):
        return reference.fp8_linear(x, w8, w_scale, bias)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    a8, a_scale = module.quantize_rows_fp8(rows)
    out = torch._scaled_mm(a8, w8.t(), scale_a=a_scale.view(-1, 1), scale_b=w_scale.view(1, -1),
                           out_dtype=scaled_mm_out_dtype(x.device, x.dtype))
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    # NOTE: the bias is not given to _scaled_mm: its bias with row-wise scales is not checked on every torch
    # this runs on (2.11, 2.13); a separate add rounds as the reference does.
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], num_out)


# The gate/up projection of a small-row batch applies SiLU-and-mul in the matmul's epilogue (one launch, no
# [M, 2 d] intermediate; docs/perf_notes.md entry 19); larger batches run `linear` then `silu_and_mul`.
_silu_fusion = True


def set_gate_up_silu_fusion(enabled: bool) -> None:
    """Fuse SiLU-and-mul into the small-row gate/up matmul (default) or always run the two ops (A/B)."""
    global _silu_fusion
    _silu_fusion = enabled


def linear_rope_cache(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A fused q/k/v projection whose epilogue applies the rotary embedding and writes k / v into the cache:
    [num_tokens, (num_heads + 2 num_kv_heads) head_dim], q and k rotated, as `linear`, `rotary_embedding`
    and `reshape_and_cache` give (the `rotary_embedding_and_cache` contract). Small-row CUDA batches only
    (the skinny matmul, one launch instead of two); None elsewhere, and the caller runs the separate ops.
    k_scale / v_scale: an fp8 cache's (`reference.reshape_and_cache`). w_scale: the layer's fp8 weight scales
    (weight float8_e4m3fn): the matmul is then `fp8_linear`'s weight-only one, up to FP8_SKINNY_MAX_ROWS."""
    if not (_rotary_cache_fusion and _qkv_rope_fusion and _elementwise_backend == "triton"):
        return None
    return _skinny(x, weight, bias, silu_mul=False, rope=(positions, cos_sin_cache, kv_cache, slot_mapping,
                                                          num_heads, num_kv_heads, head_dim, k_scale, v_scale),
                   w_scale=w_scale)


_qkv_rope_fusion = True


def set_qkv_rope_fusion(enabled: bool) -> None:
    """Let small-row q/k/v projections rotate and write the cache in their epilogue (default), or not (A/B)."""
    global _qkv_rope_fusion
    _qkv_rope_fusion = enabled


# The gate/up matmul with SiLU-and-mul in its epilogue as a Triton TMA matmul (kernels/triton_gate_up.py,
# sm_90+), for two row ranges (docs/perf_notes.md entry 32):
# * decode-sized batches past the skinny matmul (SKINNY_GEMM_MAX_ROWS < rows <= TMA_GATE_UP_MAX_DECODE_ROWS),
#   on by default: at 64 rows of the Qwen2.5-7B shape it took 74 us against 78 for cuBLAS then silu_and_mul;
# * prefill-sized batches (PREFILL_GATE_UP_MIN_ROWS rows and more), opt-in: alone, at 8192 rows, it took
#   2.88-3.29 ms against 3.01-3.45 for the two ops, but replayed back to back for 1.5 s (the GPU at its power
#   cap) both took 3.53-3.56 ms, the fused kernel with 7 % more energy per call, and the engine's
#   prefill-bound measures did not move.
# Switches of their own: unlike the skinny matmul's epilogue these do not give the unfused ops' bits (cuBLAS
# sums in another order).
TMA_GATE_UP_MAX_DECODE_ROWS = 64
PREFILL_GATE_UP_MIN_ROWS = 1024
_decode_tma_gate_up = True
_prefill_silu_fusion = False


def set_decode_gate_up_tma(enabled: bool) -> None:
    """Run gate/up projections of SKINNY_GEMM_MAX_ROWS + 1 to TMA_GATE_UP_MAX_DECODE_ROWS rows as the fused
    Triton TMA matmul (default, sm_90+), or as cuBLAS then `silu_and_mul` (A/B)."""
    global _decode_tma_gate_up
    _decode_tma_gate_up = enabled


def set_prefill_gate_up_fusion(enabled: bool) -> None:
    """Run prefill-sized gate/up projections as the fused Triton TMA matmul (opt-in, sm_90+), or as cuBLAS
    then `silu_and_mul` (default)."""
    global _prefill_silu_fusion
    _prefill_silu_fusion = enabled


def gate_up_tma_config(num_rows: int, capability: tuple[int, int]) -> Any:  # GateUpConfig | None
    """The tiling of the fused TMA gate/up matmul for num_rows rows on a GPU of this compute capability, or
    None where another path runs (the skinny matmul's rows, rows between the two ranges, no TMA before sm_90,
    the range switched off)."""
    module = _triton_module("triton_gate_up")
    if module is None or capability[0] < 9:
        return None
    if _decode_tma_gate_up and SKINNY_GEMM_MAX_ROWS < num_rows <= TMA_GATE_UP_MAX_DECODE_ROWS:
        return module.DECODE_CONFIG
    if _prefill_silu_fusion and num_rows >= PREFILL_GATE_UP_MIN_ROWS:
        return module.PREFILL_CONFIG
    return None


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _tma_gate_up(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    global _decode_tma_gate_up, _prefill_silu_fusion
    if not (x.is_cuda and x.dim() == 2):
        return None
    config = gate_up_tma_config(x.shape[0], _capability(x.device))
    module = _triton_module("triton_gate_up")
    if config is None or module is None or not module.fits(x, weight, bias, config):
        return None
    try:
        return module.gate_up_silu(x, weight, config)
    except module.OutOfResources as exc:  # a GPU with less shared memory than the tiling needs
        logger.warning("fused TMA gate/up matmul unavailable at %d rows on this GPU (%s); using torch",
                       x.shape[0], exc)
        if config == module.DECODE_CONFIG:  # switch off only the range whose tiling failed
            _decode_tma_gate_up = False
        else:
            _prefill_silu_fusion = False
        return None


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu_and_mul(linear(x, weight, bias)) for a [gate; up] weight of 2 d rows: [num_tokens, d]. On CUDA
    with the Triton elementwise backend: one fused launch for small-row batches (`_skinny`) and the row ranges
    of `gate_up_tma_config` (`_tma_gate_up`). w_scale: an fp8 layer's (weight float8_e4m3fn): then
    silu_and_mul(fp8_linear(x, weight, w_scale, bias)), fused up to FP8_SKINNY_MAX_ROWS rows (weight-only fp8)."""
    out = None
    if _elementwise_backend == "triton":
        if _silu_fusion:
            out = _skinny(x, weight, bias, silu_mul=True, w_scale=w_scale)
        if out is None and w_scale is None:
            out = _tma_gate_up(x, weight, bias)
    if out is not None:
        return out
    return silu_and_mul(linear(x, weight, bias) if w_scale is None else fp8_linear(x, weight, w_scale, bias))


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


def decode_attention_launch(num_reqs: int, kv_cache: torch.Tensor, max_seq_len: int) -> tuple[int, bool]:
    """(KV split count, busy one-split tiling) a decode-only batch of num_reqs requests launches
    `paged_attention` with on this cache's device ((1, False) off CUDA, where the reference runs): what a CUDA
    graph captured at (num_reqs, max_seq_len) fixes of the attention launch."""
    if not kv_cache.is_cuda:
        return 1, False
    num_kv_heads, num_sms = kv_cache.shape[3], _num_sms(kv_cache.device)
    splits = decode_num_splits(num_reqs, num_kv_heads, max_seq_len, num_sms)
    module = _triton_module("triton_attention")
    busy = splits == 1 and module is not None and module.decode_launch_is_busy(num_reqs, num_kv_heads, num_sms)
    return splits, busy


def decode_launch_shapes(max_num_reqs: int, max_seq_len: int, num_kv_heads: int, num_sms: int) -> list[tuple[int, int]]:
    """One (num_reqs, seq_len) per distinct decode attention launch (kernel variants and merge, without a
    shared prefix) that decode-only batches of 1 to max_num_reqs requests with contexts of up to max_seq_len
    can take, for a warm-up to compile them all: eager decode batches, and the rows a step samples
    (`AttentionMetadata.sampled`). [] where the Triton kernel is not available."""
    module = _triton_module("triton_attention")
    if module is None:
        return []
    # The split count depends on the context only below _MAX_DECODE_SPLITS tiles.
    lengths = sorted({min(max_seq_len, _DECODE_TILE_N * t) for t in range(1, _MAX_DECODE_SPLITS + 1)} | {max_seq_len})
    shapes: dict[tuple[object, ...], tuple[int, int]] = {}
    for num_reqs in range(1, max_num_reqs + 1):
        for seq_len in lengths:
            splits = decode_num_splits(num_reqs, num_kv_heads, seq_len, num_sms)
            shapes.setdefault(module.decode_launch_variant(num_reqs, num_kv_heads, splits, num_sms), (num_reqs, seq_len))
    return sorted(shapes.values())


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The CUDA device's multiprocessor count (what the kernels' launch rules read)."""
    return _num_sms(device)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
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
            return module.launch_paged_attention(query, kv_cache, metadata, scale, out, num_splits, k_scale, v_scale)
    return reference.paged_attention(query, kv_cache, metadata, scale, out, k_scale, v_scale)


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
def _varlen_attn() -> Callable[..., Any] | None:
    """torch's flash attention over concatenated variable-length sequences (`aten._flash_attention_forward`,
    GQA without repeated KV heads), or None where this torch lacks it. Called directly:
    `torch.nn.attention.varlen.varlen_attn` wraps the same op, but importing that module imports torch._dynamo,
    which took 4.2-4.5 s of every start on the H200's image (docs/perf_notes.md, entry 29)."""
    return getattr(torch.ops.aten, "_flash_attention_forward", None)


def prefill_fast_path_applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `prefill_attention` serves fresh prompts of this dtype on this device (the one-request prefill
    graphs of fresh prompts rely on it)."""
    return _prefill_fast_enabled and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


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
    (fp16/bf16); or all three padded to `prefill_attention_padding(...)` rows, zeros past num_tokens.
    Returns [num_tokens, num_heads, head_dim].
    """
    global _prefill_fast_enabled
    if not (_prefill_fast_enabled and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)):
        return None
    if not _is_pure_prefill(metadata):
        return None
    try:
        return _flash_prefill(query, key, value, metadata, scale)
    except Exception:  # an API this torch lacks: fall back for good, the Triton kernel is correct too
        if torch.cuda.is_current_stream_capturing():
            raise  # a prefill graph's capture: it fails and start-up goes on without those graphs
        import logging

        logging.getLogger(__name__).exception("flash prefill attention failed; using the Triton kernel")
        _prefill_fast_enabled = False
        return None


# One prompt: SDPA with the KV heads shared across their query group (no repeat), on a kernel kvserve names
# (torch 2.11's own order runs cuDNN on the H200; docs/perf_notes.md entry 18):
# * flash, below the cuDNN threshold;
# * cuDNN for prompts of cudnn_min_tokens(device) to SDPA_CUDNN_MAX_TOKENS tokens: faster per layer on the H200
#   (0.85 against 1.54 ms at 8k tokens, entry 15), but it builds an execution graph for every new sequence
#   length and layout (about 55-65 ms each there). So such a prompt's q/k/v are copied, contiguous, and
#   padded to a multiple of SDPA_CUDNN_BUCKET tokens (exact under the causal mask: the padding rows and keys
#   come after every real one), and `warm_up_prefill_attention` builds every bucket at start.
# The threshold is KVSERVE_SDPA_CUDNN_MIN_TOKENS when set (0: never); by default 1024 on sm_90 and later,
# where it was measured, and 0 elsewhere. Prompts captured in a prefill CUDA graph use flash. A torch whose
# sdpa_kernel cannot set a priority never uses cuDNN.
SDPA_CUDNN_MIN_TOKENS = envs.KVSERVE_SDPA_CUDNN_MIN_TOKENS  # < 0: the default just described
SDPA_CUDNN_BUCKET = 256
SDPA_CUDNN_MAX_TOKENS = 16384  # longer prompts use flash: bounds the graphs built at start (61 at most)
_CUDNN_DEFAULT_MIN_TOKENS = 1024


@functools.cache
def _sdpa_has_priority() -> bool:
    import inspect

    from torch.nn.attention import sdpa_kernel

    return "set_priority" in inspect.signature(sdpa_kernel).parameters


def cudnn_min_tokens(device: torch.device) -> int:
    """The shortest one-prompt prefill that asks for cuDNN attention on `device` (0: none does). Set
    explicitly, it applies on any device (the CPU then runs its own kernels, which tests use)."""
    if not _sdpa_has_priority():
        return 0
    if SDPA_CUDNN_MIN_TOKENS >= 0:
        return SDPA_CUDNN_MIN_TOKENS
    if device.type != "cuda" or torch.version.hip is not None:
        return 0
    return _CUDNN_DEFAULT_MIN_TOKENS if torch.cuda.get_device_capability(device)[0] >= 9 else 0


@functools.cache
def _sdpa_order(cudnn: bool) -> Callable[[], Any]:
    """A context-manager factory restricting SDPA to cuDNN alone (cudnn) or to flash, then the fallbacks.

    Only the backends' enabled flags change, and sdpa_kernel restores them on exit. It never sets a
    priority: on torch 2.11 with an sm_90 GPU, a `set_priority=True` block left the process's SDPA order
    at flash first where torch's own default has cuDNN first, so every later SDPA call in the process (the
    user's own, HF's in the same process) ran another backend than it would have without kvserve."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if cudnn:
        return functools.partial(sdpa_kernel, [SDPBackend.CUDNN_ATTENTION])
    return functools.partial(sdpa_kernel, [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


# (dtype, heads, KV heads, head dim, device type) for which cuDNN attention refused a prompt: flash from then on.
_cudnn_refused: set[tuple[Any, ...]] = set()


def _pad_tokens(t: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """A contiguous copy of t [T, ...] with zero rows up to num_tokens (>= T); t itself when it is already
    contiguous and num_tokens long (a bucket-length prompt, or inputs `prefill_attention_padding` padded)."""
    if t.shape[0] == num_tokens and t.is_contiguous():
        return t
    out = t.new_empty((num_tokens, *t.shape[1:]))
    out[: t.shape[0]].copy_(t)
    out[t.shape[0] :].zero_()
    return out


def _use_cudnn(num_tokens: int, device: torch.device) -> bool:
    min_tokens = cudnn_min_tokens(device)
    if not (0 < min_tokens <= num_tokens and _cudnn_padded(num_tokens) <= SDPA_CUDNN_MAX_TOKENS):
        return False
    # Not inside a CUDA-graph capture (the one-prompt prefill graphs): flash is captured there. cuDNN's
    # per-length graphs were measured eagerly only.
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _cudnn_padded(num_tokens: int) -> int:
    bucket = max(SDPA_CUDNN_BUCKET, 1)
    return -(-num_tokens // bucket) * bucket


# A one-prompt prefill on cuDNN reads q, k and v contiguous and padded to its bucket length: the rotary
# launch writes them there (`rotary_embedding_and_cache_padded`) instead of `_pad_tokens` copying them (at
# 8,192 tokens 2.4 ms of copies per prompt on the H200, docs/perf_notes.md entry 33).
_prefill_qkv_padding = True


def set_prefill_qkv_padding(enabled: bool) -> None:
    """Let the rotary launch write a one-prompt cuDNN prefill's q/k/v padded (default), or copy them after
    it (for measuring what the padded launch saves)."""
    global _prefill_qkv_padding
    _prefill_qkv_padding = enabled


def prefill_attention_padding(metadata: AttentionMetadata, query: torch.Tensor, key: torch.Tensor) -> int:
    """The rows `prefill_attention` wants this batch's q/k/v padded to (zeros past num_tokens), or 0 where
    it takes them as they are: a one-prompt fresh prefill that runs cuDNN attention pads to its bucket."""
    if not (_prefill_qkv_padding and prefill_fast_path_applies(query.dtype, query.device)):
        return 0
    cached = metadata.backend_cache.get("qkv_padding")  # the same for every layer of the step
    if cached is None:
        cached = 0
        if metadata.num_reqs == 1 and _is_pure_prefill(metadata):
            num_tokens = metadata.num_tokens
            refusal_key = (query.dtype, query.shape[1], key.shape[1], query.shape[2], query.device.type)
            if _use_cudnn(num_tokens, query.device) and refusal_key not in _cudnn_refused:
                cached = _cudnn_padded(num_tokens)
        metadata.backend_cache["qkv_padding"] = cached
    return cached


def _sdpa_prefill(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, num_tokens: int | None = None
) -> torch.Tensor:
    """Causal attention of one prompt of num_tokens tokens: [T, H, D] in, [num_tokens, H, D] out. Inputs
    longer than num_tokens (T > num_tokens, default T) are padded: their rows past num_tokens are zeros
    (causal, they are seen by no real row)."""
    num_tokens = query.shape[0] if num_tokens is None else num_tokens
    assert query.shape[0] >= num_tokens and key.shape[0] == value.shape[0] == query.shape[0], (
        f"query / key / value rows ({query.shape[0]}, {key.shape[0]}, {value.shape[0]}) for {num_tokens} tokens"
    )
    cudnn = _use_cudnn(num_tokens, query.device)
    if cudnn:  # the layout and length the start-up warm-up built the graph for
        padded = _cudnn_padded(num_tokens)
        query, key, value = (_pad_tokens(t, padded) for t in (query, key, value))
    q = query.transpose(0, 1).unsqueeze(0)
    k = key.transpose(0, 1).unsqueeze(0)
    v = value.transpose(0, 1).unsqueeze(0)
    gqa = query.shape[1] != key.shape[1]
    refusal_key = (query.dtype, query.shape[1], key.shape[1], query.shape[2], query.device.type)
    if cudnn and refusal_key not in _cudnn_refused:
        try:
            with _sdpa_order(True)():  # a refusal warns once per head layout: it is remembered below
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            return out.squeeze(0).transpose(0, 1)[:num_tokens]
        except RuntimeError as err:  # no cuDNN kernel for this shape or build: flash, and remember
            logger.info("cuDNN attention refused a %d-token prompt (%s); flash from now on for %s",
                        num_tokens, str(err).splitlines()[0], refusal_key)
            _cudnn_refused.add(refusal_key)
    with _sdpa_order(False)():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)[:num_tokens]


def cudnn_prefill_lengths(max_tokens: int, device: torch.device) -> list[int]:
    """The padded lengths a one-prompt prefill of at most `max_tokens` tokens runs cuDNN attention at on
    `device` (none where cuDNN is not used)."""
    min_tokens = cudnn_min_tokens(device)
    if min_tokens <= 0 or max_tokens < min_tokens:
        return []
    bucket = max(SDPA_CUDNN_BUCKET, 1)
    first = _cudnn_padded(min_tokens)
    last = min(_cudnn_padded(max_tokens), SDPA_CUDNN_MAX_TOKENS // bucket * bucket)
    return list(range(first, last + 1, bucket))


def warm_up_prefill_attention(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, max_tokens: int
) -> list[int]:
    """Build cuDNN's attention graph for every padded length of `cudnn_prefill_lengths`, with the layout
    `_sdpa_prefill` gives it, so that no request pays for one (CUDA, fp16/bf16, fast path on). Returns the
    lengths run."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or not _prefill_fast_enabled:
        return []
    lengths = cudnn_prefill_lengths(max_tokens, device)
    for n in lengths:
        query = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device)
        key = torch.zeros(n, num_kv_heads, head_dim, dtype=dtype, device=device)
        _sdpa_prefill(query, key, key, head_dim**-0.5)
    return lengths


def _flash_prefill(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    if metadata.num_reqs == 1:
        return _sdpa_prefill(query, key, value, scale, metadata.num_tokens)
    assert query.shape[0] == metadata.num_tokens, "only a one-prompt prefill takes padded inputs"
    varlen = _varlen_attn()
    if varlen is None:
        raise RuntimeError("this torch has no variable-length flash attention for a multi-request prefill")
    qsl = metadata.query_start_loc
    max_len = metadata.max_query_len
    # (query, key, value, cu_seqlens_q, cu_seqlens_k, max_q, max_k, dropout_p, is_causal, return_debug_mask)
    out = varlen(query, key.contiguous(), value.contiguous(), qsl, qsl, max_len, max_len, 0.0, True, False,
                 scale=scale)
    return out[0]


_penalty_kernel = True


def set_penalty_kernel(enabled: bool) -> None:
    """Penalise sampled rows on CUDA with the Triton kernel (default) or the torch reference (A/B)."""
    global _penalty_kernel
    _penalty_kernel = enabled


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
    """The sampler's penalties, in place (see `reference.penalise_rows_`): one Triton pass on CUDA tensors
    (unless `set_penalty_kernel(False)`)."""
    module = _triton_module("triton_penalties") if logits.is_cuda and _penalty_kernel else None
    impl = module.penalise_rows_ if module is not None else reference.penalise_rows_
    impl(logits, rows, slots, seen, counts, repetition_penalties, frequency_penalties, presence_penalties)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts router's choice (see `reference.select_experts`); torch ops on every device."""
    return reference.select_experts(router_logits, top_k, renormalize)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """A mixture-of-experts MLP's experts (see `reference.fused_moe` for the contract): the Triton kernels on
    CUDA tensors (graph-safe), the reference on CPU."""
    module = _triton_module("triton_moe") if x.is_cuda else None
    impl = module.fused_moe if module is not None else reference.fused_moe
    return impl(x, w13, w2, topk_weights, topk_ids)


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


def _fused_rotary_module(query: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor) -> Any | None:
    """triton_elementwise where its rotary launch also writes the cache for these tensors, else None."""
    module = _triton_module("triton_elementwise")
    head_dim = query.shape[2]
    if (
        _rotary_cache_fusion
        and module is not None
        and _elementwise_impl("rotary_embedding", query) is module.rotary_embedding
        and _is_pow2(head_dim // 2)
        and value.stride(2) == 1
        and value.stride(1) == head_dim
        and kv_cache.is_contiguous()
    ):
        return module
    return None


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding`, then `reshape_and_cache` of the rotated key and the value (k_scale / v_scale: an
    fp8 cache's, see `reference.reshape_and_cache`): one Triton launch on CUDA where both kernels would be
    Triton (one graph node per layer fewer at decode), else the two ops."""
    module = _fused_rotary_module(query, value, kv_cache)
    if module is not None:
        return module.rotary_embedding(positions, query, key, cos_sin_cache, value, kv_cache, slot_mapping, k_scale,
                                       v_scale)
    query, key = rotary_embedding(positions, query, key, cos_sin_cache)
    reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    return query, key


def rotary_embedding_and_cache_padded(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    pad_to: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rotary_embedding_and_cache`, returning (query, key, value) contiguous and padded with zero rows to
    pad_to (>= num_tokens) rows: the rotated query and key and value itself, in the layout
    `prefill_attention_padding` asked for. One Triton launch where the fused one applies, else the ops and
    copies."""
    module = _fused_rotary_module(query, value, kv_cache)
    if module is not None:
        return module.rotary_embedding_padded(
            positions, query, key, cos_sin_cache, value, kv_cache, slot_mapping, pad_to, k_scale, v_scale
        )
    query, key = rotary_embedding_and_cache(positions, query, key, value, cos_sin_cache, kv_cache, slot_mapping,
                                            k_scale, v_scale)
    return _pad_tokens(query, pad_to), _pad_tokens(key, pad_to), _pad_tokens(value, pad_to)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _elementwise_impl("silu_and_mul", x)(x)


__all__ = [
    "DECODE_PROGRAMS_PER_SM",
    "ELEMENTWISE_BACKENDS",
    "FP8_SKINNY_MAX_ROWS",
    "SKINNY_GEMM_MAX_ROWS",
    "decode_num_splits",
    "prefill_attention",
    "prefill_fast_path_applies",
    "cudnn_min_tokens",
    "cudnn_prefill_lengths",
    "warm_up_prefill_attention",
    "set_prefill_fast_path",
    "get_elementwise_backend",
    "fp8_linear",
    "fused_moe",
    "fp8_numerics",
    "fp8_matmul_fits",
    "linear",
    "linear_rope_cache",
    "linear_silu_mul",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "select_experts",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "rotary_embedding_and_cache_padded",
    "prefill_attention_padding",
    "set_prefill_qkv_padding",
    "set_elementwise_backend",
    "set_gate_up_silu_fusion",
    "set_prefill_gate_up_fusion",
    "set_decode_gate_up_tma",
    "gate_up_tma_config",
    "PREFILL_GATE_UP_MIN_ROWS",
    "TMA_GATE_UP_MAX_DECODE_ROWS",
    "set_qkv_rope_fusion",
    "set_rotary_cache_fusion",
    "set_skinny_gemm",
    "set_penalty_kernel",
    "penalise_rows_",
    "quantize_rows_fp8",
    "scaled_mm_out_dtype",
    "silu_and_mul",
]
