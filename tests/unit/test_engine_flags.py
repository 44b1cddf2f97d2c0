"""Engine flags of the CLI map onto EngineArgs under vLLM's names."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvserve.config import EngineArgs
from kvserve.entrypoints.cli import build_parser, engine_args_from


@pytest.mark.parametrize(
    "flags, expected",
    [([], True), (["--cascade-attn"], True), (["--no-cascade-attn"], False), (["--disable-cascade-attn"], False),
     (["--cascade-attn", "--disable-cascade-attn"], False)],
)
def test_cascade_attn_flag(flags: list[str], expected: bool) -> None:
    ns = build_parser().parse_args(["generate", "--prompt", "x", *flags])
    args = engine_args_from(ns)
    assert args["cascade_attn"] is expected
    assert EngineArgs(**args).cascade_attn is expected  # type: ignore[arg-type]


@pytest.mark.parametrize("flags", [["--quantization", "awq"], ["-q", "awq"]])
def test_quantization_flag_and_its_short_form(flags: list[str]) -> None:
    ns = build_parser().parse_args(["serve", "/models/m", *flags])
    assert engine_args_from(ns)["quantization"] == "awq"


def _config_of(command: list[str], directory: Path, max_position_embeddings: int) -> Callable[..., Any]:
    """config(*flags) -> the EngineConfig that `kvserve <command> <flags>` makes for a one-layer model
    (config.json only, dummy weights) in `directory`, on the CPU."""
    import json

    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6}))

    def config(*flags: str) -> Any:
        ns = build_parser().parse_args([*command, *flags, "--load-format", "dummy", "--device", "cpu"])
        args = {**engine_args_from(ns), "model": str(directory)}
        return EngineArgs(**args).create_engine_config()  # type: ignore[arg-type]

    return config


@pytest.mark.parametrize("command", [["serve", "/models/m"], ["generate", "--prompt", "x"]])
def test_gpu_flags_reach_the_engine_config(command: list[str], tmp_path: Path) -> None:
    """--enforce-eager turns CUDA graphs off and --gpu-memory-utilization sets the KV budget's fraction, for
    `kvserve serve` and `kvserve generate` alike; the defaults are graphs on and 0.9."""
    from kvserve.config import ConfigError

    config = _config_of(command, tmp_path, max_position_embeddings=512)

    default = config()
    assert default.enforce_eager is False and default.cache_config.gpu_memory_utilization == 0.9
    chosen = config("--enforce-eager", "--gpu-memory-utilization", "0.5")
    assert chosen.enforce_eager is True and chosen.cache_config.gpu_memory_utilization == 0.5
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        config("--gpu-memory-utilization", "1.5")


@pytest.mark.parametrize("command", [["serve", "/models/m"], ["generate", "--prompt", "x"]])
def test_more_vllm_engine_flags(command: list[str], tmp_path: Path) -> None:
    """--no-enable-chunked-prefill (the budget then holds a whole prompt), --num-gpu-blocks-override (the KV
    pool's size; 0 refused) and --trust-remote-code (accepted; it changes nothing) reach the engine config."""
    from kvserve.config import ConfigError

    config = _config_of(command, tmp_path, max_position_embeddings=16384)

    default = config()
    assert default.scheduler_config.enable_chunked_prefill is True
    assert default.scheduler_config.max_num_batched_tokens == 8192 and default.cache_config.num_blocks == 0
    whole = config("--no-enable-chunked-prefill")
    assert whole.scheduler_config.enable_chunked_prefill is False
    assert whole.scheduler_config.max_num_batched_tokens == 16384  # one max_model_len prompt fits a step
    with pytest.raises(ConfigError, match="without chunked prefill max_num_batched_tokens"):
        config("--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096")
    assert config("--enable-chunked-prefill").scheduler_config.enable_chunked_prefill is True
    assert config("--num-gpu-blocks-override", "40").cache_config.num_blocks == 40
    with pytest.raises(ConfigError, match="--num-gpu-blocks-override"):
        config("--num-gpu-blocks-override", "0")
    assert config("--trust-remote-code") == default


def test_server_logging_flags() -> None:
    """vLLM's --enable-log-requests (kvserve logs requests by default) and --disable-log-stats."""
    from kvserve.entrypoints.openai.cli_args import make_arg_parser

    default = make_arg_parser().parse_args([])
    assert default.disable_log_requests is False and default.disable_log_stats is False
    assert make_arg_parser().parse_args(["--disable-log-requests"]).disable_log_requests is True
    assert make_arg_parser().parse_args(["--enable-log-requests"]).disable_log_requests is False
    quiet = make_arg_parser().parse_args(["--disable-log-stats"])
    assert quiet.disable_log_stats is True

    from kvserve.entrypoints.openai.api_server import stat_loggers
    from kvserve.metrics.log_stats import LoggingStatLogger

    metrics = object()
    assert stat_loggers(quiet, metrics, "") == [metrics]  # type: ignore[arg-type]
    loggers = stat_loggers(default, metrics, "API server 1: ")  # type: ignore[arg-type]
    assert loggers[0] is metrics and isinstance(loggers[1], LoggingStatLogger) and len(loggers) == 2
    assert loggers[1].label == "API server 1: "
