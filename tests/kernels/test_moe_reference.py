"""The mixture-of-experts reference (`reference.select_experts` / `reference.fused_moe`) against HF's own
sparse MoE block, which the model's differential tests build on."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import reference

transformers = pytest.importorskip("transformers")
qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")


def _hf_block(dtype: torch.dtype, norm_topk_prob: bool) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob
    )
    torch.manual_seed(0)
    block = qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return block.to(dtype)


def _stacked(block: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    experts = block.experts
    if hasattr(experts, "gate_up_proj"):  # transformers 5: the experts' weights as two stacked tensors
        return experts.gate_up_proj.detach(), experts.down_proj.detach()
    w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts])
    return w13.detach(), torch.stack([e.down_proj.weight for e in experts]).detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_the_reference_moe_is_hf_sparse_moe_block(dtype: torch.dtype, norm_topk_prob: bool) -> None:
    block = _hf_block(dtype, norm_topk_prob)
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        want = block(x.unsqueeze(0))
        want = (want[0] if isinstance(want, tuple) else want).reshape(7, 32)
        weights, ids = reference.select_experts(torch.nn.functional.linear(x, block.gate.weight), 3, norm_topk_prob)
        w13, w2 = _stacked(block)
        got = reference.fused_moe(x, w13, w2, weights.to(dtype), ids)  # rounded as its router rounds them
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (7, 3)
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(7), rtol=0, atol=1e-6)
    torch.testing.assert_close(got, want)


def test_tokens_routed_to_no_expert_get_zeros_and_each_choice_counts() -> None:
    w13 = torch.randn(4, 8, 6)
    w2 = torch.randn(4, 6, 4)
    x = torch.randn(2, 6)
    ids = torch.tensor([[1, 3], [1, 1]], dtype=torch.int32)  # the second token picks expert 1 twice
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    got = reference.fused_moe(x, w13, w2, weights, ids)

    def expert(e: int, row: torch.Tensor) -> torch.Tensor:
        gate_up = w13[e] @ row
        return w2[e] @ (torch.nn.functional.silu(gate_up[:4]) * gate_up[4:])

    torch.testing.assert_close(got[0], 0.25 * expert(1, x[0]) + 0.75 * expert(3, x[0]))
    torch.testing.assert_close(got[1], expert(1, x[1]))
    zero = reference.fused_moe(x, w13, w2, torch.zeros(2, 2), ids)
    assert torch.equal(zero, torch.zeros_like(x))


mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")


def _hf_mixtral_block(dtype: torch.dtype) -> torch.nn.Module:
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=8,
                                        num_experts_per_tok=2)
    torch.manual_seed(0)
    block = mixtral.MixtralSparseMoeBlock(config)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return block.to(dtype)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_layer_is_hf_sparse_moe_block_bit_for_bit_in_bfloat16(family: str) -> None:
    """layers.moe.SparseMoeBlock (on CPU: the reference) gives HF's block's bfloat16 output exactly. Mixtral's
    router keeps the chosen experts' weights in float32, so each expert's output times its weight is rounded
    once; Qwen3-MoE's rounds them to bfloat16 first. (Mixtral's weights were rounded to bfloat16 as Qwen3-MoE's:
    about a third of the outputs one bfloat16 step off HF's.)"""
    from kvserve.layers.moe import SparseMoeBlock

    dtype = torch.bfloat16
    mixtral_family = family == "mixtral"
    hf = _hf_mixtral_block(dtype) if mixtral_family else _hf_block(dtype, norm_topk_prob=True)
    hidden, num_experts, top_k = (64, 8, 2) if mixtral_family else (32, 8, 3)
    w13, w2 = _stacked(hf)
    ours = SparseMoeBlock(hidden, num_experts, top_k, w2.shape[2], True, dtype, round_weights=not mixtral_family)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.w13.copy_(w13)
        ours.experts.w2.copy_(w2)
        x = torch.randn(64, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
        want = hf(x.unsqueeze(0))
        want = (want[0] if isinstance(want, tuple) else want).reshape(64, hidden)
        got = ours(x)
    assert got.dtype == dtype
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} outputs differ"


qwen2_moe = pytest.importorskip("transformers.models.qwen2_moe.modeling_qwen2_moe")


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_the_qwen2_moe_layer_is_hf_sparse_moe_block_bit_for_bit_in_bfloat16(norm_topk_prob: bool) -> None:
    """Qwen2-MoE's block (the model's `_moe_block`: routed experts, and the shared expert, a dense MLP gated by
    sigmoid(shared_expert_gate)) gives HF's Qwen2MoeSparseMoeBlock's bfloat16 output exactly; its router rounds
    the chosen experts' weights to bfloat16 as Qwen3-MoE's does."""
    from kvserve.model.arch import ArchConfig
    from kvserve.model.llama import _moe_block

    dtype, hidden, tokens = torch.bfloat16, 32, 64
    config = transformers.Qwen2MoeConfig(hidden_size=hidden, moe_intermediate_size=16, num_experts=8,
                                         num_experts_per_tok=3, shared_expert_intermediate_size=48,
                                         norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    hf = qwen2_moe.Qwen2MoeSparseMoeBlock(config)
    for param in hf.parameters():
        torch.nn.init.normal_(param, std=0.2)
    hf = hf.to(dtype)
    arch = ArchConfig(architecture="Qwen2MoeForCausalLM", vocab_size=16, hidden_size=hidden, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                      rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
                      tie_word_embeddings=False, attention_bias=True, qk_norm=False, bos_token_id=None,
                      eos_token_ids=(), num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                      norm_topk_prob=norm_topk_prob, moe_layers=(0,), shared_expert_intermediate_size=48)
    ours = _moe_block(arch, dtype, "model.layers.0.mlp")
    assert ours.shared_expert is not None and ours.shared_expert_gate is not None
    w13, w2 = _stacked(hf)
    shared = hf.shared_expert
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.w13.copy_(w13)
        ours.experts.w2.copy_(w2)
        ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        ours.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
        ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
        want = hf(x.unsqueeze(0)).reshape(tokens, hidden)
        got = ours(x)
        _, weights, ids = hf.gate(x)
        without_shared = hf.experts(x, ids, weights)
    assert got.dtype == dtype
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} outputs differ"
    assert not torch.equal(got, without_shared)  # the shared expert counts
