"""Start-up kernel warm-up: one mixed batch per attention tile shape, nothing written to the cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine_core import EngineCore


def test_warm_up_runs_one_batch_per_tile_shape_and_leaves_the_cache_untouched(
    tiny_model_dir: Callable[..., str],
) -> None:
    # 4 query heads over 2 KV heads: rows per tile = next power of two of 2 * chunk length, 16..128.
    model_dir = tiny_model_dir("llama")
    args = EngineArgs(model=model_dir, device="cpu", max_model_len=256, kv_cache_memory="8MiB")
    core = EngineCore(args.create_engine_config())
    arch = core.runner.arch
    assert arch.num_attention_heads // arch.num_key_value_heads == 2
    for cache in core.runner.kv_caches:
        cache.normal_()
    before = [cache.clone() for cache in core.runner.kv_caches]
    assert core.runner.warm_up_kernels() == [2, 9, 17, 33]
    assert all(torch.equal(a, b) for a, b in zip(before, core.runner.kv_caches, strict=True))


def test_warm_up_batches_use_the_steps_block_table_stride(
    tiny_model_dir: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton specialises the attention kernel on whether the block table's row stride divides by 16. A step's
    table is a slice of the runner's persistent one; a warm-up table of its own width (9 blocks here) compiled
    variants no step uses, and the first mixed step with a 5-9-token chunk compiled its own on the H200
    (docs/perf_notes.md, entry 39). Every warm-up batch (the cascade ones too) now reads rows of that table."""
    model_dir = tiny_model_dir("llama", max_position_embeddings=512)
    args = EngineArgs(model=model_dir, device="cpu", max_model_len=512, kv_cache_memory="8MiB", max_num_seqs=64)
    core = EngineCore(args.create_engine_config())
    runner = core.runner
    strides: list[int] = []
    forward = runner.model.forward

    def recording(input_ids, positions, kv_caches, attn_metadata, output_rows=None):  # noqa: ANN001, ANN202
        strides.append(attn_metadata.block_tables.stride(0))
        return forward(input_ids, positions, kv_caches, attn_metadata, output_rows)

    monkeypatch.setattr(runner.model, "forward", recording)
    runner.warm_up_kernels()
    runner._warm_up_cascade()
    width = runner.inputs.block_tables.stride(0)
    assert width == 512 // runner.block_size
    assert len(strides) == 4 + 1 + 4  # tile shapes, the two-prompt batch, four cascade batch sizes
    assert set(strides) == {width}


def _runner_recording_rows(
    tiny_model_dir: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, list[int], list[int]]:
    """A CPU engine's runner (max_num_seqs 64) and the row counts its LM head (`compute_logits`) and its last
    layer past attention (`finish`) are called with, as they are called."""
    model_dir = tiny_model_dir("llama")
    args = EngineArgs(model=model_dir, device="cpu", max_model_len=256, kv_cache_memory="8MiB", max_num_seqs=64)
    runner = EngineCore(args.create_engine_config()).runner
    logits_rows: list[int] = []
    finish_rows: list[int] = []
    compute_logits, finish = runner.model.compute_logits, runner.model.piecewise_model.finish
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: logits_rows.append(h.shape[0]) or compute_logits(h))
    monkeypatch.setattr(runner.model.piecewise_model, "finish",
                        lambda a, r, rows: finish_rows.append(rows.shape[0]) or finish(a, r, rows))
    return runner, logits_rows, finish_rows


def test_warm_up_runs_the_lm_head_at_every_row_count_of_the_skinny_matmul(
    tiny_model_dir: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The LM head runs outside the decode graphs, on 1..max_num_seqs rows; the skinny matmul's variants
    # differ by row count, so each count it serves (and the first past it) runs at start.
    from kvserve.kernels import ops

    runner, rows, _ = _runner_recording_rows(tiny_model_dir, monkeypatch)
    runner.warm_up_kernels()
    assert rows == list(range(1, ops.SKINNY_GEMM_MAX_ROWS + 2))
    rows.clear()
    runner.max_num_reqs = 5
    runner.warm_up_kernels()
    assert rows == [1, 2, 3, 4, 5]


def test_start_up_runs_the_sampled_rows_part_at_every_row_count_a_step_can_sample(
    tiny_model_dir: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # cuBLAS loads a kernel the first time a shape needs it, and that holds the host until the GPU is idle. On
    # the H200 a fresh engine's first LM head at 47 rows held it 283.7 ms, at the end of the forward, so the
    # step's tokens came out a step late. The kernel warm-up runs the LM head at the skinny matmul's row
    # counts; warm_up_sampled_rows runs the last layer past attention and the LM head at every count above.
    runner, logits_rows, finish_rows = _runner_recording_rows(tiny_model_dir, monkeypatch)
    runner.warm_up_kernels()
    runner.warm_up_sampled_rows()
    assert set(logits_rows) == set(range(1, 65))
    assert finish_rows == list(range(33, 65))  # 33: the first count past the skinny matmul
    logits_rows.clear()
    finish_rows.clear()
    runner.max_num_reqs = 5
    runner.warm_up_sampled_rows()
    assert logits_rows == finish_rows == []  # all within the skinny matmul's counts


def test_first_layers_runs_two_layers_and_restores_the_model(tiny_model_dir: Callable[..., str]) -> None:
    model_dir = tiny_model_dir("llama", num_hidden_layers=4)
    args = EngineArgs(model=model_dir, device="cpu", max_model_len=256, kv_cache_memory="8MiB")
    runner = EngineCore(args.create_engine_config()).runner
    layers, caches = list(runner.model.model.layers), list(runner.kv_caches)
    assert len(layers) == 4
    with pytest.raises(RuntimeError, match="inside"), runner._first_layers(2):
        assert list(runner.model.model.layers) == layers[:2]
        assert runner.kv_caches == caches[:2]
        assert runner.warm_up_kernels() == [2, 9, 17, 33]  # the forwards run on two layers
        raise RuntimeError("inside")
    assert list(runner.model.model.layers) == layers
    assert all(a is b for a, b in zip(runner.kv_caches, caches, strict=True)) and len(runner.kv_caches) == 4
