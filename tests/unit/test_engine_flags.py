"""Engine flags of the CLI map onto EngineArgs under vLLM's names."""

from __future__ import annotations

import pytest

from kvserve.config import EngineArgs
from kvserve.entrypoints.cli import build_parser, engine_args_from


@pytest.mark.parametrize(
    "flags, expected",
    [([], True), (["--cascade-attn"], True), (["--no-cascade-attn"], False), (["--disable-cascade-attn"], False),
     (["--cascade-attn", "--disable-cascade-attn"], False)],
)
def test_cascade_attn_flag(flags: list[str], expected: bool) -> None:
    ns = build_parser().parse_args(["generate", "--prompt", "x", *flags])
    args = engine_args_from(ns)
    assert args["cascade_attn"] is expected
    assert EngineArgs(**args).cascade_attn is expected  # type: ignore[arg-type]


@pytest.mark.parametrize("flags", [["--quantization", "awq"], ["-q", "awq"]])
def test_quantization_flag_and_its_short_form(flags: list[str]) -> None:
    ns = build_parser().parse_args(["serve", "/models/m", *flags])
    assert engine_args_from(ns)["quantization"] == "awq"
