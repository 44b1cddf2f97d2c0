"""benchmarks/engine_benchmarks.py's tprofile and hostprof sections on the CPU, tiny shapes: the profiled windows
of the 256-sequence run start where asked and hold the steps asked for, and hostprof runs the cases given."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_tprofile_windows_and_hostprof_cases(tmp_path: Path) -> None:
    out = tmp_path / "res"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "engine_benchmarks.py"), "--out", str(out), "--device", "cpu",
         "--dtype", "float32", "--model", "tiny", "--scale", "0.02", "--max-model-len", "2048",
         "--max-num-seqs", "16", "--sections", "tprofile,hostprof", "--tprofile-windows", "2,5",
         "--tprofile-steps", "2", "--hostprof-cases", "2x64,3x40"],
        cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
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

