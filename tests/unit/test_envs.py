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
