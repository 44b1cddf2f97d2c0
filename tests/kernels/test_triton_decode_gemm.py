"""The decode-rows TMA matmul (kvserve/kernels/triton_decode_gemm.py): plain (+ bias) and gate/up with
SiLU-and-mul against a float32 matmul, under every kind of plan (whole tiles, whole waves plus split tiles,
all split), its plan rule, contract and the sm_90 compile at the engine tiling.

Outputs and workspaces come from `torch.empty`, made NaN by `poison_allocations`: a tile or partial never
stored fails.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import reference, triton_decode_gemm  # noqa: E402
from kvserve.kernels.triton_decode_gemm import DecodeGemmConfig, Plan, decode_linear, fits, pick  # noqa: E402

SMALL = DecodeGemmConfig(block_m=32, block_n=16, block_k=32, num_stages=2, num_warps=4)
SMALL_X_POINTERS = DecodeGemmConfig(block_m=32, block_n=16, block_k=32, num_stages=2, num_warps=4, x_tma=False)


@pytest.fixture(autouse=True)
def _poison(poison_allocations):
    poison_allocations(triton_decode_gemm)


def operands(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
    return x, w, b


def expected(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, gate_up: bool) -> torch.Tensor:
    """A float32 matmul (+ bias) rounded once; for gate/up the separate `silu_and_mul` of that."""
    out = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)
    return reference.silu_and_mul(out) if gate_up else out


def tiles(m: int, n: int, config: DecodeGemmConfig) -> int:
    return -(-m // config.block_m) * -(-n // config.block_n)


# n = 72 output columns: 5 tiles of 16 (the last one partial); K = 128: 4 steps of 32.
PLANS = {
    "whole": lambda t: Plan(t, t, 1),
    "waves+split": lambda t: Plan(t, 2, 3),  # tiles 0-1 whole, 2-4 in 3 K ranges (4 steps: 1 + 1 + 2)
    "all-split": lambda t: Plan(t, 0, 4),  # one K step each
    "more-splits-than-steps": lambda t: Plan(t, 1, 6),  # splits with no K step at all write zeros
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gate_up", [False, True], ids=["plain", "gate_up"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("x_loads", ["tma", "pointers"])
def test_matches_float32_matmul(dtype, gate_up, with_bias, plan_name, x_loads, device, skip_bf16_on_interpreter):
    skip_bf16_on_interpreter(dtype)
    if gate_up and with_bias:
        pytest.skip("the gate/up epilogue takes no bias (fits says so)")
    m, n, k = 20, 72, 128
    x, w, b = operands(m, 2 * n if gate_up else n, k, dtype, device)
    bias = b if with_bias else None
    config = SMALL if x_loads == "tma" else SMALL_X_POINTERS
    schedule = PLANS[plan_name](tiles(m, n, config))
    out = decode_linear(x, w, bias, config, schedule, gate_up=gate_up)
    assert out.shape == (m, n) and out.dtype == dtype
    tol = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(out.float(), expected(x, w, bias, gate_up).float(), rtol=tol, atol=2e-3)
    counters = triton_decode_gemm._COUNTERS.buffers.get(x.device)
    if counters is not None:  # every tile's last program put its counter back
        assert int(counters.abs().sum()) == 0


def test_same_plan_same_bits_and_reruns_after_a_split_launch(device):
    """A split launch leaves its counters at zero, so the next launch over the same buffers gives the same
    bits (the partials are summed in split order whichever program ends last)."""
    x, w, _ = operands(32, 96, 256, torch.float16, device, seed=1)
    schedule = Plan(tiles(32, 96, SMALL), 3, 5)
    first = decode_linear(x, w, None, SMALL, schedule)
    for _ in range(2):
        assert torch.equal(decode_linear(x, w, None, SMALL, schedule), first)


def test_writes_into_a_given_output_and_reads_row_strided_x(device):
    x_wide, w, _ = operands(24, 48, 256, torch.float16, device)
    x = x_wide[:, :128]  # row stride 256 elements: 512 bytes, a tensor descriptor's 16-byte rule holds
    w = w[:, :128].contiguous()
    out = torch.full((24, 48), float("nan"), dtype=torch.float16, device=device)
    got = decode_linear(x, w, None, SMALL, Plan(tiles(24, 48, SMALL), 0, 2), out=out)
    assert got is out
    torch.testing.assert_close(out.float(), expected(x, w, None, False).float(), rtol=2**-10, atol=2e-3)


def test_pick_at_the_qwen_shapes_on_132_sms(monkeypatch):
    """The engine's choice on the H200 (132 SMs, 227 KiB of shared memory a block) at 33-64 rows: gate/up in
    64-column tiles, o_proj and down in one wave of 32-column tiles, the LM head in 64-column tiles of two
    programs per SM, q/k/v (144 tiles of 32: more than a wave; 72 of 64: barely half) left to cuBLAS; whole
    tiles only."""
    sms, shared = 132, 227 * 1024
    g, one, many = (triton_decode_gemm.GATE_UP_CONFIG, triton_decode_gemm.ONE_WAVE_CONFIG,
                    triton_decode_gemm.MANY_WAVES_CONFIG)
    for m in (33, 48, 64):
        assert pick(m, 18944, 3584, True, sms, shared) == (g, Plan(296, 296, 1))
        assert pick(m, 3584, 18944, False, sms, shared) == (one, Plan(112, 112, 1))
        assert pick(m, 3584, 3584, False, sms, shared) == (one, Plan(112, 112, 1))
        assert pick(m, 152064, 3584, False, sms, shared) == (many, Plan(2376, 2376, 1))
        assert pick(m, 4608, 3584, False, sms, shared) is None
    assert programs_per_sm_of(many, shared) == 2 and programs_per_sm_of(g, shared, gate_up=True) == 1
    assert pick(64, 18944, 3584, True, sms, 99 * 1024) is None  # sm_89-sized shared memory: no 4-stage gate/up
    monkeypatch.setattr(triton_decode_gemm, "X_TMA", False)
    config, _ = pick(64, 3584, 3584, False, sms, shared)
    assert not config.x_tma and config.block_n == one.block_n


def programs_per_sm_of(config: DecodeGemmConfig, shared: int, gate_up: bool = False) -> int:
    return triton_decode_gemm.programs_per_sm(config, gate_up, shared)


def test_fits():
    cpu = torch.device("cpu")
    x, w, b = operands(64, 256, 256, torch.float16, cpu)
    config = DecodeGemmConfig()
    assert fits(x, w, None, False, config) and fits(x, w, b, False, config) and fits(x, w, None, True, config)
    assert not fits(x, w, b, True, config)  # gate/up: no bias
    assert not fits(torch.cat([x, x]), w, None, False, config)  # more rows than one row tile
    assert not fits(x.float(), w.float(), None, False, config)  # 16-bit only
    assert not fits(x[:, :200], w[:, :200], None, False, config)  # K not a multiple of block_k
    assert not fits(x[:, 1:129], w[:, :128], None, False, config)  # start not 16-byte aligned
    assert not fits(x, w[:255], None, True, config)  # an odd gate/up row count
    assert not fits(x, w, b[:255], False, config)  # bias of the wrong length


def test_compiles_for_hopper_at_the_engine_tiling(device, hopper_compiler):
    """The engine's tilings at the Qwen2.5-7B decode shapes (gate/up, down, q/k/v with bias) compile for sm_90
    within its shared memory, whole and split (the interpreter does not check layouts or shared memory)."""
    hidden, intermediate = 3584, 18944
    dtype = torch.bfloat16
    x = torch.zeros(64, hidden, dtype=dtype, device=device)
    x_down = torch.zeros(64, intermediate, dtype=dtype, device=device)
    gate_up = torch.zeros(2 * intermediate, hidden, dtype=dtype, device=device)
    down = torch.zeros(hidden, intermediate, dtype=dtype, device=device)
    qkv = torch.zeros(4608, hidden, dtype=dtype, device=device)
    bias = torch.zeros(4608, dtype=dtype, device=device)
    g, one, many = (triton_decode_gemm.GATE_UP_CONFIG, triton_decode_gemm.ONE_WAVE_CONFIG,
                    triton_decode_gemm.MANY_WAVES_CONFIG)
    pointers = DecodeGemmConfig(**(vars(one) | {"x_tma": False}))
    lm_head = torch.zeros(4096, hidden, dtype=dtype, device=device)
    calls = [
        partial(decode_linear, x, gate_up, None, g, Plan(296, 296, 1), gate_up=True),
        partial(decode_linear, x, gate_up, None, g, Plan(296, 264, 4), gate_up=True),
        partial(decode_linear, x_down, down, None, one, Plan(112, 112, 1)),
        partial(decode_linear, x_down, down, None, pointers, Plan(112, 0, 2)),
        partial(decode_linear, x, qkv, bias, one, Plan(144, 132, 2)),
        partial(decode_linear, x, lm_head, None, many, Plan(64, 64, 1)),
    ]
    for call in calls:
        hopper_compiler.record(triton_decode_gemm, ["_decode_gemm_kernel"], call)
    results = hopper_compiler.compile_all()
    assert len(results) == len(calls)
    for result in results:
        assert result["shared_bytes"] <= 227 * 1024, result


def test_ops_rule(monkeypatch):
    """ops sends 33-64-row CUDA matmuls to it on sm_90+ (host ints only: no GPU needed to check the rule)."""
    from kvserve.kernels import ops

    cuda = torch.device("cuda")
    monkeypatch.setattr(ops, "_capability", lambda device: (9, 0))
    low, high = ops.SKINNY_GEMM_MAX_ROWS, ops.DECODE_GEMM_MAX_ROWS
    assert [ops.decode_gemm_applies(m, cuda) for m in (low, low + 1, high, high + 1)] == [False, True, True, False]
    assert not ops.decode_gemm_applies(48, torch.device("cpu"))
    monkeypatch.setattr(ops, "_capability", lambda device: (8, 9))
    assert not ops.decode_gemm_applies(48, cuda)  # no TMA before sm_90
    monkeypatch.setattr(ops, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(ops, "_decode_gemm_enabled", True)
    ops.set_decode_gemm(False)
    assert not ops.decode_gemm_applies(48, cuda)
    ops.set_decode_gemm(True)
    assert ops.decode_gemm_applies(48, cuda)
