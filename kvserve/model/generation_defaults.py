"""Default sampling settings from a model's `generation_config.json` (`--generation-config`).

Model makers ship their recommended sampling there (Qwen2.5-Instruct: temperature 0.7, top_p 0.8, top_k 20,
repetition_penalty 1.05; Llama-3.1-Instruct: temperature 0.6, top_p 0.9). vLLM applies them by default to
every request field the client leaves out, so kvserve does too:

* ``"auto"`` (the default): the model directory's `generation_config.json`, if it has one;
* ``"vllm"``: none, the engine's own neutral defaults (the name vLLM gives this choice);
* a directory: the `generation_config.json` in it, which must exist.

`--override-generation-config` (a JSON object) is applied on top in every mode (null removes a setting). Six settings are taken, the
ones vLLM takes: temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (a request's
max_tokens when it sets none). A setting the file holds is taken as written (Transformers 5 reads every one
of them as given; `do_sample` is not consulted, as in vLLM).

max_new_tokens is also a cap, by vLLM's rule (its serving code's `override_max_tokens`): with "auto" or
"vllm", only the override's max_new_tokens caps what requests ask for (the model's own file only sets the
default); with a directory, the merged value (the directory's file, or the override on top) caps too. A
request above the cap is lowered to it silently, as vLLM does (`max_tokens_cap`, `capped_max_tokens`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from typing import Any

from kvserve.protocol.sampling_params import SamplingParams, SamplingParamsError

GENERATION_CONFIG_MODES = ("auto", "vllm")
FILE_NAME = "generation_config.json"
# generation_config.json name -> SamplingParams field.
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class GenerationConfigError(ValueError):
    """A --generation-config or --override-generation-config that cannot be used."""


def sampling_defaults(model_path: str, mode: str = "auto",
                      overrides: dict[str, Any] | str | None = None) -> dict[str, Any]:
    """SamplingParams field -> default value for the request fields a client leaves out ({} for none).

    `model_path` is the resolved model (an HF directory or a .gguf file: a GGUF file carries no generation
    config, so "auto" finds none for it). Raises GenerationConfigError for a directory without the file,
    an unreadable file, an override that is not a JSON object or names another setting, or a value
    SamplingParams refuses."""
    if mode == "vllm":
        found: dict[str, Any] = {}
    elif mode == "auto":
        directory = model_path if os.path.isdir(model_path) else None
        found = _from_file(os.path.join(directory, FILE_NAME)) if directory else {}
    else:
        path = os.path.join(mode, FILE_NAME)
        if not os.path.isfile(path):
            raise GenerationConfigError(
                f"--generation-config {mode!r}: no {FILE_NAME} there; pass a directory that has one, 'auto' "
                f"(the model's own) or 'vllm' (no model defaults)"
            )
        found = _from_file(path)
    merged = {**found, **_parse_overrides(overrides)}
    defaults = {KEYS[key]: value for key, value in merged.items() if value is not None}
    try:
        SamplingParams(**defaults)
    except SamplingParamsError as exc:
        raise GenerationConfigError(f"the generation config's defaults {defaults}: {exc}") from None
    return defaults


def max_tokens_cap(mode: str, overrides: dict[str, Any] | str | None, defaults: dict[str, Any]) -> int | None:
    """The most tokens any request may generate (None: no cap), as vLLM computes its `override_max_tokens`:
    the override's max_new_tokens with --generation-config auto or vllm, else (a directory) the merged
    default's max_tokens. `defaults` is what `sampling_defaults` returned for the same arguments (which
    checked the overrides already)."""
    if mode in GENERATION_CONFIG_MODES:
        return _parse_overrides(overrides).get("max_new_tokens")
    cap = defaults.get("max_tokens")
    return int(cap) if cap is not None else None


def capped_max_tokens(requested: int | None, default: int | None, cap: int | None) -> int | None:
    """vLLM's rule for a request's max_tokens, less the context's room (which the caller applies): the
    smallest of the request's value (else the generation config's default) and the cap, over those that
    are set; None when none is."""
    values = [v for v in (requested if requested is not None else default, cap) if v is not None]
    return min(values) if values else None


def apply_cap(params: SamplingParams, cap: int | None) -> SamplingParams:
    """`params` with max_tokens lowered to `cap` (a max_tokens of None, the context's room, becomes the cap).
    Raises SamplingParamsError when the params' min_tokens is above the cap."""
    limit = capped_max_tokens(params.max_tokens, None, cap)
    if limit == params.max_tokens:
        return params
    try:
        return replace(params, max_tokens=limit)
    except SamplingParamsError as exc:
        raise SamplingParamsError(f"{exc} (max_tokens is capped at {cap} by the generation config's "
                                  f"max_new_tokens)", exc.param) from None


def describe(defaults: dict[str, Any], cap: int | None = None) -> str:
    """One log line for a server's start."""
    settings = ", ".join(f"{key}={value}" for key, value in sorted(defaults.items()))
    line = (f"default sampling settings from the model's generation config: {settings}; a request's own values "
            f"take precedence (start with --generation-config vllm to use none)")
    if cap is not None:
        line += f"; every request's max_tokens is capped at {cap} (max_new_tokens)"
    return line


def _number(key: str, value: Any, source: str) -> int | float:
    """A setting's value as SamplingParams takes it: a number (an integer for top_k and max_new_tokens)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GenerationConfigError(f"{source}: {key} must be a finite number, got {value!r}")
    if key in ("top_k", "max_new_tokens"):
        if value != int(value):
            raise GenerationConfigError(f"{source}: {key} must be an integer, got {value!r}")
        return int(value)
    return value


def _from_file(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise GenerationConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{path} does not hold a JSON object")
    return {key: _number(key, data[key], path) for key in KEYS if data.get(key) is not None}


def _parse_overrides(overrides: dict[str, Any] | str | None) -> dict[str, Any]:
    if overrides is None or overrides == "":
        return {}
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except ValueError as exc:
            raise GenerationConfigError(f"--override-generation-config is not JSON: {exc}") from None
    if not isinstance(overrides, dict):
        raise GenerationConfigError(
            f"--override-generation-config must be a JSON object, e.g. '{{\"temperature\": 0.5}}', got {overrides!r}"
        )
    unknown = sorted(set(overrides) - set(KEYS))
    if unknown:
        raise GenerationConfigError(
            f"--override-generation-config: unknown setting(s) {', '.join(unknown)}; the settings taken are "
            f"{', '.join(KEYS)}"
        )
    # null takes the file's setting away
    return {key: None if value is None else _number(key, value, "--override-generation-config")
            for key, value in overrides.items()}
