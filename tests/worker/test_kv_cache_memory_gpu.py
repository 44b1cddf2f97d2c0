"""--kv-cache-memory (and vLLM's --kv-cache-memory-bytes) on a GPU: the KV cache takes that size instead of
the --gpu-memory-utilization budget, refused with the numbers when the device lacks it; checked over fake
memory profiles and a fake runner, with no GPU."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvserve.config import ConfigError, EngineArgs
from kvserve.engine.engine_core import EngineCore, KVCapacity
from kvserve.entrypoints.cli import build_parser
from kvserve.entrypoints.openai.cli_args import server_engine_args
from kvserve.worker.memory import (
    GiB,
    KVCacheMemoryError,
    MemoryProfile,
    describe_requested_kv_cache,
    free_after_profile,
    plan_kv_cache,
    plan_requested_kv_cache,
)
from kvserve.worker.model_runner import ModelRunner

MiB = 1 << 20


def _profile(**kw: int) -> MemoryProfile:
    base = dict(total_bytes=80 * GiB, weights_bytes=15 * GiB, in_use_bytes=16 * GiB,
                activation_peak_bytes=3 * GiB, graph_reserve_bytes=512 * MiB)
    base.update(kw)
    return MemoryProfile(**base)


def test_the_requested_size_is_taken_whatever_the_utilization() -> None:
    plan = plan_requested_kv_cache(_profile(), 10 * GiB, MiB)
    assert plan.num_blocks == 10 * 1024 and plan.budget_bytes == 10 * GiB
    assert plan_requested_kv_cache(_profile(), 10 * GiB + MiB - 1, MiB).num_blocks == 10 * 1024  # whole blocks
    # All that is free, though 0.9 of the total would leave less: the utilization is not consulted.
    free = free_after_profile(_profile())
    assert free == 80 * GiB - 16 * GiB - 3 * GiB - 512 * MiB
    assert plan_requested_kv_cache(_profile(), free, MiB).num_blocks == free // MiB
    line = describe_requested_kv_cache(plan, _profile())
    assert "KV cache 10.00 GiB as --kv-cache-memory asks" in line and "10240 blocks" in line


def test_more_than_the_device_has_free_is_refused_with_the_numbers() -> None:
    free = free_after_profile(_profile())
    with pytest.raises(KVCacheMemoryError) as info:
        plan_requested_kv_cache(_profile(), free + 1, MiB)
    message = str(info.value)
    assert "--kv-cache-memory 60.50 GiB does not fit" in message and "60.50 GiB free" in message
    assert "--max-num-batched-tokens" in message and "--enforce-eager" in message
    with pytest.raises(KVCacheMemoryError, match="0.00 GiB free") as info:  # nothing free: not negative
        plan_requested_kv_cache(_profile(in_use_bytes=79 * GiB), GiB, MiB)
    assert "--enforce-eager" in str(info.value)
    assert "--enforce-eager" not in str(pytest.raises(
        KVCacheMemoryError, plan_requested_kv_cache, _profile(graph_reserve_bytes=0), 70 * GiB, MiB).value)
    with pytest.raises(ValueError):
        plan_requested_kv_cache(_profile(), GiB, 0)


def _model(directory: Path) -> str:
    import json

    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6}))
    return str(directory)


@pytest.mark.parametrize("flag", ["--kv-cache-memory", "--kv-cache-memory-bytes"])
def test_the_flag_and_its_vllm_name_reach_the_gpu_config(flag: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import kvserve.config as config_module

    monkeypatch.setattr(config_module, "_check_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    ns = build_parser().parse_args(["serve", _model(tmp_path), flag, "2GiB"])
    args = {**server_engine_args(ns), "device": "cuda", "load_format": "dummy"}
    config = EngineArgs(**args).create_engine_config()  # type: ignore[arg-type]
    assert config.model_config.model == str(tmp_path)  # the command's model, not the default one
    cache = config.cache_config
    assert cache.gpu_kv_cache_memory_bytes == 2 * GiB
    ns = build_parser().parse_args(["serve", _model(tmp_path)])
    args = {**server_engine_args(ns), "device": "cuda", "load_format": "dummy"}
    assert EngineArgs(**args).create_engine_config().cache_config.gpu_kv_cache_memory_bytes is None  # type: ignore[arg-type]
    # On CPU the flag is the CPU budget, as before.
    cpu = EngineArgs(model=_model(tmp_path), device="cpu", load_format="dummy", kv_cache_memory="2GiB")
    assert cpu.create_engine_config().cache_config.gpu_kv_cache_memory_bytes is None
    assert cpu.create_engine_config().cache_config.kv_cache_memory_bytes == 2 * GiB


def test_llm_takes_vllms_keyword() -> None:
    from kvserve.engine.llm import _engine_args

    assert _engine_args({"kv_cache_memory_bytes": 1 << 30}) == {"kv_cache_memory_bytes": 1 << 30}


def _fake_runner(requested: int | None, profile: MemoryProfile, gguf_note: str = "") -> Any:
    cache = SimpleNamespace(gpu_kv_cache_memory_bytes=requested, gpu_memory_utilization=0.5,
                            kv_cache_memory_bytes=GiB)
    return SimpleNamespace(
        device=SimpleNamespace(type="cuda"), config=SimpleNamespace(cache_config=cache),
        kv_cache_bytes_per_block=lambda: MiB, profile_memory=lambda: profile, gguf_capacity_note=lambda: gguf_note,
        memory_profile=None, kv_plan=None,
    )


def test_the_runner_sizes_the_gpu_cache_by_the_flag() -> None:
    profile = _profile()
    fits = _fake_runner(4 * GiB, profile)
    fits.gguf_capacity_note = lambda: pytest.fail("the GGUF note (it reads the file) is built only for an error")
    assert ModelRunner.determine_num_blocks(fits) == 4 * 1024
    # Without the flag: the utilization's budget, as before.
    assert ModelRunner.determine_num_blocks(_fake_runner(None, profile)) == plan_kv_cache(profile, 0.5, MiB).num_blocks
    assert plan_kv_cache(profile, 0.5, MiB).num_blocks != 4 * 1024
    with pytest.raises(ConfigError, match="does not fit on this GPU.*GGUF note"):
        ModelRunner.determine_num_blocks(_fake_runner(70 * GiB, profile, " (GGUF note)"))


def test_a_cache_too_small_for_one_request_names_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _fake_runner(MiB, _profile(), " (note: GGUF weights dequantized)")
    runner.kv_cache_bytes_per_block = lambda: MiB
    runner.memory_profile = _profile()
    core = SimpleNamespace(capacity=KVCapacity(1, 16, 256), runner=runner)
    config = SimpleNamespace(cache_config=SimpleNamespace(num_blocks=0, gpu_kv_cache_memory_bytes=MiB,
                                                          gpu_memory_utilization=0.9),
                             device_config=SimpleNamespace(device="cuda"))
    with pytest.raises(ConfigError, match=r"raise --kv-cache-memory to at least 16MiB.*GGUF weights dequantized"):
        EngineCore._check_capacity(core, config)  # type: ignore[arg-type]
    config.cache_config.gpu_kv_cache_memory_bytes = None
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization.*GGUF weights dequantized"):
        EngineCore._check_capacity(core, config)  # type: ignore[arg-type]
