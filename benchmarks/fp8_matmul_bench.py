"""Online fp8 weights' matmul (`--quantization fp8`) against the bf16 matmul, at the Qwen2.5-7B shapes.

For each projection shape (q/k/v 3584 -> 4608 with its bias, o 3584 -> 3584, gate/up 3584 -> 37888, down 18944
-> 3584) and row count: the engine's bf16 `ops.linear` (the Triton skinny matmul up to 32 rows, cuBLAS past it;
no tuned cuBLASLt plans in this process); `ops.fp8_linear` as the engine runs it (the skinny matmul reading the
fp8 weight up to `ops.FP8_SKINNY_MAX_ROWS` rows, `--fp8-skinny-max-rows` to change it; past it the Triton
per-row quantization, then `torch._scaled_mm` with row-wise scales, then the bias); each of its two paths
forced at every row count: the skinny fp8 matmul (weight-only fp8, up to `--skinny-max-rows`: its launcher
with the tiling `pick_config(weight_bytes=1)` gives, as ops would) and quantize + `_scaled_mm` (threshold 0); `torch._scaled_mm` alone on
activations quantized beforehand, and the quantization alone. Each is a cycle of calls over distinct weights
(at least 200 MB of fp8 weights, so no call finds its weight in L2) captured in a CUDA graph, as the engine
runs its decode steps, so the times are the GPU's (no launch cost): median of the replays
(`quant_matmul_bench.graph_time_us`). Achieved weight bandwidth = the weight's bytes (2 a value in bf16, 1 in
fp8, + the fp8 scales) over the time: at decode sizes both should approach the copy rate, the fp8 one in half
the time. Also checks the fp8 output against its path's reference (`reference.fp8_linear_weight_only` or
`reference.fp8_linear`) and against the bf16 matmul (largest error over the output's largest magnitude), and
the skinny path against `reference.fp8_linear_weight_only`. Prints a table and writes JSON (GPU name, commit,
date, settings).

    python benchmarks/fp8_matmul_bench.py --out benchmarks/results/<dir> [--fp8-skinny-max-rows 64]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402
from quant_matmul_bench import graph_time_us, int_list  # noqa: E402

from kvserve.kernels import ops, reference, triton_gemm  # noqa: E402

# (name, K, N, bias) of Qwen2.5-7B's projections.
SHAPES = [("qkv", 3584, 4608, True), ("o", 3584, 3584, False), ("gate_up", 3584, 37888, False),
          ("down", 18944, 3584, False)]
L2_DEFEAT_BYTES = 200 * 2**20


@contextlib.contextmanager
def fp8_skinny_max_rows(rows: int) -> Iterator[None]:
    """`ops.FP8_SKINNY_MAX_ROWS` set to `rows` inside (the path is chosen when a graph is captured)."""
    saved = ops.FP8_SKINNY_MAX_ROWS
    ops.FP8_SKINNY_MAX_ROWS = rows
    try:
        yield
    finally:
        ops.FP8_SKINNY_MAX_ROWS = saved


def skinny_fp8_config(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None) -> triton_gemm.GemmConfig | None:
    """The tiling `ops.fp8_linear` gives the skinny fp8 matmul at x's rows, or None where it does not apply."""
    props = torch.cuda.get_device_properties(x.device)
    config = triton_gemm.pick_config(x.shape[0], w8.shape[0], w8.shape[1], props.multi_processor_count,
                                     props.shared_memory_per_block_optin, weight_bytes=1)
    if config is None or not triton_gemm.fits(x, w8, config, bias, w_scale=w_scale):
        return None
    return config


