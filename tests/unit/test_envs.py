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
