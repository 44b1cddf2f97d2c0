"""Online fp8 weights' arithmetic (`--quantization fp8`): `reference.quantize_rows_fp8` and `reference.fp8_linear`
against hand computations and the unquantized matmul, and the Triton per-row quantization
(`kernels/triton_fp8.py`) against the reference, compiled on a GPU or under Triton's interpreter on the CPU, and
compiled ahead of time for sm_89 and sm_90 (plain and PDL launches) on the CPU.

The interpreter's fp32 -> fp8 rounding is not a GPU's (it drops the carry of a round-up into the exponent), so
there the kernel gets rows whose values are fp8 grid values times a power of two, with one value of magnitude
448 in each: the scale is then that power of two exactly and every cast is exact, and the bytes must equal the
reference's. On a GPU it also gets arbitrary values (tests/gpu/test_gpu_fp8_weights.py compares their bytes).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import ops, reference, triton_fp8  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # set by conftest.py without a GPU
DEVICE = "cpu" if INTERPRET else "cuda"
FP8 = torch.float8_e4m3fn


def _grid_rows(num_rows: int, num_cols: int, dtype: torch.dtype, seed: int, zero_rows: tuple[int, ...] = ()
               ) -> torch.Tensor:
    """Rows of e4m3 values (subnormals included) times 2^e (e in [-6, 3], per row), each with one value of
    magnitude 448 (so max|row| / 448 = 2^e exactly); rows in zero_rows all zeros."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (num_rows, num_cols), generator=gen, dtype=torch.int32).to(torch.uint8)
    values = codes.view(FP8).float()
    values = torch.where(values.isnan(), torch.zeros_like(values), values)  # 0x7f / 0xff are NaN in e4m3fn
    for r in range(num_rows):
        col = int(torch.randint(0, num_cols, (1,), generator=gen))
        values[r, col] = 448.0 if r % 2 else -448.0
    exponents = torch.randint(-6, 4, (num_rows, 1), generator=gen).float()
    rows = values * torch.exp2(exponents)
    for r in zero_rows:
        rows[r] = 0.0
    return rows.to(dtype)


# ------------------------------------------------------------------------------------------- reference


def test_quantize_rows_by_hand() -> None:
    x = torch.tensor([[896.0, -1.0, 0.3, -896.0], [0.0, 0.0, 0.0, 0.0], [1e-3, -2e-3, 0.0, 5e-4]])
    x8, scale = reference.quantize_rows_fp8(x)
    assert x8.dtype == FP8 and scale.dtype == torch.float32 and x8.shape == x.shape and scale.shape == (3,)
    # Row 0: max 896 -> scale 2; values / 2 rounded to e4m3 (0.5 exactly; 0.15 -> 0.15625, the nearest of
    # e4m3's 0.140625 and 0.15625); the largest maps onto +-448.
    assert scale[0].item() == 2.0
    assert x8[0].float().tolist() == [448.0, -0.5, 0.15625, -448.0]
    # A zero row: scale 1 (not 0: no 0 / 0), values zero.
    assert scale[1].item() == 1.0 and x8[1].float().abs().sum().item() == 0.0
    # Row 2: scale 2e-3 / 448 in float32; the largest magnitude maps onto -448 again.
    assert scale[2].item() == pytest.approx(2e-3 / 448, rel=1e-7)
    assert x8[2, 1].item() == -448.0
    torch.testing.assert_close((x8.float() * scale[:, None])[2], x[2], rtol=2.0**-4, atol=0.0)


def test_quantize_rows_saturates_and_keeps_relative_error() -> None:
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)[:, None]
    x8, scale = reference.quantize_rows_fp8(x)
    assert x8.float().abs().amax().item() == 448.0
    assert not x8.float().isnan().any()
    back = x8.float() * scale[:, None]
    # Normal e4m3 values round with a relative error of at most 2^-4; values below 2^-6 (subnormal) with an
    # absolute error of at most 2^-10, both in units of the row's scale.
    bound = torch.maximum(x.abs() * 2.0**-4, 2.0**-10 * scale[:, None].expand_as(x))
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()


