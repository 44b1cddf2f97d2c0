"""Piecewise graphs (kvserve/worker/piecewise.py) on the CPU: the size choice as pure functions, and the
pieces with eager attention between them against the model's own forward, through `EagerBackend` (a
replay reruns a piece and copies its results into the captured outputs, what a CUDA graph's fixed addresses
amount to). tests/gpu runs the captured CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers.cache_checks import assert_only_slots_written

from kvserve import LLM, SamplingParams
from kvserve.config import EngineArgs
from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
from kvserve.engine.engine_core import EngineCore
from kvserve.model import llama
from kvserve.worker.memory import prefill_graph_reserve_bytes
from kvserve.worker.piecewise import EagerBackend, PiecewiseGraphs, piecewise_graph_sizes, piecewise_size


def test_piecewise_graph_sizes() -> None:
    assert piecewise_graph_sizes(0) == []
    assert piecewise_graph_sizes(63) == []
    assert piecewise_graph_sizes(200) == [64, 128, 192]
    assert piecewise_graph_sizes(512) == [64, 128, 192, 256, 320, 384, 448, 512]
    sizes = piecewise_graph_sizes(2048)
    assert sizes[:8] == [64, 128, 192, 256, 320, 384, 448, 512]
    assert sizes[8:] == list(range(640, 2049, 128))
    assert piecewise_graph_sizes(700)[-1] == 640  # a limit between two sizes: the one below it


def test_piecewise_size() -> None:
    sizes = [64, 128, 192]
    assert piecewise_size(2, 2, False, sizes) == 64
    assert piecewise_size(3, 64, False, sizes) == 64
    assert piecewise_size(3, 65, False, sizes) == 128
    assert piecewise_size(40, 192, False, sizes) == 192
    assert piecewise_size(40, 193, False, sizes) is None  # past the largest: eager
    assert piecewise_size(1, 100, True, sizes) is None  # one fresh prompt: the one-prompt paths
    assert piecewise_size(1, 100, False, sizes) == 128  # one request after cached context
    assert piecewise_size(0, 0, False, sizes) is None
    assert piecewise_size(2, 10, False, []) is None


def test_reserve_counts_the_piecewise_graphs() -> None:
    # Peak of 1,000 bytes at 100 tokens, scaled to the largest size of either kind, plus the prefill graphs'
    # outputs (10 bytes a token) and the piecewise attention output (3 bytes a token of the largest).
    assert prefill_graph_reserve_bytes(1000, 100, [128, 256], 10) == 2560 + 3840
    assert prefill_graph_reserve_bytes(1000, 100, [128, 256], 10, [64, 512], 3) == 5120 + 3840 + 1536
    assert prefill_graph_reserve_bytes(1000, 100, [], 10, [64, 512], 3) == 5120 + 1536
    assert prefill_graph_reserve_bytes(1000, 100, [], 10, [], 3) == 0


def _runner(model_dir: str):  # noqa: ANN202
    args = EngineArgs(model=model_dir, device="cpu", max_model_len=256, kv_cache_memory="8MiB",
                      max_num_batched_tokens=256, max_num_seqs=8)
    return EngineCore(args.create_engine_config()).runner


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_pieces_match_the_forward_on_a_mixed_step(tiny_model_dir: Callable[..., str], variant: str) -> None:
    """A step of two decode rows, a chunk after cached context and a fresh prompt (75 tokens), padded to the
    128-token pieces: the sampled rows' final states and every request's cache slots equal the eager
    forward's; the padding writes nothing; a step that samples nothing still writes the cache."""
    runner = _runner(tiny_model_dir(variant))
    size = runner.block_size
    gen = torch.Generator().manual_seed(1)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 1000, (n,), generator=gen).tolist()

    # (req id, cached tokens, new tokens): two decoding requests, a chunk after 20 cached tokens, a fresh prompt
    shapes = [("d0", 30, 1), ("d1", 47, 1), ("c", 20, 33), ("f", 0, 40)]
    prompts = {rid: tokens(cached + new) for rid, cached, new in shapes}
    next_block = 1
    blocks: dict[str, list[int]] = {}
    for rid, cached, new in shapes:
        count = -(-(cached + new) // size)
        blocks[rid] = list(range(next_block, next_block + count))
        next_block += count
    context_step = SchedulerOutput(scheduled=[
        ScheduledRequest(rid, prompts[rid][:cached], 0, blocks[rid], True, False)
        for rid, cached, _ in shapes if cached
    ])
    step = SchedulerOutput(scheduled=[
        ScheduledRequest(rid, prompts[rid][cached:], cached, [] if cached else blocks[rid], not cached, sample)
        for (rid, cached, _), sample in zip(shapes, [True, True, False, True], strict=True)
    ])
    num_tokens = step.total_num_scheduled_tokens
    pieces = PiecewiseGraphs(runner.model, runner.kv_caches, runner.inputs.dev, runner.inputs.block_tables, [64, 128])
    pieces.capture(EagerBackend())

    def run(piecewise: bool, batch_step: SchedulerOutput) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for cache in runner.kv_caches:
            cache.zero_()
        runner.block_table = type(runner.block_table)(8, runner.block_table.width, runner.device)
        runner.block_table.apply(context_step)
        warm = runner.inputs.prepare(context_step, runner.block_table)
        with torch.inference_mode():
            runner.model(warm.input_ids, warm.positions, runner.kv_caches, warm.attn_metadata)
            runner.block_table.apply(batch_step)
            batch = runner.inputs.prepare(batch_step, runner.block_table, token_pad_to=128 if piecewise else None)
            # the sampling rows as a decode batch, where any row samples
            assert (batch.attn_metadata.sampled is not None) == any(s.sample for s in batch_step.scheduled)
            if piecewise:
                assert batch.piecewise_tokens == 128 and batch.input_ids.shape[0] == 128
                assert batch.attn_metadata.num_tokens == num_tokens
                hidden = pieces.replay(128, batch.attn_metadata, batch.logits_indices)
            else:
                assert batch.piecewise_tokens is None
                hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.attn_metadata,
                                      batch.logits_indices)
        return hidden.clone(), [c.clone() for c in runner.kv_caches]

    want_hidden, want_caches = run(False, step)
    replays = pieces.replays
    got_hidden, got_caches = run(True, step)
    assert pieces.replays == replays + 1
    assert got_hidden.shape == want_hidden.shape == (3, runner.arch.hidden_size)
    torch.testing.assert_close(got_hidden, want_hidden, rtol=1e-5, atol=1e-5)
    used = torch.tensor([b * size + i for rid, cached, new in shapes for b in blocks[rid] for i in range(size)
                         if (b - blocks[rid][0]) * size + i < cached + new])
    assert_only_slots_written(got_caches, want_caches, used)
    # The last layer attends for the sampled rows alone (decode queries over the cache); every token
    # attending, then selecting, gives the same rows, eagerly and in pieces.
    llama.set_sampled_row_attention(False)
    try:
        full_hidden, _ = run(False, step)
        full_pieces, _ = run(True, step)
    finally:
        llama.set_sampled_row_attention(True)
    torch.testing.assert_close(want_hidden, full_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full_pieces, full_hidden, rtol=1e-5, atol=1e-5)

    # No request samples (every chunk is a middle one): the pieces write the cache, nothing is returned.
    silent = SchedulerOutput(scheduled=[
        ScheduledRequest(s.req_id, s.token_ids, s.num_computed_tokens, s.new_block_ids, s.reset_block_table, False)
        for s in step.scheduled
    ])
    empty, silent_caches = run(True, silent)
    assert empty.shape == (0, runner.arch.hidden_size)
    for got, want in zip(silent_caches, want_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pieces_match_the_forward_on_a_decode_batch(tiny_model_dir: Callable[..., str]) -> None:
    """A decode-only batch (what the pieces serve past the largest decode graph): every row samples."""
    runner = _runner(tiny_model_dir("qwen2"))
    size = runner.block_size
    gen = torch.Generator().manual_seed(2)
    cached = [30, 47, 20, 9, 16]
    prompts = [torch.randint(3, 1000, (n + 1,), generator=gen).tolist() for n in cached]
    blocks, next_block = [], 1
    for n in cached:
        count = -(-(n + 1) // size)
        blocks.append(list(range(next_block, next_block + count)))
        next_block += count
    context = SchedulerOutput(scheduled=[ScheduledRequest(f"r{i}", p[:-1], 0, b, True, False)
                                         for i, (p, b) in enumerate(zip(prompts, blocks, strict=True))])
    decode = SchedulerOutput(scheduled=[ScheduledRequest(f"r{i}", p[-1:], n, [], False, True)
                                        for i, (p, n) in enumerate(zip(prompts, cached, strict=True))])
    pieces = PiecewiseGraphs(runner.model, runner.kv_caches, runner.inputs.dev, runner.inputs.block_tables, [64])
    pieces.capture(EagerBackend())
    runner.block_table.apply(context)
    warm = runner.inputs.prepare(context, runner.block_table)
    runner.block_table.apply(decode)
    results = []
    with torch.inference_mode():
        runner.model(warm.input_ids, warm.positions, runner.kv_caches, warm.attn_metadata)
        for piecewise in (False, True):
            batch = runner.inputs.prepare(decode, runner.block_table, token_pad_to=64 if piecewise else None)
            assert batch.is_decode_only and len(batch.logits_indices) == len(cached)
            if piecewise:
                results.append(pieces.replay(64, batch.attn_metadata, batch.logits_indices).clone())
            else:
                results.append(runner.model(batch.input_ids, batch.positions, runner.kv_caches,
                                            batch.attn_metadata).clone())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


def test_token_padding_refuses_a_batch_past_the_buffers(tiny_model_dir: Callable[..., str]) -> None:
    runner = _runner(tiny_model_dir("llama"))
    step = SchedulerOutput(scheduled=[ScheduledRequest("a", list(range(3, 13)), 0, [1], True, True),
                                      ScheduledRequest("b", list(range(3, 8)), 0, [2], True, True)])
    runner.block_table.apply(step)
    with pytest.raises(RuntimeError, match="cannot pad a batch of 15 tokens to 8"):
        runner.inputs.prepare(step, runner.block_table, token_pad_to=8)
    batch = runner.inputs.prepare(step, runner.block_table, token_pad_to=64)
    assert batch.piecewise_tokens == 64
    assert runner.inputs.dev["slot_mapping"][15:64].eq(-1).all()
    assert runner.inputs.dev["input_ids"][15:64].eq(0).all()
    assert batch.attn_metadata.slot_mapping.shape[0] == 15


PROMPTS = [
    "You are a careful assistant. Answer briefly. What is the capital of France?",
    "Hello, my name is",
    "今天天气很好，我们",
    "You are a careful assistant. Answer briefly. Name three primary colours.",
    "Explain what a KV cache is in one sentence.",
]


@pytest.mark.parametrize(
    "settings",
    [{}, {"async_scheduling": True, "max_num_batched_tokens": 24}],
    ids=["sync", "async-chunked"],
)
def test_engine_greedy_output_unchanged_with_piecewise_steps(default_gguf_path: str, settings: dict) -> None:
    """The engine on the default model with every step that has prefill tokens replayed piecewise gives the
    same greedy tokens as the eager engine (scheduler invariants checked every step)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[int]]:
        llm.engine.core.check_invariants_every_step = True
        # Requests arrive one after another, so that prompts share steps with other requests' decodes.
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    # One engine, eager first, then with the piecewise steps installed (no prefix caching: the second run
    # computes every prompt again).
    llm = LLM(max_model_len=256, enable_prefix_caching=False, **settings)
    want = tokens(llm)
    runner = llm.engine.core.runner
    assert runner.piecewise is None  # the first run was eager
    pieces = PiecewiseGraphs(runner.model, runner.kv_caches, runner.inputs.dev, runner.inputs.block_tables, [64, 128])
    pieces.capture(EagerBackend())
    runner.piecewise = pieces
    assert tokens(llm) == want
    assert pieces.replays > 0
