"""A mixture-of-experts model on the GPU (skipped without CUDA, or before the Triton MoE kernel is there).

A tiny random Qwen3-MoE (4 layers, layer 0 dense through mlp_only_layers, 8 experts of width 128, 2 per token)
in float32: greedy tokens with CUDA graphs (decode graphs and piecewise graphs, so `ops.fused_moe` is captured)
equal those of --enforce-eager, and HF Transformers' greedy choices on the same GPU, teacher-forced on
kvserve's tokens, agree with them up to a near-tie (two tokens within 1e-3 in HF's logprobs, which rounding of
two different float32 implementations may tip; nothing after it is compared).

The models have no tokenizer: the engine core is driven with token ids directly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_gpu_engine import _generate_staggered

from kvserve.config import EngineArgs
from kvserve.engine.engine_core import EngineCore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 1024
NUM_NEW = 24


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    # The Triton kernel behind ops.fused_moe: without it the reference's host syncs cannot be captured.
    pytest.importorskip("kvserve.kernels.triton_moe", reason="the Triton fused-MoE kernel is not in this tree")
    from helpers.tiny_models import make_bare_checkpoint

    return make_bare_checkpoint(
        str(tmp_path_factory.mktemp("qwen3-moe")), "qwen3_moe", seed=5, vocab_size=VOCAB, num_hidden_layers=4,
        head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
        mlp_only_layers=[0],
    )


def _prompts(num: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 200, (num,), generator=generator).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _core(path: str, enforce_eager: bool) -> EngineCore:
    args = EngineArgs(model=path, dtype="float32", device="cuda", enforce_eager=enforce_eager, max_model_len=1024,
                      num_kv_blocks=1024, max_num_seqs=16, max_num_batched_tokens=256)
    return EngineCore(args.create_engine_config())


def _assert_hf_agrees(hf: Any, prompt: list[int], tokens: list[int], tol: float = 1e-3) -> None:
    """HF's greedy choice after the prompt and each of kvserve's tokens is kvserve's next token, up to the
    first step where they part, which must be a near-tie in HF's logprobs."""
    ids = torch.tensor([prompt + tokens[:-1]], device="cuda")
    with torch.inference_mode():
        logprobs = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1:].float(), dim=-1)
    choices = logprobs.argmax(dim=-1).tolist()
    part = next((i for i, (a, b) in enumerate(zip(choices, tokens, strict=True)) if a != b), None)
    if part is not None:
        gap = float(logprobs[part, choices[part]] - logprobs[part, tokens[part]])
        assert gap < tol, (part, choices[part], tokens[part], gap)


def test_qwen3_moe_graphs_match_eager_and_hf(moe_checkpoint: str) -> None:
    from transformers import AutoModelForCausalLM

    prompts = _prompts(6, seed=3)
    graph_core = _core(moe_checkpoint, enforce_eager=False)
    assert graph_core.runner.graphs is not None, "CUDA graphs were not captured"
    with_graphs = _generate_staggered(graph_core, prompts, NUM_NEW, 2)
    del graph_core
    eager = _generate_staggered(_core(moe_checkpoint, enforce_eager=True), prompts, NUM_NEW, 2)
    assert with_graphs == eager
    assert all(len(t) == NUM_NEW for t in eager)
    hf = AutoModelForCausalLM.from_pretrained(moe_checkpoint, dtype=torch.float32).cuda().eval()
    for prompt, tokens in zip(prompts, eager, strict=True):
        _assert_hf_agrees(hf, prompt, tokens)