def test_fp8_linear_by_hand() -> None:
    x = torch.tensor([[448.0, 0.0, -224.0, 112.0], [0.0, 0.0, 0.0, 0.0]])
    w = torch.tensor([[0.5, 1.0, 2.0, 4.0], [-8.0, 0.0, 0.5, 0.25]])
    w8, w_scale = reference.quantize_rows_fp8(w)
    # Exact on the grid: x's scale 1, w's scales 4 / 448 and 8 / 448 (rows 112 w and 56 w: 56, 112, 224, 448
    # and -448, 0, 28, 14 are e4m3 values).
    assert w_scale.tolist() == pytest.approx([4 / 448, 8 / 448])
    bias = torch.tensor([0.5, -1.0])
    out = reference.fp8_linear(x, w8, w_scale, bias)
    torch.testing.assert_close(out, x @ w.T + bias, rtol=1e-6, atol=1e-6)
    assert out[1].tolist() == bias.tolist()  # a zero row gives the bias alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_linear_is_the_matmul_within_fp8s_error(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 80, generator=gen).to(dtype)  # leading dims kept
    w = (torch.randn(48, 80, generator=gen) / 80**0.5).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    w8, w_scale = reference.quantize_rows_fp8(w)
    out = reference.fp8_linear(x, w8, w_scale, bias)
    assert out.shape == (2, 5, 48) and out.dtype == dtype
    exact = x.float() @ w.float().T
    # Each product's two factors carry up to 2^-4 relative error each: the sum's error is at most ~2^-3 of the
    # sum of |products| (plus the output's rounding to dtype and the subnormals' tiny absolute error).
    bound = 2.0**-3 * (x.float().abs() @ w.float().abs().T) + 1e-3 * exact.abs() + 1e-3
    assert ((out.float() - bias.float() - exact).abs() <= bound).all()
    # ... and in practice errors cancel: a few percent of the output's size overall.
    rel = (out.float() - bias.float() - exact).norm() / exact.norm()
    assert rel < 0.06, rel


def test_fp8_linear_weight_only_by_hand() -> None:
    """x unquantized (0.3 is no e4m3 value), the weight's fp8 values times its row scales, the bias added in
    float32 and the sum rounded once to x's dtype."""
    x = torch.tensor([[0.3, -1.0, 2.0], [0.0, 0.0, 0.0]], dtype=torch.float16)
    w8 = torch.tensor([[448.0, 1.0, -0.5], [2.0, 0.0, 3.0]]).to(FP8)
    w_scale = torch.tensor([0.5, 4.0])
    bias = torch.tensor([1.0, -2.0], dtype=torch.float16)
    out = reference.fp8_linear_weight_only(x, w8, w_scale, bias)
    assert out.dtype == torch.float16 and out.shape == (2, 2)
    x32 = x.float()
    want = torch.stack([(x32 @ torch.tensor([448.0, 1.0, -0.5])) * 0.5 + 1.0,
                        (x32 @ torch.tensor([2.0, 0.0, 3.0])) * 4.0 - 2.0], dim=1)
    assert torch.equal(out, want.half())
    assert out[1].tolist() == bias.tolist()
    # against the weights-and-activations reference: the same within x's fp8 rounding (2^-4 relative)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, 64, generator=gen)
    w8, w_scale = reference.quantize_rows_fp8(torch.randn(32, 64, generator=gen))
    weight_only = reference.fp8_linear_weight_only(x, w8, w_scale)
    assert weight_only.shape == (3, 4, 32)
    torch.testing.assert_close(weight_only, x @ (w8.float() * w_scale[:, None]).T, rtol=1e-5, atol=1e-5)
    rel = (reference.fp8_linear(x, w8, w_scale) - weight_only).norm() / weight_only.norm()
    assert 0 < rel < 0.06, rel


