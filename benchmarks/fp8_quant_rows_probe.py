"""The per-row fp8 quantization kernel (`triton_fp8.quantize_rows_fp8`, `--quantization fp8`'s activations)
at the Qwen2.5-7B projections' input widths, under its tiling choices: rows up to ONE_TILE_MAX_COLS columns
are read once from registers, longer ones twice in LOOP_TILE tiles.

Each case cycles over enough distinct inputs (at least 200 MB) that no call finds its input in L2, in a CUDA
graph (`quant_matmul_bench.graph_time_us`); bandwidth = bytes read (the input once) and written (the fp8 values
and scales) over the time. Prints a table and writes JSON (GPU name, commit, date, settings).

    python benchmarks/fp8_quant_rows_probe.py --out /tmp/fp8q
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402
from quant_matmul_bench import graph_time_us, int_list  # noqa: E402

from kvserve.kernels import reference, triton_fp8  # noqa: E402

L2_DEFEAT_BYTES = 200 * 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=int_list, default=[1, 64, 4096, 8192])
    p.add_argument("--cols", type=int_list, default=[3584, 18944])
    p.add_argument("--one-tile-max", type=int_list, default=[4096, 8192, 32768])
    p.add_argument("--loop-tiles", type=int_list, default=[1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    defaults = (triton_fp8.ONE_TILE_MAX_COLS, triton_fp8._LOOP_TILE)
    results: list[dict[str, Any]] = []
    lines: list[str] = []
    for rows, cols in itertools.product(args.rows, args.cols):
        count = max(2, -(-L2_DEFEAT_BYTES // (rows * cols * 2)))
        inputs = [torch.randn(rows, cols, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(count)]
        want8, want_scale = reference.quantize_rows_fp8(inputs[0])
        moved = rows * cols * 3 + rows * 4
        for one_tile_max, loop_tile in itertools.product(args.one_tile_max, args.loop_tiles):
            if cols <= one_tile_max and loop_tile != args.loop_tiles[0]:
                continue  # one tile: the loop's tile is not used
            triton_fp8.ONE_TILE_MAX_COLS, triton_fp8._LOOP_TILE = one_tile_max, loop_tile
            got8, got_scale = triton_fp8.quantize_rows_fp8(inputs[0])
            same = torch.equal(got_scale, want_scale) and torch.equal(got8.view(torch.uint8), want8.view(torch.uint8))
            us = graph_time_us(lambda i, xs=inputs: triton_fp8.quantize_rows_fp8(xs[i % len(xs)]), 2 * count, args.repeats)
            mode = "one tile" if cols <= one_tile_max else f"loop {loop_tile}"
            results.append({"rows": rows, "cols": cols, "one_tile_max_cols": one_tile_max, "loop_tile": loop_tile,
                            "mode": mode, "us": us, "tbps": moved / us / 1e6, "equal_to_reference": same})
            lines.append(f"{rows:>5} {cols:>6} {one_tile_max:>8} {mode:<10} {us:>9.1f} {moved / us / 1e6:>6.2f} "
                         f"{'equal' if same else 'DIFFERS'}")
            print(lines[-1], flush=True)
        inputs.clear()
        torch.cuda.empty_cache()
    triton_fp8.ONE_TILE_MAX_COLS, triton_fp8._LOOP_TILE = defaults
    write_result(args.out, "fp8_quant_rows", vars(args) | {"out": str(args.out)}, results, "cuda")
    print(f"\n{torch.cuda.get_device_name()}, bf16 input; us a call (CUDA graphs), TB/s of bytes read and written")
    print(f"{'rows':>5} {'cols':>6} {'1tile<=':>8} {'mode':<10} {'us':>9} {'TB/s':>6} reference")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
