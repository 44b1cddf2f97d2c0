"""Sweep of the gate/up matmul with SiLU-and-mul in its epilogue (`kvserve/kernels/triton_gate_up.py`) against
what the engine runs without it: torch's matmul (cuBLAS) then kvserve's `silu_and_mul`, at the Qwen2.5-7B MLP
shape (K = 3584, D = 18944), bf16, at the row counts asked (decode or prefill sizes).

Each timing is a CUDA graph of one call (`attention_sweep.time_graph`). Every Triton tiling is first checked
against the two-op result; one that fails to compile or to match is reported and skipped.

    python benchmarks/gate_up_sweep.py --out /tmp/gate_up [--rows 1024,8192]

Prints per row count: cuBLAS alone, cuBLAS + silu_and_mul, and each tiling's time and TFLOP/s (gate/up
FLOPs / time), best first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from attention_sweep import time_graph  # noqa: E402
from common import GpuEnergy, sustained, write_result  # noqa: E402

from kvserve.kernels import ops  # noqa: E402
from kvserve.kernels.triton_gate_up import GateUpConfig, gate_up_silu  # noqa: E402

HIDDEN, INTERMEDIATE = 3584, 18944
ROWS = [512, 1024, 2048, 4096, 8192]
# (block_m, block_n, block_k, stages, warps)
TILINGS = [(128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 64, 64, 4, 4), (128, 64, 64, 5, 4),
           (64, 128, 64, 4, 4), (128, 128, 128, 2, 8), (256, 64, 64, 3, 8), (128, 64, 128, 3, 4)]


def matches(got: torch.Tensor, want: torch.Tensor, rel: float = 0.02) -> tuple[bool, float, float]:
    """(whether got is within rel of want's largest magnitude everywhere, the largest |got - want|, the
    largest |want|), in float32. A NaN in got fails: the error is then NaN, and no comparison holds for it."""
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    return err <= rel * scale, err, scale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--loaders", default="ptr,tma", help="ptr (pointers), tma (TMA descriptors)")
    parser.add_argument("--tilings", default=";".join(",".join(map(str, t)) for t in TILINGS),
                        help="block_m,block_n,block_k,stages,warps;...")
    parser.add_argument("--group-ms", default="8")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sustained-s", type=float, default=0.0,
                        help="also time each case replayed back to back for this long (the GPU then runs at its "
                        "power cap's clock), with the energy per call from NVML")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    weight = torch.randn(2 * INTERMEDIATE, HIDDEN, device="cuda", dtype=dtype) * HIDDEN**-0.5
    tilings = [tuple(int(v) for v in t.split(",")) for t in args.tilings.split(";")]
    unknown = set(args.loaders.split(",")) - {"ptr", "tma"}
    if unknown:
        parser.error(f"unknown loaders {sorted(unknown)}: use ptr and/or tma")
    results = []
    all_configs: list[tuple[str, GateUpConfig]] = []
    for m in [int(v) for v in args.rows.split(",")]:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=dtype)
        flops = 2.0 * m * HIDDEN * 2 * INTERMEDIATE
        want = ops.silu_and_mul(torch.nn.functional.linear(x, weight))
        rows = [("cublas", time_graph(lambda x=x: torch.nn.functional.linear(x, weight), args.reps), 0.0),
                ("cublas+silu_and_mul",
                 time_graph(lambda x=x: ops.silu_and_mul(torch.nn.functional.linear(x, weight)), args.reps), 0.0)]
        for loader in args.loaders.split(","):
            for group_m in [int(v) for v in args.group_ms.split(",")]:
                for bm, bn, bk, stages, warps in tilings:
                    config = GateUpConfig(bm, bn, bk, stages, warps, group_m, use_tma=loader == "tma")
                    name = f"{loader} {bm}x{bn}x{bk} s{stages} w{warps} g{group_m}"
                    try:
                        started = time.perf_counter()
                        got = gate_up_silu(x, weight, config)
                        torch.cuda.synchronize()
                        compile_s = time.perf_counter() - started
                    except Exception as exc:  # noqa: BLE001 (a tiling past the GPU's resources)
                        print(f"  {m} {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        continue
                    ok, err, scale = matches(got, want)
                    if not ok:
                        print(f"  {m} {name}: mismatch {err:.3g} (scale {scale:.3g})", flush=True)
                        continue
                    ms = time_graph(lambda x=x, c=config: gate_up_silu(x, weight, c), args.reps)
                    rows.append((name, ms, err))
                    all_configs.append((name, config))
                    print(f"  {m} {name}: {ms:.3f} ms (compile {compile_s:.1f} s, max err {err:.3g})", flush=True)
        rows.sort(key=lambda r: r[1])
        print(f"\nrows {m}: what            ms     TFLOP/s")
        for name, ms, err in rows:
            print(f"  {name:32s} {ms:8.3f} {flops / ms / 1e9:8.1f}")
            results.append({"rows": m, "what": name, "ms": ms, "tflops": flops / ms / 1e9, "max_err": err})
        triton_rows = [name for name, _, _ in rows if name.startswith(("ptr", "tma"))]
        if args.sustained_s > 0 and not triton_rows:
            print(f"rows {m}: no Triton tiling compiled and matched; no sustained runs")
        elif args.sustained_s > 0:
            energy = GpuEnergy()
            best = triton_rows[0]
            config = next(c for c in all_configs if c[0] == best)[1]
            cases = {"cublas+silu_and_mul": lambda x=x: ops.silu_and_mul(torch.nn.functional.linear(x, weight)),
                     best: lambda x=x, c=config: gate_up_silu(x, weight, c)}
            print(f"rows {m} sustained {args.sustained_s:.1f} s: what      ms/call   J/call   SM MHz at end")
            for _ in range(2):  # twice in turn
                for name, fn in cases.items():
                    ms, joules, mhz = sustained(fn, args.sustained_s, energy)
                    jtext = "n/a" if joules is None else f"{joules:.3f}"
                    print(f"  {name:32s} {ms:8.3f} {jtext:>8} {mhz}", flush=True)
                    results.append({"rows": m, "what": name, "sustained_ms": ms, "joules": joules, "sm_mhz": mhz})
    write_result(args.out, "gate_up_sweep", vars(args) | {"out": str(args.out)}, results, "cuda")
    return 0


if __name__ == "__main__":
    sys.exit(main())
