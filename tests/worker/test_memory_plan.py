"""KV-cache sizing arithmetic over fake memory profiles (no GPU needed)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvserve.worker.memory import (
    GiB,
    MemoryProfile,
    gpu_capacity_hint,
    plan_kv_cache,
    prefill_graph_reserve_bytes,
)

MiB = 1 << 20


def _profile(**kw: int) -> MemoryProfile:
    base = dict(
        total_bytes=140 * GiB,
        weights_bytes=15 * GiB,
        in_use_bytes=16 * GiB,
        activation_peak_bytes=3 * GiB,
        graph_reserve_bytes=512 * MiB,
    )
    base.update(kw)
    return MemoryProfile(**base)


def test_budget_is_utilization_times_total_minus_used_activations_and_graphs() -> None:
    per_block = 896 * 1024  # Qwen2.5-7B: 16 tokens x 56 KiB
    plan = plan_kv_cache(_profile(), 0.9, per_block)
    expected_budget = int(140 * GiB * 0.9) - 16 * GiB - 3 * GiB - 512 * MiB
    assert plan.budget_bytes == expected_budget
    assert plan.num_blocks == expected_budget // per_block
    assert plan.num_blocks * per_block <= expected_budget < (plan.num_blocks + 1) * per_block


def test_budget_shrinks_one_for_one_with_each_term() -> None:
    per_block = MiB
    base = plan_kv_cache(_profile(), 0.9, per_block).num_blocks
    assert plan_kv_cache(_profile(activation_peak_bytes=4 * GiB), 0.9, per_block).num_blocks == base - 1024
    assert plan_kv_cache(_profile(graph_reserve_bytes=0), 0.9, per_block).num_blocks == base + 512
    assert plan_kv_cache(_profile(in_use_bytes=17 * GiB), 0.9, per_block).num_blocks == base - 1024


def test_no_room_gives_zero_blocks_not_negative() -> None:
    plan = plan_kv_cache(_profile(in_use_bytes=130 * GiB), 0.9, MiB)
    assert plan.num_blocks == 0 and plan.budget_bytes < 0
    with pytest.raises(ValueError):
        plan_kv_cache(_profile(), 0.9, 0)


def test_capacity_hint_names_the_flags_and_the_needed_utilization() -> None:
    profile = _profile(in_use_bytes=120 * GiB)
    hint = gpu_capacity_hint(profile, 0.9, MiB, blocks_needed=2048)
    assert "--gpu-memory-utilization" in hint and "--max-num-batched-tokens" in hint
    assert "--enforce-eager" in hint
    # 120 + 3 + 0.5 GiB in use + 2 GiB of KV = 125.5 GiB of 140 -> 0.90 (rounded up is fine)
    assert "at least 0.90" in hint
    hopeless = gpu_capacity_hint(_profile(in_use_bytes=139 * GiB), 0.9, MiB, blocks_needed=4096)
    assert "1.0" in hopeless and "--gpu-memory-utilization from" not in hopeless


def test_prefill_graph_reserve_scales_the_activation_peak_and_adds_the_outputs() -> None:
    # peak scaled to the largest graph, plus every graph's output rows kept in the pool
    assert prefill_graph_reserve_bytes(3 * GiB, 8192, [128, 2048, 256], 7168) == 3 * GiB // 4 + 2432 * 7168
    assert prefill_graph_reserve_bytes(1000, 3, [1], 0) == 334  # rounded up
    assert prefill_graph_reserve_bytes(3 * GiB, 8192, [], 7168) == 0  # no prefill graphs


def test_the_engines_gpu_sizing_path_on_a_fake_profile(tiny_model_dir: Callable[..., str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's GPU branch of `determine_num_blocks` and the engine's capacity check, with the profiled
    forward replaced by a fake profile: the blocks are what the budget leaves, and when one max_model_len
    request does not fit the error says how many tokens there are and which flags to change, with numbers."""
    from types import SimpleNamespace

    import torch

    from kvserve.config import ConfigError, EngineArgs
    from kvserve.engine.engine_core import EngineCore, KVCapacity

    args = EngineArgs(model=tiny_model_dir("llama"), device="cpu", max_model_len=256, kv_cache_memory="8MiB")
    core = EngineCore(args.create_engine_config())
    runner = core.runner
    runner.device = torch.device("cuda")  # only its type is read on this path
    per_block = runner.kv_cache_bytes_per_block()
    gpu_config = SimpleNamespace(device_config=SimpleNamespace(device="cuda"),
                                 cache_config=SimpleNamespace(gpu_memory_utilization=0.9, num_blocks=None))

    def size(in_use_blocks: int) -> int:
        profile = MemoryProfile(total_bytes=1000 * per_block, weights_bytes=500 * per_block,
                                in_use_bytes=in_use_blocks * per_block, activation_peak_bytes=80 * per_block,
                                graph_reserve_bytes=10 * per_block)
        monkeypatch.setattr(runner, "profile_memory", lambda: profile)
        blocks = runner.determine_num_blocks()
        assert runner.memory_profile is profile
        core.capacity = KVCapacity(blocks, 16, 256)
        core._check_capacity(gpu_config)  # type: ignore[arg-type]
        return blocks

    assert size(700) == 900 - 700 - 80 - 10  # 0.9 x total - in use - activations - graph reserve
    with pytest.raises(ConfigError) as info:
        size(800)  # 10 blocks = 160 tokens; one request of 256 tokens needs 16
    message = str(info.value)
    assert "holds 160 tokens (10 blocks)" in message and "max_model_len=256" in message
    assert "raise --gpu-memory-utilization from 0.90 to at least 0.91" in message
    assert "--max-num-batched-tokens" in message and "--enforce-eager" in message
    assert message.endswith("or lower --max-model-len")


@pytest.mark.parametrize("settings, hint", [
    ({"kv_cache_memory": "64KiB"}, "raise --kv-cache-memory to at least 1MiB"),
    ({"num_kv_blocks": 3}, "raise --num-gpu-blocks-override (num_kv_blocks) to at least 16"),
], ids=["cpu-budget", "block-override"])
def test_too_small_a_cache_names_the_flag_that_was_set(tiny_model_dir: Callable[..., str], settings: dict,
                                                        hint: str) -> None:
    """A KV cache too small for one max_model_len request names the flag that sized it, with a size that
    suffices (not rounded down to 0.00GiB for a small model)."""
    from kvserve.config import ConfigError, EngineArgs
    from kvserve.engine.engine_core import EngineCore

    args = EngineArgs(model=tiny_model_dir("llama"), device="cpu", max_model_len=256, block_size=16, **settings)
    with pytest.raises(ConfigError) as info:
        EngineCore(args.create_engine_config())
    assert hint in str(info.value)


def test_memory_size_text_rounds_up() -> None:
    from kvserve.config import memory_size_text, parse_memory_size

    for size in (1, (1 << 20) + 1, 700 << 20, (1 << 30) + 1, 5 * (1 << 30) // 3):
        text = memory_size_text(size)
        assert parse_memory_size(text) >= size and parse_memory_size(text) - size < max(size // 100, 1 << 20), text
    assert memory_size_text(1 << 20) == "1MiB" and memory_size_text(3 << 30) == "3.00GiB"