def test_ops_run_the_reference_off_cuda() -> None:
    x = torch.randn(3, 32)
    w8, w_scale = ops.quantize_rows_fp8(torch.randn(16, 32))
    assert torch.equal(ops.fp8_linear(x, w8, w_scale), reference.fp8_linear(x, w8, w_scale))
    assert ops.fp8_matmul_fits(w8) and not ops.fp8_matmul_fits(torch.empty(16, 40, dtype=FP8))


# ------------------------------------------------------------------------------------- Triton kernel


def _run_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_fp8.quantize_rows_fp8(x.to(DEVICE))


SHAPES = [(1, 16), (7, 100), (5, 33), (3, 1), (4, 640)]
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_bytes_equal_the_reference_on_grid_values(shape: tuple[int, int], dtype: torch.dtype) -> None:
    num_rows, num_cols = shape
    x = _grid_rows(num_rows, num_cols, dtype, seed=num_rows * 1000 + num_cols,
                   zero_rows=(num_rows - 1,) if num_rows > 2 else ())
    x8, scale = _run_kernel(x)
    want8, want_scale = reference.quantize_rows_fp8(x)
    assert x8.dtype == FP8 and x8.shape == shape and scale.shape == (num_rows,)
    assert torch.equal(scale.cpu(), want_scale)
    assert torch.equal(x8.cpu().view(torch.uint8), want8.view(torch.uint8))


def test_kernel_loops_over_long_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows past ONE_TILE_MAX_COLS take the two-pass tiled path (made small here: the interpreter is slow)."""
    monkeypatch.setattr(triton_fp8, "ONE_TILE_MAX_COLS", 64)
    monkeypatch.setattr(triton_fp8, "_LOOP_TILE", 32)
    x = _grid_rows(3, 300, torch.float32, seed=5, zero_rows=(1,))
    x8, scale = _run_kernel(x)
    want8, want_scale = reference.quantize_rows_fp8(x)
    assert torch.equal(scale.cpu(), want_scale)
    assert torch.equal(x8.cpu().view(torch.uint8), want8.view(torch.uint8))


def test_kernel_reads_strided_rows_and_no_rows() -> None:
    buffer = torch.full((4, 64), 1e4)
    buffer[:, :48] = _grid_rows(4, 48, torch.float32, seed=9)
    view = buffer[:, :48]  # rows 64 apart, 48 columns read (the 1e4 past them would change every scale)
    x8, scale = _run_kernel(torch.zeros(0, 32))
    assert x8.shape == (0, 32) and scale.shape == (0,)
    x8, scale = triton_fp8.quantize_rows_fp8(view.to(DEVICE))
    want8, want_scale = reference.quantize_rows_fp8(view)
    assert torch.equal(scale.cpu(), want_scale)
    assert torch.equal(x8.cpu().view(torch.uint8), want8.view(torch.uint8))


@pytest.mark.parametrize("num_cols", [40, 300])
def test_a_nan_makes_its_row_nan(num_cols: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the reference: a NaN's row gets a NaN scale and only NaN values (300 columns: the tiled loop). Under
    the interpreter the values are not checked: its fp32 -> e4m3fn cast turns NaN into 384 (a GPU's
    cvt.rn.satfinite gives NaN; tests/kernels/test_fp8_kv_cache_kernels.py meets the same)."""
    monkeypatch.setattr(triton_fp8, "ONE_TILE_MAX_COLS", 64)
    monkeypatch.setattr(triton_fp8, "_LOOP_TILE", 32)
    x = _grid_rows(3, num_cols, torch.float32, seed=7)
    x[1, num_cols - 3] = float("nan")
    x8, scale = _run_kernel(x)
    want8, want_scale = reference.quantize_rows_fp8(x)
    assert want_scale[1].isnan() and want8[1].float().isnan().all()
    assert scale[1].isnan()
    if not INTERPRET:
        assert x8[1].float().isnan().all()
    assert torch.equal(scale.cpu()[::2], want_scale[::2])
    assert torch.equal(x8.cpu()[::2].view(torch.uint8), want8[::2].view(torch.uint8))


