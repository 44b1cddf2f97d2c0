"""A GGUF file's weights are dequantized at load: the load logs the file's size, the weights' size in memory
and their dtype, and a GPU capacity error says so, so that a user who picked a 4-bit file to fit a small GPU
learns why it does not fit."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.model.gguf import GGUFInfo, quantized_types
from kvserve.model.loader import load_model, parameter_bytes
from kvserve.worker.model_runner import ModelRunner


def test_the_load_logs_the_file_and_memory_sizes(default_gguf_path: str, tiny_model_dir: Callable[..., str],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    config = ModelConfig(model=default_gguf_path, tokenizer=default_gguf_path, dtype="float32", max_model_len=64)
    with caplog.at_level(logging.INFO, logger="kvserve.model.loader"):
        model = load_model(config, torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(lines) == 1, lines
    found = re.fullmatch(r"GGUF (\S+) weights dequantized to float32 at load: (\d+) MiB file -> (\d+) MiB in memory",
                         lines[0])
    assert found, lines[0]
    assert found.group(1).split("/")[0] == "Q4_1"  # the default model: SmolLM2-135M-Instruct Q4_1
    assert int(found.group(2)) == round(os.path.getsize(default_gguf_path) / (1 << 20))
    assert int(found.group(3)) == round(parameter_bytes(model) / (1 << 20))
    assert int(found.group(3)) > 4 * int(found.group(2))  # float32: over four times the 4-bit file

    # An HF directory logs nothing of the kind.
    caplog.clear()
    path = tiny_model_dir("llama")
    with caplog.at_level(logging.INFO, logger="kvserve.model.loader"):
        load_model(ModelConfig(model=path, tokenizer=path, dtype="float32", max_model_len=64), torch.device("cpu"))
    assert not [r for r in caplog.records if "dequantized" in r.getMessage()]


def test_quantized_types_most_parameters_first() -> None:
    info = GGUFInfo(metadata={}, rope_freqs=None,
                    tensor_types={"a.weight": "Q6_K", "b.weight": "Q4_K", "c.weight": "Q4_K", "norm.weight": "F32"},
                    tensor_shapes={"a.weight": (4, 8), "b.weight": (4, 8), "c.weight": (4, 8), "norm.weight": (8,)})
    assert quantized_types(info) == ["Q4_K", "Q6_K"]
    only_f32 = GGUFInfo(metadata={}, rope_freqs=None, tensor_types={"a.weight": "F32"},
                        tensor_shapes={"a.weight": (4, 8)})
    assert quantized_types(only_f32) == ["F32"]


def test_the_gpu_capacity_note_is_for_gguf_models_only(default_gguf_path: str,
                                                       tiny_model_dir: Callable[..., str]) -> None:
    def runner(path: str, load_format: str = "auto") -> object:
        config = ModelConfig(model=path, tokenizer=path, dtype="bfloat16", max_model_len=64, load_format=load_format)
        return SimpleNamespace(config=SimpleNamespace(model_config=config), weights_bytes=lambda: 300 << 20)

    note = ModelRunner.gguf_capacity_note(runner(default_gguf_path))  # type: ignore[arg-type]
    assert re.search(r"GGUF Q4_1\S* weights dequantized to bfloat16 at load: \d+ MiB file -> 300 MiB in memory", note)
    assert "AWQ or GPTQ" in note
    assert ModelRunner.gguf_capacity_note(runner(default_gguf_path, "dummy")) == ""  # type: ignore[arg-type]
    assert ModelRunner.gguf_capacity_note(runner(tiny_model_dir("llama"))) == ""  # type: ignore[arg-type]