def measure(name: str, k: int, n: int, m: int, dense: list[torch.Tensor], quantized: list[tuple[torch.Tensor,
            torch.Tensor]], bias: torch.Tensor | None, args: argparse.Namespace, gen: torch.Generator) -> dict[str, Any]:
    """One shape at `m` rows: the timings over the weight cycle, bandwidths and errors."""
    count = len(dense)
    dtype = dense[0].dtype
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    a8, a_scale = ops.quantize_rows_fp8(x)
    out_dtype = ops.scaled_mm_out_dtype(x.device, dtype)
    fp8_out = ops.fp8_linear(x, *quantized[0], bias)
    scale = fp8_out.float().abs().max().item()
    skinny_config = skinny_fp8_config(x, *quantized[0], bias)
    # the reference of the path ops.fp8_linear took: weight-only on the skinny matmul's rows
    ran_skinny = skinny_config is not None and m <= ops.FP8_SKINNY_MAX_ROWS
    path_reference = reference.fp8_linear_weight_only if ran_skinny else reference.fp8_linear
    err_ref = (fp8_out.float() - path_reference(x, *quantized[0], bias).float()).abs().max().item() / scale
    err_bf16 = (fp8_out.float() - ops.linear(x, dense[0], bias).float()).abs().max().item() / scale
    calls = 2 * count
    bf16_us = graph_time_us(lambda i: ops.linear(x, dense[i % count], bias), calls, args.repeats)
    fp8_us = graph_time_us(lambda i: ops.fp8_linear(x, *quantized[i % count], bias), calls, args.repeats)
    mm_us = graph_time_us(lambda i: torch._scaled_mm(a8, quantized[i % count][0].t(), scale_a=a_scale.view(-1, 1),
                                                     scale_b=quantized[i % count][1].view(1, -1),
                                                     out_dtype=out_dtype), calls, args.repeats)
    quant_us = graph_time_us(lambda i: ops.quantize_rows_fp8(x), calls, args.repeats)
    with fp8_skinny_max_rows(0):
        scaled_us = graph_time_us(lambda i: ops.fp8_linear(x, *quantized[i % count], bias), calls, args.repeats)
    skinny_us = skinny_err = float("nan")
    if skinny_config is not None and m <= args.skinny_max_rows:
        # the launcher itself, with the tiling ops.fp8_linear would give it at these rows: no silent fallback
        w8, w_scale = quantized[0]
        skinny_out = triton_gemm.skinny_linear(x, w8, bias, skinny_config, w_scale=w_scale)
        skinny_us = graph_time_us(lambda i: triton_gemm.skinny_linear(
            x, quantized[i % count][0], bias, skinny_config, w_scale=quantized[i % count][1]), calls, args.repeats)
        want = reference.fp8_linear_weight_only(x, *quantized[0], bias).float()
        skinny_err = (skinny_out.float() - want).abs().max().item() / want.abs().max().item()
    bf16_bytes = k * n * dense[0].element_size()
    fp8_bytes = k * n + 4 * n
    return {"shape": name, "k": k, "n": n, "rows": m, "bias": bias is not None, "bf16_us": bf16_us,
            "fp8_linear_us": fp8_us, "fp8_skinny_max_rows": ops.FP8_SKINNY_MAX_ROWS,
            "skinny_fp8_us": skinny_us, "skinny_fp8_config": str(skinny_config), "scaled_path_us": scaled_us,
            "scaled_mm_us": mm_us, "quantize_us": quant_us,
            "bf16_weight_tbps": bf16_bytes / bf16_us / 1e6, "fp8_weight_tbps": fp8_bytes / fp8_us / 1e6,
            "skinny_fp8_weight_tbps": fp8_bytes / skinny_us / 1e6, "scaled_path_weight_tbps": fp8_bytes / scaled_us / 1e6,
            "scaled_mm_weight_tbps": fp8_bytes / mm_us / 1e6, "speedup": bf16_us / fp8_us,
            "rel_err_vs_reference": err_ref, "rel_err_vs_bf16": err_bf16,
            "skinny_rel_err_vs_weight_only_reference": skinny_err, "scaled_mm_out_dtype": str(out_dtype)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=int_list, default=[1, 8, 32, 64, 128, 256, 4096, 8192])
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="comma-separated subset of the shapes")
    p.add_argument("--fp8-skinny-max-rows", type=int, default=None,
                   help="ops.FP8_SKINNY_MAX_ROWS for the fp8_linear column (default: the engine's)")
    p.add_argument("--skinny-max-rows", type=int, default=256,
                   help="time the skinny fp8 matmul forced at up to this many rows")
    args = p.parse_args()
    if args.fp8_skinny_max_rows is not None:
        ops.FP8_SKINNY_MAX_ROWS = args.fp8_skinny_max_rows
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    wanted = set(args.shapes.split(","))
    results: list[dict[str, Any]] = []
    lines: list[str] = []
    for name, k, n, has_bias in SHAPES:
        if name not in wanted:
            continue
        count = max(2, -(-L2_DEFEAT_BYTES // (k * n)))
        dense = [(torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(dtype) for _ in range(count)]
        quantized = [ops.quantize_rows_fp8(w) for w in dense]
        bias = (torch.randn(n, generator=gen, device="cuda") * 0.1).to(dtype) if has_bias else None
        for m in args.rows:
            e = measure(name, k, n, m, dense, quantized, bias, args, gen)
            results.append(e)
            lines.append(f"{name:<8} {m:>5} {e['bf16_us']:>9.1f} {e['fp8_linear_us']:>9.1f} {e['skinny_fp8_us']:>9.1f} "
                         f"{e['scaled_path_us']:>9.1f} {e['scaled_mm_us']:>9.1f} {e['quantize_us']:>8.1f} "
                         f"{e['speedup']:>6.2f}x {e['bf16_weight_tbps']:>6.2f} {e['fp8_weight_tbps']:>6.2f} "
                         f"{e['skinny_fp8_weight_tbps']:>6.2f} {e['scaled_mm_weight_tbps']:>6.2f}  err "
                         f"{e['rel_err_vs_reference']:.1e}/{e['rel_err_vs_bf16']:.1e}/"
                         f"{e['skinny_rel_err_vs_weight_only_reference']:.1e}")
            print(lines[-1], flush=True)
        dense.clear()
        quantized.clear()
        torch.cuda.empty_cache()
    write_result(args.out, "fp8_matmul", vars(args) | {"out": str(args.out)}, results, "cuda")
    print(f"\n{torch.cuda.get_device_name()}, {args.dtype}; times in us (CUDA graphs), weight bandwidth in TB/s; "
          f"fp8: ops.fp8_linear (skinny up to {ops.FP8_SKINNY_MAX_ROWS} rows), skinny: forced weight-only fp8 "
          "(nan: not timed), scaled: forced quantize + _scaled_mm; err: fp8 output vs its path's reference / vs "
          "the bf16 matmul, skinny vs reference.fp8_linear_weight_only, over the largest magnitude")
    print(f"{'shape':<8} {'rows':>5} {'bf16':>9} {'fp8':>9} {'skinny':>9} {'scaled':>9} {'mm only':>9} {'quant':>8} "
          f"{'bf16/fp8':>7} {'bf16 BW':>6} {'fp8 BW':>6} {'sk BW':>6} {'mm BW':>6}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
