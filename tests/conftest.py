"""Session-wide fixtures for model tests. Expensive objects are built once per session and shared.

* `default_gguf_path` -> str: the SmolLM2-135M-Instruct Q4_1 GGUF (skips the test if not installed).
* `smollm_tokenizer` -> the HF tokenizer of that GGUF (vocab 49152, chat template); ~4 s the first time.
* `tiny_model_dir(arch="llama", seed=0, **config_overrides)` -> str: a tiny random HF checkpoint directory
  (config.json, model.safetensors, tokenizer) made by `helpers.tiny_models.make_tiny_checkpoint`;
  `arch` is a key of `tiny_models.VARIANTS`: "llama", "llama3" (Llama 3.1 RoPE scaling), "llama-tied",
  "qwen2", "qwen3", and YaRN variants ("qwen2-yarn", "qwen3-yarn", "llama-yarn", "llama-yarn-explicit").
  Cached per argument set; treat the directory as read-only.
* `tiny_gguf_path(arch="llama")` -> str: the same tiny checkpoint re-exported as a float32 GGUF file laid out
  as llama.cpp's converter does, RoPE scaling included (not "llama-yarn", whose mscale and truncate the
  converter drops).
* `hf_gguf_model` -> HF Transformers' float32 model loaded from `default_gguf_path` (~13 s, once), eval mode.
  Do not modify it.

Helpers to build KV caches, attention metadata and run a batch: `helpers` (tests/helpers; pytest puts
tests/ on sys.path because tests/ has no __init__.py, so import it as `from helpers import ...`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
from helpers import tiny_models, xdist

from kvserve import envs
from kvserve.model.paths import ModelLoadError, default_model_path

# The session's cache directory, as the pytest-xdist controller made it, for its workers.
_SESSION_CACHE_ENV = "KVSERVE_TEST_SESSION_CACHE"


def pytest_configure(config: pytest.Config) -> None:
    # What outlives a run (GGUF files' converted tokenizers, matmul choices) goes to a directory of the session's
    # own, shared with the servers it starts (through the environment), never the user's cache. Under
    # pytest-xdist the workers share the controller's (its writes are atomic renames); the controller removes it.
    worker = hasattr(config, "workerinput")  # an xdist worker (not a pytest these tests run, which inherits its env)
    shared = os.environ.get(_SESSION_CACHE_ENV) if worker else None
    if shared:
        cache = shared
    else:
        cache = tempfile.mkdtemp(prefix="kvserve-test-cache-")
        os.environ[_SESSION_CACHE_ENV] = cache
        config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
    os.environ["KVSERVE_CACHE_DIR"] = envs.KVSERVE_CACHE_DIR = cache
    if worker:
        xdist.share_the_cores()


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    try:
        return default_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm_tokenizer(default_gguf_path: str) -> Any:
    return tiny_models.smollm_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_gguf_path: str) -> Callable[..., str]:
    cache: dict[str, str] = {}

    def make(arch: str = "llama", seed: int = 0, **config_overrides: Any) -> str:
        key = json.dumps([arch, seed, config_overrides], sort_keys=True)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = tiny_models.make_tiny_checkpoint(str(directory), arch, seed, **config_overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_gguf_path(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Callable[..., str]
) -> Callable[..., str]:
    cache: dict[str, str] = {}

    def make(arch: str = "llama") -> str:
        if arch not in cache:
            path = os.path.join(str(tmp_path_factory.mktemp(f"gguf-{arch}")), f"tiny-{arch}.gguf")
            cache[arch] = tiny_models.write_gguf(tiny_model_dir(arch), path)
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def hf_gguf_model(default_gguf_path: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf_path),
        gguf_file=os.path.basename(default_gguf_path),
        dtype=torch.float32,
    )
    return model.eval()


@pytest.fixture(scope="session")
def default_llm(default_gguf_path: str) -> Any:
    """kvserve's LLM on the default model (float32 on CPU, default settings, max_model_len 2048)."""
    from kvserve import LLM

    return LLM(max_model_len=2048)
