"""Hugging Face repo ids resolved from the local HF cache, offline (`kvserve/model/paths.py`, `locate`): the
model and tokenizer arguments of EngineArgs / LLM() / the CLI, vLLM's revision, tokenizer_revision and
download_dir, the error when an id is not cached, and a local path winning over an id of the same spelling."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.hf_cache import add_snapshot

from kvserve import LLM, SamplingParams
from kvserve.config import EngineArgs
from kvserve.entrypoints.cli import build_parser, engine_args_from
from kvserve.entrypoints.openai.cli_args import make_arg_parser, server_engine_args
from kvserve.model.paths import ModelLoadError, hf_cache_dir, looks_like_repo_id, resolve_model_path

REPO = "tiny-org/tiny-llama"
MAIN = "a" * 40  # main's commit: the llama of seed 0
V2 = "b" * 40  # branch v2's commit (and tag refs/tags/v2.0): the llama of seed 1


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Callable[..., str]) -> dict[str, str]:
    cache = str(tmp_path_factory.mktemp("hf-hub"))
    return {
        "cache": cache,
        "main": add_snapshot(cache, REPO, MAIN, tiny_model_dir("llama"), refs=("main",)),
        "v2": add_snapshot(cache, REPO, V2, tiny_model_dir("llama", seed=1), refs=("v2", "tags/v2.0")),
    }


@pytest.fixture
def hf_env(monkeypatch: pytest.MonkeyPatch, hub: dict[str, str]) -> dict[str, str]:
    """HF_HUB_CACHE naming the test cache (the others cleared, so the order is tested as it is)."""
    for var in ("HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", hub["cache"])
    return hub


def _greedy(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return list(llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids)


def test_offline_llm_takes_a_cached_repo_id_and_its_revision(hf_env: dict[str, str],
                                                             tiny_model_dir: Callable[..., str]) -> None:
    """LLM("org/name") loads main's snapshot from HF_HUB_CACHE (the same greedy tokens as the snapshot's path;
    served under the id as given); revision= and download_dir= pick another branch's snapshot."""
    by_id = LLM(REPO, max_model_len=64, kv_cache_memory="32MiB")
    assert by_id.config.model_config.model == hf_env["main"] == by_id.config.model_config.tokenizer
    assert by_id.config.model_config.served_model_name == REPO
    by_path = LLM(hf_env["main"], max_model_len=64, kv_cache_memory="32MiB")
    assert _greedy(by_id) == _greedy(by_path)

    os.environ["HF_HUB_CACHE"] = "/nonexistent"  # download_dir wins over the environment
    v2 = LLM(REPO, revision="v2", download_dir=hf_env["cache"], max_model_len=64, kv_cache_memory="32MiB")
    assert v2.config.model_config.model == hf_env["v2"] == v2.config.model_config.tokenizer
    v2_path = LLM(tiny_model_dir("llama", seed=1), max_model_len=64, kv_cache_memory="32MiB")
    assert _greedy(v2) == _greedy(v2_path) != _greedy(by_path)


