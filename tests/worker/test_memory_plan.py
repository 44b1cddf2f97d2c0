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
    start_memory_error,
)

MiB = 1 << 20


def _profile(**kw: int) -> MemoryProfile:
    base = dict(
        total_bytes=140 * GiB,
        weights_bytes=15 * GiB,
        in_use_at_start_bytes=1 * GiB,  # the CUDA context and anything other processes hold
        in_use_bytes=17 * GiB,  # this process added 16 GiB: weights and workspaces
        activation_peak_bytes=3 * GiB,
        graph_reserve_bytes=512 * MiB,
    )
    base.update(kw)
    return MemoryProfile(**base)


def test_budget_is_utilization_times_total_minus_this_process_activations_and_graphs() -> None:
    per_block = 896 * 1024  # Qwen2.5-7B: 16 tokens x 56 KiB
    plan = plan_kv_cache(_profile(), 0.9, per_block)
    # what this process added since its start (17 - 1 GiB), not the device-wide 17 GiB
    expected_budget = int(140 * GiB * 0.9) - 16 * GiB - 3 * GiB - 512 * MiB
    assert plan.budget_bytes == expected_budget
    assert plan.num_blocks == expected_budget // per_block
    assert plan.num_blocks * per_block <= expected_budget < (plan.num_blocks + 1) * per_block


def test_budget_shrinks_one_for_one_with_each_term() -> None:
    per_block = MiB
    base = plan_kv_cache(_profile(), 0.9, per_block).num_blocks
    assert plan_kv_cache(_profile(activation_peak_bytes=4 * GiB), 0.9, per_block).num_blocks == base - 1024
    assert plan_kv_cache(_profile(graph_reserve_bytes=0), 0.9, per_block).num_blocks == base + 512
    assert plan_kv_cache(_profile(in_use_bytes=18 * GiB), 0.9, per_block).num_blocks == base - 1024
    # memory in use at start (other processes) does not count against this instance
    assert plan_kv_cache(_profile(in_use_at_start_bytes=2 * GiB, in_use_bytes=18 * GiB), 0.9,
                         per_block).num_blocks == base


def test_a_second_instance_gets_its_own_share_of_a_shared_gpu() -> None:
    """Two instances at 0.45 on one GPU, as vLLM allows: the second starts with the first's 63 GiB (and a CUDA
    context) in use and gets 0.45 x total - what it adds itself, as the first did; the device-wide formula
    (memory in use at start counted as this instance's) left it no block at all."""
    per_block = MiB
    first = plan_kv_cache(_profile(in_use_at_start_bytes=512 * MiB, in_use_bytes=16 * GiB + 512 * MiB), 0.45,
                          per_block)
    expected = int(140 * GiB * 0.45) - 16 * GiB - 3 * GiB - 512 * MiB
    assert first.budget_bytes == expected and first.num_blocks == expected // per_block
    held = 63 * GiB + 512 * MiB  # the first instance's whole budget, and its context
    second_profile = _profile(in_use_at_start_bytes=held + 512 * MiB, in_use_bytes=held + 16 * GiB + 512 * MiB)
    second = plan_kv_cache(second_profile, 0.45, per_block)
    assert second.budget_bytes == expected and second.num_blocks == first.num_blocks
    assert second.num_blocks * per_block > 40 * GiB
    device_wide = plan_kv_cache(_profile(in_use_at_start_bytes=0, in_use_bytes=second_profile.in_use_bytes),
                                0.45, per_block)
    assert device_wide.num_blocks == 0


def test_memory_freed_by_another_process_does_not_shrink_this_ones_below_its_weights() -> None:
    # another process released 10 GiB between the two readings: the growth (6 GiB) is floored at the weights
    profile = _profile(in_use_at_start_bytes=20 * GiB, in_use_bytes=26 * GiB)
    assert profile.process_bytes == 15 * GiB
    assert plan_kv_cache(profile, 0.9, MiB).budget_bytes == int(140 * GiB * 0.9) - 15 * GiB - 3 * GiB - 512 * MiB


def test_describe_names_this_instances_terms() -> None:
    profile = _profile()
    text = plan_kv_cache(profile, 0.9, MiB).describe(profile, 0.9)
    assert "utilization 0.90 (this instance's budget; 1.00 GiB was in use at start)" in text
    assert "this process added 16.00 GiB (weights 15.00 GiB)" in text
    assert "activation peak 3.00 GiB" in text and "graph reserve 0.50 GiB" in text


