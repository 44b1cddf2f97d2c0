"""`--quantization fp8` (online fp8 weights) on a GPU (skipped without CUDA, or below compute capability 8.9).

* Kernels at Qwen2.5-7B's shapes (q/k/v 3584 -> 4608 with bias, o 3584 -> 3584, gate/up 3584 -> 37888, down
  18944 -> 3584), 1 to 4,096 rows, bf16 and fp16: the Triton per-row quantization stores the reference's bytes
  and scales for arbitrary values; `ops.fp8_linear` past FP8_SKINNY_MAX_ROWS rows (that quantization, then
  `torch._scaled_mm` with row-wise scales, then the bias; at any row count with the threshold set to 0)
  matches `reference.fp8_linear` (the same fp8 products summed in another order: a rounding of the output's
  dtype apart); at up to FP8_SKINNY_MAX_ROWS rows (and 64 / 256 with the threshold raised) the skinny matmul
  reading the fp8 weight matches `reference.fp8_linear_weight_only`, with `_scaled_mm` forbidden, and so do
  its SiLU-and-mul and rotary + KV-cache epilogues (`ops.linear_silu_mul`, `ops.linear_rope_cache`, bitwise
  the plain matmul then the elementwise kernels); the allocator's free blocks are NaN-poisoned first and the
  reference forbidden inside ops (so the GPU path really ran); a shape `_scaled_mm` cannot take runs the
  reference past the skinny rows; the calls are captured in a CUDA graph and replay with new inputs.
* The engine (tiny random models): CUDA graphs against eager, float32, the same greedy tokens; fp8 weights
  against the unquantized model in bfloat16, top-5 logprobs within the CPU test's tolerance
  (tests/engine/test_fp8_weights.py: 8x e4m3's relative error); no Triton variant compiled after start; the
  weights' freed memory reaching the KV cache under --gpu-memory-utilization.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch
from helpers.engine_runs import greedy_with_logprobs, top_logprobs

from kvserve.config import EngineArgs
from kvserve.engine.engine_core import EngineCore
from kvserve.kernels import ops, reference
from kvserve.layers.linear import Linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FP8 = torch.float8_e4m3fn
# Qwen2.5-7B's projections: (input size K, output size N, bias)
SHAPES = {"qkv": (3584, 4608, True), "o": (3584, 3584, False), "gate_up": (3584, 37888, False),
          "down": (18944, 3584, False)}
ROWS = [1, 7, 64, 300, 4096]
VOCAB = 1024
MAX_TOKENS = 24
LOGPROB_TOL = 8 * 2.0**-4  # tests/engine/test_fp8_weights.py's rule


@pytest.fixture(autouse=True, scope="module")
def _needs_fp8_gpu() -> None:
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("--quantization fp8 needs compute capability 8.9 or later")


def _poison_free_memory(num_bytes: int = 1 << 30) -> None:
    """Fill a block of the caching allocator with NaN and free it: the next allocations (the kernels' outputs)
    reuse NaN memory, so an element a kernel leaves unwritten shows."""
    torch.full((num_bytes // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()


def _forbid_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("ops ran the torch reference where the GPU path applies")

    monkeypatch.setattr(reference, "fp8_linear", refuse)
    monkeypatch.setattr(reference, "quantize_rows_fp8", refuse)


# ------------------------------------------------------------------------------------------------ kernels


@pytest.mark.parametrize("num_cols", [3584, 18944, 40000])  # 40000: past one tile (the tiled loop)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_quantize_rows_stores_the_references_bytes(num_cols: int, rows: int, dtype: torch.dtype,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, num_cols, device="cuda", generator=gen) * torch.logspace(
        -4, 2, rows, device="cuda")[:, None]).to(dtype)
    x[rows // 2] = 0.0
    want8, want_scale = reference.quantize_rows_fp8(x)
    _poison_free_memory()
    _forbid_reference(monkeypatch)
    x8, scale = ops.quantize_rows_fp8(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(x8.view(torch.uint8), want8.view(torch.uint8))


def _layer_tensors(shape: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    k, n, has_bias = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(k + n)
    weight = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(dtype)
    w8, w_scale = ops.quantize_rows_fp8(weight)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype) if has_bias else None
    return w8, w_scale, bias


def _forbid_scaled_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The skinny path must run: the activation quantization and `_scaled_mm` (and the references) refuse."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("ops ran the quantize + _scaled_mm path where the skinny fp8 matmul applies")

    _forbid_reference(monkeypatch)
    monkeypatch.setattr(reference, "fp8_linear_weight_only", refuse)
    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    monkeypatch.setattr(ops, "quantize_rows_fp8", refuse)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp8_linear_matches_the_reference(shape: str, rows: int, dtype: torch.dtype,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights-and-activations path (`_scaled_mm`) at every row count: FP8_SKINNY_MAX_ROWS set to 0."""
    w8, w_scale, bias = _layer_tensors(shape, dtype)
    x = torch.randn(rows, w8.shape[1], device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows))
    x = x.to(dtype)
    want = reference.fp8_linear(x, w8, w_scale, bias)
    _poison_free_memory()
    with monkeypatch.context() as patch:
        _forbid_reference(patch)
        patch.setattr(ops, "FP8_SKINNY_MAX_ROWS", 0)
        got = ops.fp8_linear(x, w8, w_scale, bias)
    assert got.shape == want.shape and got.dtype == dtype
    assert not got.isnan().any()
    # The same fp8 products, summed in another order and rounded to dtype by _scaled_mm's kernels: up to four
    # units of the output dtype's last place, relative to the row's size. (With row-wise scales, cuBLAS's
    # kernels at 64 rows and more differed from the reference by up to 0.0093 of the row's largest value in
    # bfloat16 on an H100: 2.4 units; 1 and 7 rows stayed within 2.)
    scale = want.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-6)
    assert ((got.float() - want.float()).abs() / scale).max().item() <= 2**-6


