"""KV-cache sizing arithmetic over fake memory profiles (no GPU needed)."""

from __future__ import annotations

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
