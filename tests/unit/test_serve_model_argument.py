"""`kvserve serve --served-model-name qwen /models/x`: argparse gives the model to --served-model-name (it takes
several words), so the default model would be served as "qwen" and "/models/x". Refused with the fix spelled
out, before any model is loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.entrypoints.cli import build_parser
from kvserve.entrypoints.openai.cli_args import server_engine_args, swallowed_model

REPO_ROOT = Path(__file__).resolve().parents[2]


def _model_dir(tmp_path: Path) -> str:
    """A directory that reads as an HF model (config.json; nothing is loaded)."""
    directory = tmp_path / "qwen-model"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    return str(directory)


def _error(*argv: str) -> str | None:
    return swallowed_model(build_parser().parse_args(["serve", *argv]))


def test_a_model_directory_after_the_served_name_is_refused(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    ns = build_parser().parse_args(["serve", "--served-model-name", "qwen", model])
    assert ns.model_tag is None and ns.served_model_name == ["qwen", model]  # what argparse does
    with pytest.raises(ValueError) as refused:
        server_engine_args(ns)
    message = str(refused.value)
    assert f"no model given, and --served-model-name took {model!r}, which is a model" in message
    assert f"the default model would be served as 'qwen', {model!r}" in message
    assert message.endswith(f"Put the model first: kvserve serve {model} --served-model-name qwen")


def test_other_spellings_of_a_model_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    # a directory with config.json given by its bare name; a .gguf file, even one that does not exist
    assert _error("--served-model-name", "qwen", "qwen-model", "--port", "9000") is not None
    assert "Put the model first: kvserve serve /models/x.gguf --served-model-name qwen chat" in str(
        _error("--served-model-name", "qwen", "/models/x.gguf", "chat"))
    # the model alone after the flag
    assert str(_error("--served-model-name", model)).endswith(f"Put the model first: kvserve serve {model}")
    # a repo id whose snapshot is in the local Hugging Face cache
    cache = tmp_path / "hub"
    (cache / "models--org--name" / "refs").mkdir(parents=True)
    (cache / "models--org--name" / "refs" / "main").write_text("a" * 40)
    (cache / "models--org--name" / "snapshots" / ("a" * 40)).mkdir(parents=True)
    assert _error("--download-dir", str(cache), "--served-model-name", "qwen", "org/name") is not None
    assert _error("--download-dir", str(cache), "--served-model-name", "qwen", "org/uncached") is None


def test_a_model_taken_by_hf_token_is_refused(tmp_path: Path) -> None:
    """vLLM's --hf-token takes an optional value: before the model, it takes the model as its token."""
    model = _model_dir(tmp_path)
    ns = build_parser().parse_args(["serve", "--hf-token", model])
    assert ns.model_tag is None and ns.hf_token == model  # what argparse does
    with pytest.raises(ValueError, match=rf"^no model given, and --hf-token took '{model}', which is a model, as "
                                         rf"its token: the default model would be served. Put the model first: "
                                         rf"kvserve serve {model} --hf-token \.\.\.$"):
        server_engine_args(ns)
    for argv in ([model, "--hf-token", "hf_abc"], ["--hf-token", "hf_abc", model], [model, "--hf-token"]):
        assert server_engine_args(build_parser().parse_args(["serve", *argv]))["model"] == model, argv


def test_served_names_that_are_not_models_and_given_models_pass(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen").mkdir()  # a directory without config.json named like the served name
    assert _error("--served-model-name", "qwen") is None
    assert _error("--served-model-name", "qwen", "chat") is None
    assert _error("--served-model-name", "Qwen/Qwen2.5-7B-Instruct") is None  # a repo id not in any cache
    assert _error(model, "--served-model-name", "qwen", model) is None  # the model is given
    assert _error("--model", model, "--served-model-name", "qwen", model) is None
    assert _error("--served-model-name", "qwen", "--model", model) is None


def test_both_server_entry_points_refuse_it_before_loading(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m kvserve.entrypoints.openai.api_server` in this process, `python -m kvserve serve` as a
    process: exit 2 with the message (the model directory holds no weights: nothing was loaded)."""
    from kvserve.entrypoints.openai.api_server import main as api_server_main

    model = _model_dir(tmp_path)
    unreachable = ["--host", "256.0.0.1"]  # were the check missing, the server would stop at its bind
    assert api_server_main(["--served-model-name", "qwen", model, *unreachable]) == 2
    assert "kvserve serve: error: no model given, and --served-model-name took" in capsys.readouterr().err
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--served-model-name", "qwen", model,
                           *unreachable], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"Put the model first: kvserve serve {model} --served-model-name qwen" in done.stderr
