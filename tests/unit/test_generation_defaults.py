"""Sampling defaults from a model's generation_config.json: --generation-config (auto / vllm / a directory)
and --override-generation-config, read as vLLM reads them; bad settings refused at start, naming the source."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.tiny_models import with_generation_config

from kvserve.config import ConfigError, EngineArgs
from kvserve.model.generation_defaults import GenerationConfigError, sampling_defaults

# What Qwen2.5-7B-Instruct ships, with the keys that are not sampling settings.
QWEN_FILE = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
             "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
             "transformers_version": "4.37.0"}
QWEN_DEFAULTS = {"repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}


def _model_dir(tmp_path: Path, settings: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(settings))
    return str(tmp_path)


def test_auto_takes_the_sampling_settings_of_the_models_file(tmp_path: Path) -> None:
    path = _model_dir(tmp_path, QWEN_FILE)
    assert sampling_defaults(path) == QWEN_DEFAULTS
    assert sampling_defaults(path, "auto") == QWEN_DEFAULTS
    # max_new_tokens is a request's max_tokens; min_p is taken too; a value equal to Transformers' old
    # defaults is still what the file says.
    path = _model_dir(tmp_path, {"max_new_tokens": 300, "min_p": 0.05, "top_k": 50, "temperature": None})
    assert sampling_defaults(path) == {"max_tokens": 300, "min_p": 0.05, "top_k": 50}


def test_no_file_a_gguf_file_and_vllm_mode_give_no_defaults(tmp_path: Path) -> None:
    assert sampling_defaults(str(tmp_path)) == {}
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert sampling_defaults(str(gguf)) == {}
    path = _model_dir(tmp_path, QWEN_FILE)
    assert sampling_defaults(path, "vllm") == {}
    assert sampling_defaults(path, "vllm", '{"temperature": 0.5}') == {"temperature": 0.5}


def test_a_directory_of_its_own(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    _model_dir(model, QWEN_FILE)
    other = tmp_path / "other"
    other.mkdir()
    _model_dir(other, {"temperature": 0.2, "max_new_tokens": 64})
    assert sampling_defaults(str(model), str(other)) == {"temperature": 0.2, "max_tokens": 64}
    with pytest.raises(GenerationConfigError, match=r"--generation-config .*no generation_config.json"):
        sampling_defaults(str(model), str(tmp_path))


def test_overrides_go_on_top_and_null_removes_a_setting(tmp_path: Path) -> None:
    path = _model_dir(tmp_path, QWEN_FILE)
    assert sampling_defaults(path, "auto", {"temperature": 0.0, "max_new_tokens": 12}) == {
        **QWEN_DEFAULTS, "temperature": 0.0, "max_tokens": 12}
    assert sampling_defaults(path, "auto", '{"top_k": null, "repetition_penalty": null}') == {
        "temperature": 0.7, "top_p": 0.8}
    assert sampling_defaults(path, "auto", "") == QWEN_DEFAULTS


@pytest.mark.parametrize("overrides, message", [
    ('{"temprature": 0.5}', "unknown setting.*temprature"),
    ("{temperature: 0.5}", "not JSON"),
    ("[0.5]", "must be a JSON object"),
    ('{"temperature": "hot"}', "--override-generation-config: temperature must be a finite number"),
    ('{"top_k": 2.5}', "top_k must be an integer"),
    ('{"top_p": true}', "top_p must be a finite number"),
    ('{"temperature": -1}', "temperature must be >= 0"),
    ('{"max_new_tokens": 0}', "max_tokens must be an integer >= 1"),
    ('{"top_p": 1.5}', "top_p"),
])
def test_bad_overrides_are_refused(tmp_path: Path, overrides: str, message: str) -> None:
    with pytest.raises(GenerationConfigError, match=message):
        sampling_defaults(str(tmp_path), "auto", overrides)


@pytest.mark.parametrize("settings, message", [
    ({"top_k": "20"}, "top_k must be a finite number"),
    ({"temperature": math.inf}, "temperature must be a finite number"),
    ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer"),
])
def test_bad_file_values_are_refused_naming_the_file(tmp_path: Path, settings: dict, message: str) -> None:
    path = _model_dir(tmp_path, settings)
    with pytest.raises(GenerationConfigError, match=message) as err:
        sampling_defaults(path)
    assert os.path.join(path, "generation_config.json") in str(err.value)
    assert sampling_defaults(path, "vllm") == {}  # the file is not read


def test_unreadable_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(GenerationConfigError, match="cannot read"):
        sampling_defaults(str(tmp_path))
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(GenerationConfigError, match="does not hold a JSON object"):
        sampling_defaults(str(tmp_path))


def test_engine_config_and_flags(tiny_model_dir: Callable[..., str], tmp_path: Path) -> None:
    from kvserve.entrypoints.openai.cli_args import make_arg_parser, server_engine_args

    model = with_generation_config(tiny_model_dir("llama"), str(tmp_path), {"temperature": 0.6, "top_p": 0.9})

    def defaults(**kwargs: object) -> dict:
        args = EngineArgs(model=model, device="cpu", max_model_len=128, **kwargs)  # type: ignore[arg-type]
        return args.create_engine_config().model_config.sampling_defaults

    assert defaults() == {"temperature": 0.6, "top_p": 0.9}
    config = EngineArgs(model=model, device="cpu", max_model_len=128).create_engine_config()
    assert hash(config) == hash(config.with_num_blocks(0))  # the defaults (a dict) are left out of the hash
    assert defaults(generation_config="vllm") == {}
    assert defaults(override_generation_config='{"top_p": 0.5}') == {"temperature": 0.6, "top_p": 0.5}
    with pytest.raises(ConfigError, match="unknown setting"):
        defaults(override_generation_config='{"topp": 0.5}')

    ns = make_arg_parser().parse_args([model, "--generation-config", "vllm",
                                       "--override-generation-config", '{"temperature": 0.1}'])
    args = server_engine_args(ns)
    assert args["generation_config"] == "vllm" and args["override_generation_config"] == '{"temperature": 0.1}'
    assert defaults(generation_config=args["generation_config"],
                    override_generation_config=args["override_generation_config"]) == {"temperature": 0.1}
    ns = make_arg_parser().parse_args([model])
    assert server_engine_args(ns)["generation_config"] == "auto"
    assert server_engine_args(ns)["override_generation_config"] is None

    from kvserve.entrypoints.cli import build_parser, engine_args_from

    # `generate` has its own sampling flags and no generation-config ones (they would do nothing there).
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--generation-config", "vllm"])
    assert engine_args_from(build_parser().parse_args(["generate", "--prompt", "x"]))["generation_config"] == "auto"
    ns = build_parser().parse_args(["triton-repo", "--name", "m", "--generation-config", "vllm"])
    assert engine_args_from(ns)["generation_config"] == "vllm"
