"""Sweep of the Triton skinny matmul (`kvserve/kernels/triton_gemm.py`) against torch's matmul (cuBLAS) at the
Qwen2.5-7B decode shapes, bf16: qkv (with bias), o_proj, gate_up, down, and the LM head, at M = 1..128 rows.
`--weight-dtype fp8`: the same with fp8 (e4m3) weights and per-row scales (weight-only fp8, the kernel's
`w_scale`; --quantization fp8), checked against `reference.fp8_linear_weight_only`; its baseline is the fp8
path past the skinny rows (`ops.fp8_linear` with FP8_SKINNY_MAX_ROWS 0: per-token quantization, then cuBLAS's
`torch._scaled_mm`).

Each case holds one weight copy per layer (28, fewer for the LM head) and times a CUDA graph that runs the
matmul once per copy, as a decode step does: no Python launch cost and no L2 reuse between calls. Every
Triton configuration is checked against a float32 matmul of the same operands first; one that fails to
compile (shared memory) or to match is reported and skipped.

    python benchmarks/gemm_sweep.py --out /tmp/gemm_sweep.json [--budget-s 240] [--weight-dtype fp8]

Prints per case: cuBLAS, the best Triton configurations and the bandwidth each reaches (weight bytes /
time) against the 4.28 TB/s copy rate.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from attention_sweep import time_graph  # noqa: E402

from kvserve.kernels import ops, reference  # noqa: E402
from kvserve.kernels.triton_gemm import GemmConfig, fits, skinny_linear  # noqa: E402

COPY_TBPS = 4.28
# name, N, K, bias (Qwen2.5-7B: hidden 3584, intermediate 18944, 28 query / 4 KV heads of 128, vocab 152064)
SHAPES = [("qkv", 4608, 3584, True), ("o_proj", 3584, 3584, False), ("gate_up", 37888, 3584, False),
          ("down", 3584, 18944, False), ("lm_head", 152064, 3584, False)]
ROWS = [1, 8, 64, 128]
BLOCK_NS = [64, 128]
BLOCK_KS = [128, 256]
FP8_BLOCK_KS = [128, 256, 512]  # an fp8 weight tile of 2 block_k keys holds a bf16 tile's bytes
STAGES = [3, 4]
SPLITS = [1, 2, 3, 4, 6, 7, 8, 14, 16]


def layer_copies(n: int, k: int, has_bias: bool, dtype: torch.dtype, fp8: bool = False
                 ) -> tuple[int, int, torch.Generator, list, list, list]:
    """One weight (and bias) per layer, up to 28 and about 6 GB, so that timed graphs get no L2 reuse: returns
    (weight bytes, copies, the generator for the inputs, weights, biases, scales). fp8: the weights quantized
    per row (`ops.quantize_rows_fp8`) and their float32 scales (counted in the bytes); else scales are None."""
    nbytes = n * k + 4 * n if fp8 else n * k * 2
    copies = max(2, min(28, int(6e9 // nbytes)))
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    weights = [torch.randn(n, k, generator=gen, device="cuda", dtype=dtype) * k**-0.5 for _ in range(copies)]
    biases = [torch.randn(n, generator=gen, device="cuda", dtype=dtype) if has_bias else None for _ in range(copies)]
    scales: list = [None] * copies
    if fp8:
        quantized = [ops.quantize_rows_fp8(w) for w in weights]
        weights, scales = [w8 for w8, _ in quantized], [scale for _, scale in quantized]
    return nbytes, copies, gen, weights, biases, scales


def baseline_step(xs: torch.Tensor, ws: list, bs: list, ss: list) -> None:
    """cuBLAS over every copy: torch's linear, or for fp8 weights `ops.fp8_linear` past the skinny rows."""
    if ss[0] is None:
        for w, b in zip(ws, bs, strict=True):
            torch.nn.functional.linear(xs, w, b)
        return
    saved = ops.FP8_SKINNY_MAX_ROWS
    ops.FP8_SKINNY_MAX_ROWS = 0
    try:
        for w, b, scale in zip(ws, bs, ss, strict=True):
            ops.fp8_linear(xs, w, scale, b)
    finally:
        ops.FP8_SKINNY_MAX_ROWS = saved


