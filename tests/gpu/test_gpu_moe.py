"""The mixture-of-experts kernels (kvserve/kernels/triton_moe.py) on the GPU (skipped without CUDA): against
`reference.fused_moe` at Qwen3-30B-A3B's and Mixtral-8x7B's real shapes, through `ops.fused_moe`, and captured
in a CUDA graph, replayed with new routing."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import ops, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# name: (hidden H, moe intermediate I, experts E, top k)
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}


@pytest.fixture(scope="module")
def weights() -> dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]]:
    """Each shape's expert weights, made once per dtype (Mixtral's are 2.8 GB in 16 bits)."""
    return {}


def expert_weights(cache: dict, name: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if (name, dtype) not in cache:
        cache.clear()  # one shape's weights on the GPU at a time
        hidden, inter, num_experts, _ = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device="cuda") * hidden**-0.5).to(dtype)
        w2 = (torch.randn(num_experts, hidden, inter, generator=gen, device="cuda") * inter**-0.5).to(dtype)
        cache[(name, dtype)] = (w13, w2)
    return cache[(name, dtype)]


def routing(num_tokens: int, hidden: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device="cuda")
    topk_weights, topk_ids = reference.select_experts(logits, top_k, renormalize=True)
    return x, topk_weights, topk_ids


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Elementwise within a few roundings of the dtype at the output's scale: the kernel and the reference
    round the same intermediates (gate/up, silu, the down output, the weighted output) but accumulate the
    matmuls in a different order, so a rounding can flip anywhere upstream; and the kernel sums the k slots in
    float32 where the reference sums them in x's dtype."""
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    scale = want.float().abs().max().item()
    eps = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got.float(), want.float(), rtol=4 * eps, atol=4 * eps * scale)
    relative = (got.float() - want.float()).norm() / want.float().norm()
    assert relative < eps, relative


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 256, 2048])
def test_fused_moe_matches_reference_at_real_shapes(weights, name: str, dtype: torch.dtype, num_tokens: int) -> None:
    hidden, _, num_experts, top_k = SHAPES[name]
    w13, w2 = expert_weights(weights, name, dtype)
    x, topk_weights, topk_ids = routing(num_tokens, hidden, num_experts, top_k, dtype, seed=num_tokens)
    got = ops.fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert_close_to_reference(got, reference.fused_moe(x, w13, w2, topk_weights, topk_ids), dtype)


@pytest.mark.parametrize("name", list(SHAPES))
def test_fused_moe_in_a_cuda_graph(weights, name: str, restores_cuda_defaults: None) -> None:
    """Captured at T = 64, replayed with new x / weights / ids copied into the captured inputs: the same bits
    as an eager call on those inputs, on every replay (the output set to NaN before each). No host sync."""
    from kvserve.kernels import triton_moe

    dtype, num_tokens = torch.bfloat16, 64
    hidden, _, num_experts, top_k = SHAPES[name]
    w13, w2 = expert_weights(weights, name, dtype)
    x, topk_weights, topk_ids = routing(num_tokens, hidden, num_experts, top_k, dtype, seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)  # compiles outside the capture
        torch.cuda.set_sync_debug_mode("error")
        try:
            triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)  # a host sync raises here
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (2, 3, 4):
        new_x, new_weights, new_ids = routing(num_tokens, hidden, num_experts, top_k, dtype, seed=seed)
        if seed == 4:  # every token's first choice expert 3: its segment spans several blocks
            new_ids[:, 0] = 3
        x.copy_(new_x)
        topk_weights.copy_(new_weights)
        topk_ids.copy_(new_ids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = triton_moe.fused_moe(new_x, w13, w2, new_weights, new_ids.clone())
        assert torch.equal(out, eager), seed
        assert_close_to_reference(out, reference.fused_moe(new_x, w13, w2, new_weights, new_ids), dtype)
