"""benchmarks/engine_benchmarks.py's tprofile, hostprof, mixed and poisson sections on the CPU, tiny shapes: the
profiled windows of the 256-sequence run start where asked and hold the steps asked for, hostprof runs the
cases given, the mixed section's arrivals each share a step with the decoding requests (with each step's host
copy of its sampled ids timed), and the poisson section serves every arrival in each round."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run_tiny(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """engine_benchmarks.py on the CPU's tiny model (float32, counts scaled by 0.02), results under `out`."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "engine_benchmarks.py"), "--out", str(out), "--device", "cpu",
         "--dtype", "float32", "--model", "tiny", "--scale", "0.02", "--max-model-len", "2048",
         "--max-num-seqs", "16", *args],
        cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(300)
def test_tprofile_windows_and_hostprof_cases(tmp_path: Path) -> None:
    out = tmp_path / "res"
    # Lengths scaled by 0.1 (prompts and outputs of 10-102 tokens, not 100-1024): the run's ~100 steps still
    # hold both windows, without the ~1000 decode steps of full-length outputs.
    _run_tiny(out, "--sections", "tprofile,hostprof", "--tprofile-windows", "2,5",
              "--tprofile-steps", "2", "--hostprof-cases", "2x64,3x40", "--length-scale", "0.1")
    tprofile = json.loads((out / "engine_tprofile.json").read_text())["results"]
    windows = tprofile["windows"]
    # A window opens after the step it is named by and holds the next `--tprofile-steps` steps.
    assert [w["first_step"] for w in windows] == [3, 6]
    assert all(len(w["batches"]) == 2 and all(b > 0 for b in w["batches"]) for w in windows)
    assert all(w["wall_us_per_step"] > 0 for w in windows)
    assert tprofile["output_tok_s"] > 0
    hostprof = json.loads((out / "engine_hostprof.json").read_text())["results"]
    assert sorted(hostprof) == ["b2x64", "b3x40"]
    assert all(case["wall"] > 0 and "schedule" in case for case in hostprof.values())

@pytest.mark.timeout(300)
def test_mixed_section_arrivals_share_steps_with_decodes(tmp_path: Path) -> None:
    out = tmp_path / "res"
    proc = _run_tiny(out, "--sections", "mixed", "--mixed-cases", "3x64x20,2x32x40", "--mixed-cycles", "3",
                     "--time-host-copies")
    cases = json.loads((out / "engine_mixed.json").read_text())["results"]
    assert [(c["batch"], c["context"], c["prompt"]) for c in cases] == [(3, 64, 20), (2, 32, 40)]
    for case in cases:
        # No CUDA graphs on the CPU: every window is eager; each of its 3 arrivals is one step with prefill tokens.
        assert list(case["windows"]) == ["eager"] and len(case["windows"]["eager"]) == 4
        for window in case["windows"]["eager"]:
            assert window["mixed_steps"] == 3 and window["piecewise_steps"] == 0
            assert window["median_spike_ms"] > 0 and window["mean_step_ms"] > 0
    # --time-host-copies: every sampling step's copy, inside its launch; arrivals (prefill tokens) among them.
    copies = json.loads((out / "engine_host_copies.json").read_text())["results"]
    assert len(copies) > 20 and all(0 < c["copy_s"] <= c["launch_s"] for c in copies)
    assert {c["tokens"] for c in copies} >= {3, 23, 2, 42}
    assert "host copy of sampled ids, steps of <= 2048 tokens" in proc.stdout


@pytest.mark.timeout(300)
def test_poisson_section_serves_every_arrival(tmp_path: Path) -> None:
    out = tmp_path / "res"
    _run_tiny(out, "--sections", "poisson", "--poisson-rate", "100", "--poisson-duration", "0.3",
              "--poisson-in", "10", "--poisson-out", "5", "--poisson-rounds", "1")
    result = json.loads((out / "engine_poisson.json").read_text())["results"]
    assert result["input_len"] == 10 and result["output_len"] == 5 and result["arrivals"] > 10
    rounds = result["rounds"]
    # No CUDA graphs on the CPU: both rounds are eager, and every arrival is served to its last token.
    assert [r["mode"] for r in rounds] == ["eager", "eager"]
    for r in rounds:
        assert r["requests"] == r["completed"] == result["arrivals"]
        assert r["ttft_ms"]["mean"] > 0 and r["tpot_ms"]["mean"] > 0 and r["other_step_ms"]["median"] > 0
        assert r["piecewise_steps"] == 0


@pytest.mark.timeout(300)
def test_poisson_section_without_arrivals_reports_nan(tmp_path: Path) -> None:
    out = tmp_path / "res"
    _run_tiny(out, "--sections", "poisson", "--poisson-rate", "1", "--poisson-duration", "0.001",
              "--poisson-in", "10", "--poisson-out", "5", "--poisson-rounds", "1")
    result = json.loads((out / "engine_poisson.json").read_text())["results"]
    assert result["arrivals"] == 0
    for r in result["rounds"]:
        assert r["requests"] == r["completed"] == 0
        assert math.isnan(r["ttft_ms"]["mean"]) and math.isnan(r["tpot_ms"]["p99"])


@pytest.mark.timeout(300)
def test_kprofile_section_runs_with_the_host_phases_labelled(tmp_path: Path) -> None:
    """The kprofile section labels the host phases by routing the runner's calls (its sampler, a callable object
    with other methods the step uses, among them); on the CPU there are no device events to time, but the steps
    must run through the labels (the sampler's `release` was lost behind a plain function once)."""
    out = tmp_path / "res"
    proc = _run_tiny(out, "--sections", "kprofile", "--kprofile-cases", "b2")
    assert "kernel profile b2" in proc.stdout
    assert "b2" in json.loads((out / "engine_kprofile.json").read_text())["results"]
