"""The 4-bit quantized matmul (kernels/triton_quant.py) against the bf16 matmul, at the Qwen2.5-7B shapes.

For each projection shape and row count: torch's bf16 `F.linear` (cuBLAS), the fused Triton kernel on the
plain layout, the paired-dequantizing kernel on the prepared layout, the Triton dequantizer followed by
torch's matmul on the dense weight, and `ops.quantized_linear`'s choice (on the engine's layout); each
a cycle of calls over distinct weights (about 200 MB, so no call finds its weight in L2) captured in a CUDA
graph, as the engine runs its decode steps, so the times are the GPU's (no launch cost); median of the
replays. `--sweep` times tilings of the fused kernel and the dequantizer instead; `--pairs-sweep` those of
the paired-dequantizing kernel. Also checks
each path's output against the reference dequantization (max abs error printed). Prints a table and writes
JSON (GPU name, commit, date, settings).

    python benchmarks/quant_matmul_bench.py --out benchmarks/results/<dir>
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import COPY_TBPS, write_result  # noqa: E402

from kvserve.kernels import ops, reference, triton_quant  # noqa: E402
from kvserve.layers.quantization import PackedWeight, pack_rows  # noqa: E402

# (name, K, N) of Qwen2.5-7B's projections.
SHAPES = [("qkv", 3584, 4608), ("o", 3584, 3584), ("gate_up", 3584, 37888), ("down", 18944, 3584)]


def random_packed(k: int, n: int, bits: int, group: int, gen: torch.Generator,
                  scales_dtype: torch.dtype = torch.float16) -> PackedWeight:
    """Random packed weights (scales in `scales_dtype`: the engine casts them to the model's dtype)."""
    top = 1 << bits
    q = torch.randint(0, top, (k, n), generator=gen, device="cuda")
    zeros = torch.full((k // group, n), top // 2, dtype=torch.uint8, device="cuda")
    scales = (torch.rand((k // group, n), generator=gen, device="cuda") * 0.004 + 0.002).to(scales_dtype)
    return PackedWeight(pack_rows(q, bits), zeros, scales, bits, group, None)


def time_us(fn: Any, calls: int, repeats: int) -> float:
    """Median over `repeats` of the mean time of `calls` back-to-back calls (fn(i) for the i-th)."""
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def graph_time_us(fn: Any, calls: int, repeats: int) -> float:
    """GPU time of fn(i) for i < calls, captured once as a CUDA graph (no host launch cost), replayed
    `repeats` times: median per call."""
    for i in range(min(calls, 2)):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(samples)


def sweep(args: argparse.Namespace, gen: torch.Generator, num_sms: int) -> list[str]:
    """Tilings of the fused kernel and the dequantizer at the 7B shapes, GPU-timed in CUDA graphs."""
    from dataclasses import replace

    lines: list[str] = []
    results: list[dict[str, Any]] = []
    for name, k, n in SHAPES:
        count = max(2, -(-200 * 2**20 // (k * n * 2)))
        dense = [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        packed = [random_packed(k, n, args.bits, args.group_size, gen) for _ in range(count)]
        quant_bytes = k * n * args.bits / 8 + (k // args.group_size) * n * 3
        for m in args.sweep_rows:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
            base = triton_quant.pick_config(m, packed[0], num_sms)
            assert base is not None
            bf16 = graph_time_us(lambda i, x=x: torch.nn.functional.linear(x, dense[i % count]), 2 * count, 5)  # noqa: B023 - called within the iteration
            timed: list[tuple[float, Any]] = []

            def run(config: Any, x: torch.Tensor = x) -> float:
                try:
                    return graph_time_us(lambda i: triton_quant.quant_matmul(x, packed[i % count], None, config),  # noqa: B023 - called within the iteration
                                         2 * count, 5)  # noqa: B023 - called within the iteration
                except Exception as exc:  # noqa: BLE001 - a tiling that does not fit: reported, skipped
                    print(f"  {config}: {type(exc).__name__}", flush=True)
                    return float("inf")

            for gather in (True, False):
                config = replace(base, gather=gather)
                timed.append((run(config), config))
            gather = min(timed, key=lambda t: t[0])[1].gather
            for block_n in (64, 128, 256):
                for block_k in (32, 64):
                    for warps, stages in ((4, 4), (8, 4), (4, 3)):
                        config = replace(base, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages,
                                         gather=gather)
                        tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, block_n)
                        chunks = k // block_k
                        split = 1
                        while tiles * split < num_sms and split < 16 and chunks % (split * 2) == 0:
                            split *= 2
                        for s in sorted({max(1, split // 2), split, split * 2 if chunks % (split * 2) == 0 else split}):
                            timed.append((run(replace(config, split_k=s)), replace(config, split_k=s)))
            best_us, best = min(timed, key=lambda t: t[0])
            base_us = timed[0][0] if timed[0][1].gather else timed[1][0]
            floor = quant_bytes / (COPY_TBPS * 1e12) * 1e6
            line = (f"{name:<8} {m:>4} bf16 {bf16:7.1f}  pick {base_us:7.1f}  best {best_us:7.1f} "
                    f"({best.block_n}x{best.block_k} w{best.num_warps} s{best.num_stages} split {best.split_k} "
                    f"gather {int(best.gather)})  floor {floor:5.1f}")
            print(line, flush=True)
            lines.append(line)
            results.append({"shape": name, "rows": m, "bf16_us": bf16, "pick_us": base_us, "best_us": best_us,
                            "best": vars(best), "all": [(t, vars(c)) for t, c in timed]})
        for block_n in (32, 64):
            for gather in (False,):
                for warps in (4, 8):
                    us = graph_time_us(lambda i, b=block_n, g=gather, w=warps: triton_quant.dequantize(
                        packed[i % count], torch.bfloat16, b, g, w), 2 * count, 5)  # noqa: B023 - called within the iteration
                    line = f"{name:<8} dequant {block_n}x gather {int(gather)} w{warps}: {us:7.1f} us"
                    print(line, flush=True)
                    lines.append(line)
                    results.append({"shape": name, "dequant": {"block_n": block_n, "gather": gather, "warps": warps},
                                    "us": us})
        dense.clear()
        packed.clear()
        torch.cuda.empty_cache()
    write_result(args.out, "quant_sweep", vars(args) | {"out": str(args.out)}, results, "cuda")
    return lines


def pairs_sweep(args: argparse.Namespace, gen: torch.Generator, num_sms: int) -> list[str]:
    """Tilings of the paired-dequantizing kernel at the 7B shapes (row tile, column tile, warps, K split),
    GPU-timed in CUDA graphs; the best per shape and row count against the default pick and cuBLAS bf16."""
    from dataclasses import replace

    lines: list[str] = []
    results: list[dict[str, Any]] = []
    for name, k, n in SHAPES:
        count = max(2, -(-200 * 2**20 // (k * n * 2)))
        dense = [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        prepared = [ops.prepare_quantized(random_packed(k, n, 4, 128, gen, torch.bfloat16), torch.bfloat16)
                    for _ in range(count)]
        for m in args.sweep_rows:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
            bf16 = graph_time_us(lambda i, x=x: torch.nn.functional.linear(x, dense[i % count]), 2 * count, 5)  # noqa: B023 - called within the iteration
            base = triton_quant.pick_pairs_config(m, prepared[0], num_sms)
            timed: list[tuple[float, Any]] = []
            for block_m in sorted({16, 32, 64, min(64, max(16, triton.next_power_of_2(m)))}):
                if block_m > max(16, triton.next_power_of_2(m)):
                    continue
                for block_n, warps, stages in itertools.product(args.pairs_block_n, args.pairs_warps,
                                                                args.pairs_stages):
                    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
                    chunks = k // 128
                    split = 1
                    while tiles * split < 2 * num_sms and split < 16 and chunks % (split * 2) == 0:
                        split *= 2
                    for s in sorted({max(1, split // 2), split}):
                        config = replace(base, block_m=block_m, block_n=block_n, num_warps=warps, split_k=s,
                                         num_stages=stages)
                        try:
                            us = graph_time_us(lambda i, x=x, c=config, p=prepared, cnt=count:
                                               triton_quant.quant_matmul_pairs(x, p[i % cnt], None, c),
                                               2 * count, 5)
                        except Exception as exc:  # noqa: BLE001 - a tiling that does not fit: reported, skipped
                            print(f"  {config}: {type(exc).__name__}", flush=True)
                            continue
                        timed.append((us, config))
            pick_us = next((t for t, c in timed if c == base), float("nan"))
            best_us, best = min(timed, key=lambda t: t[0])
            line = (f"{name:<8} {m:>4} bf16 {bf16:7.1f}  pick {pick_us:7.1f}  best {best_us:7.1f} "
                    f"(m{best.block_m} n{best.block_n} w{best.num_warps} s{best.num_stages} split {best.split_k})")
            print(line, flush=True)
            lines.append(line)
            results.append({"shape": name, "rows": m, "bf16_us": bf16, "pick_us": pick_us, "best_us": best_us,
                            "best": vars(best), "all": [(t, vars(c)) for t, c in timed]})
        dense.clear()
        prepared.clear()
        torch.cuda.empty_cache()
    write_result(args.out, "quant_pairs_sweep", vars(args) | {"out": str(args.out)}, results, "cuda")
    return lines


def measure(name: str, k: int, n: int, m: int, dense: list[torch.Tensor], packed: list[PackedWeight],
            prepared: list[PackedWeight], args: argparse.Namespace, gen: torch.Generator,
            num_sms: int) -> dict[str, Any]:
    """One shape at `m` rows: every path timed over the weight cycle, and checked against the reference.
    `prepared`: the same weights in the engine's layout (`ops.prepare_quantized`; the paired-dequantizing
    kernel's where it applies), which `ops_us` times."""
    count = len(dense)
    x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    config = triton_quant.pick_config(m, packed[0], num_sms)
    expected = reference.quantized_linear(x.float(), packed[0]).float()
    scale = expected.abs().max().item()

    def rel_err(out: torch.Tensor | None) -> float:
        return float("nan") if out is None else (out.float() - expected).abs().max().item() / scale

    deq = triton_quant.dequantize(packed[0], torch.bfloat16)
    err_fused = rel_err(triton_quant.quant_matmul(x, packed[0], None, config) if config else None)
    err_deq = rel_err(torch.nn.functional.linear(x, deq) if deq is not None else None)
    calls = 2 * count
    bf16_us = graph_time_us(lambda i: torch.nn.functional.linear(x, dense[i % count]), calls, args.repeats)
    fused_us = float("nan")
    if config is not None:
        fused_us = graph_time_us(lambda i: triton_quant.quant_matmul(x, packed[i % count], None, config), calls,
                                 args.repeats)
    deq_us = graph_time_us(lambda i: torch.nn.functional.linear(x, triton_quant.dequantize(packed[i % count],
                                                                                            torch.bfloat16)),
                           calls, args.repeats)
    ops_us = graph_time_us(lambda i: ops.quantized_linear(x, prepared[i % count]), calls, args.repeats)
    pairs_us, err_pairs = float("nan"), float("nan")
    if prepared[0].zero_scale is not None:
        pairs_config = triton_quant.pick_pairs_config(m, prepared[0], num_sms)
        err_pairs = rel_err(triton_quant.quant_matmul_pairs(x, prepared[0], None, pairs_config))
        pairs_us = graph_time_us(lambda i: triton_quant.quant_matmul_pairs(x, prepared[i % count], None,
                                                                           pairs_config), calls, args.repeats)
    quant_bytes = k * n * args.bits / 8 + (k // args.group_size) * n * 3
    return {"shape": name, "k": k, "n": n, "rows": m, "bf16_us": bf16_us, "fused_us": fused_us,
            "pairs_us": pairs_us, "rel_err_pairs": err_pairs, "dequant_dense_us": deq_us, "ops_us": ops_us,
            "quant_floor_us": quant_bytes / (COPY_TBPS * 1e12) * 1e6,
            "fused_config": None if config is None else vars(config), "rel_err_fused": err_fused,
            "rel_err_dequant_dense": err_deq}


def int_list(value: str) -> list[int]:
    return [int(x) for x in value.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=int_list,
                   default=[1, 8, 16, 32, 64, 128, 256, 512, 2048, 8192])
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--sweep", action="store_true", help="time tilings of both kernels instead")
    p.add_argument("--pairs-sweep", action="store_true", help="time tilings of the paired-dequantizing kernel")
    p.add_argument("--sweep-rows", type=int_list, default=[1, 16, 64, 128, 256])
    p.add_argument("--pairs-block-n", type=int_list, default=[64, 128], help="--pairs-sweep's column tiles")
    p.add_argument("--pairs-warps", type=int_list, default=[4, 8], help="--pairs-sweep's warp counts")
    p.add_argument("--pairs-stages", type=int_list, default=[3], help="--pairs-sweep's pipeline stages")
    p.add_argument("--pairs-32-row-tiles", action="store_true",
                   help="the paired kernel in 32-row tiles past 32 rows (A/B of its 64-row tiles of two dots)")
    args = p.parse_args()
    triton_quant.PAIRS_TWO_DOTS = not args.pairs_32_row_tiles
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.sweep or args.pairs_sweep:
        lines = sweep(args, gen, num_sms) if args.sweep else pairs_sweep(args, gen, num_sms)
        print("\n" + "\n".join(lines))
        return 0
    results: list[dict[str, Any]] = []
    rows_out: list[str] = []
    for name, k, n in SHAPES:
        count = max(2, -(-200 * 2**20 // (k * n * 2)))
        dense = [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        packed = [random_packed(k, n, args.bits, args.group_size, gen, torch.bfloat16) for _ in range(count)]
        prepared = [ops.prepare_quantized(w, torch.bfloat16) for w in packed]
        for m in args.rows:
            e = measure(name, k, n, m, dense, packed, prepared, args, gen, num_sms)
            results.append(e)
            split = e["fused_config"]["split_k"] if e["fused_config"] else "-"
            rows_out.append(f"{name:<8} {m:>5} {e['bf16_us']:>9.1f} {e['fused_us']:>9.1f} {e['pairs_us']:>9.1f} "
                            f"{e['dequant_dense_us']:>9.1f} {e['ops_us']:>9.1f} {e['quant_floor_us']:>7.1f} "
                            f"{e['bf16_us'] / e['ops_us']:>6.2f}x  split {split}  err "
                            f"{e['rel_err_fused']:.1e}/{e['rel_err_pairs']:.1e}/{e['rel_err_dequant_dense']:.1e}")
            print(rows_out[-1], flush=True)
        dense.clear()
        packed.clear()
        prepared.clear()
        torch.cuda.empty_cache()
    write_result(args.out, "quant_matmul", vars(args) | {"out": str(args.out)}, results, "cuda")
    print(f"\n{'shape':<8} {'rows':>5} {'bf16 us':>9} {'fused us':>9} {'pairs us':>9} {'deq+mm':>9} {'ops us':>9} "
          f"{'floor':>7} {'bf16/ops':>7}")
    print("\n".join(rows_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
