"""YaRN rotary tables against HF Transformers' own computation.

HF's rotary embedding (`_compute_yarn_parameters` for the frequencies and attention factor, then the model's
`RotaryEmbedding.forward` for cos and sin) is the oracle: kvserve's cos/sin table must be bit-identical to
HF's cos and sin in float32 at every position, for several factors, head dims, thetas and the optional
parameters (attention_factor, mscale / mscale_all_dim, beta_fast / beta_slow, truncate).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from kvserve.layers.rotary import (
    RotaryEmbedding,
    check_rope_scaling,
    compute_cos_sin_cache,
    compute_rope_parameters,
)

NUM_POSITIONS = 4096

CASES: list[dict[str, Any]] = [
    # Qwen2.5's documented setting.
    {"factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1000000.0},
    {"factor": 2.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0},
    {"factor": 8.0, "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    {"factor": 32.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0},
    {"factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},  # the tiny models'
    {"factor": 16.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "attention_factor": 1.25},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "mscale": 1.0,
     "mscale_all_dim": 0.707},
    {"factor": 4.0, "original_max_position_embeddings": 2048, "rope_theta": 10000.0, "beta_fast": 16,
     "beta_slow": 2, "truncate": False},
    {"factor": 1.0, "original_max_position_embeddings": 2048, "rope_theta": 10000.0},  # mscale 1, no change
]


def _ids(case: dict[str, Any]) -> str:
    return ",".join(f"{k.replace('original_max_position_embeddings', 'orig')}={v}" for k, v in case.items())


def _hf_rotary(config_cls: type, rotary_cls: type, head_dim: int, case: dict[str, Any]) -> tuple[Any, ...]:
    config = config_cls(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=NUM_POSITIONS,
        rope_parameters={"rope_type": "yarn", **case},
    )
    rotary = rotary_cls(config)
    x = torch.zeros(1, 1, head_dim, dtype=torch.float32)
    cos, sin = rotary(x, torch.arange(NUM_POSITIONS)[None, :])
    return rotary.inv_freq, rotary.attention_scaling, cos[0], sin[0]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize(
    "config_cls, rotary_cls", [(Qwen2Config, Qwen2RotaryEmbedding), (LlamaConfig, LlamaRotaryEmbedding)],
    ids=["qwen2", "llama"],
)
def test_yarn_table_equals_transformers(config_cls, rotary_cls, head_dim: int, case: dict[str, Any]) -> None:
    hf_inv_freq, hf_attention, hf_cos, hf_sin = _hf_rotary(config_cls, rotary_cls, head_dim, case)
    params = {k: v for k, v in case.items() if k != "rope_theta"}
    inv_freq, attention = compute_rope_parameters(head_dim, case["rope_theta"], {"rope_type": "yarn", **params})
    assert torch.equal(inv_freq, hf_inv_freq)
    assert attention == hf_attention
    table = compute_cos_sin_cache(inv_freq, NUM_POSITIONS, attention)
    half = head_dim // 2
    assert torch.equal(torch.cat([table[:, :half], table[:, :half]], dim=-1), hf_cos)
    assert torch.equal(torch.cat([table[:, half:], table[:, half:]], dim=-1), hf_sin)


def test_yarn_rotary_module_uses_the_scaled_table() -> None:
    """The module the model builds holds the YaRN table (attention factor included), not the plain one."""
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    rotary = RotaryEmbedding(64, 256, 10000.0, params)
    inv_freq, attention = compute_rope_parameters(64, 10000.0, params)
    assert attention == pytest.approx(0.1 * math.log(4.0) + 1)
    assert torch.equal(rotary.cos_sin_cache, compute_cos_sin_cache(inv_freq, 256, attention))
    plain = RotaryEmbedding(64, 256, 10000.0)
    # High frequencies kept, low ones divided by the factor; every value scaled by the attention factor.
    assert torch.allclose(rotary.cos_sin_cache[1, 0], plain.cos_sin_cache[1, 0] * attention)
    assert not torch.allclose(rotary.cos_sin_cache[:, 31], plain.cos_sin_cache[:, 31] * attention)


@pytest.mark.parametrize("params", [
    None, {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}])
def test_tables_are_built_on_the_cpu_whatever_the_default_device(params: dict[str, Any] | None) -> None:
    """The model is built under the GPU as default device; the tables are computed on the CPU all the same (a
    tensor made without a device there landed on the GPU beside CPU ones: the YaRN GPU test failed on an H100).
    The meta device stands in for the GPU here."""
    expected = compute_rope_parameters(64, 10000.0, params)
    with torch.device("meta"):
        inv_freq, attention = compute_rope_parameters(64, 10000.0, params)
        rotary = RotaryEmbedding(64, 128, 10000.0, params)
    assert inv_freq.device.type == "cpu" and torch.equal(inv_freq, expected[0]) and attention == expected[1]
    assert rotary.cos_sin_cache.device.type == "meta"  # moved to the default device only at the end


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su", None])
def test_unsupported_rope_types_are_refused_naming_the_supported(rope_type: str | None) -> None:
    with pytest.raises(ValueError, match=f"unsupported rope_type {rope_type!r}; supported: default, linear, "
                                         "llama3, yarn"):
        check_rope_scaling({"rope_type": rope_type, "factor": 4.0})


def test_yarn_needs_its_factor() -> None:
    with pytest.raises(ValueError, match="rope_type 'yarn' needs factor"):
        check_rope_scaling({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64})
