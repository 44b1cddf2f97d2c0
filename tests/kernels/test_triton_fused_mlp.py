"""The one-launch decode MLP (kvserve/kernels/triton_fused_mlp.py) against a float32 gate/up matmul, the separate
`silu_and_mul` and a float32 down matmul; its counters left at zero; its contract.

Its scratch and output come from `torch.empty`, made NaN by `poison_allocations`: a tile or partial never
written fails. Under the interpreter one program does every unit in order (programs run one after another
there); on a GPU the launch has one program per SM.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import reference, triton_fused_mlp  # noqa: E402
from kvserve.kernels.triton_fused_mlp import FusedMlpConfig, fits, fused_mlp  # noqa: E402

SMALL = FusedMlpConfig(block_n1=32, block_k1=64, stages1=2, block_n2=32, block_k2=64, stages2=2, split2=3)
# The flattened loops need ranges of equal length: I = 512 is 8 chunks of 64, in 4 ranges of 2.
SMALL_FLAT = FusedMlpConfig(**(vars(SMALL) | {"split2": 4, "flat": True}))
# Flat gate/up loop, down units one at a time: any ranges.
SMALL_HYBRID = FusedMlpConfig(**(vars(SMALL) | {"flat": True, "flat_down": False}))


@pytest.fixture(autouse=True)
def _poison(poison_allocations):
    poison_allocations(triton_fused_mlp)


def operands(m: int, h: int, i: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=gen).to(device=device, dtype=dtype)
    w_gate_up = (torch.randn(2 * i, h, generator=gen) * h**-0.5).to(device=device, dtype=dtype)
    w_down = (torch.randn(h, i, generator=gen) * i**-0.5).to(device=device, dtype=dtype)
    return x, w_gate_up, w_down


def unfused(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The engine's ops with float32 matmuls rounded once each: what the kernel promises."""
    act = reference.silu_and_mul(torch.nn.functional.linear(x.float(), w_gate_up.float()).to(x.dtype))
    return torch.nn.functional.linear(act.float(), w_down.float()).to(x.dtype)


def programs(device: torch.device) -> int:
    return triton_fused_mlp.num_programs(device)


@pytest.mark.parametrize("config", [SMALL, SMALL_FLAT, SMALL_HYBRID], ids=["per-unit", "flat", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
# 1, 5 and 64 rows (a partial row tile and a full one); I = 512 is 8 chunks of 64, so SMALL's 3 ranges hold
# 2, 3 and 3 chunks; H = 192 is 6 down tiles.
@pytest.mark.parametrize("m", [1, 5, 64])
def test_matches_the_unfused_ops(config, dtype, m, device, skip_bf16_on_interpreter):
    skip_bf16_on_interpreter(dtype)
    x, w_gate_up, w_down = operands(m, 192, 512, dtype, device)
    assert fits(x, w_gate_up, w_down, config)
    out = fused_mlp(x, w_gate_up, w_down, config, programs=programs(device))
    assert out.shape == (m, 192) and out.dtype == dtype
    tol = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(out.float(), unfused(x, w_gate_up, w_down).float(), rtol=tol, atol=2e-3)


@pytest.mark.parametrize("flat,flat_down", [(False, True), (True, True), (True, False)],
                         ids=["per-unit", "flat", "hybrid"])
@pytest.mark.parametrize("split2", [1, 2, 8])
def test_any_split_count_gives_the_same_result_within_rounding_and_is_repeatable(split2, flat, flat_down, device):
    """One range (no partials), two, and one chunk per range; a second launch gives the same bits (the
    partials are summed in split order whichever program comes last) and the counters are zero afterwards."""
    x, w_gate_up, w_down = operands(7, 128, 512, torch.float16, device, seed=1)
    config = FusedMlpConfig(**(vars(SMALL) | {"split2": split2, "flat": flat, "flat_down": flat_down}))
    first = fused_mlp(x, w_gate_up, w_down, config, programs=programs(device))
    second = fused_mlp(x, w_gate_up, w_down, config, programs=programs(device))
    assert torch.equal(first, second)
    torch.testing.assert_close(first.float(), unfused(x, w_gate_up, w_down).float(), rtol=2**-10, atol=2e-3)
    counters = triton_fused_mlp._counters.get(x.device, 1)
    assert not counters.any(), "a counter was left non-zero: the next launch would skip its waits"


def test_contract(device):
    x, w_gate_up, w_down = operands(8, 128, 256, torch.float16, device)
    assert fits(x, w_gate_up, w_down, SMALL)
    assert not fits(torch.cat([x] * 9), w_gate_up, w_down, SMALL)  # 72 rows: past one row tile
    assert not fits(x.float(), w_gate_up.float(), w_down.float(), SMALL)
    assert not fits(x, w_gate_up[:-2], w_down, SMALL)  # gate/up rows not 2 x the down's columns
    narrow = [t.contiguous() for t in (x[:, :96], w_gate_up[:, :96], w_down[:96])]
    assert not fits(*narrow, SMALL)  # H = 96: not a multiple of block_k1
    assert not fits(x, w_gate_up, w_down, FusedMlpConfig(**(vars(SMALL) | {"split2": 5})))  # 4 chunks < 5
    assert not fits(x.t().contiguous().t(), w_gate_up, w_down, SMALL)  # x not contiguous
    assert fits(x, w_gate_up, w_down, SMALL_FLAT)
    assert not fits(x, w_gate_up, w_down, FusedMlpConfig(**(vars(SMALL_FLAT) | {"split2": 3})))  # 4 chunks in 3
    assert fits(x, w_gate_up, w_down, FusedMlpConfig(**(vars(SMALL_HYBRID) | {"split2": 3})))


def test_compiles_for_hopper_at_the_qwen_shape(device, hopper_compiler, monkeypatch):
    """The default tiling and the probe's split counts at the Qwen2.5-7B MLP shape compile for sm_90 within its
    shared memory, with and without programmatic dependent launch (the interpreter checks neither layouts nor
    shared memory), as compiled on a GPU (the block barrier as inline assembly). The gate/up loop's 4 stages of
    x, gate and up tiles (48 KiB each) are in the shared memory of both kernels: their loops are pipelined (a
    `tl.debug_barrier` inside the flat kernel's loops kept them to single buffers, 49,160 bytes)."""
    monkeypatch.setattr(triton_fused_mlp, "compiled_for", lambda device: True)
    hidden, intermediate = 3584, 18944
    x = torch.zeros(64, hidden, dtype=torch.bfloat16, device=device)
    w_gate_up = torch.zeros(2 * intermediate, hidden, dtype=torch.bfloat16, device=device)
    w_down = torch.zeros(hidden, intermediate, dtype=torch.bfloat16, device=device)
    for split2, flat, flat_down in ((2, False, True), (3, False, True), (4, False, True), (4, True, True),
                                    (3, True, False)):
        config = FusedMlpConfig(split2=split2, flat=flat, flat_down=flat_down)
        assert fits(x, w_gate_up, w_down, config)
        kernel = "_fused_mlp_flat_kernel" if flat else "_fused_mlp_kernel"
        hopper_compiler.record(triton_fused_mlp, [kernel],
                               lambda config=config: fused_mlp(x, w_gate_up, w_down, config, programs=132))
    results = hopper_compiler.compile_all()
    assert len(results) == 5
    for result in results:
        assert 4 * 48 * 1024 <= result["shared_bytes"] <= 227 * 1024, result