def test_start_refused_when_free_memory_is_below_the_budget() -> None:
    assert start_memory_error(126 * GiB, 140 * GiB, 0.9) is None  # exactly the budget free: starts
    assert start_memory_error(77 * GiB, 140 * GiB, 0.45) is None
    message = start_memory_error(70 * GiB, 140 * GiB, 0.9)
    assert message is not None
    assert "only 70.00 GiB of the GPU's 140.00 GiB is free at start" in message
    assert "less than the 126.00 GiB that --gpu-memory-utilization 0.90 asks for this instance" in message
    assert "other processes (or earlier allocations of this one) hold 70.00 GiB" in message
    assert "lower --gpu-memory-utilization to at most 0.50" in message
    nearly_full = start_memory_error(GiB // 2, 140 * GiB, 0.9)
    assert nearly_full is not None and "lower --gpu-memory-utilization, or free GPU memory" in nearly_full


def test_no_room_gives_zero_blocks_not_negative() -> None:
    plan = plan_kv_cache(_profile(in_use_bytes=131 * GiB), 0.9, MiB)
    assert plan.num_blocks == 0 and plan.budget_bytes < 0
    with pytest.raises(ValueError):
        plan_kv_cache(_profile(), 0.9, 0)


def test_capacity_hint_names_the_flags_and_the_needed_utilization() -> None:
    # a second instance at 0.2: 20 GiB in use at start (not its own); it adds 16 GiB + 3 + 0.5 = 19.5 GiB
    profile = _profile(in_use_at_start_bytes=20 * GiB, in_use_bytes=36 * GiB)
    hint = gpu_capacity_hint(profile, 0.2, MiB, blocks_needed=10 * 1024)
    assert "--gpu-memory-utilization" in hint and "--max-num-batched-tokens" in hint
    assert "--enforce-eager" in hint
    # 28 GiB budget - 19.5 = 8.5 GiB of KV, 1.5 GiB short; 19.5 + 10 GiB of KV = 29.5 GiB of 140 -> 0.2107,
    # rounded up; the 20 GiB in use at start is not counted (the device-wide figure would ask for 0.36)
    assert hint.startswith("1.50 GiB more KV cache is needed; ")
    assert "raise --gpu-memory-utilization from 0.20 to at least 0.22;" in hint
    assert int(0.22 * 140 * GiB) - profile.non_kv_bytes >= 10 * GiB > int(0.21 * 140 * GiB) - profile.non_kv_bytes
    # what is needed is more than was free at start: raising it needs other processes to release memory
    crowded = gpu_capacity_hint(_profile(in_use_at_start_bytes=100 * GiB, in_use_bytes=116 * GiB), 0.2, MiB,
                                blocks_needed=30 * 1024)
    assert ("raise --gpu-memory-utilization from 0.20 to at least 0.36, after other processes release GPU "
            "memory (only 40.00 GiB was free at start)") in crowded
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
                                 cache_config=SimpleNamespace(gpu_memory_utilization=0.9, num_blocks=None,
                                                              gpu_kv_cache_memory_bytes=None))

    def size(in_use_blocks: int) -> int:
        # 50 blocks' worth in use at start (other processes): not counted against this instance
        profile = MemoryProfile(total_bytes=1000 * per_block, weights_bytes=500 * per_block,
                                in_use_at_start_bytes=50 * per_block,
                                in_use_bytes=(50 + in_use_blocks) * per_block,
                                activation_peak_bytes=80 * per_block, graph_reserve_bytes=10 * per_block)
        monkeypatch.setattr(runner, "profile_memory", lambda: profile)
        blocks = runner.determine_num_blocks()
        assert runner.memory_profile is profile
        core.capacity = KVCapacity(blocks, 16, 256)
        core._check_capacity(gpu_config)  # type: ignore[arg-type]
        return blocks

    assert size(700) == 900 - 700 - 80 - 10  # 0.9 x total - this process's growth - activations - graph reserve
    with pytest.raises(ConfigError) as info:
        size(800)  # 10 blocks = 160 tokens; one request of 256 tokens needs 16
    message = str(info.value)
    assert "holds 160 tokens (10 blocks)" in message and "max_model_len=256" in message
    assert "raise --gpu-memory-utilization from 0.90 to at least 0.91;" in message
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


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, readings: list[tuple[int, int]], calls: list[str]) -> None:
    """torch.cuda's memory functions as the runner calls them, answering `mem_get_info` from `readings`
    (free, total) in turn; `calls` records the order."""
    import torch

    def mem_get_info(device: object = None) -> tuple[int, int]:
        calls.append("mem_get_info")
        return readings.pop(0)

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * GiB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1 * GiB + 512 * MiB)


