"""Start-up matmul tuning (kvserve/kernels/cublaslt.py): the choice rule, the saved results, which row counts
are tuned, and that nothing changes where cuBLASLt cannot run (CPU). The cuBLASLt calls themselves are
tested on the GPU (tests/gpu/test_gpu_ops.py, test_gpu_engine.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine_core import EngineCore
from kvserve.kernels import cublaslt, ops
from kvserve.worker.model_runner import ModelRunner


def test_pick_takes_the_fastest_and_prefers_torch_on_ties() -> None:
    assert cublaslt.pick({cublaslt.TORCH_CHOICE: 10.0, 0: 11.0, 1: 9.5, 2: 9.9}) == 1
    assert cublaslt.pick({cublaslt.TORCH_CHOICE: 9.5, 0: 9.5, 1: 9.5}) == cublaslt.TORCH_CHOICE
    assert cublaslt.pick({0: 9.5, 3: 9.5}) == 0  # equal candidates: the heuristic's earlier rank
    # A failed timing never wins; with nothing timed, torch runs.
    assert cublaslt.pick({cublaslt.TORCH_CHOICE: 10.0, 0: math.nan, 1: math.inf}) == cublaslt.TORCH_CHOICE
    assert cublaslt.pick({}) == cublaslt.TORCH_CHOICE


def test_the_loaded_cublaslt_is_found_in_the_process_map() -> None:
    maps = (
        "7f00-7f10 r-xp 00000000 00:00 1 /usr/lib/libc.so.6\n"
        "7f20-7f30 r--p 00000000 00:00 2\n"
        "7f40-7f50 r-xp 00000000 00:00 3 /venv/nvidia/cu13/lib/libcublasLt.so.13\n"
        "7f60-7f70 r-xp 00000000 00:00 4 /venv/nvidia/cu13/lib/libcublas.so.13\n"
    )
    assert cublaslt._mapped_library(maps, "libcublasLt") == "/venv/nvidia/cu13/lib/libcublasLt.so.13"
    assert cublaslt._mapped_library(maps, "libcublas") == "/venv/nvidia/cu13/lib/libcublas.so.13"
    assert cublaslt._mapped_library(maps, "libcudnn") is None


def test_saved_results_round_trip_and_a_bad_file_reads_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "gemm_tuning.json"
    assert cublaslt.load_cache(path) == {}
    results = {"H200|cublasLt 130100|torch 2.11|bfloat16|64x4608x3584|bias 1":
               {"choice": 3, "algo": [2**64 - 1, 0, 5, 6, 7, 8, 9, 10], "torch_us": 11.9, "chosen_us": 11.5}}
    cublaslt.save_cache(path, results)
    assert cublaslt.load_cache(path) == results
    assert not list(path.parent.glob("*.tmp"))  # written through a temporary file, renamed into place
    path.write_text("{not json")
    assert cublaslt.load_cache(path) == {}
    path.write_text("[1, 2]")
    assert cublaslt.load_cache(path) == {}


def test_cublaslt_is_unavailable_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine has cuBLASLt")
    with pytest.raises(cublaslt.LtUnavailable):
        cublaslt.LtMatmul(64, 128, 256, torch.bfloat16, False, 0)


def test_untuned_shapes_run_torch() -> None:
    cublaslt.clear_tuning()
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    assert cublaslt.tuned_plan(x, w, b) is None
    assert torch.equal(ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))


def _runner_stub(use_cuda_graphs: bool, graph_sizes: list[int], budget: int,
                 prefill: tuple[list[int], list[int]]) -> SimpleNamespace:
    config = SimpleNamespace(
        use_cuda_graphs=use_cuda_graphs,
        cuda_graph_sizes=graph_sizes,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=budget),
    )
    return SimpleNamespace(config=config, prefill_graph_sizes=lambda: prefill)


def test_tuned_rows_are_the_decode_graph_sizes_past_the_skinny_matmul() -> None:
    sizes = [1, 2, 4, 8, 16, 32, 48, 64, 256]
    stub = _runner_stub(True, sizes, 8192, ([128, 256, 384], [128, 256]))
    rows = ModelRunner.gemm_tuning_rows(stub)  # type: ignore[arg-type]
    assert rows == [48, 64, 256]
    assert all(n > ops.SKINNY_GEMM_MAX_ROWS for n in rows)
    # Eager: batches come in every size, nothing is tuned.
    eager = _runner_stub(False, sizes, 2048, ([], []))
    assert ModelRunner.gemm_tuning_rows(eager) == []  # type: ignore[arg-type]


def test_cpu_engine_tunes_nothing(tiny_model_dir: Callable[..., str], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve import envs

    monkeypatch.setattr(envs, "KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(envs, "KVSERVE_GEMM_TUNING", True)  # asked for, but there is no cuBLASLt on the CPU
    args = EngineArgs(model=tiny_model_dir("llama"), device="cpu", max_model_len=256, kv_cache_memory="8MiB")
    core = EngineCore(args.create_engine_config())
    assert not core.runner.gemm_tuning_enabled()
    assert core.runner.tune_gemms() == []
    assert cublaslt.num_tuned() == 0
    assert not list(tmp_path.iterdir())  # no results file written
