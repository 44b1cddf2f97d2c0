"""Sweep of the decode-rows TMA matmul (`kvserve/kernels/triton_decode_gemm.py`) against what the engine ran
before it at 33-64 rows: torch's matmul (cuBLAS), and for gate/up the fused TMA gate/up kernel of
`triton_gate_up.py` (and cuBLAS then `silu_and_mul`), at the Qwen2.5-7B decode shapes, bf16.

Each case holds one weight copy per layer (`gemm_sweep.layer_copies`: up to 28, no L2 reuse between calls)
and times a CUDA graph that runs the matmul once per copy (`attention_sweep.time_graph`, the median of
--repeats such timings). Every variant is checked against a float32 matmul first; one that fails to compile
or to match is reported and skipped. Variants: the tiling (block_m, block_n, block_k, stages, warps) with the
plan the engine would take (`engine_plan`), and the same tiling forced to each split count of --splits (the
whole waves unsplit, the rest cut; 1: every tile whole).

    python benchmarks/decode_gemm_sweep.py --out /tmp/decode_gemm.json [--rows 48,64]

Prints per shape and row count each variant's µs per call and the weight bytes / time against 4.28 TB/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from attention_sweep import time_graph  # noqa: E402
from gemm_sweep import layer_copies  # noqa: E402

from kvserve.kernels import ops, triton_decode_gemm, triton_gate_up  # noqa: E402
from kvserve.kernels.triton_decode_gemm import DecodeGemmConfig, Plan, decode_linear, pick  # noqa: E402

COPY_TBPS = 4.28
# name, weight rows, K, bias, gate/up (Qwen2.5-7B: hidden 3584, intermediate 18944, 28 / 4 heads of 128)
SHAPES = {"gate_up": (37888, 3584, False, True), "down": (3584, 18944, False, False),
          "o_proj": (3584, 3584, False, False), "qkv": (4608, 3584, True, False),
          "lm_head": (152064, 3584, False, False)}
TILINGS = "64,64,128,4,4,t;64,64,128,3,4,t;64,32,128,6,4,t;64,32,128,6,4,p;64,64,128,4,4,p"


def _tiling(text: str) -> DecodeGemmConfig:
    """block_m,block_n,block_k,stages,warps[,x loads: t (TMA, default) or p (pointers)]"""
    values = text.split(",")
    bm, bn, bk, stages, warps = (int(v) for v in values[:5])
    return DecodeGemmConfig(bm, bn, bk, stages, warps, x_tma=values[5:] in ([], ["t"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="48,64")
    parser.add_argument("--tilings", default=TILINGS, help="block_m,block_n,block_k,stages,warps;...")
    parser.add_argument("--splits", default="1,2,4,7", help="forced split counts tried per tiling")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = torch.bfloat16
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    max_shared = ops._max_shared_bytes(torch.device("cuda"))
    rows_list = [int(v) for v in args.rows.split(",")]
    tilings = [_tiling(t) for t in args.tilings.split(";")]
    forced = [int(v) for v in args.splits.split(",")]
    results: list[dict] = []
    table: list[str] = []
    for name in args.shapes.split(","):
        n_w, k, has_bias, gate_up = SHAPES[name]
        nbytes, copies, gen, weights, biases = layer_copies(n_w, k, has_bias, dtype)
        n_out = n_w // 2 if gate_up else n_w
        for m in rows_list:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=dtype)
            ref = torch.nn.functional.linear(x.float(), weights[0].float(),
                                             None if biases[0] is None else biases[0].float())
            if gate_up:
                ref = ops.silu_and_mul(ref.to(dtype)).float()
            # (label, one graph's work over every copy, one call on copy 0 to check; None: the reference path)
            variants: list[tuple[str, object, object]] = []

            def cublas(ws: list = weights, bs: list = biases, xs: torch.Tensor = x, g: bool = gate_up) -> None:
                for w, b in zip(ws, bs, strict=True):
                    y = torch.nn.functional.linear(xs, w, b)
                    if g:
                        ops.silu_and_mul(y)

            variants.append(("cublas" + ("+silu_and_mul" if gate_up else ""), cublas, None))
            if gate_up:
                def old_tma(ws: list = weights, xs: torch.Tensor = x) -> None:
                    for w in ws:
                        triton_gate_up.gate_up_silu(xs, w, triton_gate_up.DECODE_CONFIG)

                variants.append(("tma gate_up (before)", old_tma, lambda xs=x, w=weights[0]: triton_gate_up.gate_up_silu(
                    xs, w, triton_gate_up.DECODE_CONFIG)))
            candidates: list[tuple[str, DecodeGemmConfig, Plan]] = []
            picked = pick(m, n_out, k, gate_up, num_sms, max_shared)
            if picked is not None:
                candidates.append(("engine pick", *picked))
            for config in tilings:
                per_sm = triton_decode_gemm.programs_per_sm(config, gate_up, max_shared)
                if per_sm < 1:
                    table.append(f"  {name} {m}: {config} needs more shared memory than the GPU has")
                    continue
                tiles = -(-m // config.block_m) * -(-n_out // config.block_n)
                for s in forced:
                    dp = tiles if s == 1 else tiles // (num_sms * per_sm) * (num_sms * per_sm)
                    if s > 1 and dp == tiles:
                        continue
                    candidates.append((f"split {s}", config, Plan(tiles, dp, s)))
            for plan_name, config, schedule in candidates:

                def run(ws: list = weights, bs: list = biases, xs: torch.Tensor = x, c: DecodeGemmConfig = config,
                        p: Plan = schedule, g: bool = gate_up) -> None:
                    for w, b in zip(ws, bs, strict=True):
                        decode_linear(xs, w, b, c, p, gate_up=g)

                def once(xs: torch.Tensor = x, w: torch.Tensor = weights[0], b: torch.Tensor | None = biases[0],
                         c: DecodeGemmConfig = config, p: Plan = schedule, g: bool = gate_up) -> torch.Tensor:
                    return decode_linear(xs, w, b, c, p, gate_up=g)

                label = (f"{config.block_m}x{config.block_n}x{config.block_k} s{config.num_stages} "
                         f"w{config.num_warps} x-{'tma' if config.x_tma else 'ptr'} {plan_name} "
                         f"(dp {schedule.dp_tiles}, splits {schedule.splits}, grid {schedule.grid})")
                variants.append((label, run, once))
            for label, fn, once in variants:
                row = {"shape": name, "rows": m, "variant": label, "copies": copies}
                try:
                    if once is not None:
                        got = once()  # type: ignore[operator]
                        err = ((got.float() - ref).norm() / ref.norm()).item()
                        row["rel_err"] = err
                        if not err < 1e-2:
                            row["error"] = f"relative error {err:.3g}"
                    if "error" not in row:
                        fn()  # type: ignore[operator]
                        torch.cuda.synchronize()
                        times = [time_graph(fn, reps=10) / copies * 1e3 for _ in range(args.repeats)]
                        row["us"] = statistics.median(times)
                        row["us_all"] = times
                        row["tbps"] = nbytes / (row["us"] * 1e-6) / 1e12
                except Exception as exc:  # compile failure (shared memory) or launch error
                    row["error"] = repr(exc)[:200]
                results.append(row)
            timed = sorted((r for r in results if r["shape"] == name and r["rows"] == m and "us" in r),
                           key=lambda r: r["us"])
            table.append(f"{name} rows {m}: {nbytes / 1e6:.1f} MB of weight")
            for r in timed:
                table.append(f"  {r['us']:7.1f} us {r['tbps']:.2f} TB/s ({r['tbps'] / COPY_TBPS:.0%})  {r['variant']}")
            for r in results:
                if r["shape"] == name and r["rows"] == m and "error" in r:
                    table.append(f"  failed: {r['variant']}: {r['error']}")
        del weights, biases
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "num_sms": num_sms,
                                    "results": results}, indent=1))
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
