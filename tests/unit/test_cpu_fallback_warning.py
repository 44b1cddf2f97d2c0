"""`kvserve serve` without --device on a machine whose torch has no usable CUDA GPU: it serves on the CPU, and
says so at start with why and which flag decides (a vLLM user expects such a server to fail at start)."""

from __future__ import annotations

import pytest
import torch

from kvserve.entrypoints.openai.api_server import cpu_fallback_warning


@pytest.mark.parametrize("flag, device", [("cpu", "cpu"), ("cuda", "cuda"), (None, "cuda"), (None, "cuda:1")])
def test_no_warning_when_the_device_was_chosen_or_is_a_gpu(flag: str | None, device: str) -> None:
    assert cpu_fallback_warning(flag, device) is None


def test_a_cpu_build_of_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    warning = cpu_fallback_warning(None, "cpu")
    assert warning is not None and warning.startswith("no CUDA GPU (this torch was built without CUDA): serving on "
                                                      "the CPU")
    assert "--device cuda makes a missing GPU an error" in warning and "--device cpu" in warning


def test_a_cuda_build_that_sees_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    warning = cpu_fallback_warning(None, "cpu")
    assert warning is not None and "torch (CUDA 12.8) sees no usable GPU" in warning and "container" in warning
