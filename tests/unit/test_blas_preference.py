"""kvserve prefers cuBLASLt for torch's matmuls on CUDA, and leaves the choice alone where it does not apply
or the user made it (TORCH_BLAS_PREFER_CUBLASLT set)."""

from __future__ import annotations

import pytest
import torch

from kvserve import envs
from kvserve.worker import model_runner


def test_cpu_leaves_the_blas_choice_alone() -> None:
    before = torch.backends.cuda.preferred_blas_library()
    assert not model_runner.prefer_cublaslt(torch.device("cpu"))
    assert torch.backends.cuda.preferred_blas_library() == before


def test_cuda_prefers_cublaslt_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", lambda backend=None: calls.append(backend))
    monkeypatch.setattr(envs, "TORCH_BLAS_PREFER_CUBLASLT_SET", False)
    assert model_runner.prefer_cublaslt(torch.device("cuda"))
    assert calls == ["cublaslt"]
    monkeypatch.setattr(envs, "TORCH_BLAS_PREFER_CUBLASLT_SET", True)
    assert not model_runner.prefer_cublaslt(torch.device("cuda"))
    assert calls == ["cublaslt"]
