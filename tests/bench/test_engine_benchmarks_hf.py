"""benchmarks/engine_benchmarks.py's seeds + hf sections on the CPU, tiny shapes: HF generate runs on the seeds
section's own prompts (in a fresh process by default, checked by a digest of the prompts; in the benchmark's
process with --hf-in-process), and the ratio the issue asks for is reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("in_process", [False, True], ids=["fresh-process", "in-process"])
def test_seeds_then_hf_same_prompts_and_ratio(tmp_path: Path, in_process: bool) -> None:
    out = tmp_path / "res"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "engine_benchmarks.py"), "--out", str(out), "--device", "cpu",
         "--dtype", "float32", "--model", "tiny", "--scale", "0.1", "--length-scale", "0.05",
         "--max-model-len", "1024", "--sections", "seeds,hf", *(["--hf-in-process"] if in_process else [])],
        cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seeds = json.loads((out / "engine_seeds.json").read_text())["results"]
    hf = json.loads((out / "engine_hf.json").read_text())["results"]
    assert hf["same_prompts_as_seeds"] is True
    assert hf["process"] == ("this process, after kvserve" if in_process else "a fresh process")
    assert len(hf["runs_s"]) == 4 and hf["elapsed_s"] == min(hf["runs_s"][1:])
    assert (hf["num_seqs"], hf["input_len"], hf["output_len"]) == (
        seeds["num_seqs"], seeds["input_len"], seeds["output_len"])
    assert hf["kvserve_over_hf"] == pytest.approx(seeds["output_tok_s"] / hf["output_tok_s"])
    assert "seeds' workload, kvserve / HF" in proc.stdout


@pytest.mark.timeout(200)
def test_a_failed_hf_process_is_reported_with_its_error(tmp_path: Path) -> None:
    out = tmp_path / "res"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "engine_benchmarks.py"), "--out", str(out), "--device", "cpu",
         "--dtype", "no_such_dtype", "--model", "tiny", "--sections", "hf"],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    errors = (out / "engine_errors.json").read_text()
    assert "hf_probe.py failed" in errors and "no_such_dtype" in errors, (errors, proc.stderr[-2000:])