def test_the_runner_reads_memory_in_use_at_start_before_the_weights_and_refuses_too_little(
    tiny_model_dir: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner on CUDA (faked) reads the device's memory in use after releasing its cached blocks and before
    loading the weights; at a utilization above the free memory it refuses there, naming the numbers and the
    flag; --num-gpu-blocks-override skips the check (the utilization sizes nothing then)."""
    import torch

    from kvserve.config import ConfigError, EngineArgs
    from kvserve.worker import model_runner

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the config's device check
    monkeypatch.setattr(model_runner, "prefer_cublaslt", lambda device: False)

    class Loaded(Exception):
        pass

    def load_model(*args: object, **kwargs: object) -> None:
        calls.append("load_model")
        raise Loaded

    monkeypatch.setattr(model_runner, "load_model", load_model)

    def start(utilization: float, free: int, **kw: object) -> None:
        calls.clear()
        _fake_cuda(monkeypatch, [(free, 80 * GiB)], calls)
        args = EngineArgs(model=tiny_model_dir("llama"), device="cuda", dtype="float32", max_model_len=256,
                          gpu_memory_utilization=utilization, **kw)
        model_runner.ModelRunner(args.create_engine_config())

    with pytest.raises(Loaded):  # 36 GiB asked, 44 GiB free (another instance holds 36 GiB): starts
        start(0.45, 44 * GiB)
    assert calls == ["empty_cache", "mem_get_info", "load_model"]
    with pytest.raises(ConfigError) as info:
        start(0.6, 44 * GiB)
    assert calls == ["empty_cache", "mem_get_info"]  # refused before the weights
    message = str(info.value)
    assert "only 44.00 GiB of the GPU's 80.00 GiB is free at start" in message
    assert "48.00 GiB that --gpu-memory-utilization 0.60 asks for this instance" in message
    assert "hold 36.00 GiB: lower --gpu-memory-utilization to at most 0.55" in message
    with pytest.raises(Loaded):
        start(0.6, 44 * GiB, num_kv_blocks=64)


def test_the_profile_counts_what_this_process_added_since_its_start(
    tiny_model_dir: Callable[..., str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`profile_memory` run on the CPU with torch.cuda's readings faked: the start figure the runner read,
    the device-wide figure after the step, the peak above the step's start; the KV budget counts only the
    growth, and a growth below the weights (another process freed memory meanwhile) is floored and warned of."""
    import logging

    from kvserve.config import EngineArgs
    from kvserve.engine.engine_core import EngineCore

    args = EngineArgs(model=tiny_model_dir("llama"), device="cpu", max_model_len=256, kv_cache_memory="8MiB")
    runner = EngineCore(args.create_engine_config()).runner
    assert runner.in_use_at_start_bytes is None  # not read off CUDA
    calls: list[str] = []
    runner.in_use_at_start_bytes = 36 * GiB  # another instance's 36 GiB, read at this one's start
    _fake_cuda(monkeypatch, [(40 * GiB, 80 * GiB)], calls)
    kept_before = runner.sampler.kept_bytes()
    profile = runner.profile_memory()
    kept = runner.sampler.kept_bytes() - kept_before
    assert profile.total_bytes == 80 * GiB and profile.in_use_bytes == 40 * GiB
    assert profile.in_use_at_start_bytes == 36 * GiB and profile.process_bytes == 4 * GiB
    assert profile.weights_bytes == runner.weights_bytes() > 0
    assert profile.activation_peak_bytes == 512 * MiB - kept and profile.graph_reserve_bytes == 0  # CPU: no graphs
    plan = plan_kv_cache(profile, 0.45, MiB)
    assert plan.budget_bytes == int(80 * GiB * 0.45) - 4 * GiB - profile.activation_peak_bytes
    assert calls[-1] == "mem_get_info"

    runner.in_use_at_start_bytes = 40 * GiB + 1  # memory released by another process: no growth seen
    _fake_cuda(monkeypatch, [(40 * GiB, 80 * GiB)], calls)
    with caplog.at_level(logging.WARNING, logger=runner_logger_name()):
        profile = runner.profile_memory()
    assert profile.process_bytes == profile.weights_bytes
    assert "memory counted at start was released meanwhile" in caplog.text


def runner_logger_name() -> str:
    from kvserve.worker import model_runner

    return model_runner.logger.name
