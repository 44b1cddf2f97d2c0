"""Does a torch matmul at a row count not seen before hold the host until the GPU is idle?

A fresh engine's first LM head at 47 rows held the host 283.7 ms inside `aten::mm` (docs/perf_notes.md, entry
47). This probe keeps the GPU busy (`torch.cuda._sleep`, about `--busy-ms`) before each matmul and times the
host side of the matmul call alone, for each row count in `--rows`, twice in that order: a first-use cost
shows in the first round only. Shapes: the Qwen2.5-7B q/k/v (3584 -> 4608), gate/up (3584 -> 37888) and LM
head (3584 -> 152064), bf16, cuBLASLt preferred as in the engine.

    python benchmarks/cublas_first_use.py --rows 47,50,2100,3000,3001,5000,8000
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {"qkv": (3584, 4608), "gate_up": (3584, 37888), "lm_head": (3584, 152064)}


def sleep_ms(cycles: int) -> float:
    """How long `torch.cuda._sleep(cycles)` keeps the GPU busy (ms)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def sleep_cycles(ms: float) -> int:
    """Clock cycles of `torch.cuda._sleep` that take about `ms` on this GPU, timed after a first launch
    (timing the first launch, which loads the kernel, gave about 15 ms of sleep for 50 asked)."""
    cycles = 10_000_000
    sleep_ms(cycles)
    return int(cycles * ms / max(sleep_ms(cycles), 1e-3))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="47,50,100,2100,3000,3001,5000,8000")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--busy-ms", type=float, default=50.0)
    args = p.parse_args()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    rows = [int(r) for r in args.rows.split(",")]
    device = torch.device("cuda")
    cycles = sleep_cycles(args.busy_ms)
    busy_ms = sleep_ms(cycles)  # what the GPU's busy time came to
    x = torch.randn(max(rows), 3584, device=device, dtype=torch.bfloat16)
    print(f"GPU busy about {busy_ms:.0f} ms before each call; host ms of the matmul call (round 1, round 2)")
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        torch.nn.functional.linear(x[:1], w)  # the shape's first use at one row, out of the timing
        times: dict[int, list[float]] = {m: [] for m in rows}
        for _ in range(2):
            for m in rows:
                torch.cuda.synchronize()
                torch.cuda._sleep(cycles)
                t0 = time.perf_counter()
                torch.nn.functional.linear(x[:m], w)
                times[m].append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        cells = " ".join(f"{m}:{a:.1f}/{b:.1f}" for m, (a, b) in times.items())
        print(f"{name:8s} {cells}", flush=True)
        del w
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
