"""The command line's usage: ports out of range are usage errors (exit 2, one line) rather than a traceback from
bind(); an error after parsing, and an unrecognized argument, names the subcommand; every option with a numeric
default says it in --help; a tensor-parallel size below 1, an empty served name and a chat template file that
cannot be read are refused before anything starts."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from kvserve.entrypoints.cli import build_parser, main, port_number


@pytest.mark.parametrize("text, value", [("0", 0), ("8000", 8000), ("65535", 65535)])
def test_a_port_number_is_0_to_65535(text: str, value: int) -> None:
    assert port_number(text) == value


@pytest.mark.parametrize("text, message", [("65536", "a port is 0-65535, got 65536"),
                                           ("-1", "a port is 0-65535, got -1"),
                                           ("http", "expected a port number, got 'http'")])
def test_a_port_out_of_range_is_refused(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        port_number(text)


@pytest.mark.parametrize("argv", [["serve", "--port", "99999"], ["serve", "--port=-1"],
                                  ["route", "--backend", "http://127.0.0.1:1", "--port", "70000"]])
def test_serve_and_route_refuse_a_port_out_of_range_as_a_usage_error(argv: list[str],
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """It was `OverflowError: bind(): port must be 0-65535` with a traceback, after the server began to start."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"kvserve {argv[0]}: error: argument --port: a port is 0-65535" in err and "Traceback" not in err


def test_an_error_after_parsing_names_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--num-prompts", "-1"]) == 2
    assert capsys.readouterr().err.startswith("kvserve bench: error: --num-prompts must be in [1, ")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_every_numeric_default_is_in_the_help() -> None:
    """`kvserve serve --help` showed no default for --max-num-seqs, --block-size or --seed, `kvserve route --help`
    none for --port: a user had to read the README. bool flags say what they do instead."""
    missing = [f"{command} {action.option_strings[0]} (default {action.default})"
               for command, sub in _subparsers(build_parser()).items() for action in sub._actions
               if type(action.default) in (int, float) and action.help != argparse.SUPPRESS
               and "default" not in (action.help or "")]
    assert missing == []


@pytest.mark.parametrize("argv", [["serve", "m", "--foo"], ["generate", "--prompt", "x", "--foo"],
                                  ["triton-repo", "--name", "m", "--foo"], ["bench", "--foo"],
                                  ["route", "--backend", "http://127.0.0.1:1", "--foo"]])
def test_an_unrecognized_argument_names_the_subcommand(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """As argparse reports a subcommand's other errors: that subcommand's usage and name, not the top level's."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"usage: kvserve {argv[0]} [-h]"), lines
    assert lines[-1] == f"kvserve {argv[0]}: error: unrecognized arguments: --foo"


def test_an_unrecognized_argument_before_the_subcommand_is_the_top_levels(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--foo", "serve", "m"])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("usage: kvserve [-h] [--version]") and lines[-1] == (
        "kvserve: error: unrecognized arguments: --foo")


@pytest.mark.parametrize("argv", [["serve", "m", "--tensor-parallel-size", "0"], ["serve", "m", "-tp", "-1"],
                                  ["generate", "--prompt", "x", "-tp", "0"], ["triton-repo", "--name", "m", "-tp=0"]])
def test_a_tensor_parallel_size_below_1_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """It was refused only once the model's config was read, as a size that does not divide the heads."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"kvserve {argv[0]}: error: argument --tensor-parallel-size/-tp: must be at least 1, got " in err, err


def test_engine_args_refuse_a_tensor_parallel_size_below_1(tiny_model_dir: Callable[..., str]) -> None:
    from kvserve.config import ConfigError, EngineArgs

    with pytest.raises(ConfigError, match=r"^tensor_parallel_size \(--tensor-parallel-size\) must be >= 1, got 0$"):
        EngineArgs(model=tiny_model_dir("llama"), device="cpu", tensor_parallel_size=0).create_engine_config()


@pytest.mark.parametrize("names", [[""], ["m", ""], [" "]])
def test_an_empty_served_model_name_is_a_usage_error(names: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A served model with an empty id could not be asked for by name."""
    with pytest.raises(SystemExit) as exited:
        main(["serve", "m", "--served-model-name", *names])
    assert exited.value.code == 2
    assert "kvserve serve: error: argument --served-model-name: a served model name cannot be empty" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("template", ["/nonexistent.jinja", "/"])
def test_a_missing_chat_template_file_is_refused_before_the_engine_starts(
        template: str, tiny_model_dir: Callable[..., str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """It was read only by the tokenizer, in the engine that had already started."""
    from kvserve.entrypoints.openai import api_server

    def started(*_: object) -> int:
        raise AssertionError("the server started")

    monkeypatch.setattr(api_server, "serve", started)
    model = tiny_model_dir("llama")
    capsys.readouterr()  # a first build's progress bar
    assert main(["serve", model, "--device", "cpu", "--chat-template", template]) == 2
    err = capsys.readouterr().err
    assert err == (f"kvserve serve: error: chat template {template!r} is neither a file nor a Jinja template\n"), err


def test_an_unreadable_chat_template_file_is_a_config_error(tiny_model_dir: Callable[..., str],
                                                            tmp_path: Path) -> None:
    from kvserve.config import EngineArgs

    template = tmp_path / "t.jinja"
    template.write_bytes(b"\xff{{ messages }}")
    with pytest.raises(ValueError, match="cannot read the chat template file .*t.jinja"):
        EngineArgs(model=tiny_model_dir("llama"), device="cpu", chat_template=str(template)).create_engine_config()
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    config = EngineArgs(model=tiny_model_dir("llama"), device="cpu", chat_template=str(template)).create_engine_config()
    assert config.model_config.chat_template == str(template)


def test_a_chat_template_that_is_not_jinja_is_refused_before_the_engine_starts(
        tiny_model_dir: Callable[..., str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A --chat-template with a Jinja syntax error (a file's or the text's) is a start-up error naming it; the
    server used to start and answer every chat request with a 400. Transformers' own tags still compile."""
    from kvserve.entrypoints.openai import api_server

    def started(*_: object) -> int:
        raise AssertionError("the server started")

    monkeypatch.setattr(api_server, "serve", started)
    model = tiny_model_dir("llama")
    capsys.readouterr()  # a first build's progress bar
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }", encoding="utf-8")
    for template, where in ((str(broken), str(broken)), ("{% if %}", "given as text")):
        assert main(["serve", model, "--device", "cpu", "--chat-template", template]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvserve serve: error: chat template ({where}) is not valid Jinja: "), err
        assert err.endswith("(line 1)\n") and err.count("\n") == 1, err
    from kvserve.config import EngineArgs

    tagged = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    config = EngineArgs(model=model, device="cpu", chat_template=tagged).create_engine_config()
    assert config.model_config.chat_template == tagged
