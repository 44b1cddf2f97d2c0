"""Time of the sampler's step for penalised requests: N rows of a P-token prompt whose outputs grow by one
token a step, with repetition, frequency and presence penalties, greedy. Two ways to count the tokens:
`kept` (rows carry their request id: counts kept on the device, only the new token counted) and `lists`
(no id: every prompt and output padded and uploaded each step); on CUDA each with the penalties as the Triton
kernel and as the torch reference. Prints milliseconds a step: host time of the call (on CUDA the GPU work is
queued, not waited for) and the time until the sampled ids are ready.

  python benchmarks/sampler_cost.py --rows 64 --prompt-len 4096 --steps 50 [--device cuda]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.kernels import ops  # noqa: E402
from kvserve.layers.sampler import Sampler, SamplingRow  # noqa: E402
from kvserve.protocol.sampling_params import SamplingParams  # noqa: E402


def run(mode: str, args: argparse.Namespace, device: torch.device) -> tuple[float, float]:
    """(host ms a step, ms a step until the ids are ready), medians over the timed steps."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)
    rows = [
        SamplingRow(params, [rng.randrange(args.vocab) for _ in range(args.prompt_len)], [], None,
                    req_id=f"r{i}" if mode == "kept" else None)
        for i in range(args.rows)
    ]
    logits = torch.randn(args.rows, args.vocab, device=device)
    sampler = Sampler()
    host: list[float] = []
    ready: list[float] = []
    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        ids = sampler(logits, rows, []).sampled_token_ids
        queued = time.perf_counter()
        tokens = ids.tolist()  # the engine's one copy of the step's ids
        done = time.perf_counter()
        for row, token in zip(rows, tokens, strict=True):
            row.output_token_ids.append(token)
        if step >= args.warmup:
            host.append((queued - start) * 1e3)
            ready.append((done - start) * 1e3)
    return sorted(host)[len(host) // 2], sorted(ready)[len(ready) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"{args.rows} rows, {args.prompt_len}-token prompts, vocab {args.vocab}, {args.steps} steps on {device}")
    print(f"{'counts':8s} {'penalties':10s} {'host ms/step':>13s} {'ready ms/step':>14s}")
    kernels = ("triton", "torch") if device.type == "cuda" else ("torch",)
    for mode in ("kept", "lists"):
        for kernel in kernels:
            ops.set_penalty_kernel(kernel == "triton")
            host, ready = run(mode, args, device)
            print(f"{mode:8s} {kernel:10s} {host:13.2f} {ready:14.2f}")


if __name__ == "__main__":
    main()
