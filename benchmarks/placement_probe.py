"""Where a one-wave grid's programs land on the SMs, launched plainly or with programmatic dependent launch
(PDL) behind another kernel (docs/perf_notes.md entry 55 inferred that a small-footprint decode attention
kernel crowded onto fewer SMs under PDL; this checks the placement itself).

A probe kernel of G programs, each `num_warps` warps, records its SM (%smid) and spins for a fixed time. It
runs after a predecessor kernel: either a short, narrow one (like the rotary launch before the decode
attention) or a wide one whose programs end at staggered times (like a matmul draining). The probe is
launched plainly (it starts once the predecessor has ended) or with PDL (its programs may be placed while the
predecessor still runs; they wait for it before their first instruction past the wait). Per case: the SMs
the probe used, the most programs one SM held, and the probe's span (first program start to last end).

    python benchmarks/placement_probe.py --out /tmp/placement.json
"""

# Kernel parameters stay unannotated: @triton.jit reads annotations as type/constexpr specialisations.
# ruff: noqa: ANN001, ANN201

from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvserve.kernels.triton_pdl import pdl_wait_then_release  # noqa: E402


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _spin_kernel(out_ptr, spin_ns, stagger_ns, period, PDL: tl.constexpr):
    """Wait for the previous kernel (PDL), let the next one launch, then spin spin_ns + (pid % period) *
    stagger_ns nanoseconds; record (SM, start, end)."""
    pdl_wait_then_release(PDL)
    pid = tl.program_id(0)
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    start = _now()
    until = start + spin_ns + (pid % period).to(tl.int64) * stagger_ns
    t = start
    while t < until:
        t = _now()
    tl.store(out_ptr + pid * 3, smid.to(tl.int64))
    tl.store(out_ptr + pid * 3 + 1, start)
    tl.store(out_ptr + pid * 3 + 2, t)


PREDECESSORS = {
    # name: (programs per SM, warps, spin ns, stagger ns between the SMs' programs); narrow: 64 programs in all
    "narrow": (None, 4, 5_000, 0),
    "wide": (4, 4, 20_000, 150),
}


def run_case(pred: str, grid: int, warps: int, pdl: bool, spin_ns: int, reps: int, num_sms: int) -> dict:
    per_sm, w_pred, spin_pred, stagger = PREDECESSORS[pred]
    n_pred = 64 if per_sm is None else per_sm * num_sms
    pred_out = torch.empty(n_pred * 3, dtype=torch.int64, device="cuda")
    out = torch.empty(grid * 3, dtype=torch.int64, device="cuda")
    per_sm_max, sms_used, spans = [], [], []
    for _ in range(reps):
        _spin_kernel[(n_pred,)](pred_out, spin_pred, stagger, num_sms, PDL=True, num_warps=w_pred)
        _spin_kernel[(grid,)](out, spin_ns, 0, 1, PDL=pdl, num_warps=warps, launch_pdl=pdl)
        torch.cuda.synchronize()
        rows = out.view(grid, 3).cpu()
        counts = collections.Counter(rows[:, 0].tolist())
        per_sm_max.append(max(counts.values()))
        sms_used.append(len(counts))
        spans.append((rows[:, 2].max() - rows[:, 1].min()).item() / 1e3)
    return {"predecessor": pred, "grid": grid, "num_warps": warps, "pdl": pdl, "spin_us": spin_ns / 1e3,
            "sms_used": sms_used, "max_per_sm": per_sm_max, "span_us": spans}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--grids", default="192,256")
    parser.add_argument("--warps", default="1,4,8")
    parser.add_argument("--spin-us", type=float, default=20.0)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    cases = itertools.product(PREDECESSORS, [int(g) for g in args.grids.split(",")],
                              [int(w) for w in args.warps.split(",")], (False, True))
    for pred, grid, warps, pdl in cases:
        results.append(run_case(pred, grid, warps, pdl, int(args.spin_us * 1e3), args.reps, num_sms))
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "num_sms": num_sms,
                                    "results": results}, indent=1))
    print(f"{num_sms} SMs; probe programs spin {args.spin_us:.0f} us each; {args.reps} launches per row")
    print("predecessor  grid  warps  launch | SMs used (per launch)      | most on one SM    | span us (median)")
    for r in results:
        spans = sorted(r["span_us"])
        print(f"{r['predecessor']:11s} {r['grid']:5d} {r['num_warps']:6d}  {'PDL' if r['pdl'] else 'plain':6s} | "
              f"{' '.join(f'{v:3d}' for v in r['sms_used']):26s} | {' '.join(f'{v:2d}' for v in r['max_per_sm']):17s} | "
              f"{spans[len(spans) // 2]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
