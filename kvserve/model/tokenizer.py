"""The tokenizer (and chat template) of a model directory or a GGUF file."""

from __future__ import annotations

import copy
import functools
import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.model.paths import ModelLoadError


def load_tokenizer(model_path: str, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """HF tokenizer for an HF directory, or for a .gguf file (vocabulary and chat template from its metadata).

    `chat_template` replaces the model's template: a path to a template file, or the template text itself.
    """
    path = os.path.abspath(os.path.expanduser(model_path))
    try:
        if path.endswith(".gguf"):
            # Building a tokenizer from GGUF metadata takes seconds; engines started again in the same
            # process (tests, notebooks) reuse the conversion. A copy keeps callers independent.
            stat = os.stat(path)
            tokenizer = copy.deepcopy(_tokenizer_from_gguf(path, stat.st_size, stat.st_mtime_ns))
        else:
            tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {model_path}: {exc}") from exc
    if chat_template is not None:
        tokenizer.chat_template = _read_chat_template(chat_template)
    return tokenizer


@functools.lru_cache(maxsize=4)
def _tokenizer_from_gguf(path: str, size: int, mtime_ns: int) -> PreTrainedTokenizerBase:
    # size and mtime are part of the cache key so a replaced file is converted again.
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _read_chat_template(template: str) -> str:
    # A string naming an existing file is a path; anything else is the template itself (a Jinja template
    # always contains "{", which no sane file name does).
    if "{" not in template and os.path.isfile(os.path.expanduser(template)):
        with open(os.path.expanduser(template), encoding="utf-8") as f:
            return f.read()
    if "{" not in template:
        raise ModelLoadError(f"chat template {template!r} is neither a file nor a Jinja template")
    return template
