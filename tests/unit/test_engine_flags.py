"""Engine flags of the CLI map onto EngineArgs under vLLM's names."""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize("command", [["serve", "/models/m"], ["generate", "--prompt", "x"]])
def test_gpu_flags_reach_the_engine_config(command: list[str], tmp_path: Path) -> None:
    """--enforce-eager turns CUDA graphs off and --gpu-memory-utilization sets the KV budget's fraction, for
    `kvserve serve` and `kvserve generate` alike; the defaults are graphs on and 0.9."""
    import json

    from kvserve.config import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6}))

    def config(*flags: str) -> object:
        ns = build_parser().parse_args([*command, *flags, "--load-format", "dummy", "--device", "cpu"])
        args = {**engine_args_from(ns), "model": str(tmp_path)}
        return EngineArgs(**args).create_engine_config()  # type: ignore[arg-type]

    default = config()
    assert default.enforce_eager is False and default.cache_config.gpu_memory_utilization == 0.9
    chosen = config("--enforce-eager", "--gpu-memory-utilization", "0.5")
    assert chosen.enforce_eager is True and chosen.cache_config.gpu_memory_utilization == 0.5
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        config("--gpu-memory-utilization", "1.5")
