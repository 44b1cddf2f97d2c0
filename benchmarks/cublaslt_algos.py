"""cuBLASLt's heuristic candidates against torch's pick, at the Qwen2.5-7B matmul shapes, bf16.

torch's `linear` runs the first algorithm cuBLASLt's heuristic returns. This times every candidate the
heuristic offers (up to `kvserve.kernels.cublaslt.MAX_CANDIDATES`) for each shape and row count, each in a
CUDA graph over one weight copy per layer (`gemm_sweep.layer_copies`, no L2 reuse between calls), checks each
candidate's result against torch's, and prints torch's time, the heuristic's first candidate, and the fastest.

    python benchmarks/cublaslt_algos.py --out /tmp/lt_algos.json [--rows 64,128,192] [--shapes qkv,down]

`--model DIR [--tp N] [--dtype float16]` takes the shapes of another model (an HF directory; config.json is
enough) as the engine's start-up tuning groups them, instead of the Qwen2.5-7B ones.

Ends with a table per row count: one decode step's matmuls (28 layers and the LM head) in ms with torch's
pick and with the faster of torch's pick and the fastest candidate, per shape, and the floors at 4.28 TB/s and at --peak-tflops.

`--sustained-s S` also times torch's pick (before and after) and every correct candidate (or the
`--sustained-top K` fastest by the short timing) over S seconds of back-to-back work after S seconds of
warm-up (`common.sustained`: the clock the power cap allows, and the energy per call), as a long prefill
or a busy engine's decode steps run; `--tuning-out FILE` then writes each shape's choice by the
sustained times as the engine's stored sustained choices (`kvserve.kernels.cublaslt` cache entries): read
from KVSERVE_CACHE_DIR/gemm_tuning.json, or shipped as kvserve/kernels/gemm_sustained_choices.json.
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
from common import GpuEnergy, sustained  # noqa: E402
from gemm_sweep import COPY_TBPS, SHAPES, layer_copies  # noqa: E402

from kvserve.kernels import cublaslt  # noqa: E402
from kvserve.kernels.cublaslt import LtMatmul  # noqa: E402

ROWS = [48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256, 1024, 2048, 8192]
NUM_LAYERS = 28


def model_shapes(path: str, tp: int, dtype: torch.dtype) -> tuple[list[tuple[str, int, int, bool]], int]:
    """The matmul shapes the engine's start-up tuning chooses for (`model_runner.gemm_tuning_groups`) of the
    model in `path` (an HF directory; built on the meta device, nothing loaded) with `tp` tensor-parallel ranks:
    rank 0's and, with tp > 1, rank 1's (a row-parallel layer's bias is rank 0's only), as (name, N, K, bias)
    named by their first layer's last name part; and the model's layer count."""
    from kvserve import distributed
    from kvserve.model.arch import load_arch_config
    from kvserve.model.registry import get_model_class
    from kvserve.worker.model_runner import gemm_tuning_groups

    arch = load_arch_config(path)
    model_cls = get_model_class(arch.architecture)
    shapes: dict[tuple[int, int, bool], str] = {}
    for rank in range(min(tp, 2)):
        previous = distributed.set_group_for_building(distributed.TPGroup(rank, tp))
        try:
            with torch.device("meta"):
                model = model_cls(arch, dtype)
        finally:
            distributed.set_group_for_building(previous)
        for (n, k, has_bias, _), group in gemm_tuning_groups(model).items():
            name = group.names[0].rsplit(".", 1)[-1] + ("" if has_bias or rank == 0 else "_nobias")
            shapes.setdefault((n, k, has_bias), name)
    return [(name, n, k, has_bias) for (n, k, has_bias), name in shapes.items()], arch.num_hidden_layers


def sustained_runs(args: argparse.Namespace, energy: GpuEnergy, run_torch: object, plan: LtMatmul,
                   x: torch.Tensor, weights: list, biases: list, out: torch.Tensor, timed: list[dict], m: int, n: int,
                   k: int, has_bias: bool, tuning: dict[str, dict]) -> None:
    """Sustained times of torch's pick (first and last, to see drift) and each timed candidate (into its
    dict: sustained_us, sustained_j per call, sm_mhz at the end); prints one line per run; adds this shape's
    choice by the sustained times to `tuning` (the engine's cache entry format)."""
    copies = len(weights)

    def run(label: str, fn: object) -> tuple[float, float | None, int | None]:
        ms, joules, mhz = sustained(fn, args.sustained_s, energy)  # type: ignore[arg-type]
        us, j = ms * 1e3 / copies, None if joules is None else joules / copies
        jtext = "n/a" if j is None else f"{j * 1e3:8.1f}"
        print(f"  sustained M={m:5d} n={n:6d} {label:12s} {us:9.1f} us/call {jtext} mJ/call  SM {mhz} MHz", flush=True)
        return us, j, mhz

    torch_runs = [run("torch", run_torch)]
    if args.sustained_top > 0:  # the fastest by the short timing only (the rest keep no sustained time)
        timed = sorted(timed, key=lambda c: c["us"])[:args.sustained_top]
    for c in timed:
        i = c["index"]

        def run_lt(xs: torch.Tensor = x, i: int = i) -> None:
            for w, b in zip(weights, biases, strict=True):
                plan.run(xs, w, b, out, candidate=i)

        c["sustained_us"], c["sustained_j"], c["sm_mhz"] = run(f"#{i}", run_lt)
    torch_runs.append(run("torch again", run_torch))
    times = {cublaslt.TORCH_CHOICE: statistics.mean(r[0] for r in torch_runs)}
    times.update({c["index"]: c["sustained_us"] for c in timed})
    choice = cublaslt.pick(times, args.min_gain)
    key = cublaslt.cache_key(x.device, m, n, k, x.dtype, has_bias, sustained=True)
    tuning[key] = cublaslt.stored_entry(plan, choice, times[cublaslt.TORCH_CHOICE], times[choice])
    print(f"  sustained M={m:5d} n={n:6d} choice {'torch' if choice == cublaslt.TORCH_CHOICE else '#' + str(choice)}: "
          f"{times[choice]:.1f} against torch's {times[cublaslt.TORCH_CHOICE]:.1f} us/call", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default=None,
                        help="comma-separated shape names (default: all; the Qwen2.5-7B ones: "
                        + ",".join(s[0] for s in SHAPES) + ")")
    parser.add_argument("--model", default=None,
                        help="an HF model directory (config.json is enough): its layers' shapes, as the engine tunes "
                        "them, instead of the Qwen2.5-7B ones (no LM head)")
    parser.add_argument("--tp", type=int, default=1, help="with --model: tensor-parallel ranks (shards the shapes)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--peak-tflops", type=float, default=791.0, help="the bf16 matmul peak measured here")
    parser.add_argument("--sustained-s", type=float, default=0.0,
                        help="also time torch's pick and each candidate over this many seconds of back-to-back work")
    parser.add_argument("--sustained-top", type=int, default=0,
                        help="with --sustained-s: time only this many candidates sustained, the fastest by the short "
                        "timing (0: all)")
    parser.add_argument("--tuning-out", type=Path, default=None,
                        help="with --sustained-s: write the engine's tuning file, choices by the sustained times")
    parser.add_argument("--min-gain", type=float, default=cublaslt.MIN_GAIN,
                        help="a candidate's sustained time must beat torch's by this fraction to be chosen")
    args = parser.parse_args()
    if args.tuning_out is not None and args.sustained_s <= 0:
        parser.error("--tuning-out needs --sustained-s")
    if args.sustained_top < 0:
        parser.error("--sustained-top must be 0 (all) or more")
    if args.tp < 1:
        parser.error("--tp must be 1 or more")
    energy = GpuEnergy() if args.sustained_s > 0 else None
    tuning: dict[str, dict] = {}
    torch.backends.cuda.preferred_blas_library("cublaslt")  # what the engine runs
    rows = [int(r) for r in args.rows.split(",")]
    dtype = getattr(torch, args.dtype)
    all_shapes, num_layers = model_shapes(args.model, args.tp, dtype) if args.model else (SHAPES, NUM_LAYERS)
    shapes = [s for s in all_shapes if args.shapes is None or s[0] in args.shapes.split(",")]
    if not shapes:
        parser.error(f"no shape named {args.shapes}; this model has {', '.join(s[0] for s in all_shapes)}")
    print("shapes (name, N, K, bias):", shapes, flush=True)
    results: dict[str, dict[int, dict]] = {}
    for name, n, k, has_bias in shapes:
        nbytes, copies, gen, weights, biases = layer_copies(n, k, has_bias, dtype)
        results[name] = {}
        for m in rows:
            reps = 20 if m <= 256 else 3
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=dtype)
            out = torch.empty(m, n, device="cuda", dtype=dtype)
            reference = torch.nn.functional.linear(x, weights[0], biases[0]).float()
            scale = reference.abs().max().item()

            def run_torch(xs: torch.Tensor = x, ws: list = weights, bs: list = biases) -> None:
                for w, b in zip(ws, bs, strict=True):
                    torch.nn.functional.linear(xs, w, b)

            torch_us = time_graph(run_torch, reps) / copies * 1e3
            plan = LtMatmul(m, n, k, dtype, has_bias, torch.cuda.current_device())
            assert plan.check_inputs(x, weights[0], biases[0])
            cands = []
            for i in range(len(plan.candidates)):
                out.fill_(float("nan"))
                plan.run(x, weights[0], biases[0], out, candidate=i)
                err = (out.float() - reference).abs().max().item()
                if not err <= 2e-2 * scale:
                    cands.append({"index": i, "error": err, **plan.config(i)})
                    continue

                def run_lt(xs: torch.Tensor = x, ws: list = weights, bs: list = biases, i: int = i,
                           o: torch.Tensor = out, p: LtMatmul = plan) -> None:
                    for w, b in zip(ws, bs, strict=True):
                        p.run(xs, w, b, o, candidate=i)

                us = time_graph(run_lt, reps) / copies * 1e3
                cands.append({"index": i, "us": us, "workspace": plan.workspace_sizes[i], **plan.config(i)})
            timed = [c for c in cands if "us" in c]
            if energy is not None:
                sustained_runs(args, energy, run_torch, plan, x, weights, biases, out, timed, m, n, k, has_bias,
                               tuning)
            best = min(timed, key=lambda c: c["us"]) if timed else None
            first = cands[0] if cands and "us" in cands[0] else None
            tuned = min(torch_us, best["us"]) if best else torch_us
            row = {"torch_us": torch_us, "tuned_us": tuned, "first_us": first["us"] if first else None,
                   "best_us": best["us"] if best else None, "best": best, "num_candidates": len(cands),
                   "num_wrong": len(cands) - len(timed), "candidates": cands,
                   "floor_bytes_us": nbytes / COPY_TBPS / 1e6,
                   "floor_flops_us": 2 * m * n * k / args.peak_tflops / 1e6}
            results[name][m] = row
            print(f"{name:8s} M={m:5d} torch {torch_us:8.1f}  first {row['first_us'] or float('nan'):8.1f}  "
                  f"best {row['best_us'] or float('nan'):8.1f} (#{best['index'] if best else -1} of "
                  f"{len(cands)}, {len(cands) - len(timed)} wrong)  "
                  f"{ {key: v for key, v in (best or {}).items() if key not in ('us', 'index')} }", flush=True)
        del weights, biases
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "results": results}, indent=1))
    if args.tuning_out is not None:
        cublaslt.save_cache(args.tuning_out, tuning)
        print(f"tuning: {len(tuning)} entries written to {args.tuning_out}")
    # One rank's layers (rank 0's: the bias-free copies of row-parallel layers are other ranks').
    layer_shapes = [s[0] for s in all_shapes if s[0] != "lm_head" and not s[0].endswith("_nobias")]
    if all(name in results for name in layer_shapes):
        print(f"\n{'M':>5s} {'torch ms':>9s} {'tuned ms':>9s} {'gain %':>7s} {'floor ms':>9s}   per shape torch/tuned us: "
              + " ".join(layer_shapes))
        for m in rows:
            def step_ms(key: str, m: int = m) -> float:
                total = num_layers * sum(results[name][m][key] for name in layer_shapes)
                if "lm_head" in results:
                    total += results["lm_head"][m][key]
                return total / 1e3

            t, b = step_ms("torch_us"), step_ms("tuned_us")
            floor = max(step_ms("floor_bytes_us"), step_ms("floor_flops_us"))
            print(f"{m:5d} {t:9.3f} {b:9.3f} {100 * (t - b) / t:7.1f} {floor:9.3f}   "
                  + " ".join(f"{results[name][m]['torch_us']:.1f}/{results[name][m]['tuned_us']:.1f}"
                             for name in layer_shapes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
