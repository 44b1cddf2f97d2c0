"""A one-request prefill padded to a graph's token count (what the prefill CUDA graphs replay) computes the
same rows and writes the same KV cache as the unpadded step, in both padding forms (more tokens of the
prompt: the fresh-prompt graphs; a second request of no length: the cache graphs), fresh and after cached
context: run eagerly on the CPU, where the graphs themselves cannot be captured. tests/gpu covers the
captured graphs, tests/kernels the Triton kernel on a padded step."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers.cache_checks import assert_only_slots_written

from kvserve.config import EngineArgs
from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
from kvserve.engine.engine_core import EngineCore


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
@pytest.mark.parametrize(
    ("context", "as_request"), [(0, False), (0, True), (20, True)],
    ids=["fresh-prompt-graph", "cache-graph-fresh", "cache-graph-after-cached-context"],
)
def test_padded_prefill_matches_unpadded(
    tiny_model_dir: Callable[..., str], variant: str, context: int, as_request: bool
) -> None:
    args = EngineArgs(model=tiny_model_dir(variant), device="cpu", max_model_len=256, kv_cache_memory="8MiB",
                      max_num_batched_tokens=256)
    runner = EngineCore(args.create_engine_config()).runner
    size = runner.block_size
    prompt = torch.randint(3, 1000, (context + 37,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks = list(range(5, 5 + -(-len(prompt) // size)))
    first = -(-context // size)
    cached = SchedulerOutput(scheduled=[ScheduledRequest("p", prompt[:context], 0, blocks[:first], True, True)])
    step = SchedulerOutput(scheduled=[ScheduledRequest("p", prompt[context:], context, blocks[first:], not context,
                                                       True)])

    def run(batch_step: SchedulerOutput, pad_to: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        runner.block_table.apply(batch_step)
        batch = runner.inputs.prepare(batch_step, runner.block_table, prefill_pad_to=pad_to,
                                      pad_as_request=as_request and pad_to is not None)
        with torch.inference_mode():
            hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.attn_metadata)
            logits = runner.model.compute_logits(hidden[batch.logits_indices])
        return hidden[: len(batch_step.scheduled[0].token_ids)].clone(), logits

    def forward(pad_to: int | None) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        for cache in runner.kv_caches:
            cache.zero_()
        if context:
            run(cached, None)  # the context goes into the cache unpadded either way
        hidden, logits = run(step, pad_to)
        return hidden, [c.clone() for c in runner.kv_caches], logits

    hidden, caches, logits = forward(None)
    padded_hidden, padded_caches, padded_logits = forward(128)
    torch.testing.assert_close(padded_hidden, hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded_logits, logits, rtol=1e-5, atol=1e-5)
    assert padded_logits.argmax(-1).tolist() == logits.argmax(-1).tolist()
    # The request's slots hold the same K/V (a matmul over 128 rows may round differently from one over
    # 37); every other slot is still zero: the padding tokens wrote nothing.
    slots = torch.tensor([b * size + i for b in blocks for i in range(size)][: len(prompt)])
    assert_only_slots_written(padded_caches, caches, slots)