def _assert_weight_only_close(got: torch.Tensor, want: torch.Tensor, ulps: float = 1.0) -> None:
    """The skinny matmul against `reference.fp8_linear_weight_only`: the same float32 products summed in
    another order, each rounded once to the output dtype: `ulps` units in the last place of the element, plus
    2^-12 of the row's largest magnitude for elements the sums' order moves across a rounding boundary near 0."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any()
    ulp = 2.0**-7 if want.dtype == torch.bfloat16 else 2.0**-10
    row_max = want.float().abs().amax(dim=-1, keepdim=True)
    bound = ulps * ulp * want.float().abs() + 2.0**-12 * row_max
    excess = (got.float() - want.float()).abs() - bound
    assert excess.max().item() <= 0, excess.max().item()


SKINNY_ROWS = [1, 7, 16, 32]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", SKINNY_ROWS + [64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_skinny_fp8_linear_matches_the_weight_only_reference(shape: str, rows: int, dtype: torch.dtype,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """At up to FP8_SKINNY_MAX_ROWS rows `ops.fp8_linear` is weight-only fp8 (the skinny matmul); 64 and 256
    rows with the threshold raised to 256 (benchmarks/fp8_matmul_bench.py times them so)."""
    w8, w_scale, bias = _layer_tensors(shape, dtype)
    x = torch.randn(rows, w8.shape[1], device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows))
    x = x.to(dtype)
    want = reference.fp8_linear_weight_only(x, w8, w_scale, bias)
    _poison_free_memory()
    with monkeypatch.context() as patch:
        _forbid_scaled_mm(patch)
        if rows > ops.FP8_SKINNY_MAX_ROWS:
            patch.setattr(ops, "FP8_SKINNY_MAX_ROWS", 256)
        got = ops.fp8_linear(x, w8, w_scale, bias)
    _assert_weight_only_close(got, want)


@pytest.mark.parametrize("rows", SKINNY_ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_skinny_fp8_silu_mul_epilogue(rows: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ops.linear_silu_mul` of an fp8 gate/up layer: bitwise silu_and_mul of the plain skinny fp8 matmul,
    and so close to silu_and_mul of the weight-only reference (gate and up a unit apart at most each: three
    units of the product)."""
    w8, w_scale, _ = _layer_tensors("gate_up", dtype)
    x = torch.randn(rows, w8.shape[1], device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows))
    x = x.to(dtype)
    want = reference.silu_and_mul(reference.fp8_linear_weight_only(x, w8, w_scale))
    _poison_free_memory()
    with monkeypatch.context() as patch:
        _forbid_scaled_mm(patch)
        fused = ops.linear_silu_mul(x, w8, None, w_scale=w_scale)
        plain = ops.fp8_linear(x, w8, w_scale)
    assert fused.shape == (rows, w8.shape[0] // 2) and fused.dtype == dtype
    assert torch.equal(fused, ops.silu_and_mul(plain))
    _assert_weight_only_close(fused, want, ulps=3)


@pytest.mark.parametrize("rows", SKINNY_ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cache_dtype", ["model", "fp8"])
def test_skinny_fp8_rope_cache_epilogue(rows: int, dtype: torch.dtype, cache_dtype: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`ops.linear_rope_cache` of an fp8 q/k/v layer (Qwen2.5-7B: 28 + 2 x 4 heads of 128, bias): bitwise the
    plain skinny fp8 matmul then `ops.rotary_embedding_and_cache` (the rotated q, k, v and the cache bytes,
    an fp8 cache scaled), padding slots untouched."""
    from kvserve.layers.rotary import RotaryEmbedding

    heads, kv_heads, head_dim, block_size = 28, 4, 128, 16
    w8, w_scale, bias = _layer_tensors("qkv", dtype)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, w8.shape[1], device="cuda", generator=gen).to(dtype)
    positions = torch.randint(0, 4000, (rows,), device="cuda", generator=gen)
    slots = torch.randperm(64 * block_size, device="cuda", generator=gen)[:rows]
    if rows > 1:
        slots[0] = -1  # padding: not written
    cos_sin = RotaryEmbedding(head_dim, 4096, 1e6).cos_sin_cache.to("cuda")
    cache_shape = (2, 64, block_size, kv_heads, head_dim)
    if cache_dtype == "fp8":
        k_scale, v_scale = 0.25, 0.5
        fused_cache = torch.full(cache_shape, 0x7F, dtype=torch.uint8, device="cuda").view(FP8)  # NaN in e4m3fn
    else:
        k_scale, v_scale = 1.0, 1.0
        fused_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device="cuda")
    expected_cache = fused_cache.clone()
    _poison_free_memory()
    with monkeypatch.context() as patch:
        _forbid_scaled_mm(patch)
        fused = ops.linear_rope_cache(x, w8, bias, positions, cos_sin, fused_cache, slots, heads, kv_heads, head_dim,
                                      k_scale=k_scale, v_scale=v_scale, w_scale=w_scale)
        plain = ops.fp8_linear(x, w8, w_scale, bias)
    assert fused is not None
    q, k, v = plain.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.reshape(rows, heads, head_dim), k.reshape(rows, kv_heads, head_dim), v.reshape(rows, kv_heads, head_dim)
    q_rot, k_rot = ops.rotary_embedding_and_cache(positions, q, k, v, cos_sin, expected_cache, slots, k_scale, v_scale)
    assert torch.equal(fused, torch.cat([q_rot.reshape(rows, -1), k_rot.reshape(rows, -1), v.reshape(rows, -1)], -1))
    assert torch.equal(fused_cache.view(torch.uint8), expected_cache.view(torch.uint8))


def test_shapes_scaled_mm_cannot_take_run_the_reference() -> None:
    """Past the skinny rows (which take neither shape either: N is not a multiple of a weight tile)."""
    weight = torch.randn(40, 72, device="cuda", dtype=torch.bfloat16)  # 40 and 72 are not multiples of 16
    w8, w_scale = ops.quantize_rows_fp8(weight)
    assert not ops.fp8_matmul_fits(w8)
    x = torch.randn(5, 72, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(ops.fp8_linear(x, w8, w_scale), reference.fp8_linear(x, w8, w_scale))


@pytest.mark.parametrize("rows", [8, 64])  # the skinny path and the _scaled_mm one (bf16 / fp16)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fp8_linear_is_captured_in_a_cuda_graph(rows: int, dtype: torch.dtype) -> None:
    """No host sync: the call captures, and a replay with new inputs gives the eager result."""
    w8, w_scale, bias = _layer_tensors("qkv", dtype)
    static_x = torch.randn(rows, w8.shape[1], device="cuda", dtype=dtype)
    ops.fp8_linear(static_x, w8, w_scale, bias)  # warm-up: Triton compile and the output-dtype probe outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ops.fp8_linear(static_x, w8, w_scale, bias)
    new_x = torch.randn_like(static_x)
    static_x.copy_(new_x)
    graph.replay()
    assert torch.equal(static_out, ops.fp8_linear(new_x, w8, w_scale, bias))


# ------------------------------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from helpers.tiny_models import make_bare_checkpoint

    models = {"llama": ("llama", {}), "qwen2-hd128": ("qwen2", {"hidden_size": 512, "num_attention_heads": 4,
                                                                 "num_key_value_heads": 1}),
              "qwen3": ("qwen3", {"head_dim": 64})}
    return {name: make_bare_checkpoint(str(tmp_path_factory.mktemp(name)), model_type, seed=i, vocab_size=VOCAB,
                                       **overrides)
            for i, (name, (model_type, overrides)) in enumerate(models.items())}


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist()
            for n in torch.randint(5, 400, (12,), generator=generator).tolist()]


def _run(path: str, dtype: str, quantization: str | None, enforce_eager: bool = False,
         **kwargs: Any) -> tuple[EngineCore, list]:
    settings: dict[str, Any] = {"max_model_len": 1024, "num_kv_blocks": 1024, "max_num_seqs": 16,
                                "max_num_batched_tokens": 512, **kwargs}
    args = EngineArgs(model=path, dtype=dtype, device="cuda", enforce_eager=enforce_eager, quantization=quantization,
                      **settings)
    core = EngineCore(args.create_engine_config())
    return core, greedy_with_logprobs(core, _prompts(), MAX_TOKENS)


@pytest.mark.parametrize("model", ["llama", "qwen2-hd128", "qwen3"])
def test_graphs_give_eagers_tokens(checkpoints: dict[str, str], model: str) -> None:
    """float32 (as tests/gpu/test_gpu_engine.py's graph tests): the decode and piecewise graphs replay the same
    per-row quantization and matmuls as eager steps."""
    core, graphs = _run(checkpoints[model], "float32", "fp8")
    layer = core.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight is None and layer.self_attn.qkv_proj.weight_fp8 is not None
    assert core.runner.graphs is not None
    assert core.startup_late_variants == [] and core.late_kernel_variants == []
    del core
    _, eager = _run(checkpoints[model], "float32", "fp8", enforce_eager=True)
    assert [t for t, _ in graphs] == [t for t, _ in eager]


@pytest.mark.parametrize("model", ["llama", "qwen2-hd128", "qwen3"])
def test_bf16_fp8_weights_agree_with_the_unquantized_model(checkpoints: dict[str, str], model: str) -> None:
    base_core, base = _run(checkpoints[model], "bfloat16", None)
    del base_core
    core, got = _run(checkpoints[model], "bfloat16", "fp8")
    assert all(m.weight_fp8 is not None for m in core.runner.model.modules() if isinstance(m, Linear))
    assert core.late_kernel_variants == []
    largest, compared, top1_listed = 0.0, 0, 0
    for (got_tokens, got_lps), (want_tokens, want_lps) in zip(got, base, strict=True):
        part = next((i for i, (a, b) in enumerate(zip(got_tokens, want_tokens, strict=True)) if a != b), None)
        for step in range(MAX_TOKENS if part is None else part + 1):
            mine, theirs = top_logprobs(got_lps[step]), top_logprobs(want_lps[step])
            compared += 1
            top1_listed += max(theirs, key=theirs.__getitem__) in mine
            common = mine.keys() & theirs.keys()
            assert len(common) >= 3, (step, mine, theirs)
            for token in common:
                largest = max(largest, abs(mine[token] - theirs[token]))
                assert abs(mine[token] - theirs[token]) <= LOGPROB_TOL, (step, token, mine, theirs)
        if part is not None:
            want_top = top_logprobs(want_lps[part])
            a, b = got_tokens[part], want_tokens[part]
            assert a in want_top and abs(want_top[a] - want_top[b]) <= LOGPROB_TOL, (part, a, b, want_top)
    print(f"{model}: {compared} positions compared, largest logprob gap {largest:.3f}, unquantized top-1 in fp8's "
          f"top-5 at {top1_listed}")
    assert top1_listed >= 0.95 * compared
    assert largest > 0.0


_KV_BYTES_SCRIPT = """
import sys
from kvserve.config import EngineArgs
from kvserve.engine.engine_core import EngineCore
from kvserve.layers.linear import Linear
quantization = None if sys.argv[2] == "None" else sys.argv[2]
args = EngineArgs(model=sys.argv[1], dtype="bfloat16", device="cuda", load_format="dummy", quantization=quantization,
                  max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512, gpu_memory_utilization=0.5,
                  enforce_eager=True)
core = EngineCore(args.create_engine_config())
# the unquantized projections' bytes (an fp8 engine's weights are in weight_fp8: 0 there)
linear = sum(m.weight.numel() * m.weight.element_size() for m in core.runner.model.modules()
             if isinstance(m, Linear) and m.weight is not None)
print(core.capacity.num_blocks * core.runner.kv_cache_bytes_per_block(), linear)
core.shutdown()
"""


def test_freed_weights_reach_the_kv_cache(checkpoints: dict[str, str], tmp_path: Any) -> None:
    """A model with ~1 GB of bf16 projection weights (dummy weights: only config.json is read): with fp8 weights
    the --gpu-memory-utilization budget gives the KV cache about the half it saves."""
    directory = str(tmp_path / "big")
    os.makedirs(directory)
    shutil.copy(os.path.join(checkpoints["llama"], "config.json"), directory)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4)
    with open(path, "w") as f:
        json.dump(config, f)
    # Each engine in a process of its own, as a server runs it: what earlier tests left in this process (their
    # kernels, cuBLAS's workspaces, pools) moved the two budgets by different amounts (a deterministic 79 % of
    # the ideal gain after the file's other engine tests, 132 % alone).
    kv_bytes = {}
    for quantization in (None, "fp8"):
        result = subprocess.run([sys.executable, "-c", _KV_BYTES_SCRIPT, directory, str(quantization)],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        kv_bytes[quantization], linear = (int(v) for v in result.stdout.split()[-2:])
        if quantization is None:
            linear_bytes = linear
    gained = kv_bytes["fp8"] - kv_bytes[None]
    print(f"bf16 projections {linear_bytes / 2**20:.0f} MiB; KV cache {kv_bytes[None] / 2**20:.0f} -> "
          f"{kv_bytes['fp8'] / 2**20:.0f} MiB")
    assert gained >= 0.4 * linear_bytes  # half the bytes saved, less the scales and the allocator's rounding


@pytest.mark.parametrize("model", ["llama", "qwen2-hd128"])
def test_an_fp8_checkpoint_gives_what_quantizing_at_load_gives(checkpoints: dict[str, str], model: str,
                                                                tmp_path: Any) -> None:
    """An fp8 checkpoint (compressed-tensors, per output channel, quantized on the CPU by the function online fp8
    uses) against `--quantization fp8` on the dense checkpoint, float32 with CUDA graphs: the same fp8 values and
    scales (the GPU's per-row quantization stores the reference's bytes: test_quantize_rows_stores_the_references_
    bytes), so the same greedy tokens and logprobs. Then the same checkpoint in bfloat16 with graphs runs."""
    from helpers.fp8_checkpoints import compressed_tensors, write_fp8_checkpoint

    path = write_fp8_checkpoint(checkpoints[model], str(tmp_path / "fp8"), compressed_tensors("channel"),
                                per_tensor=False)
    core, got = _run(path, "float32", None)
    assert core.config.model_config.quantization is None and core.runner.graphs is not None
    assert all(m.weight is None and m.weight_fp8 is not None
               for m in core.runner.model.modules() if isinstance(m, Linear))
    del core
    _, want = _run(checkpoints[model], "float32", "fp8")
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, got_lps), (_, want_lps) in zip(got, want, strict=True):
        assert [(lp.token_ids, lp.logprobs) for lp in got_lps] == [(lp.token_ids, lp.logprobs) for lp in want_lps]
    core, bf16 = _run(path, "bfloat16", None)
    assert core.late_kernel_variants == []
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in bf16)


@pytest.mark.parametrize("model", ["llama", "qwen2-hd128"])
def test_a_block_wise_fp8_checkpoint_gives_what_quantizing_its_dense_weights_gives(checkpoints: dict[str, str],
                                                                                    model: str, tmp_path: Any) -> None:
    """A block-wise fp8 checkpoint (blocks of 24 x 40, partial at every edge) is dequantized and requantized per
    row at load by the GPU's per-row quantization: the same greedy tokens and logprobs as `--quantization fp8` on
    the dense checkpoint of its dequantized weights, float32 with CUDA graphs; then bfloat16 with graphs runs."""
    from helpers.fp8_checkpoints import write_block_fp8_checkpoint, write_dequantized_checkpoint

    block = write_block_fp8_checkpoint(checkpoints[model], str(tmp_path / "b"), (24, 40))
    dense = write_dequantized_checkpoint(block, str(tmp_path / "d"), (24, 40))
    core, got = _run(block, "float32", None)
    assert core.runner.graphs is not None
    assert all(m.weight is None and m.weight_fp8 is not None
               for m in core.runner.model.modules() if isinstance(m, Linear))
    del core
    _, want = _run(dense, "float32", "fp8")
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, got_lps), (_, want_lps) in zip(got, want, strict=True):
        assert [(lp.token_ids, lp.logprobs) for lp in got_lps] == [(lp.token_ids, lp.logprobs) for lp in want_lps]
    core, bf16 = _run(block, "bfloat16", None)
    assert core.late_kernel_variants == []
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in bf16)
