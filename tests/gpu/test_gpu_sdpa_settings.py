"""kvserve's prefill attention leaves torch's SDPA backend choice for the rest of the process as it found it
(skipped without CUDA). On torch 2.11 with an H200, a `sdpa_kernel(..., set_priority=True)` block around
kvserve's cuDNN prefill left flash first for every later SDPA call of the process, where torch's default runs
cuDNN: HF generate in the same process then ran another attention kernel than it does alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
import torch
from torch.profiler import ProfilerActivity, profile

if sys.argv[1] == "kvserve-first":
    from kvserve.kernels import ops

    ops.SDPA_CUDNN_MIN_TOKENS = 512
    q = torch.randn(1024, 28, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1024, 4, 128, dtype=torch.bfloat16, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ops._sdpa_prefill(q, k, k, 128 ** -0.5)
        torch.cuda.synchronize()
    assert any("cudnn" in e.name.lower() for e in prof.events()), "kvserve's prefill did not run cuDNN"
# A decode-shaped call as HF makes it: one query token per sequence, no mask.
q = torch.randn(8, 28, 1, 128, dtype=torch.bfloat16, device="cuda")
k = torch.randn(8, 28, 600, 128, dtype=torch.bfloat16, device="cuda")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    torch.nn.functional.scaled_dot_product_attention(q, k, k)
    torch.cuda.synchronize()
names = [e.name.lower() for e in prof.events()]
print(json.dumps({"cudnn": any("cudnn" in n for n in names), "flash": any("flash" in n for n in names),
                  "order": list(torch._C._get_sdp_priority_order())}))
"""


def _backend_after(mode: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", _PROBE, mode], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_prefill_leaves_sdpa_backend_choice_of_the_process_alone() -> None:
    alone = _backend_after("alone")
    after = _backend_after("kvserve-first")
    assert (after["cudnn"], after["flash"]) == (alone["cudnn"], alone["flash"]), (alone, after)
    assert after["order"] == alone["order"], (alone, after)
