"""The prefill gate/up matmul with SiLU-and-mul in its epilogue (kvserve/kernels/triton_gate_up.py) against a
float32 matmul followed by the separate `silu_and_mul`, its contract, and the ops rule that picks it.

The output comes from `torch.empty`, made NaN by `poison_allocations`: a tile never stored fails.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import ops, reference, triton_gate_up  # noqa: E402
from kvserve.kernels.triton_gate_up import GateUpConfig, fits, gate_up_silu  # noqa: E402

SMALL = dict(block_m=32, block_n=32, block_k=32, num_stages=2, num_warps=4, group_m=2)
CONFIGS = {
    "pointers": GateUpConfig(**SMALL),
    "tma": GateUpConfig(**SMALL, use_tma=True),
    "pointers-group1": GateUpConfig(**(SMALL | {"group_m": 1})),
}


@pytest.fixture(autouse=True)
def _poison(poison_allocations):
    poison_allocations(triton_gate_up)


def operands(m: int, d: int, k: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(2 * d, k, generator=gen) * k**-0.5).to(device=device, dtype=dtype)
    return x, w


def two_ops(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The unfused result with a float32 matmul rounded once: what the kernel's epilogue promises."""
    return reference.silu_and_mul(torch.nn.functional.linear(x.float(), w.float()).to(x.dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
# Partial tiles on every axis: rows (70 = 2 x 32 + 6), gate/up columns (80 = 2 x 32 + 16), K (96 + 16); and
# more row tiles than a group, so the grouped walk wraps.
@pytest.mark.parametrize("m,d,k", [(64, 64, 64), (70, 80, 112), (150, 48, 64)])
def test_matches_float32_matmul_then_silu_and_mul(dtype, name, m, d, k, device, skip_bf16_on_interpreter):
    skip_bf16_on_interpreter(dtype)
    x, w = operands(m, d, k, dtype, device)
    out = gate_up_silu(x, w, CONFIGS[name])
    assert out.shape == (m, d) and out.dtype == dtype
    tol = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(out.float(), two_ops(x, w).float(), rtol=tol, atol=1e-3)


def test_writes_into_a_given_output_and_reads_row_strided_x(device):
    """x may be a row slice of a wider tensor (stride(0) > K); `out` is filled in place."""
    x_wide, w = operands(40, 32, 128, torch.float16, device)
    x = x_wide[:, :64]
    w = w[:, :64].contiguous()
    out = torch.full((40, 32), float("nan"), dtype=torch.float16, device=device)
    for config in (CONFIGS["pointers"], CONFIGS["tma"]):
        out.fill_(float("nan"))
        assert gate_up_silu(x, w, config, out=out) is out
        torch.testing.assert_close(out.float(), two_ops(x, w).float(), rtol=2**-10, atol=1e-3)


def test_fits():
    x, w = operands(8, 32, 64, torch.float16, torch.device("cpu"))
    tma, ptr = CONFIGS["tma"], CONFIGS["pointers"]
    assert fits(x, w, None, tma) and fits(x, w, None, ptr)
    assert not fits(x, w, torch.zeros(64, dtype=torch.float16), ptr)  # bias: not in the epilogue
    assert not fits(x, w[:63], None, ptr)  # odd row count: no gate/up halves
    assert not fits(x.float(), w.float(), None, ptr)  # 16-bit operands only
    assert not fits(x, w.to(torch.bfloat16), None, ptr)
    assert not fits(x, w[:, :32], None, ptr)  # K differs
    x_cols = torch.zeros(64, 8, dtype=torch.float16).t()  # [8, 64] with inner stride 8
    w_cols = torch.zeros(64, 64, dtype=torch.float16).t()  # [64, 64] with inner stride 64
    assert x_cols.shape == x.shape and w_cols.shape == w.shape
    assert not fits(x_cols, w, None, ptr) and not fits(x, w_cols, None, ptr)  # inner strides must be 1
    assert not fits(x[0], w, None, ptr) and not fits(x[0], w, None, tma)  # 2-D only
    # A tensor descriptor needs 16-byte aligned starts and row strides; plain pointers do not.
    x_wide = torch.zeros(8, 65, dtype=torch.float16)[:, 1:]
    assert fits(x_wide, w, None, ptr) and not fits(x_wide, w, None, tma)
    x_odd_stride = torch.zeros(8, 68, dtype=torch.float16)[:, :64]  # 136-byte rows
    assert not fits(x_odd_stride, w, None, tma)


def test_tma_gate_up_rule(monkeypatch):
    """The fused TMA matmul serves the rows past the skinny matmul up to TMA_GATE_UP_MAX_DECODE_ROWS (default
    on) and, opt-in, PREFILL_GATE_UP_MIN_ROWS rows and more; only on sm_90+; each range has its switch."""
    low, high, prefill = ops.SKINNY_GEMM_MAX_ROWS, ops.TMA_GATE_UP_MAX_DECODE_ROWS, ops.PREFILL_GATE_UP_MIN_ROWS
    decode_config, prefill_config = triton_gate_up.DECODE_CONFIG, triton_gate_up.PREFILL_CONFIG
    assert decode_config.use_tma and prefill_config.use_tma
    monkeypatch.setattr(ops, "_decode_tma_gate_up", True)
    monkeypatch.setattr(ops, "_prefill_silu_fusion", False)
    assert ops.gate_up_tma_config(low, (9, 0)) is None  # the skinny matmul's rows
    assert ops.gate_up_tma_config(low + 1, (9, 0)) == decode_config
    assert ops.gate_up_tma_config(high, (9, 0)) == decode_config
    assert ops.gate_up_tma_config(high + 1, (9, 0)) is None
    assert ops.gate_up_tma_config(high, (8, 0)) is None  # no TMA
    assert ops.gate_up_tma_config(prefill, (9, 0)) is None  # prefill range off
    ops.set_prefill_gate_up_fusion(True)
    ops.set_decode_gate_up_tma(False)
    assert ops.gate_up_tma_config(prefill, (9, 0)) == prefill_config
    assert ops.gate_up_tma_config(8 * prefill, (10, 0)) == prefill_config
    assert ops.gate_up_tma_config(prefill - 1, (9, 0)) is None
    assert ops.gate_up_tma_config(prefill, (8, 9)) is None
    assert ops.gate_up_tma_config(high, (9, 0)) is None  # decode range switched off


def test_switch_defaults():
    """Out of the box: the decode range on, the prefill range off (docs/perf_notes.md entry 32)."""
    import subprocess
    import sys

    code = "from kvserve.kernels import ops; print(ops._decode_tma_gate_up, ops._prefill_silu_fusion)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_ops_linear_silu_mul_large_cpu_batch_is_the_two_ops(monkeypatch):
    """CPU tensors never reach the Triton kernel, however many rows, the prefill fusion switched on or not."""
    for rows in (ops.TMA_GATE_UP_MAX_DECODE_ROWS, ops.PREFILL_GATE_UP_MIN_ROWS):
        x, w = operands(rows, 16, 32, torch.float16, torch.device("cpu"))
        for enabled in (False, True):
            monkeypatch.setattr(ops, "_prefill_silu_fusion", enabled)
            want = ops.silu_and_mul(torch.nn.functional.linear(x, w))
            assert torch.equal(ops.linear_silu_mul(x, w), want)


def test_compiles_for_hopper_at_the_engine_tiling(device, hopper_compiler):
    """The engine's tilings at the Qwen2.5-7B MLP shape, with TMA descriptors (and the prefill tiling with
    pointers), compile for sm_90 within its shared memory (the interpreter does not check layouts or shared
    memory)."""
    if hopper_compiler.pdl:
        pytest.skip("the prefill matmul launches without programmatic dependent launch")
    hidden, intermediate = 3584, 18944
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.zeros(1000, hidden, dtype=dtype, device=device)
        w = torch.zeros(2 * intermediate, hidden, dtype=dtype, device=device)
        config = triton_gate_up.PREFILL_CONFIG
        hopper_compiler.record(triton_gate_up, ["_gate_up_silu_tma_kernel"], partial(gate_up_silu, x, w, config))
        pointers = GateUpConfig(**(vars(config) | {"use_tma": False}))
        hopper_compiler.record(triton_gate_up, ["_gate_up_silu_kernel"], partial(gate_up_silu, x, w, pointers))
        hopper_compiler.record(triton_gate_up, ["_gate_up_silu_tma_kernel"],
                               partial(gate_up_silu, x[:50], w, triton_gate_up.DECODE_CONFIG))
    results = hopper_compiler.compile_all()
    assert len(results) == 6
    for result in results:
        assert result["shared_bytes"] <= 227 * 1024, result
