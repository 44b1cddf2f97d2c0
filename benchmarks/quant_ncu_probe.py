"""One launch of each 4-bit matmul case inside a CUDA profiler range, for Nsight Compute (`ncu
--profile-from-start off`): the paired-dequantizing kernel (kernels/triton_quant.py) at the Qwen2.5-7B shapes
and the row counts given, and torch's bf16 matmul (cuBLAS) on the same shapes for comparison. Each case runs
three times first (compile, warm), so the profiled launch is the steady one. It prints each paired case's
tiling; the profile is ncu's report (without ncu the cases just run).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python benchmarks/quant_ncu_probe.py --cases gate_up:64,gate_up:16,cublas:gate_up:64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_matmul_bench import SHAPES, random_packed  # noqa: E402

from kvserve.kernels import ops, triton_quant  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="gate_up:64,gate_up:16,down:64,qkv:64,cublas:gate_up:64",
                   help="comma-separated SHAPE:ROWS (the paired kernel at its default tiling), "
                        "tiles32:SHAPE:ROWS (32-row tiles past 32 rows) or cublas:SHAPE:ROWS (bf16 F.linear)")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = {name: (k, n) for name, k, n in SHAPES}
    runs = []
    for case in args.cases.split(","):
        *kind, name, rows = case.split(":")
        k, n = shapes[name]
        m = int(rows)
        x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        if kind == ["cublas"]:
            dense = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
            runs.append((case, lambda x=x, w=dense: torch.nn.functional.linear(x, w)))
            continue
        weight = ops.prepare_quantized(random_packed(k, n, 4, 128, gen, torch.bfloat16), torch.bfloat16)
        triton_quant.PAIRS_TWO_DOTS = kind != ["tiles32"]
        config = triton_quant.pick_pairs_config(m, weight, num_sms)
        print(f"{case}: {config}", flush=True)
        runs.append((case, lambda x=x, w=weight, c=config: triton_quant.quant_matmul_pairs(x, w, None, c)))
    for _, fn in runs:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    for case, fn in runs:
        torch.cuda.nvtx.range_push(case)
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        torch.cuda.nvtx.range_pop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
