"""Sweep of the Triton decode-attention launch parameters on the GPU (tile of keys, warps, pipeline stages,
KV splits) at the Qwen2.5-7B shape, bf16 (the cache in bf16, or in fp8 with --kv-dtype fp8).

Each case builds 28 separate KV caches (one per layer; blocks scattered by a permutation unless
--block-orders says inorder, stored token-major unless --layouts says hnd) and times a CUDA
graph of 28 launches, one per cache, as a decode step runs them: the per-layer time that graph gives is the
number a decode step pays, with no Python launch cost and no L2 reuse between layers. Every configuration
is first checked against the torch reference on one layer; a configuration that fails to compile (e.g. out
of shared memory) or to match is reported and skipped.

    python benchmarks/attention_sweep.py --out /tmp/sweep.json

Prints, per case, the current default and the best configurations last, with the bandwidth they reach
against the 4.28 TB/s copy rate.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gpu_kernels import MODELS, attention_bytes, make_batch  # noqa: E402

from kvserve.kernels import reference, triton_attention  # noqa: E402

COPY_TBPS = 4.28
LAYERS = 28
# (batch, context, split counts to try)
CASES = [(1, 1024, [16, 32, 64]), (64, 1024, [1, 2, 3, 4, 6]), (160, 1000, [1, 2, 3]), (64, 4096, [1, 2, 4])]
TILES = [32, 64, 128]
WARPS = [2, 4, 8]
STAGES = [2, 3, 4]


def time_graph(fn: object, reps: int = 20) -> float:
    """ms per replay of a graph that runs fn once (warmed up outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # type: ignore[operator]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()  # type: ignore[operator]
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _case(text: str) -> tuple[int, int, list[int]]:
    """batch:context:splits, e.g. 64:1024:1/2 (context r: lengths uniform in [100, 2048])."""
    batch, ctx, splits = text.split(":")
    return int(batch), -1 if ctx == "r" else int(ctx), [int(v) for v in splits.split("/")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", type=lambda v: [_case(c) for c in v.split(",")], default=CASES,
                        help="batch:context:splits,... (context r: uniform in [100, 2048]); default: "
                        + ",".join(f"{b}:{c}:{'/'.join(map(str, s))}" for b, c, s in CASES))
    parser.add_argument("--tiles", default=",".join(map(str, TILES)))
    parser.add_argument("--warps", default=",".join(map(str, WARPS)))
    parser.add_argument("--stages", default=",".join(map(str, STAGES)))
    parser.add_argument("--prefetch-ids", default="on",
                        help="on,off: decode launches with the block ids loaded one tile ahead (DECODE_PREFETCH_IDS) "
                        "and/or in the tile's iteration")
    parser.add_argument("--layouts", default="nhd",
                        help="nhd,hnd: KV cache memory layout (hnd: a block's heads apart, see make_batch)")
    parser.add_argument("--block-orders", default="scattered",
                        help="scattered,inorder: each request's blocks scattered by a permutation and/or in order")
    parser.add_argument("--merge", default="fused",
                        help="split launches, comma-separated: fused (the last split program merges), kernel (a "
                        "reduce launch)")
    parser.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16",
                        help="the KV cache's dtype: bf16 (the model's) or fp8 (e4m3, scales 1.0, as --kv-cache-dtype "
                        "fp8 stores it)")
    args = parser.parse_args()
    merges = [m == "fused" for m in args.merge.split(",")]
    prefetches = [v == "on" for v in args.prefetch_ids.split(",")]
    default_prefetch = triton_attention.DECODE_PREFETCH_IDS
    # Every one-split row runs the swept tiling: past DECODE_BUSY_PROGRAMS_PER_SM the launcher would take its
    # busy tiling whatever the sweep sets.
    default_busy = triton_attention.DECODE_BUSY_PROGRAMS_PER_SM
    triton_attention.DECODE_BUSY_PROGRAMS_PER_SM = 1 << 30
    fused_max_splits = triton_attention.DECODE_FUSED_MERGE_MAX_SPLITS
    tiles, warps_list, stages_list = ([int(v) for v in a.split(",")] for a in (args.tiles, args.warps, args.stages))
    shape = MODELS["qwen2.5-7b"]
    scale = shape.head_dim**-0.5
    # One split launches with its own parameters (DECODE_LAUNCH_ONE_SPLIT), several with DECODE_LAUNCH.
    default = dict(triton_attention.DECODE_LAUNCH)
    # An fp8 cache's one-split launches take DECODE_LAUNCH_ONE_SPLIT_FP8: the sweep sets and restores it too.
    one_split = (triton_attention.DECODE_LAUNCH_ONE_SPLIT_FP8 if args.kv_dtype == "fp8"
                 else triton_attention.DECODE_LAUNCH_ONE_SPLIT)
    default_one = dict(one_split)
    default_busy_one = dict(triton_attention.DECODE_LAUNCH_ONE_SPLIT_BUSY)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    summary = []
    variants = list(itertools.product(args.layouts.split(","), args.block_orders.split(",")))
    for layout, order in variants:
        if layout not in ("nhd", "hnd") or order not in ("scattered", "inorder"):
            parser.error(f"unknown layout {layout!r} or block order {order!r}")
    for (batch, ctx, split_options), (layout, order) in itertools.product(args.cases, variants):
        gen = torch.Generator(device="cuda").manual_seed(batch)
        if ctx < 0:
            lengths = torch.randint(100, 2049, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
        else:
            lengths = [ctx] * batch
        layers = [make_batch(shape, torch.bfloat16, [(1, n) for n in lengths], gen, layout=layout,
                             scattered=order == "scattered") for _ in range(LAYERS)]
        if args.kv_dtype == "fp8":  # random normal values, well inside e4m3's range (448)
            layers = [(q, kv.to(torch.float8_e4m3fn), md) for q, kv, md in layers]
        query, kv0, metadata = layers[0]
        expected = reference.paged_attention(query, kv0, metadata, scale)
        bytes_per_layer = attention_bytes(query, kv0, metadata)
        outs = [torch.empty_like(q) for q, _, _ in layers]
        case_rows = []
        for tile, warps, stages, prefetch in itertools.product(tiles, warps_list, stages_list, prefetches):
            for launch in (triton_attention.DECODE_LAUNCH, one_split):
                launch.update(TILE_N=tile, num_warps=warps, num_stages=stages)
            triton_attention.DECODE_PREFETCH_IDS = prefetch
            for splits, fused in itertools.product(split_options, merges):
                if splits == 1 and fused != merges[0]:
                    continue  # one split has no merge
                triton_attention.DECODE_FUSED_MERGE_MAX_SPLITS = fused_max_splits if fused else 0
                # The merge a split launch takes (past DECODE_FUSED_MERGE_MAX_SPLITS the reduce kernel's).
                merged_in_kernel = fused and splits <= fused_max_splits
                if fused != merged_in_kernel and len(merges) > 1:
                    continue  # the same launch as the "kernel" row
                row = {"batch": batch, "context": ctx, "layout": layout, "block_order": order, "tile_n": tile,
                       "num_warps": warps, "num_stages": stages,
                       "num_splits": splits, "merge": "fused" if merged_in_kernel else "kernel",
                       "prefetch_ids": prefetch,
                       # the stages the launch runs (the launcher trims them for buffers past its limit)
                       "kv_dtype": args.kv_dtype,
                       "stages_run": triton_attention.decode_stages(stages, tile, shape.head_dim,
                                                                    kv0.element_size()) if prefetch else stages}
                try:
                    out = triton_attention.launch_paged_attention(query, kv0, metadata, scale, None, splits)
                    err = (out.float() - expected.float()).abs().max().item()
                    if not err < 2e-2:
                        row["error"] = f"max abs err {err:.3g}"
                    else:

                        def step(s: int = splits, batches: list = layers, outputs: list = outs) -> None:
                            for (q, kv, md), o in zip(batches, outputs, strict=True):
                                triton_attention.launch_paged_attention(q, kv, md, scale, o, s)

                        ms = time_graph(step) / LAYERS
                        row["us_per_layer"] = ms * 1e3
                        row["tbps"] = bytes_per_layer / (ms * 1e-3) / 1e12
                except Exception as exc:  # compile failure (shared memory) or launch error
                    row["error"] = repr(exc)[:160]
                case_rows.append(row)
        triton_attention.DECODE_FUSED_MERGE_MAX_SPLITS = fused_max_splits
        triton_attention.DECODE_PREFETCH_IDS = default_prefetch
        for launch, saved in ((triton_attention.DECODE_LAUNCH, default),
                              (one_split, default_one)):
            launch.clear()
            launch.update(saved)
        timed = sorted((r for r in case_rows if "us_per_layer" in r), key=lambda r: r["us_per_layer"])
        results.extend(case_rows)

        def is_default_row(r: dict, batch: int = batch) -> bool:
            # What the engine launches for this case: the split tiling, the one-split one, or the busy one.
            busy = r["num_splits"] == 1 and batch * shape.num_kv_heads > default_busy * num_sms
            d = default_busy_one if busy else default_one if r["num_splits"] == 1 else default
            return ((r["tile_n"], r["num_warps"], r["num_stages"]) == (d["TILE_N"], d["num_warps"], d["num_stages"])
                    and r["prefetch_ids"] == (default_prefetch and not busy)
                    and (r["num_splits"] == 1 or r["merge"] == (
                        "fused" if r["num_splits"] <= fused_max_splits else "kernel")))

        is_default = [r for r in timed if is_default_row(r)]
        summary.append((batch, ctx, f"{layout}/{order}", bytes_per_layer, is_default, timed[:5],
                        sum(1 for r in case_rows if "error" in r)))
        del layers, outs, expected
        torch.cuda.empty_cache()
    triton_attention.DECODE_BUSY_PROGRAMS_PER_SM = default_busy
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "default": default,
                                    "default_one_split": default_one,
                                    "results": results}, indent=1))
    for batch, ctx, variant, nbytes, is_default, best, failures in summary:
        print(f"\nbatch {batch} ctx {ctx if ctx > 0 else 'U[100,2048]'} {variant}: {nbytes / 1e6:.1f} MB per layer, "
              f"{failures} configs failed")
        for label, rows in (("default", is_default), ("best", best[:3])):
            for r in rows:
                print(f"  {label:8s} ids {'ahead' if r['prefetch_ids'] else 'inline'} tile {r['tile_n']:4d} "
                      f"warps {r['num_warps']} stages {r['stages_run']} "
                      f"splits {r['num_splits']:3d} {r['merge']:6s}: {r['us_per_layer']:7.1f} us/layer "
                      f"{r['tbps']:.2f} TB/s ({r['tbps'] / COPY_TBPS:.0%} of copy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
