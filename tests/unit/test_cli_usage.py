"""The command line's usage: ports out of range are usage errors (exit 2, one line) rather than a traceback from
bind(); an error after parsing names the subcommand; every option with a numeric default says it in --help."""

from __future__ import annotations

import argparse

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