def test_revision_is_a_branch_tag_or_commit(hf_env: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.model.paths"):
        assert resolve_model_path(REPO) == hf_env["main"]
    assert f"using the Hugging Face cache's snapshot {hf_env['main']}" in caplog.text
    assert resolve_model_path(REPO, "main") == hf_env["main"]
    assert resolve_model_path(REPO, "v2") == resolve_model_path(REPO, "tags/v2.0") == hf_env["v2"]
    assert resolve_model_path(REPO, V2) == resolve_model_path(REPO, MAIN.replace("a", "b")) == hf_env["v2"]
    assert resolve_model_path(REPO, MAIN) == hf_env["main"]


def test_the_same_snapshot_as_huggingface_hub_finds_offline(hf_env: dict[str, str]) -> None:
    """The cache is read directly; huggingface_hub's own offline lookup agrees on the layout."""
    from huggingface_hub import snapshot_download

    for revision in ("main", "v2", V2):
        assert resolve_model_path(REPO, revision) == os.path.abspath(
            snapshot_download(REPO, revision=revision, cache_dir=hf_env["cache"], local_files_only=True))


def test_tokenizer_ids_and_tokenizer_revision(hf_env: dict[str, str], tiny_model_dir: Callable[..., str]) -> None:
    """--tokenizer takes a cached id too, at --tokenizer-revision, which defaults to --revision (as vLLM)."""
    local = tiny_model_dir("llama")
    config = EngineArgs(model=local, tokenizer=REPO, tokenizer_revision="v2", max_model_len=64).create_engine_config()
    assert config.model_config.model == local and config.model_config.tokenizer == hf_env["v2"]
    config = EngineArgs(model=REPO, tokenizer=REPO, revision="v2", max_model_len=64).create_engine_config()
    assert config.model_config.model == config.model_config.tokenizer == hf_env["v2"]
    config = EngineArgs(model=REPO, revision="v2", tokenizer_revision="main", tokenizer=REPO,
                        max_model_len=64).create_engine_config()
    assert (config.model_config.model, config.model_config.tokenizer) == (hf_env["v2"], hf_env["main"])
    # --tokenizer-revision alone: the model's repo's tokenizer at that revision (as vLLM)
    config = EngineArgs(model=REPO, revision="v2", tokenizer_revision="main", max_model_len=64).create_engine_config()
    assert (config.model_config.model, config.model_config.tokenizer) == (hf_env["v2"], hf_env["main"])
    # --load-format dummy reads only the snapshot's config.json
    dummy = EngineArgs(model=REPO, load_format="dummy", max_model_len=64).create_engine_config()
    assert dummy.model_config.model == hf_env["main"]


def test_bench_tokenizer_takes_a_cached_id(hf_env: dict[str, str]) -> None:
    from kvserve.bench.runner import _load_tokenizer

    assert _load_tokenizer(REPO).name_or_path == hf_env["main"]


def test_an_id_not_in_the_cache_says_where_it_looked_and_how_to_get_it(hf_env: dict[str, str]) -> None:
    cache = hf_env["cache"]
    with pytest.raises(ModelLoadError) as missing:
        EngineArgs(model="other-org/absent").create_engine_config()
    text = str(missing.value)
    assert f"local Hugging Face cache {cache} (from HF_HUB_CACHE) has no snapshot of it at revision 'main'" in text
    assert "`huggingface-cli download other-org/absent --local-dir DIR` and pass DIR" in text
    assert "`huggingface-cli download other-org/absent` to fill the cache" in text and "never downloads" in text

    with pytest.raises(ModelLoadError) as branch:
        resolve_model_path(REPO, "v3", download_dir=cache)
    text = str(branch.value)
    assert "at revision 'v3'; the cache holds branches/tags main, tags/v2.0, v2; snapshots " in text
    assert f"{MAIN}, {V2}" in text and f"huggingface-cli download {REPO} --revision v3 --local-dir DIR" in text

    with pytest.raises(ModelLoadError, match=r"/nowhere \(from --download-dir\).*that directory does not exist"):
        resolve_model_path(REPO, download_dir="/nowhere")
    with pytest.raises(ModelLoadError, match="tokenizer 'absent-tokenizer'|'absent-tokenizer' is not a local path"):
        EngineArgs(model=REPO, tokenizer="absent-tokenizer").create_engine_config()


def test_a_local_path_wins_over_an_id_of_the_same_spelling(
        hf_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        tiny_model_dir: Callable[..., str], caplog: pytest.LogCaptureFixture) -> None:
    """A relative directory named like the id is loaded (with a warning that --revision means nothing for it);
    a missing path that cannot be an id keeps the old error."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir("llama", seed=1), tmp_path / REPO)
    with caplog.at_level(logging.WARNING, logger="kvserve.model.paths"):
        assert resolve_model_path(REPO, "main") == str(tmp_path / REPO)
    assert "is a local path: revision 'main' is not used" in caplog.text
    with pytest.raises(ModelLoadError, match="model path './absent' does not exist"):
        resolve_model_path("./absent")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path("a/b/c")


def test_repo_id_spelling_and_cache_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("Qwen/Qwen2.5-7B-Instruct", "gpt2", "meta-llama/Llama-3.1-8B", "a/b", "org_1/m.v2"):
        assert looks_like_repo_id(name), name
    for name in ("./m", "/abs/m", "a/b/c", "org/-m", "org/m.", "org--x/m", "a/..b", "~/models/m", ""):
        assert not looks_like_repo_id(name), name
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", "/home/u")
    assert hf_cache_dir() == ("/home/u/.cache/huggingface/hub", "the default")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert hf_cache_dir() == ("/xdg/huggingface/hub", "the default")
    monkeypatch.setenv("HF_HOME", "/hf")
    assert hf_cache_dir() == ("/hf/hub", "HF_HOME")
    monkeypatch.setenv("HF_HUB_CACHE", "/hub")
    assert hf_cache_dir() == ("/hub", "HF_HUB_CACHE")
    assert hf_cache_dir("/vol/hf") == ("/vol/hf", "--download-dir")


def test_cli_flags_reach_the_engine_args() -> None:
    ns = make_arg_parser().parse_args([REPO, "--revision", "v2", "--tokenizer-revision", "main",
                                       "--download-dir", "/vol/hf", "--tokenizer", "other/tok"])
    args = server_engine_args(ns)
    assert (args["model"], args["revision"], args["tokenizer_revision"], args["download_dir"], args["tokenizer"]) == (
        REPO, "v2", "main", "/vol/hf", "other/tok")
    generate = build_parser().parse_args(["generate", "--prompt", "x", "--model", REPO, "--revision", "v2"])
    assert engine_args_from(generate)["revision"] == "v2" and engine_args_from(generate)["download_dir"] is None
