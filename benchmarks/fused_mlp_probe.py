"""Probe: does the decode MLP as one persistent launch (`kvserve/kernels/triton_fused_mlp.py`) beat the engine's
two launches (the TMA gate/up matmul with SiLU-and-mul, then cuBLAS's down projection) at 33-64 rows?

Each case is 28 layers in one CUDA graph, each layer with its own weights (Qwen2.5-7B: H 3584, I 18944, bf16,
407 MB a layer, so nothing stays in L2 between layers) and the decode step's order of kernels: the fused
residual add + RMSNorm, then the MLP; a layer's MLP output is the next layer's RMSNorm input, as in the
model. Timed by graph replay (`attention_sweep.time_graph`, the mean of back-to-back replays), each case
twice in turn. Before timing, each fused configuration's output is checked against the engine's path.

    python benchmarks/fused_mlp_probe.py --out /tmp/fused_mlp [--rows 48,64] [--configs "4,4,4,1;8,2,3,2"]

A configuration is split2,stages1,stages2,programs per SM[,block_n2[,flat]] (two programs per SM need
tilings that fit twice in shared memory; flat 1: the kernel with one pipelined loop per kind of unit, 2: a
flat gate/up loop and down units one at a time).

Prints ms per 28 layers and µs per layer (the better of the rounds) with the MLP's weight bytes per µs,
and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from attention_sweep import time_graph  # noqa: E402
from common import write_result  # noqa: E402

from kvserve.kernels import ops  # noqa: E402
from kvserve.kernels.triton_fused_mlp import FusedMlpConfig, fits, fused_mlp  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS = 3584, 18944, 28
MLP_BYTES = 3 * HIDDEN * INTERMEDIATE * 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="48,64")
    parser.add_argument("--configs", default="4,4,4,1;8,4,4,1;4,4,6,1;8,4,6,1;8,2,3,2",
                        help="split2,stages1,stages2,programs per SM[,block_n2[,flat]];...")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype, dev = torch.bfloat16, torch.device("cuda")
    w_gate_up = [torch.randn(2 * INTERMEDIATE, HIDDEN, device=dev, dtype=dtype) * HIDDEN**-0.5 for _ in range(LAYERS)]
    w_down = [torch.randn(HIDDEN, INTERMEDIATE, device=dev, dtype=dtype) * INTERMEDIATE**-0.5
              for _ in range(LAYERS)]
    norm_w = [1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=dtype) for _ in range(LAYERS)]
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    configs: dict[str, tuple[FusedMlpConfig, int]] = {}
    for spec in args.configs.split(";"):
        split2, stages1, stages2, per_sm, *rest = (int(v) for v in spec.split(","))
        block_n2, flat = (rest + [64, 0][len(rest):])[:2]
        name = f"fused{['', ' flat', ' hybrid'][flat]} s{split2} st{stages1}/{stages2} x{per_sm} n2={block_n2}"
        configs[name] = (FusedMlpConfig(split2=split2, stages1=stages1, stages2=stages2, block_n2=block_n2,
                                        flat=flat > 0, flat_down=flat == 1), num_sms * per_sm)
    results: dict[str, Any] = {}
    rows_out = []
    for m in (int(v) for v in args.rows.split(",")):
        x0 = torch.randn(m, HIDDEN, device=dev, dtype=dtype)
        residual = torch.randn(m, HIDDEN, device=dev, dtype=dtype)

        def engine_layers(x0: torch.Tensor = x0, residual: torch.Tensor = residual) -> torch.Tensor:
            h, res = x0, residual.clone()
            for layer in range(LAYERS):
                normed, res = ops.rms_norm(h, norm_w[layer], 1e-6, res)
                h = ops.linear(ops.linear_silu_mul(normed, w_gate_up[layer]), w_down[layer])
            return h

        def fused_layers(config: FusedMlpConfig, programs: int, x0: torch.Tensor = x0,
                         residual: torch.Tensor = residual, m: int = m) -> torch.Tensor:
            scratch = (torch.empty((m, INTERMEDIATE), device=dev, dtype=dtype),
                       torch.empty((config.split2, m, HIDDEN), device=dev, dtype=torch.float32))
            h, res = x0, residual.clone()
            for layer in range(LAYERS):
                normed, res = ops.rms_norm(h, norm_w[layer], 1e-6, res)
                h = fused_mlp(normed, w_gate_up[layer], w_down[layer], config, programs, scratch)
            return h

        # One layer's MLP against the engine's path on the same input.
        normed, _ = ops.rms_norm(x0, norm_w[0], 1e-6, residual.clone())
        want = ops.linear(ops.linear_silu_mul(normed, w_gate_up[0]), w_down[0]).float()
        cases: dict[str, Any] = {"engine (TMA gate/up + cuBLAS down)": engine_layers}
        for name, (config, programs) in configs.items():
            if not fits(normed, w_gate_up[0], w_down[0], config):
                print(f"rows {m}: {name} does not fit", flush=True)
                continue
            try:
                got = fused_mlp(normed, w_gate_up[0], w_down[0], config, programs).float()
                again = fused_mlp(normed, w_gate_up[0], w_down[0], config, programs).float()
            except Exception as exc:  # noqa: BLE001 (a tiling past shared memory: report, go on)
                print(f"rows {m}: {name} failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            err = ((got - want).abs().max() / want.abs().max()).item()
            same = torch.equal(got, again)
            print(f"rows {m}: {name}: max |diff| / max |engine| = {err:.2e}, repeat bitwise equal: {same}",
                  flush=True)
            if err > 2e-2 or not same:
                print(f"rows {m}: {name} skipped (wrong result)", flush=True)
                continue
            cases[name] = lambda config=config, programs=programs: fused_layers(config, programs)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, fn in cases.items():
                times[name].append(time_graph(fn, 20))
        base = min(times["engine (TMA gate/up + cuBLAS down)"])
        for name, ts in times.items():
            best = min(ts)
            per_layer_us = best * 1e3 / LAYERS
            rows_out.append((m, name, best, per_layer_us, MLP_BYTES / per_layer_us / 1e6, (best - base) * 1e3 / LAYERS))
        results[str(m)] = {name: ts for name, ts in times.items()}
    print(f"\n{'rows':>4}  {'case':<40} {'ms/28':>7} {'us/layer':>9} {'TB/s':>6} {'vs engine us/layer':>19}")
    for m, name, best, per, tbps, delta in rows_out:
        print(f"{m:>4}  {name:<40} {best:7.3f} {per:9.2f} {tbps:6.2f} {delta:+19.2f}")
    write_result(args.out, "fused_mlp_probe", vars(args) | {"out": str(args.out)}, results, "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
