"""llama.cpp's `{arch}.rope.scaling.*` GGUF metadata read as HF rope parameters (kvserve/model/gguf_rope.py):
what each key becomes, llama.cpp's defaults where keys are absent, and refusals that name the key.

Files hold only metadata and an embedding (`write_config_gguf`); the generation tests in
test_generate_vs_hf.py check that the parameters read here run the converted model as HF runs its checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.tiny_models import write_config_gguf

from kvserve.config import EngineArgs
from kvserve.model.arch import ArchConfig, load_arch_config
from kvserve.model.paths import ModelLoadError

CONTEXT_LENGTH = 64  # the test file's {arch}.context_length
TYPE, FACTOR, ORIGINAL = "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length"


def _arch(tmp_path: Path, metadata: dict[str, Any], arch: str = "qwen2", context_length: int = CONTEXT_LENGTH
          ) -> ArchConfig:
    return load_arch_config(write_config_gguf(str(tmp_path / "m.gguf"), arch, metadata, context_length))


@pytest.mark.parametrize(
    "metadata, rope_scaling",
    [
        ({}, None),
        # llama.cpp's scaling type defaults to linear; without a factor that is plain RoPE.
        ({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}, None),
        ({"rope.scaling.type": "linear"}, None),
        ({"rope.scaling.type": "linear", "rope.scaling.factor": 1.0}, None),
        ({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
        ({"rope.scaling.factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
        ({"rope.scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),  # the older key
        # Qwen2.5's export: type, factor and the pre-training length.
        (
            {TYPE: "yarn", FACTOR: 4.0, ORIGINAL: 32},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        ),
        # No original_context_length: context_length, as llama.cpp and HF default it.
        (
            {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.finetuned": True},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": CONTEXT_LENGTH},
        ),
        # The optional YaRN parameters under HF's names, float32 values back to the decimals written; an
        # extrapolation weight of 1, or negative (unset), is HF's YaRN.
        (
            {
                "rope.scaling.type": "yarn",
                "rope.scaling.factor": 2.5,
                "rope.scaling.original_context_length": 32,
                "rope.scaling.yarn_beta_fast": 8.0,
                "rope.scaling.yarn_beta_slow": 0.5,
                "rope.scaling.yarn_attn_factor": 1.1,
                "rope.scaling.yarn_ext_factor": 1.0,
                "rope.scaling.yarn_log_multiplier": 0.0,
                "rope.scaling.attn_factor": 1.0,
            },
            {
                "rope_type": "yarn",
                "factor": 2.5,
                "original_max_position_embeddings": 32,
                "beta_fast": 8.0,
                "beta_slow": 0.5,
                "attention_factor": 1.1,
            },
        ),
        (
            {"rope.scaling.type": "yarn", "rope.scaling.factor": 1.1, "rope.scaling.yarn_ext_factor": -1.0},
            {"rope_type": "yarn", "factor": 1.1, "original_max_position_embeddings": CONTEXT_LENGTH},
        ),
    ],
)
def test_rope_scaling_metadata_reads_as_hf_parameters(
    tmp_path: Path, metadata: dict[str, Any], rope_scaling: dict[str, Any] | None
) -> None:
    assert _arch(tmp_path, metadata).rope_scaling == rope_scaling


def test_yarn_gguf_max_model_len_is_original_times_factor(tmp_path: Path) -> None:
    """As for a safetensors checkpoint: YaRN serves original_context_length x factor positions, above the
    file's context_length (Qwen2.5's exports keep 32768 there with factor 4: 131072)."""
    yarn = {TYPE: "yarn", FACTOR: 4.0, ORIGINAL: 32768}
    path = write_config_gguf(str(tmp_path / "qwen.gguf"), "qwen2", yarn, context_length=32768)
    arch = load_arch_config(path)
    assert (arch.max_position_embeddings, arch.max_positions) == (32768, 131072)
    # float32 factors back to their decimals: 100 x float32(1.1) would be 110.00000238 (int 110 either way
    # here), and 1000 x float32(2.3) = 2299.99995 would lose a position.
    odd = {TYPE: "yarn", FACTOR: 2.3, ORIGINAL: 1000}
    assert _arch(tmp_path, odd, arch="llama", context_length=1000).max_positions == 2300
    config = EngineArgs(model=path).create_engine_config()
    assert config.model_config.max_model_len == 131072


def test_linear_gguf_max_model_len_is_context_length_times_factor(tmp_path: Path) -> None:
    """As for a safetensors checkpoint (and vLLM): linear scaling stretches the file's context_length by
    its factor; the factor may come as rope.scale_linear too."""
    assert _arch(tmp_path, {TYPE: "linear", FACTOR: 4.0}).max_positions == 4 * CONTEXT_LENGTH
    assert _arch(tmp_path, {"rope.scale_linear": 2.0}, arch="llama").max_positions == 2 * CONTEXT_LENGTH
    path = write_config_gguf(str(tmp_path / "linear.gguf"), "llama", {TYPE: "linear", FACTOR: 4.0},
                             context_length=1000)
    assert EngineArgs(model=path).create_engine_config().model_config.max_model_len == 4000


@pytest.mark.parametrize(
    "metadata, message",
    [
        (
            {"rope.scaling.type": "longrope"},
            r"GGUF rope scaling type 'longrope' \(qwen2.rope.scaling.type\) is not supported "
            r"\(supported: none, linear, yarn\)",
        ),
        (
            {TYPE: "yarn", FACTOR: 40.0, "rope.scaling.yarn_log_multiplier": 0.1},
            r"GGUF key qwen2.rope.scaling.yarn_log_multiplier = 0.1 is not supported: it is DeepSeek's "
            r"0.1 x mscale_all_dim",
        ),
        (
            {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_ext_factor": 0.5},
            r"GGUF key qwen2.rope.scaling.yarn_ext_factor = 0.5 is not supported",
        ),
        (
            {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0, "rope.scaling.attn_factor": 1.2},
            r"GGUF key qwen2.rope.scaling.attn_factor = 1.2 is not supported: llama.cpp multiplies cos and "
            r"sin",
        ),
        ({"rope.scaling.alpha": 1000.0}, r"GGUF key qwen2.rope.scaling.alpha = 1000.0 is not supported"),
        (
            {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0, "rope.scaling.yarn_beta_fast": 8.0},
            r"GGUF key qwen2.rope.scaling.yarn_beta_fast applies to YaRN only, but qwen2.rope.scaling.type "
            r"is 'linear'",
        ),
        (
            {"rope.scaling.mystery": 1.0},
            r"GGUF key qwen2.rope.scaling.mystery is not supported \(kvserve reads "
            r"qwen2.rope.scaling.\{alpha, attn_factor, factor, ",
        ),
    ],
)
def test_unrepresentable_rope_metadata_is_refused_by_key(
    tmp_path: Path, metadata: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelLoadError, match=r"^m\.gguf: " + message):
        _arch(tmp_path, metadata)