@pytest.mark.skipif(INTERPRET, reason="the interpreter's fp8 rounding is not the GPU's (module docstring)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_kernel_bytes_equal_the_reference_on_any_values(dtype: torch.dtype) -> None:
    x = (torch.randn(33, 3584, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    x[5] = 0.0
    x8, scale = _run_kernel(x)
    want8, want_scale = reference.quantize_rows_fp8(x)
    assert torch.equal(scale.cpu(), want_scale)
    assert torch.equal(x8.cpu().view(torch.uint8), want8.view(torch.uint8))


# ------------------------------------------------------------------------------ ahead-of-time compile


def _record_launches(compiler: object) -> None:
    """The launches a 7B model's layers make (K 3584: one tile; 18944: past ONE_TILE_MAX_COLS, the tiled loop)
    and a row of ONE_TILE_MAX_COLS (the widest one tile), in each activation dtype."""
    assert 3584 <= triton_fp8.ONE_TILE_MAX_COLS < 18944
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for num_cols in (3584, 18944, triton_fp8.ONE_TILE_MAX_COLS):
            x = torch.zeros(2, num_cols, dtype=dtype)
            compiler.record(triton_fp8, ["_quantize_rows_kernel"],  # type: ignore[attr-defined]
                            lambda x=x: triton_fp8.quantize_rows_fp8(x))


def test_kernel_compiles_for_hopper(hopper_compiler: object) -> None:
    """Plain and PDL launches compile for sm_90 (types and fp8 conversions the interpreter lets through)."""
    _record_launches(hopper_compiler)
    specs = hopper_compiler.specs  # type: ignore[attr-defined]
    assert {spec["constexprs"]["ONE_TILE"] for spec in specs} == {True, False}
    hopper_compiler.compile_all()  # type: ignore[attr-defined]


def test_kernel_compiles_for_ada(compiler_for: object) -> None:
    """sm_89, the first GPU --quantization fp8 runs on."""
    compiler = compiler_for(89)  # type: ignore[operator]
    _record_launches(compiler)
    compiler.compile_all()


def test_scaled_mm_output_dtype_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load-time probe of `torch._scaled_mm` (row-wise scales): the model's dtype where it runs, bfloat16
    (then cast) where only that runs, and a RuntimeError naming the refusals where neither does, so that a
    GPU without row-wise fp8 matmuls fails at load (ModelLoadError) instead of at its first large batch."""
    asked: list[torch.dtype] = []

    def scaled_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
        asked.append(out_dtype)
        if out_dtype not in allowed:
            raise RuntimeError(f"{out_dtype} output is not supported with row-wise scaling\nmore detail")
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    probe = ops.scaled_mm_out_dtype.__wrapped__  # uncached
    cpu = torch.device("cpu")
    allowed = {torch.bfloat16, torch.float16}
    assert probe(cpu, torch.float16) == torch.float16 and asked == [torch.float16]
    allowed = {torch.bfloat16}
    assert probe(cpu, torch.float32) == torch.bfloat16
    allowed = set()
    asked.clear()
    with pytest.raises(RuntimeError, match=r"cannot run fp8 matmuls with row-wise scales .*torch.bfloat16: "
                                           r"torch.bfloat16 output is not supported.*--quantization fp8"):
        probe(cpu, torch.bfloat16)
    assert asked == [torch.bfloat16]  # bfloat16 is tried once
    with pytest.raises(RuntimeError, match=r"torch.float16: .*; torch.bfloat16: "):
        probe(cpu, torch.float16)
