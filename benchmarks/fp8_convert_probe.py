"""Where the weight-only fp8 skinny matmul loses its bytes' advantage: the fp8 -> bf16 widening, or the stream.

At batch 1 the skinny matmul reading an fp8 weight streamed gate/up at 2.09 TB/s of fp8 bytes on an H100, where
the bf16 weight streams at 3.04 (docs/perf_notes.md entry 69); on an H200 the fp8 engine decoded batch 1
slower than bf16. This probe times one K loop, as the engine's kernel runs it (weight tile the dot's wide
side, activations padded to 16+ rows, split-K writing float32 partials; no epilogue, no reduce), with the
weight tile brought to the dot in five ways:

* `bf16`: a bf16 weight (the baseline: twice the bytes);
* `cvt_bf16`: fp8 e4m3 widened with `.to(bfloat16)` (what `triton_gemm` ships);
* `cvt_fp16`: fp8 widened to fp16 (one hardware conversion per pair on sm_89+) and the activations cast to
  fp16 (inexact past fp16's range: timing only);
* `bits_bf16`: the e4m3 bits moved into a bf16 by integer shifts (value x 2^-120, exact, subnormals too),
  the activations scaled by 2^64 (exact) and the float32 sum by 2^56 after the loop: exact like `cvt_bf16`;
* `fp8_dot`: activations quantized per row to e4m3 beforehand and an fp8 x fp8 dot (other numerics:
  per-token activation scales, as `_scaled_mm` past 32 rows);
* `fp16_row`: `cvt_fp16` made safe: before the K loop the program finds each row's largest |x| over its own
  K chunk and scales the row by the power of two that brings it into [2^14, 2^15) (exact), the float32 sum
  scaled back after the loop: `cvt_bf16`'s numerics, short of values 2^31 below their row's largest;
* `fp16_tile`: the same with a power of two per row of each K tile, found in the loop (no pass before it),
  each tile's dot scaled back as it is added.

`--outlier` also checks each mode with one activation of 3 x 10^5 a row (past fp16's 65,504).

Each mode runs each tiling of a small grid (weight rows a program, keys a tile, stages, split count) over a
cycle of distinct weights (200 MB+, none in L2) in a CUDA graph; the table gives each mode's best and the
weight bandwidth it reached (the weight's bytes over the time). The PTX of one tiling per mode is counted
(conversions, multiplies, integer ops, MMAs in the loop) to show what each widening costs in instructions.
Checks every mode's output against the float32 reference of its numerics. JSON + table.

    python benchmarks/fp8_convert_probe.py --out benchmarks/results/<dir> [--rows 1,32] [--budget-s 300]
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001, ANN201

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402
from quant_matmul_bench import graph_time_us, int_list  # noqa: E402

from kvserve.kernels import ops, triton_gemm  # noqa: E402

SHAPES = [("qkv", 3584, 4608), ("o", 3584, 3584), ("gate_up", 3584, 37888), ("down", 18944, 3584)]
MODES = {"bf16": 0, "cvt_bf16": 1, "cvt_fp16": 2, "bits_bf16": 3, "fp8_dot": 4, "fp16_row": 5, "fp16_tile": 6}
L2_DEFEAT_BYTES = 200 * 2**20


@triton.jit
def _fp16_scales(amax):
    """Powers of two (down, up = 1 / down) for rows whose largest |x| is amax (float32): amax * down in
    [2^14, 2^15), from amax's exponent field (clamped so both stay normal float32s)."""
    e = tl.minimum(tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15), 253)
    down = ((268 - e) << 23).to(tl.float32, bitcast=True)
    up = ((e - 14) << 23).to(tl.float32, bitcast=True)
    return down, up


