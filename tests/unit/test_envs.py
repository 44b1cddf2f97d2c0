"""kvserve.envs reads other libraries' variables as those libraries do."""

from __future__ import annotations

import importlib

import pytest

from kvserve import envs


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("true", True), ("True", True), ("on", True),
                                                 ("0", False), ("false", False), ("", False)])
def test_triton_interpret_reads_triton_booleans(value: str, expected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton interprets for TRITON_INTERPRET=true as for 1: kvserve must agree (its paired 4-bit kernel's
    PTX does not run in the interpreter). The kernels read it when imported, which in a test session is after
    kvserve.envs was (the full suite's first run of this change failed that way)."""
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert envs.triton_interpreting() is expected  # read now, for modules imported after the variable is set
    try:
        assert importlib.reload(envs).TRITON_INTERPRET is expected
    finally:
        monkeypatch.undo()
        importlib.reload(envs)


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("", ""), ("k", "k")])
def test_kvserve_api_key_is_read_as_set_even_empty(value: str | None, expected: str | None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """KVSERVE_API_KEY="" is "set: no key" (it must keep VLLM_API_KEY out), not "unset"."""
    from kvserve.entrypoints.openai.cli_args import api_key_from

    if value is None:
        monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("KVSERVE_API_KEY", value)
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    try:
        reloaded = importlib.reload(envs)
        assert reloaded.KVSERVE_API_KEY == expected
        key = api_key_from(None, reloaded.KVSERVE_API_KEY, reloaded.VLLM_API_KEY)[0]
        assert key == {None: "vllm-key", "": None, "k": "k"}[value]
    finally:
        monkeypatch.undo()
        importlib.reload(envs)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("KVSERVE_CPU_KVCACHE_SPACE", "4GiB", "KVSERVE_CPU_KVCACHE_SPACE must be an integer, got '4GiB'"),
    ("VLLM_ENABLE_RESPONSES_API_STORE", "true", "VLLM_ENABLE_RESPONSES_API_STORE must be an integer, got 'true'"),
    ("KVSERVE_LOGGING_LEVEL", "verbose", "KVSERVE_LOGGING_LEVEL must be a log level"),
    ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "yes", "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be 1, true, 0 or false, got 'yes'"),
])
def test_a_variable_of_the_wrong_kind_is_an_error_at_start_not_at_import(
        name: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Such a value raised while kvserve.envs was imported: every command, --help too, ended with a traceback
    (and a bad log level with logging's "Unknown level", naming no variable). Now the command line parses and an
    engine's configuration is refused with one line naming the variable."""
    from kvserve.config import EngineArgs
    from kvserve.entrypoints.cli import main

    monkeypatch.setenv(name, value)
    try:
        reloaded = importlib.reload(envs)
        assert reloaded.KVSERVE_LOGGING_LEVEL == "INFO"  # a bad level reads as the default until the error
        with pytest.raises(SystemExit) as exited:
            main(["--version"])
        assert exited.value.code == 0
        with pytest.raises(ValueError, match=f"^environment variable {message}"):
            EngineArgs(model="/nonexistent").create_engine_config()
        assert main(["generate", "--model", "/nonexistent", "--prompt", "x"]) == 2
        assert capsys.readouterr().err.startswith(f"kvserve generate: error: environment variable {message}")
    finally:
        monkeypatch.undo()
        importlib.reload(envs)
    envs.check_values()  # unset again: nothing to report


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("TRUE", True), (" true ", True), ("0", False),
                                                 ("false", False), ("", False), (None, False)])
def test_allow_long_max_model_len_is_read_as_vllm_reads_it(value: str | None, expected: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "KVSERVE_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
        monkeypatch.delenv("KVSERVE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
        if value is not None:
            monkeypatch.setenv(name, value)
        try:
            reloaded = importlib.reload(envs)
            assert reloaded.KVSERVE_ALLOW_LONG_MAX_MODEL_LEN is expected
            assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" not in reloaded.unread_vllm_env_vars()
        finally:
            monkeypatch.undo()
            importlib.reload(envs)
