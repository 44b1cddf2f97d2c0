"""Cascade attention end to end on CPU: the engine with the Triton attention kernels (interpreted) gives the
same greedy tokens with cascade on as off, and cascade really runs for a batch sharing a prompt prefix.

On CPU the engine normally attends with the torch reference, which ignores the shared prefix; here the
model's attention calls are routed to the Triton launcher, and the cascade thresholds are lowered to fit
a tiny model and short prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.kernels import ops, triton_attention  # noqa: E402
from kvserve.layers.attention_metadata import AttentionMetadata  # noqa: E402
from kvserve.worker import input_batch  # noqa: E402

# About 100 tokens: a prefix of six full blocks, more than one 64-key tile of the shared-prefix kernel.
SHARED = (
    "You are a careful assistant. Answer briefly and precisely, and say when you are unsure. Use plain words. "
    "Never invent facts, names or numbers. Prefer short sentences; avoid jargon unless the user uses it first. "
    "When a question is ambiguous, ask one clarifying question before answering. Keep a friendly tone. "
    "If the user writes in another language, answer in that language. Format lists with dashes, one item "
    "per line, and put code in fenced blocks with the language named after the opening fence."
)
PROMPTS = [SHARED + suffix for suffix in (" Capital of France?", " Three colours?", " Hi.", " What is 2+2?")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def triton_attention_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Route attention to the Triton kernels; returns the common_prefix_len of every decode launch."""
    prefixes: list[int] = []

    def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                        scale: float, out: torch.Tensor | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> torch.Tensor:
        if metadata.is_decode_only:
            prefixes.append(metadata.common_prefix_len)
        return triton_attention.launch_paged_attention(query, kv_cache, metadata, scale, out, None, k_scale, v_scale)

    monkeypatch.setattr(ops, "paged_attention", paged_attention)
    monkeypatch.setattr(input_batch, "CASCADE_MIN_REQS", 2)
    monkeypatch.setattr(input_batch, "CASCADE_MIN_PREFIX_TOKENS", 16)
    return prefixes


def _generate(model: str, cascade: bool, **settings: Any) -> list[list[int]]:
    # 256 blocks (the tiny model's default pool, 131072, makes the invariant check after every step ~0.25 s).
    llm = LLM(model=model, max_model_len=256, block_size=16, num_kv_blocks=256, cascade_attn=cascade, **settings)
    llm.engine.core.check_invariants_every_step = True
    llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)  # puts the shared prefix in the cache
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("settings", [{}, {"async_scheduling": True}], ids=["sync", "async"])
def test_cascade_keeps_greedy_tokens(settings: dict[str, Any], tiny_model_dir: Callable[..., str],
                                     triton_attention_on_cpu: list[int], device: torch.device) -> None:
    model = tiny_model_dir("llama")
    plain = _generate(model, cascade=False, **settings)
    assert not any(triton_attention_on_cpu), "cascade ran with the flag off"
    triton_attention_on_cpu.clear()
    cascade = _generate(model, cascade=True, **settings)
    shared_tokens = max(triton_attention_on_cpu)
    assert shared_tokens >= 80, f"cascade never ran (prefix lengths seen: {set(triton_attention_on_cpu)})"
    assert cascade == plain
