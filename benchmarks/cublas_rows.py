"""torch's matmul (cuBLAS and cuBLASLt) against the number of rows, at the Qwen2.5-7B decode shapes, bf16.

A decode graph of batch B runs every matmul at M = B rows, and the engine pads a batch to the next captured
size, so the time per M says which sizes are worth capturing (a size whose matmuls are slower than a larger
one's is not) and how far the matmuls of a mid-sized batch are from the weight-streaming floor and the
compute floor. Each case runs one weight copy per layer in a CUDA graph (`gemm_sweep.layer_copies`), so no
call reuses another's weights in L2. Optionally the Triton skinny matmul at a fixed tiling, for the same rows.

    python benchmarks/cublas_rows.py --out /tmp/cublas_rows.json [--rows 64,128,192] [--skinny 64,128,4,3]

Prints, per M: µs per call of each shape and of a whole step's matmuls (28 layers and the LM head), against
the floors at 4.28 TB/s and at --peak-tflops.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from attention_sweep import time_graph  # noqa: E402
from gemm_sweep import COPY_TBPS, SHAPES, layer_copies  # noqa: E402

ROWS = [16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256]
NUM_LAYERS = 28


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    parser.add_argument("--libraries", default="cublaslt,cublas", help="torch BLAS back-ends to time")
    parser.add_argument("--skinny", default="", help="block_n,block_k,split,stages: also time the Triton skinny "
                        "matmul at this tiling where it fits (rows <= 64)")
    parser.add_argument("--peak-tflops", type=float, default=791.0, help="the bf16 matmul peak measured here")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    libraries = [v for v in args.libraries.split(",") if v]
    shapes = [s for s in SHAPES if s[0] in args.shapes.split(",")]
    dtype = torch.bfloat16
    skinny = None
    if args.skinny:
        from kvserve.kernels.triton_gemm import GemmConfig, fits, skinny_linear

        bn, bk, split, stages = (int(v) for v in args.skinny.split(","))
        skinny = GemmConfig(bn, bk, split, stages)
    results: dict[str, dict[int, dict[str, float]]] = {}
    for name, n, k, has_bias in shapes:
        nbytes, copies, gen, weights, biases = layer_copies(n, k, has_bias, dtype)
        results[name] = {}
        for m in rows:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=dtype)
            row: dict[str, float] = {}

            def run(xs: torch.Tensor = x, ws: list = weights, bs: list = biases) -> None:
                for w, b in zip(ws, bs, strict=True):
                    torch.nn.functional.linear(xs, w, b)

            for library in libraries:
                torch.backends.cuda.preferred_blas_library(library)
                row[library] = time_graph(run) / copies * 1e3
            torch.backends.cuda.preferred_blas_library("cublas")
            if skinny is not None and m <= 64 and n % skinny.block_n == 0 and fits(x, weights[0], skinny):
                reference = torch.nn.functional.linear(x.float(), weights[0].float(),
                                                       None if biases[0] is None else biases[0].float())
                got = skinny_linear(x, weights[0], biases[0], skinny).float()
                if (got - reference).abs().max().item() <= 2e-2 * reference.abs().max().item():

                    def run_skinny(xs: torch.Tensor = x, ws: list = weights, bs: list = biases) -> None:
                        for w, b in zip(ws, bs, strict=True):
                            skinny_linear(xs, w, b, skinny)

                    row["skinny"] = time_graph(run_skinny) / copies * 1e3
                else:
                    row["skinny_error"] = 1.0
            row["floor_bytes_us"] = nbytes / COPY_TBPS / 1e6
            row["floor_flops_us"] = 2 * m * n * k / args.peak_tflops / 1e6
            results[name][m] = row
            print(name, m, {key: round(v, 1) for key, v in row.items()}, flush=True)
        del weights, biases
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "results": results}, indent=1))
    # A step's matmuls: 28 x (qkv + o_proj + gate_up + down) + the LM head, per library.
    layer_shapes = [s[0] for s in SHAPES if s[0] != "lm_head"]
    if all(name in results for name in layer_shapes):
        print(f"\n{'M':>4s} " + " ".join(f"{lib + ' ms':>12s}" for lib in libraries)
              + f" {'floor ms':>9s}  per shape (us, {libraries[0]}): " + " ".join(layer_shapes))
        for m in rows:
            def step_ms(key: str, m: int = m) -> float:
                total = NUM_LAYERS * sum(results[name][m][key] for name in layer_shapes)
                if "lm_head" in results:
                    total += results["lm_head"][m][key]
                return total / 1e3

            floor = max(step_ms("floor_bytes_us"), step_ms("floor_flops_us"))
            print(f"{m:4d} " + " ".join(f"{step_ms(lib):12.3f}" for lib in libraries) + f" {floor:9.3f}  "
                  + " ".join(f"{results[name][m][libraries[0]]:6.1f}" for name in layer_shapes)
                  + ("  skinny " + " ".join(f"{results[name][m].get('skinny', float('nan')):6.1f}"
                                            for name in layer_shapes) if skinny is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
