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
from kvserve.model.generation_defaults import (
    GenerationConfigError,
    apply_cap,
    capped_max_tokens,
    max_tokens_cap,
    sampling_defaults,
)
from kvserve.protocol.sampling_params import SamplingParams, SamplingParamsError

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


def test_max_new_tokens_caps_requests_by_vllms_rule(tmp_path: Path) -> None:
    """vLLM's override_max_tokens: with auto or vllm only the override's max_new_tokens caps (the model's own
    file sets a default); with a directory, its file's (or the override on top) caps too."""
    model = _model_dir(tmp_path, {"max_new_tokens": 300})

    def cap(mode: str, overrides: dict | str | None = None) -> int | None:
        return max_tokens_cap(mode, overrides, sampling_defaults(model, mode, overrides))

    assert cap("auto") is None
    assert cap("vllm") is None
    assert cap("auto", {"max_new_tokens": 40}) == 40
    assert cap("vllm", '{"max_new_tokens": 40}') == 40
    assert cap("auto", {"max_new_tokens": None}) is None
    assert cap("auto", {"temperature": 0.5}) is None
    assert cap(model) == 300
    assert cap(model, {"max_new_tokens": 40}) == 40
    assert cap(model, {"max_new_tokens": None}) is None

    # min over the values that are set: the request's own (else the default) and the cap.
    assert capped_max_tokens(None, None, None) is None
    assert capped_max_tokens(None, 300, None) == 300
    assert capped_max_tokens(500, 300, None) == 500  # a default is no cap
    assert capped_max_tokens(500, 300, 40) == 40
    assert capped_max_tokens(None, 300, 40) == 40
    assert capped_max_tokens(None, None, 40) == 40
    assert capped_max_tokens(7, None, 40) == 7


def test_apply_cap_lowers_silently_and_refuses_min_tokens_above_it() -> None:
    params = SamplingParams(max_tokens=100, temperature=0.3)
    assert apply_cap(params, None) is params
    assert apply_cap(params, 200) is params
    assert apply_cap(params, 40) == SamplingParams(max_tokens=40, temperature=0.3)
    assert apply_cap(SamplingParams(max_tokens=None), 40).max_tokens == 40  # the context's room, capped
    with pytest.raises(SamplingParamsError, match=r"min_tokens \(50\).*capped at 40") as info:
        apply_cap(SamplingParams(max_tokens=100, min_tokens=50), 40)
    assert info.value.param == "min_tokens"


def test_the_servers_length_limits() -> None:
    """The API server's max_tokens: the request's own (else the default, within the context's room), lowered to
    the cap; min_tokens above the result is a 400 naming the request's field and the cap."""
    from kvserve.entrypoints.openai.errors import BadRequestError
    from kvserve.entrypoints.openai.serving_common import with_length_limits

    params = SamplingParams(max_tokens=None)
    assert with_length_limits(params, None, None, 50) is params  # nothing set: the engine takes the room
    assert with_length_limits(params, 300, None, 50).max_tokens == 50
    assert with_length_limits(params, 30, None, 50).max_tokens == 30
    assert with_length_limits(params, 300, 40, 50).max_tokens == 40
    assert with_length_limits(SamplingParams(max_tokens=45), 30, None, 50).max_tokens == 45
    assert with_length_limits(SamplingParams(max_tokens=45), 30, 40, 50).max_tokens == 40
    assert with_length_limits(SamplingParams(max_tokens=16), None, 4, 50).max_tokens == 4
    with pytest.raises(BadRequestError, match="caps max_tokens at 4") as info:
        with_length_limits(SamplingParams(max_tokens=16, min_tokens=10), None, 4, 50,
                           {"max_tokens": "max_completion_tokens"})
    assert info.value.param == "min_tokens"


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

    def cap(**kwargs: object) -> int | None:
        args = EngineArgs(model=model, device="cpu", max_model_len=128, **kwargs)  # type: ignore[arg-type]
        return args.create_engine_config().model_config.max_tokens_cap

    assert cap() is None
    assert cap(override_generation_config='{"max_new_tokens": 9}') == 9
    assert cap(generation_config=model, override_generation_config='{"max_new_tokens": 9}') == 9
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
