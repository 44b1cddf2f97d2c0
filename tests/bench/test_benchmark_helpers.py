"""Helpers of the GPU benchmark scripts that decide what a run reports, checked on the CPU."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_kernel_time_counts_each_kernel_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kprofile total sums kernels and copies only: the profiler also gives aten ops and the driver's launch
    calls device time of the kernels under them."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import engine_benchmarks

    def event(key: str, us: float) -> SimpleNamespace:
        return SimpleNamespace(key=key, self_device_time_total=us)

    events = [event("aten::mm", 900.0), event("nvjet_sm90_tst_320x128", 900.0), event("cuLaunchKernelEx", 40.0),
              event("cudaLaunchKernel", 5.0), event("_rms_norm_kernel", 30.0), event("Memset (Device)", 2.0)]
    assert engine_benchmarks._kernel_us(events) == 932.0


def test_gate_up_sweep_rejects_a_nan_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiling whose output holds a NaN is a mismatch, not a timed candidate (session 19: the warp-specialised
    loop gave NaN and `err > tol` let it through)."""
    import torch

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gate_up_sweep

    want = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    assert gate_up_sweep.matches(want + 0.01, want)[0]
    assert not gate_up_sweep.matches(want + 0.5, want)[0]
    got = want.clone()
    got[1, 0] = float("nan")
    ok, err, _ = gate_up_sweep.matches(got, want)
    assert not ok and err != err


def test_itl_stalls_groups_gaps_that_end_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests held up by one slow step form one stall, with the first token another request got then;
    a gap elsewhere is its own stall; a failed request's stand-in TTFT counts as no token."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import itl_stalls

    def record(start: float, ttft: float, gaps: list[float], error: str | None = None) -> dict:
        return {"start_s": start, "ttft_s": ttft, "itl_s": gaps, "error_kind": error}

    records = [
        record(0.0, 0.010, [0.005, 0.200, 0.005]),  # tokens at 0.010, 0.015, 0.215, 0.220
        record(0.0, 0.012, [0.005, 0.199, 0.005]),  # 0.012, 0.017, 0.216, 0.221
        record(0.1, 0.1155, [0.005]),  # first token at 0.2155, with the stall's end
        record(0.0, 0.500, [0.090]),  # a gap of its own, ending at 0.590
        record(0.0, 0.216, [], error="timeout"),  # ignored
    ]
    stalls = itl_stalls.find_stalls(records, min_gap_s=0.05)
    assert [(round(s.end_s, 3), s.waiting, round(s.longest_ms), s.first_tokens) for s in stalls] == [
        (0.215, 2, 200, 1), (0.59, 1, 90, 0)]
    assert itl_stalls.find_stalls(records, min_gap_s=0.3) == []
    # A client collection inside the first stall's gaps marks it; one after both does not.
    client = {"long_gc_pauses": [[0.100, 150.0]], "long_loop_lags": [[0.300, 60.0]]}
    assert [itl_stalls.client_stall(s, client) for s in stalls] == ["gc 150", "-"]
    assert itl_stalls.client_stall(stalls[0], None) == "-"


def test_cublaslt_algos_derives_the_engines_matmul_shapes_from_a_model(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Callable[..., str],
) -> None:
    """`cublaslt_algos.py --model DIR --tp N` times the shapes the engine's start-up tuning looks up: the
    model's dense layers per rank, sharded, a row-parallel layer's bias on rank 0 only (rank 1 runs it, and
    looks it up, without), no LM head; and the model's layer count for its per-step table."""
    import torch

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import cublaslt_algos

    path = tiny_model_dir("llama", attention_bias=True)  # q/k/v and o_proj with a bias
    config = json.loads((Path(path) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    shapes, layers = cublaslt_algos.model_shapes(path, 1, torch.bfloat16)
    assert layers == config["num_hidden_layers"]
    assert sorted(shapes) == sorted([("qkv_proj", qkv, hidden, True), ("o_proj", hidden, hidden, True),
                                     ("gate_up_proj", 2 * inter, hidden, False), ("down_proj", hidden, inter, False)])
    sharded, _ = cublaslt_algos.model_shapes(path, 2, torch.bfloat16)
    assert sorted(sharded) == sorted([("qkv_proj", qkv // 2, hidden, True), ("o_proj", hidden, hidden // 2, True),
                                      ("o_proj_nobias", hidden, hidden // 2, False),
                                      ("gate_up_proj", inter, hidden, False), ("down_proj", hidden, inter // 2, False)])
