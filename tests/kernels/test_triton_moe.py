"""The mixture-of-experts kernels (kvserve/kernels/triton_moe.py): the alignment by expert as a pure function,
and `fused_moe` against `reference.fused_moe`.

The kernels' buffers (act, y, out) come from `torch.empty`, made NaN by `poison_allocations`: a row never
written, or a padding row that leaks into a sum, fails the comparison.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import reference, triton_moe  # noqa: E402
from kvserve.kernels.triton_moe import MoeConfig, align_by_expert, fused_moe, max_blocks  # noqa: E402

# Small tiles for the interpreter; two K steps at H = 40 / I = 24 with block_k 16, partial N tiles.
SMALL = MoeConfig(block_m=16, block_n_gate_up=16, block_n_down=16, block_k=16, num_warps=4, num_stages=2)


@pytest.fixture(autouse=True)
def _poison(poison_allocations):
    poison_allocations(triton_moe)


def check_alignment(ids: torch.Tensor, num_experts: int, block_m: int, use_kernel: bool) -> None:
    sorted_ids, block_expert, num_blocks = align_by_expert(ids, num_experts, block_m, use_kernel=use_kernel)
    flat = ids.reshape(-1).long().cpu()
    num_pairs = flat.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    assert sorted_ids.shape == (blocks * block_m,) and sorted_ids.dtype == torch.int32
    assert block_expert.shape == (blocks,) and block_expert.dtype == torch.int32
    sorted_ids, block_expert = sorted_ids.cpu().long(), block_expert.cpu().long()
    counts = torch.bincount(flat, minlength=num_experts)
    used = int(((counts + block_m - 1) // block_m).sum())
    assert num_blocks.tolist() == [used]
    # Used blocks first, in expert order, each expert with exactly ceil(count / block_m) blocks; then -1.
    want_experts = torch.repeat_interleave(torch.arange(num_experts), (counts + block_m - 1) // block_m)
    assert block_expert[:used].tolist() == want_experts.tolist()
    assert (block_expert[used:] == -1).all()
    # Every pair exactly once, in a block of its expert, in pair order within the expert; the rest sentinels.
    real = sorted_ids < num_pairs
    assert sorted(sorted_ids[real].tolist()) == list(range(num_pairs))
    assert (sorted_ids[~real] == num_pairs).all()
    assert not real[used * block_m:].any()
    owner = block_expert.repeat_interleave(block_m)
    assert torch.equal(flat[sorted_ids[real]], owner[real])
    for expert in range(num_experts):
        pairs = sorted_ids[(owner == expert) & real]
        assert pairs.tolist() == sorted(pairs.tolist())
        # The expert's pairs lead its segment; only its last block holds padding.
        segment = real[owner == expert]
        assert segment[: int(counts[expert])].all() and not segment[int(counts[expert]):].any()


@pytest.mark.parametrize(
    "ids,num_experts,block_m",
    [
        ([[3]], 8, 16),  # T = 1, k = 1: one block, seven experts with no pairs
        ([[5, 1]], 8, 4),  # T = 1, k = 2
        ([[0, 0], [0, 0], [0, 0]], 4, 4),  # one expert, repeated in a row: two blocks, the second padded
        ([[2, 2, 1], [1, 1, 1]], 3, 2),  # expert 0 empty; 2 blocks for expert 1, 1 for expert 2
        ([[i % 7, (i * 3 + 1) % 7] for i in range(20)], 7, 4),
        ([[1, 2]], 64, 16),  # E > T k
    ],
)
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_align_by_expert(ids, num_experts, block_m, use_kernel, device):
    check_alignment(torch.tensor(ids, dtype=torch.int32, device=device), num_experts, block_m, use_kernel)
    check_alignment(torch.tensor(ids, dtype=torch.int64, device=device), num_experts, block_m, use_kernel)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_align_by_expert_random(use_kernel, device):
    """Several of the kernel's chunks of pairs (200 x 8 pairs, 64 a chunk at 128 experts), experts not a power
    of two, more blocks than a chunk."""
    gen = torch.Generator().manual_seed(0)
    for num_tokens, top_k, num_experts, block_m in [(37, 4, 16, 8), (200, 8, 128, 16), (9, 2, 3, 64),
                                                    (300, 2, 5, 4)]:
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
        check_alignment(ids.to(device), num_experts, block_m, use_kernel)


def test_align_paths_agree_and_default_by_size(monkeypatch, device):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 6, (50, 3), generator=gen).to(device)
    kernel = align_by_expert(ids, 6, 8, use_kernel=True)
    ops = align_by_expert(ids, 6, 8, use_kernel=False)
    for a, b in zip(kernel, ops, strict=True):
        assert torch.equal(a, b)
    launched = []
    monkeypatch.setattr(triton_moe, "_align_kernel", _Recorder(launched))
    monkeypatch.setattr(triton_moe, "ALIGN_KERNEL_MAX_PAIRS", 150)
    align_by_expert(ids, 6, 8)
    assert len(launched) == 1  # 150 pairs: the kernel
    monkeypatch.setattr(triton_moe, "ALIGN_KERNEL_MAX_PAIRS", 149)
    align_by_expert(ids, 6, 8)
    assert len(launched) == 1  # past it: the torch ops


class _Recorder:
    def __init__(self, launches: list) -> None:
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(grid)


def operands(num_tokens, hidden, inter, num_experts, top_k, dtype, device, seed=0, ids=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    if ids is None:
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, ids.shape[1], generator=gen), dim=-1)
    cast = dict(device=device, dtype=dtype)
    return x.to(**cast), w13.to(**cast), w2.to(**cast), weights.to(device), ids.to(torch.int32).to(device)


CASES = {
    "T1": dict(num_tokens=1, hidden=40, inter=24, num_experts=8, top_k=2),
    "T3-k2": dict(num_tokens=3, hidden=40, inter=24, num_experts=4, top_k=2),
    # 8 experts with ~5 pairs each in 16-row blocks: most rows of most blocks are padding
    "many-padding": dict(num_tokens=20, hidden=32, inter=16, num_experts=8, top_k=2),
    # several blocks for one expert, rows past the first block
    "few-experts": dict(num_tokens=24, hidden=24, inter=40, num_experts=2, top_k=2),
    "E>Tk": dict(num_tokens=2, hidden=40, inter=24, num_experts=32, top_k=3),
}


@pytest.mark.parametrize("align", ["kernel", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_moe_float32_matches_reference(case, align, device, monkeypatch):
    if align == "torch":
        monkeypatch.setattr(triton_moe, "ALIGN_KERNEL_MAX_PAIRS", 0)
    x, w13, w2, weights, ids = operands(**CASES[case], dtype=torch.float32, device=device)
    got = fused_moe(x, w13, w2, weights, ids, config=SMALL)
    torch.testing.assert_close(got, reference.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights_dtype", ["float32", "x"], ids=["float32-weights", "x-dtype-weights"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["T3-k2", "many-padding"])
def test_fused_moe_16_bit_matches_reference(case, dtype, weights_dtype, device, skip_bf16_on_interpreter):
    """Routing weights as given: float32 (Mixtral's router) or rounded to x's dtype (Qwen3-MoE's)."""
    skip_bf16_on_interpreter(dtype)
    x, w13, w2, weights, ids = operands(**CASES[case], dtype=dtype, device=device)
    if weights_dtype == "x":
        weights = weights.to(dtype)
    got = fused_moe(x, w13, w2, weights, ids, config=SMALL)
    assert got.dtype == dtype and got.shape == x.shape
    want = reference.fused_moe(x, w13, w2, weights, ids)
    tol = 2**-6 if dtype == torch.bfloat16 else 2**-9
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_repeated_expert_in_a_row_and_int64_ids(device):
    """A token that picks one expert twice gets both weighted copies; int64 ids give the same result."""
    ids = torch.tensor([[1, 1, 3], [0, 3, 3], [2, 2, 2]])
    x, w13, w2, weights, ids32 = operands(3, 40, 24, 4, 3, torch.float32, device, ids=ids)
    want = reference.fused_moe(x, w13, w2, weights, ids32)
    for topk_ids in (ids32, ids32.long()):
        torch.testing.assert_close(fused_moe(x, w13, w2, weights, topk_ids, config=SMALL), want,
                                   rtol=1e-5, atol=1e-5)


def test_default_tiling_and_strided_x(device):
    """`pick_config`'s tiling (no override), with x a row slice of a wider tensor."""
    x_wide, w13, w2, weights, ids = operands(5, 48, 32, 8, 2, torch.float32, device)
    x = torch.cat([x_wide, x_wide], dim=1)[:, :48]
    assert x.stride(0) == 96
    got = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, reference.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_pick_config_by_pairs_per_expert():
    assert triton_moe.pick_config(1, 8, 128) is triton_moe.DECODE_CONFIG
    assert triton_moe.pick_config(512, 8, 128) is triton_moe.MIDDLE_CONFIG
    assert triton_moe.pick_config(2048, 8, 128) is triton_moe.PREFILL_CONFIG
    assert triton_moe.pick_config(8192, 8, 128) is triton_moe.LARGE_PREFILL_CONFIG
    assert triton_moe.pick_config(64, 2, 8) is triton_moe.DECODE_CONFIG


def one_expert_repeated(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """[E, ...] weights of one expert's storage (expert stride 0, like a real one divisible by 16): launches
    are recorded, never run, so the full 1.6 GB need not be allocated."""
    return torch.zeros(1, *shape[1:], dtype=dtype).expand(shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_kernels_compile_for_hopper(dtype, compiler_for):
    """The three kernels as `fused_moe` launches them at Qwen3-30B-A3B's shape, with each size class's tiling
    (T = 1, 512, 2048, 8192), compiled ahead of time for sm_90: type errors, shared memory over the limit."""
    compiler = compiler_for(90)
    hidden, inter, num_experts, top_k = 2048, 768, 128, 8
    w13 = one_expert_repeated((num_experts, 2 * inter, hidden), dtype)
    w2 = one_expert_repeated((num_experts, hidden, inter), dtype)
    sizes = [1, 512, 2048, 8192] if dtype == torch.bfloat16 else [1, 8192]
    for num_tokens in sizes:
        ids = torch.randint(0, num_experts, (num_tokens, top_k), dtype=torch.int32)
        weights = torch.full((num_tokens, top_k), 1 / top_k)
        x = torch.zeros(num_tokens, hidden, dtype=dtype)
        compiler.record(triton_moe, ["_moe_gate_up_kernel", "_moe_down_kernel", "_moe_sum_kernel"],
                        partial(fused_moe, x, w13, w2, weights, ids))
        compiler.record(triton_moe, ["_align_kernel"], partial(align_by_expert, ids, num_experts, 16, True))
    compiled = compiler.compile_all()
    assert {entry["block_m"] for entry in compiled} >= {16, 128}
    # Hopper's opt-in shared memory per block (227 KiB): float32's 128-row gate/up tiling needs 192 KiB.
    assert max(entry["shared_bytes"] for entry in compiled) <= 227 * 1024
