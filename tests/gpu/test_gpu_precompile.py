"""Start-up's Triton precompile on the GPU (skipped without CUDA): a recorded launch is skipped and then
compiled ahead of its real launch; an engine started in a fresh process loads every Triton variant at start
(none during the warm-up and capture after the precompile, none while serving varied requests)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.kernels import triton_precompile

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * FACTOR, mask=mask)


def test_a_new_variant_is_skipped_then_compiled_ahead_of_its_launch() -> None:
    if not triton_precompile.available():
        pytest.skip("this Triton lacks the cache hooks or preload")
    factor = random.Random().randint(2, 1 << 20)  # a variant no earlier test loaded
    x = torch.randn(1000, device="cuda")
    out = torch.full_like(x, float("nan"))
    with triton_precompile.Precompiler(workers=2) as pre:
        loaded = triton_precompile.loaded_count()
        _scale_kernel[(8,)](x, out, x.numel(), FACTOR=factor, BLOCK=128)
        torch.cuda.synchronize()
        assert torch.isnan(out).all(), "a launch of a variant being compiled must not run"
    assert pre.variants == ["_scale_kernel"] and pre.failed == []
    assert triton_precompile.loaded_count() == loaded + 1
    _scale_kernel[(8,)](x, out, x.numel(), FACTOR=factor, BLOCK=128)
    torch.cuda.synchronize()
    assert triton_precompile.loaded_count() == loaded + 1, "the launch compiled its variant again"
    torch.testing.assert_close(out, x * factor)


_ENGINE_SCRIPT = r"""
import json, random, sys
from kvserve.config import EngineArgs
from kvserve.engine.engine_core import EngineCore
from kvserve.kernels import triton_precompile
from kvserve.protocol.engine import EngineCoreRequest
from kvserve.protocol.sampling_params import SamplingParams

path, dtype = sys.argv[1], sys.argv[2]
args = EngineArgs(model=path, dtype=dtype, device="cuda", max_model_len=2048, num_kv_blocks=1024, max_num_seqs=48,
                  max_num_batched_tokens=1024, enable_prefix_caching=True)
core = EngineCore(args.create_engine_config())
rng = random.Random(0)
vocab = core.runner.arch.vocab_size
n = 0

def run(prompts, max_tokens, **params):
    global n
    for prompt, m in zip(prompts, max_tokens):
        sp = SamplingParams(max_tokens=m, ignore_eos=True, **params)
        core.add_request(EngineCoreRequest(req_id=str(n), prompt_token_ids=prompt, sampling_params=sp, max_tokens=m))
        n += 1
    while core.has_unfinished_requests():
        core.step()

tokens = lambda k: [rng.randrange(3, vocab) for _ in range(k)]
run([tokens(1100)], [6], temperature=0.0)  # a chunked prompt: a fresh 1,024-token chunk, then one over the cache
run([tokens(1024)], [3], temperature=0.0)  # one fresh prompt at cuDNN's threshold
run([tokens(rng.randint(2, 300)) for _ in range(40)], [rng.randint(1, 40) for _ in range(40)], temperature=0.0)
shared = tokens(300)  # prefix-cache hits, then a batch that shares a long prefix
run([shared + tokens(rng.randint(1, 40)) for _ in range(12)], [rng.randint(4, 24) for _ in range(12)],
    temperature=0.8, top_k=20, top_p=0.9, logprobs=3, seed=1)
run([tokens(rng.randint(2, 2000)) for _ in range(6)], [rng.randint(1, 30) for _ in range(6)], temperature=0.0)
print("RESULT " + json.dumps({"phases": core.startup_phases, "startup_late": core.startup_late_variants,
                              "serving_late": core.late_kernel_variants, "loaded": triton_precompile.loaded_count()}))
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_loads_every_triton_variant_at_start(tmp_path: Path, dtype: str) -> None:
    """In a fresh process (nothing loaded yet) with an empty Triton cache: the precompile leaves the warm-up and
    capture nothing to compile, and serving chunked, fresh, mixed, prefix-hit, shared-prefix and sampled
    batches of 1 to 48 requests loads no variant."""
    if not triton_precompile.available():
        pytest.skip("this Triton lacks the cache hooks or preload")
    from helpers.tiny_models import make_bare_checkpoint

    model = make_bare_checkpoint(str(tmp_path / "model"), "qwen2", seed=3, max_position_embeddings=4096)
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "KVSERVE_TRITON_PRECOMPILE": "1"}
    result = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, model, dtype], capture_output=True, text=True,
                            env=env, timeout=900, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(v for v in result.stdout.splitlines() if v.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    assert "triton_precompile" in out["phases"]
    assert "sampled_rows_warm_up" in out["phases"]  # the last phase: the sampled rows' part at 33-48 rows
    assert out["startup_late"] == [], f"compiled during the warm-up or capture: {out['startup_late']}"
    assert out["serving_late"] == [], f"compiled while serving: {out['serving_late']}"
    assert out["loaded"] > 10