def configs(n: int, k: int, num_sms: int, block_ns: list[int], block_ks: list[int],
            stages_list: list[int] = STAGES, warps_list: list[int] | None = None,
            splits: list[int] = SPLITS, fused_only: bool = False, weight_bytes: int = 2) -> list[GemmConfig]:
    out = []
    for bn, bk, stages in itertools.product(block_ns, block_ks, stages_list):
        if bn * bk * weight_bytes * stages > 200 * 1024:  # weight tiles alone past shared memory
            continue
        for warps in warps_list or ([4, 8] if bn >= 128 else [4]):
            for split in splits:
                programs = n // bn * split
                if n % bn or k % bk or split > k // bk or not num_sms <= programs <= 12 * num_sms:
                    continue
                out.append(GemmConfig(bn, bk, split, stages, warps))
                if split > 1 and not fused_only:
                    out.append(GemmConfig(bn, bk, split, stages, warps, fused_reduce=False))
    random.Random(n * k).shuffle(out)  # a case cut short by the budget still samples every axis
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping a case past its share")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    parser.add_argument("--block-ns", default=",".join(map(str, BLOCK_NS)))
    parser.add_argument("--block-ks", default=None, help=f"default {','.join(map(str, BLOCK_KS))} "
                        f"({','.join(map(str, FP8_BLOCK_KS))} with --weight-dtype fp8)")
    parser.add_argument("--stages", default=",".join(map(str, STAGES)))
    parser.add_argument("--warps", default="", help="num_warps values (default: 4, and 8 for 128+-row tiles)")
    parser.add_argument("--splits", default=",".join(map(str, SPLITS)),
                        help="split-K counts (need not divide K's chunks)")
    parser.add_argument("--fused-only", action="store_true", help="skip the separate-reduce variants")
    parser.add_argument("--picked", action="store_true",
                        help="time only pick_config's tiling (and two other depths) with plain and PDL launches")
    parser.add_argument("--weight-dtype", choices=["bf16", "fp8"], default="bf16",
                        help="fp8: e4m3 weights with per-row scales (weight-only fp8)")
    args = parser.parse_args()
    if args.block_ks is None:
        args.block_ks = ",".join(map(str, FP8_BLOCK_KS if args.weight_dtype == "fp8" else BLOCK_KS))
    if args.picked:
        return picked(args)
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = [s for s in SHAPES if s[0] in args.shapes.split(",")]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    # A case may take twice its share (the first ones pay the compiles); the sweep stops at the budget.
    per_case = 2 * args.budget_s / (len(rows_list) * len(shapes))
    deadline = time.monotonic() + args.budget_s
    dtype = torch.bfloat16
    fp8 = args.weight_dtype == "fp8"
    results, summary = [], []
    for name, n, k, has_bias in shapes:
        nbytes, copies, gen, weights, biases, scales = layer_copies(n, k, has_bias, dtype, fp8)
        for m in rows_list:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=dtype)
            if fp8:
                expected = reference.fp8_linear_weight_only(x, weights[0], scales[0], biases[0]).float()
            else:
                expected = torch.nn.functional.linear(
                    x.float(), weights[0].float(), None if biases[0] is None else biases[0].float()
                )
            tol = 2e-2 * expected.abs().max().item()

            def cublas(xs: torch.Tensor = x, ws: list = weights, bs: list = biases, ss: list = scales) -> None:
                baseline_step(xs, ws, bs, ss)

            base_us = time_graph(cublas) / copies * 1e3
            case = {"shape": name, "n": n, "k": k, "m": m, "bias": has_bias, "weight_dtype": args.weight_dtype,
                    "cublas_us": base_us,
                    "cublas_tbps": nbytes / base_us / 1e6, "configs": []}
            start = time.monotonic()
            block_ns = [int(v) for v in args.block_ns.split(",")]
            block_ks = [int(v) for v in args.block_ks.split(",")]
            stages_list = [int(v) for v in args.stages.split(",")]
            warps_list = [int(v) for v in args.warps.split(",") if v]
            splits = [int(v) for v in args.splits.split(",")]
            for cfg in configs(n, k, num_sms, block_ns, block_ks, stages_list, warps_list, splits,
                               args.fused_only, 1 if fp8 else 2):
                if time.monotonic() - start > per_case or time.monotonic() > deadline:
                    case["truncated"] = True
                    break
                row: dict = {"block_n": cfg.block_n, "block_k": cfg.block_k, "split_k": cfg.split_k,
                             "num_stages": cfg.num_stages, "num_warps": cfg.num_warps,
                             "fused_reduce": cfg.fused_reduce}
                try:
                    assert fits(x, weights[0], cfg, w_scale=scales[0])
                    got = skinny_linear(x, weights[0], biases[0], cfg, w_scale=scales[0])
                    err = (got.float() - expected).abs().max().item()
                    if not err <= tol:
                        row["error"] = f"max abs err {err:.3g} > {tol:.3g}"
                    else:

                        def step(c: GemmConfig = cfg, xs: torch.Tensor = x, ws: list = weights,
                                 bs: list = biases, ss: list = scales) -> None:
                            for w, b, scale in zip(ws, bs, ss, strict=True):
                                skinny_linear(xs, w, b, c, w_scale=scale)

                        us = time_graph(step) / copies * 1e3
                        again = skinny_linear(x, weights[0], biases[0], cfg, w_scale=scales[0])  # after the replays
                        if not torch.equal(again, got):
                            row["error"] = "a launch after the graph replays gave different bits"
                        else:
                            row["us"] = us
                            row["tbps"] = nbytes / us / 1e6
                except Exception as exc:  # out of shared memory, or a launch error
                    row["error"] = repr(exc)[:160]
                case["configs"].append(row)
            results.append(case)
            timed = sorted((r for r in case["configs"] if "us" in r), key=lambda r: r["us"])
            failed = sum(1 for r in case["configs"] if "error" in r)
            summary.append((case, timed[:3], failed))
            print(f"{name} m={m}: cublas {base_us:.1f} us, best triton "
                  f"{timed[0]['us'] if timed else float('nan'):.1f} us, {len(case['configs'])} configs, "
                  f"{failed} failed", flush=True)
        del weights, biases, scales
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "num_sms": num_sms,
                                    "triton": __import__("triton").__version__, "torch": torch.__version__,
                                    "weight_dtype": args.weight_dtype, "results": results}, indent=1))
    print(f"\n{'shape':8s} {'M':>4s} {'cuBLAS us':>9s} {'TB/s':>5s} | {'triton us':>9s} {'TB/s':>5s} "
          f"{'speedup':>7s}  config (block_n, block_k, split, stages, warps[, separate reduce])")
    for case, best, failed in summary:
        for i, r in enumerate(best[:2]):
            head = (f"{case['shape']:8s} {case['m']:4d} {case['cublas_us']:9.1f} {case['cublas_tbps']:5.2f}"
                    if i == 0 else " " * 30)
            print(f"{head} | {r['us']:9.1f} {r['tbps']:5.2f} {case['cublas_us'] / r['us']:6.2f}x  "
                  f"({r['block_n']}, {r['block_k']}, {r['split_k']}, {r['num_stages']}, {r['num_warps']}"
                  + (", separate" if r["split_k"] > 1 and not r["fused_reduce"] else "") + ")"
                  + (f"  [{failed} failed]" if failed and i == 0 else ""))
    # The best time at each split count (any tiling): what a split rule is fitted to.
    print(f"\n{'shape':8s} {'M':>4s}  best us by split count (block_n / programs)")
    for case, _, _ in summary:
        by_split: dict[int, dict] = {}
        for r in case["configs"]:
            if "us" in r and (r["split_k"] not in by_split or r["us"] < by_split[r["split_k"]]["us"]):
                by_split[r["split_k"]] = r
        print(f"{case['shape']:8s} {case['m']:4d}  " + "  ".join(
            f"{s}: {r['us']:.1f} ({r['block_n']}/{case['n'] // r['block_n'] * s})" for s, r in sorted(by_split.items())))
    return 0


