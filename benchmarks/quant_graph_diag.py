"""Where a quantized bf16 model's greedy tokens with CUDA graphs first part from eager ones: each step's token
count, and the first step whose logprobs differ (GPU; the checkpoints of tests/gpu/test_gpu_quantized.py)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))

import test_gpu_quantized as t  # noqa: E402
from helpers.quantized import quantize_checkpoint  # noqa: E402
from helpers.tiny_models import make_bare_checkpoint  # noqa: E402

from kvserve.config import EngineArgs  # noqa: E402
from kvserve.engine.engine_core import EngineCore  # noqa: E402
from kvserve.protocol.engine import EngineCoreRequest  # noqa: E402
from kvserve.protocol.sampling_params import SamplingParams  # noqa: E402

DEVICE = "cuda" if len(sys.argv) < 2 else sys.argv[1]


def run(path: str, eager: bool, prompts: list[list[int]], step_tokens: int) -> tuple[list[int], list[tuple]]:
    args = EngineArgs(model=path, dtype="bfloat16" if DEVICE == "cuda" else "float32", device=DEVICE,
                      enforce_eager=eager, max_model_len=1024, num_kv_blocks=512, max_num_seqs=16,
                      max_num_batched_tokens=step_tokens)
    core = EngineCore(args.create_engine_config())
    runner = core.runner
    sizes: list[int] = []
    launch = runner.execute_model_async

    def recording(so):  # type: ignore[no-untyped-def]
        sizes.append(so.total_num_scheduled_tokens)
        return launch(so)

    runner.execute_model_async = recording
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(req_id=str(i), prompt_token_ids=p, sampling_params=params,
                                           max_tokens=20))
    steps = []
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            for lp in out.new_logprobs or []:
                steps.append((len(sizes), out.req_id, lp.token_ids, [round(v, 5) for v in lp.logprobs]))
    return sizes, steps


def main() -> None:
    root = Path(tempfile.mkdtemp())
    for i, (name, (model_type, kwargs)) in enumerate(t.CASES.items()):
        if name == "gptq8-qwen3":
            continue
        dense = make_bare_checkpoint(str(root / name / "dense"), model_type, seed=i, vocab_size=t.VOCAB)
        quantize_checkpoint(dense, str(root / name / "q"), str(root / name / "d"), **kwargs)
        prompts = t._prompts(8, seed=5)
        for step_tokens in (512, 128):
            gs, g = run(str(root / name / "q"), False, prompts, step_tokens)
            es, e = run(str(root / name / "q"), True, prompts, step_tokens)
            diffs = [(a, b) for a, b in zip(g, e, strict=True) if a != b]
            print(name, step_tokens, "step tokens", gs if gs == es else (gs, es))
            print(name, step_tokens, "identical" if not diffs else
                  f"{len(diffs)} of {len(g)} outputs differ; first (step, request, top ids, logprobs) graph "
                  f"{diffs[0][0]} eager {diffs[0][1]}")

if __name__ == "__main__":
    main()