@triton.jit(do_not_specialize=["M"])
def _probe_kernel(x_ptr, w_ptr, part_ptr, M, N, num_chunks, stride_xm, stride_wn,
                  SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  MODE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    chunk_begin = pid_s * num_chunks // SPLIT_K
    chunk_end = (pid_s + 1) * num_chunks // SPLIT_K
    k_start = chunk_begin.to(tl.int64) * BLOCK_K
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + k_start + offs_k[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + k_start + offs_k[None, :]
    m_mask = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if MODE == 5:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        xp = x_ptrs
        for _ in range(chunk_begin, chunk_end):
            amax = tl.maximum(amax, tl.max(tl.abs(tl.load(xp, mask=m_mask, other=0.0).to(tl.float32)), axis=1))
            xp += BLOCK_K
        row_down, row_up = _fp16_scales(amax)
    for _ in range(chunk_begin, chunk_end):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs, mask=m_mask, other=0.0)
        if MODE == 5:
            w = w.to(tl.float16)
            x = (x.to(tl.float32) * row_down[:, None]).to(tl.float16)
        elif MODE == 6:
            w = w.to(tl.float16)
            xf = x.to(tl.float32)
            tile_down, tile_up = _fp16_scales(tl.max(tl.abs(xf), axis=1))
            x = (xf * tile_down[:, None]).to(tl.float16)
        if MODE == 1:
            w = w.to(tl.bfloat16)
        elif MODE == 2:
            w = w.to(tl.float16)
            x = x.to(tl.float16)
        elif MODE == 3:
            # w holds the e4m3 bytes as uint8: sign to bit 15, exponent and mantissa to bits 4-10 of a bf16
            w16 = w.to(tl.uint16)
            w = (((w16 & 0x80) << 8) | ((w16 & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)
            x = (x * 18446744073709551616.0).to(tl.bfloat16)  # 2^64, exact
        if MODE == 6:
            acc += tl.dot(w, tl.trans(x)) * tile_up[None, :]
        else:
            acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if MODE == 3:
        acc = acc * 72057594037927936.0  # 2^56: 2^-120 x 2^64 undone
    if MODE == 5:
        acc = acc * row_up[None, :]
    tile = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
    tl.store(part_ptr + pid_s.to(tl.int64) * M * N + tile, acc, mask=offs_m[None, :] < M)


def launch(mode: int, x: torch.Tensor, w: torch.Tensor, part: torch.Tensor, block_n: int, block_k: int,
           split: int, stages: int) -> Any:
    m = x.shape[0]
    n, k = w.shape
    block_m = triton_gemm.launch_block_m(m)
    grid = (n // block_n, split, triton.cdiv(m, block_m))
    return _probe_kernel[grid](x, w, part, m, n, k // block_k, x.stride(0), w.stride(0), SPLIT_K=split,
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, MODE=mode, num_warps=4,
                               num_stages=stages)


def ptx_counts(compiled: Any) -> dict[str, int]:
    """Instruction counts in a compiled kernel's PTX (the whole kernel; the loop dominates)."""
    ptx = compiled.asm["ptx"]
    lines = [ln.strip() for ln in ptx.splitlines() if ln.strip() and not ln.strip().startswith(("//", ".", "$"))]
    counts = {"lines": len(lines)}
    for key, pattern in (("cvt", r"^cvt\."), ("mul_fma", r"^(mul|fma)\.(rn\.)?(f|bf)"), ("int_ops", r"^(and|or|shl|shr|prmt|lop3)\."),
                         ("mma", r"^(mma|wgmma)\."), ("ld_shared", r"^ld\.shared|^ldmatrix"), ("cp_async", r"^cp\.async")):
        counts[key] = sum(1 for ln in lines if re.match(pattern, ln))
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=int_list, default=[1, 32])
    p.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting new shapes after this long")
    p.add_argument("--outlier", action="store_true",
                   help="also check each mode (first tiling) with one activation of 3e5 a row")
    args = p.parse_args()
    t0 = time.monotonic()
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    modes = [m for m in args.modes.split(",") if m]
    results: list[dict[str, Any]] = []
    lines: list[str] = []
    ptx: dict[str, dict[str, int]] = {}
    for name, k, n in SHAPES:
        if name not in args.shapes.split(",") or time.monotonic() - t0 > args.budget_s:
            continue
        count = max(2, -(-L2_DEFEAT_BYTES // (k * n)))
        dense = [(torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(count)]
        quantized = [ops.quantize_rows_fp8(w) for w in dense]
        for m in args.rows:
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            x8, x_scale = ops.quantize_rows_fp8(x)
            base = triton_gemm.pick_config(m, n, k, props.multi_processor_count, props.shared_memory_per_block_optin)
            assert base is not None
            tilings = sorted({(bn, bk, st, sp) for bn, bk, st in ((64, 128, 3), (64, 128, 4), (64, 256, 3), (128, 128, 3))
                              for sp in (base.split_k, min(16, 2 * base.split_k)) if k // bk >= sp})
            # each mode's sum before any scale: bf16 x bf16, bf16 x e4m3 (exact in float32), e4m3 x e4m3
            wants = {0: x.float() @ dense[0].float().t(), 1: x.float() @ quantized[0][0].float().t(),
                     4: x8.float() @ quantized[0][0].float().t()}
            for mode_name in modes:
                mode = MODES[mode_name]
                if mode == 0:
                    weights = dense
                    xin = x
                elif mode == 4:
                    weights = [q[0] for q in quantized]
                    xin = x8
                elif mode == 3:
                    weights = [q[0].view(torch.uint8) for q in quantized]
                    xin = x
                else:
                    weights = [q[0] for q in quantized]
                    xin = x
                best: dict[str, Any] | None = None
                for bn, bk, st, sp in tilings:
                    if mode == 0 and (bn, bk, st, sp) != (base.block_n, base.block_k, base.num_stages, base.split_k):
                        if bk == 256 or bn == 128:
                            continue  # bf16's own tiling and its split/stage neighbours only
                    part = torch.empty((sp, m, n), dtype=torch.float32, device="cuda")
                    try:
                        compiled = launch(mode, xin, weights[0], part, bn, bk, sp, st)
                    except Exception as e:  # noqa: BLE001 (a tiling that does not compile: skipped, named)
                        lines.append(f"# {name} {m} {mode_name} {bn}x{bk} st{st} sp{sp}: {type(e).__name__}")
                        continue
                    got = part.sum(0)
                    want = wants[mode if mode in wants else 1]
                    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                    outlier_err = None
                    if args.outlier and best is None:
                        xo = xin.clone()
                        if mode != 4:
                            xo[:, 7] = 3e5
                            po = torch.empty_like(part)
                            launch(mode, xo, weights[0], po, bn, bk, sp, st)
                            wo = xo.float() @ (dense[0] if mode == 0 else quantized[0][0]).float().t()
                            outlier_err = ((po.sum(0) - wo).abs().max().item()
                                           / max(wo.abs().max().item(), 1e-30))
                    if f"{mode_name}" not in ptx and m == args.rows[0]:
                        ptx[mode_name] = ptx_counts(compiled) | {"tiling": f"{bn}x{bk} st{st} sp{sp}"}
                    calls = 2 * count
                    us = graph_time_us(lambda i, mode=mode, bn=bn, bk=bk, sp=sp, st=st, part=part, weights=weights,
                                       xin=xin, count=count: launch(mode, xin, weights[i % count], part, bn, bk,
                                                                    sp, st),
                                       calls, args.repeats)
                    wbytes = k * n * weights[0].element_size()
                    e = {"shape": name, "k": k, "n": n, "rows": m, "mode": mode_name, "block_n": bn, "block_k": bk,
                         "stages": st, "split_k": sp, "us": us, "weight_tbps": wbytes / us / 1e6, "rel_err": err,
                         "outlier_rel_err": outlier_err,
                         "shipped_bf16_tiling": (bn, bk, st, sp) == (base.block_n, base.block_k, base.num_stages,
                                                                      base.split_k)}
                    results.append(e)
                    if best is None or us < best["us"]:
                        best = e
                if best is not None:
                    shipped = next((r for r in results if r["shape"] == name and r["rows"] == m
                                    and r["mode"] == mode_name and r["shipped_bf16_tiling"]), None)
                    lines.append(f"{name:<8} {m:>4} {mode_name:<10} {best['us']:>8.1f} {best['weight_tbps']:>6.2f} "
                                 f"{best['block_n']}x{best['block_k']} st{best['stages']} sp{best['split_k']:<3} "
                                 f"{shipped['us'] if shipped else float('nan'):>8.1f} {best['rel_err']:.1e}"
                                 + (f" outlier {oe:.1e}" if (oe := next(
                                     (r["outlier_rel_err"] for r in results if r["shape"] == name and r["rows"] == m
                                      and r["mode"] == mode_name and r["outlier_rel_err"] is not None), None))
                                     is not None else ""))
                    print(lines[-1], flush=True)
            del x
        dense.clear()
        quantized.clear()
        torch.cuda.empty_cache()
    write_result(args.out, "fp8_convert_probe", vars(args) | {"out": str(args.out)},
                 {"timings": results, "ptx": ptx}, "cuda")
    print(f"\n{torch.cuda.get_device_name()}; PTX counts (one tiling, first row count):")
    for mode_name, c in ptx.items():
        print(f"  {mode_name:<10} " + " ".join(f"{key}={val}" for key, val in c.items()))
    print("best tiling per mode: us, weight TB/s, tiling, us at bf16's shipped tiling, error vs its reference")
    print(f"{'shape':<8} {'rows':>4} {'mode':<10} {'best us':>8} {'TB/s':>6} tiling {'at bf16 tiling':>14} err")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