def picked(args: argparse.Namespace) -> int:
    """pick_config's tiling per case: cuBLAS, plain launches, PDL launches (and PDL at two other pipeline
    depths). The graph runs one matmul per weight copy back to back (in a decode step a norm, SiLU or
    attention kernel sits between two matmuls, so PDL numbers here are not the engine's)."""
    from kvserve.kernels import triton_pdl
    from kvserve.kernels.triton_gemm import pick_config

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    max_shared = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    fp8 = args.weight_dtype == "fp8"
    variants = [("plain", False, None), ("pdl", True, None)]
    variants += ([("pdl k128 s3", True, (128, 3)), ("pdl k512 s3", True, (512, 3))] if fp8 else
                 [("pdl k64 s6", True, (64, 6)), ("pdl k256 s3", True, (256, 3))])
    dtype = torch.bfloat16
    results = []
    for name, n, k, has_bias in [s for s in SHAPES if s[0] in args.shapes.split(",")]:
        nbytes, copies, gen, weights, biases, scales = layer_copies(n, k, has_bias, dtype, fp8)
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=dtype)
            cfg = pick_config(m, n, k, num_sms, max_shared, weight_bytes=1 if fp8 else 2)

            def cublas(xs: torch.Tensor = x, ws: list = weights, bs: list = biases, ss: list = scales) -> None:
                baseline_step(xs, ws, bs, ss)

            row = {"shape": name, "m": m, "config": str(cfg), "cublas_us": time_graph(cublas) / copies * 1e3}
            reference = None
            for label, pdl, tiling in variants:
                triton_pdl.set_enabled(pdl)
                c = cfg
                if tiling is not None:
                    c = GemmConfig(cfg.block_n, tiling[0], cfg.split_k, tiling[1], cfg.num_warps)
                    if k % c.block_k or c.split_k > k // c.block_k:
                        continue

                def step(c: GemmConfig = c, xs: torch.Tensor = x, ws: list = weights, bs: list = biases,
                         ss: list = scales) -> None:
                    for w, b, scale in zip(ws, bs, ss, strict=True):
                        skinny_linear(xs, w, b, c, w_scale=scale)

                try:
                    got = skinny_linear(x, weights[0], biases[0], c, w_scale=scales[0])
                    reference = got if reference is None else reference
                    row[label] = time_graph(step) / copies * 1e3
                    row[label + " same bits"] = bool(torch.equal(got, reference))
                except Exception as exc:  # a tiling this GPU or Triton cannot build
                    row[label + " error"] = repr(exc)[:200]
                    print(f"{name} m={m} {label}: {row[label + ' error']}", flush=True)
            results.append(row)
            timed = [v[0] for v in variants if v[0] in row]
            print(f"{name:8s} {m:4d} cublas {row['cublas_us']:7.1f} | "
                  + " ".join(f"{label} {row[label]:7.1f}" + ("" if row[label + ' same bits'] else " DIFF")
                             for label in timed)
                  + f"  ({nbytes / min(row[v] for v in timed) / 1e6:.2f} TB/s best) {cfg}", flush=True)
        del weights, biases, scales
        torch.cuda.empty_cache()
    triton_pdl.set_enabled(True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "num_sms": num_sms,
                                    "weight_dtype": args.weight_dtype, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
