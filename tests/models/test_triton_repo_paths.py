"""`kvserve triton-repo` given Hugging Face repo ids from the local cache writes the snapshot paths they resolve
to, so Triton loads what was checked here whatever cache it has (or none); --write-repo-ids writes the ids
(and the revision and cache flags) as given instead."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.hf_cache import add_snapshot

from kvserve.config import EngineArgs
from kvserve.entrypoints.cli import main

MODEL_REPO = "tiny-org/tiny-llama"
TOKENIZER_REPO = "tiny-org/tiny-tokenizer"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Callable[..., str]) -> dict[str, str]:
    cache = str(tmp_path / "hf-hub")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    return {
        "cache": cache,
        "main": add_snapshot(cache, MODEL_REPO, "a" * 40, tiny_model_dir("llama"), refs=("main",)),
        "v2": add_snapshot(cache, MODEL_REPO, "b" * 40, tiny_model_dir("llama", seed=1), refs=("v2",)),
        "tokenizer": add_snapshot(cache, TOKENIZER_REPO, "c" * 40, tiny_model_dir("llama"), refs=("main", "v2")),
    }


def _repo(out: Path, *flags: str) -> dict[str, Any]:
    assert main(["triton-repo", "--name", "tiny", "--out", str(out), "--device", "cpu", "--max-model-len", "64",
                 *flags]) == 0
    return json.loads((out / "tiny" / "1" / "kvserve.json").read_text())


def test_repo_ids_are_written_as_their_cached_snapshots(hub: dict[str, str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    args = _repo(tmp_path / "models", "--model", MODEL_REPO, "--revision", "v2", "--tokenizer", TOKENIZER_REPO)
    assert args["model"] == hub["v2"] and args["tokenizer"] == hub["tokenizer"]
    assert not {"revision", "tokenizer_revision", "download_dir"} & set(args)
    # Where Triton runs, with no Hugging Face cache: the written arguments load the same files.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-cache"))
    model_config = EngineArgs(**args).create_engine_config().model_config
    assert (model_config.model, model_config.tokenizer) == (hub["v2"], hub["tokenizer"])


def test_the_models_own_tokenizer_is_not_written(hub: dict[str, str], tmp_path: Path) -> None:
    args = _repo(tmp_path / "models", "--model", MODEL_REPO)
    assert args["model"] == hub["main"] and "tokenizer" not in args and "revision" not in args
    # --tokenizer-revision alone: the model repo's tokenizer at that revision, another snapshot
    args = _repo(tmp_path / "other", "--model", MODEL_REPO, "--tokenizer-revision", "v2")
    assert (args["model"], args["tokenizer"]) == (hub["main"], hub["v2"])
    assert "tokenizer_revision" not in args


def test_download_dir_is_resolved_away(hub: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    args = _repo(tmp_path / "models", "--model", MODEL_REPO, "--download-dir", hub["cache"])
    assert args["model"] == hub["main"] and "download_dir" not in args


def test_write_repo_ids_keeps_them_as_given(hub: dict[str, str], tmp_path: Path) -> None:
    args = _repo(tmp_path / "models", "--model", MODEL_REPO, "--revision", "v2", "--tokenizer", TOKENIZER_REPO,
                 "--write-repo-ids")
    assert (args["model"], args["revision"], args["tokenizer"]) == (MODEL_REPO, "v2", TOKENIZER_REPO)
