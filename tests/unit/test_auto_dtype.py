"""--dtype auto as vLLM resolves it: the checkpoint's config dtype (config.json's `dtype`, or the older
`torch_dtype`) on a GPU, bfloat16 for float32 checkpoints where the GPU has it; float32 on CPU (kvserve's
reference path). Checked as a function of (config dtype, device, GPU capability), with no GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.config import EngineArgs, auto_dtype
from kvserve.model.arch import load_arch_config

AMPERE, VOLTA = (8, 0), (7, 0)


@pytest.mark.parametrize("config_dtype, capability, expected", [
    ("float16", AMPERE, "float16"),  # most AWQ/GPTQ exports
    ("float16", VOLTA, "float16"),
    ("bfloat16", AMPERE, "bfloat16"),
    ("bfloat16", (9, 0), "bfloat16"),
    ("bfloat16", VOLTA, "float16"),  # no bfloat16 before Ampere: vLLM falls back to float16
    ("float32", AMPERE, "bfloat16"),
    ("float32", VOLTA, "float16"),
    (None, AMPERE, "bfloat16"),  # a config without one, and GGUF files: the device's default
    (None, VOLTA, "float16"),
])
def test_auto_follows_the_checkpoint_on_a_gpu(config_dtype: str | None, capability: tuple[int, int],
                                              expected: str) -> None:
    assert auto_dtype(config_dtype, "cuda", capability) == expected


@pytest.mark.parametrize("config_dtype", ["float16", "bfloat16", "float32", None])
def test_auto_is_float32_on_cpu(config_dtype: str | None) -> None:
    assert auto_dtype(config_dtype, "cpu", None) == "float32"


def _model(directory: Path, **dtype_keys: object) -> str:
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, **dtype_keys}))
    return str(directory)


@pytest.mark.parametrize("keys, expected", [
    ({"torch_dtype": "float16"}, "float16"),
    ({"dtype": "bfloat16"}, "bfloat16"),  # Transformers 5's name
    ({"dtype": "bfloat16", "torch_dtype": "float16"}, "bfloat16"),
    ({"torch_dtype": "torch.float16"}, "float16"),
    ({"torch_dtype": "float32"}, "float32"),
    ({"text_config": {"torch_dtype": "float16"}}, "float16"),
    ({}, None),
    ({"torch_dtype": "float8_e4m3fn"}, None),  # unknown: the device's default
])
def test_the_config_dtype_is_read(tmp_path: Path, keys: dict, expected: str | None) -> None:
    assert load_arch_config(_model(tmp_path, **keys)).config_dtype == expected


@pytest.mark.parametrize("keys, capability, dtype, expected", [
    ({"torch_dtype": "float16"}, AMPERE, "auto", "float16"),
    ({"torch_dtype": "bfloat16"}, AMPERE, "auto", "bfloat16"),
    ({"torch_dtype": "float32"}, AMPERE, "auto", "bfloat16"),
    ({"torch_dtype": "bfloat16"}, VOLTA, "auto", "float16"),
    ({"torch_dtype": "float16"}, AMPERE, "bfloat16", "bfloat16"),  # an explicit --dtype wins
])
def test_the_engine_config_on_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keys: dict,
                                    capability: tuple[int, int], dtype: str, expected: str) -> None:
    import torch

    import kvserve.config as config_module

    monkeypatch.setattr(config_module, "_check_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    args = EngineArgs(model=_model(tmp_path, **keys), device="cuda", load_format="dummy", dtype=dtype)
    assert args.create_engine_config().model_config.dtype == expected


def test_the_engine_config_on_cpu_stays_float32(tmp_path: Path) -> None:
    args = EngineArgs(model=_model(tmp_path, torch_dtype="bfloat16"), device="cpu", load_format="dummy")
    assert args.create_engine_config().model_config.dtype == "float32"
