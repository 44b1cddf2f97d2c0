"""Probe: does an L2 prefetch of a matmul's weights, issued by the kernel before it, shorten a decode step?

At decode the matmuls stream their weights from HBM and the kernels between them (attention over the KV
cache, RMSNorm) leave the weights alone; at batch 64 the o_proj matmul (25.7 MB at the Qwen2.5-7B shape)
reads at ~2.7 TB/s because it is short (ramp and tail). If the attention kernel before it, or a small kernel,
issues `prefetch.global.L2` for those weights, the matmul may find them in L2 (50 MB on the H200).

Each case is 28 "layers" in one CUDA graph, each layer with its own buffers (so nothing is in L2 from the
replay before), timed by graph replay:

* stream+o:   a read-bound kernel over 134 MB (the KV bytes of batch 64 x 1k context), then a 64-row
              matmul with a 3584 x 3584 weight. Variants: prefetch of the matmul's weight from the stream
              kernel, and the stream's loads marked evict_first (so they do not push the prefetch out).
* down+tiny+qkv: a 64-row matmul with an 18944 x 3584 weight, a tiny kernel, then one with 4608 x 3584;
              the tiny kernel optionally prefetches the second weight.

Prints a table (ms per 28 layers and µs per layer, each the better of two rounds) and writes JSON to --out.
Timed with `attention_sweep.time_graph` (mean of back-to-back replays); the session-13 results
(`benchmarks/results/h200-2026-12-01/session13/call1`) were taken at 74ee0a0 with the median of single replays.
Run on the GPU only: `python benchmarks/l2_prefetch_probe.py --out /tmp/l2probe`.
"""

# ruff: noqa: ANN001
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_sweep import time_graph  # noqa: E402

LINE = 128  # bytes per L2 line


@triton.jit
def _prefetch_lines(base_ptr, first_line, num_lines, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Issue prefetch.global.L2 for `num_lines` 128-byte lines from line `first_line` of a byte pointer."""
    for start in range(0, num_lines, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ptrs = base_ptr + (first_line + tl.minimum(idx, num_lines - 1)).to(tl.int64) * 128
        if EVICT_LAST:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_share(pf_ptr, pf_lines, PF_BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr):
    """This program's equal share of the `pf_lines` lines at `pf_ptr`, prefetched."""
    per = tl.cdiv(pf_lines, tl.num_programs(0))
    first = tl.program_id(0) * per
    count = tl.minimum(per, pf_lines - first)
    if count > 0:
        _prefetch_lines(pf_ptr, first, count, PF_BLOCK, EVICT_LAST)


@triton.jit
def _stream_kernel(src_ptr, n_per_prog, out_ptr, pf_ptr, pf_lines, BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
                   EVICT_FIRST: tl.constexpr, EVICT_LAST: tl.constexpr, PF_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if PREFETCH:
        _prefetch_share(pf_ptr, pf_lines, PF_BLOCK, EVICT_LAST)
    base = src_ptr + pid.to(tl.int64) * n_per_prog
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_per_prog, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if EVICT_FIRST:
            x = tl.load(base + offs, mask=offs < n_per_prog, other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(base + offs, mask=offs < n_per_prog, other=0.0)
        acc += x.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


@triton.jit
def _tiny_kernel(x_ptr, n, pf_ptr, pf_lines, BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
                 EVICT_LAST: tl.constexpr, PF_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if PREFETCH:
        _prefetch_share(pf_ptr, pf_lines, PF_BLOCK, EVICT_LAST)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(x_ptr + offs, x * 1.0001, mask=offs < n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--rows", type=int, default=64)
    args = p.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    layers, rows = args.layers, args.rows
    hidden, inter, qkv_out = 3584, 18944, 4608
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    stream_elems = 134 * 1024 * 1024 // 2
    progs = 2 * num_sms
    n_per_prog = stream_elems // progs
    kv = [torch.randn(progs * n_per_prog, device=dev, dtype=dt) for _ in range(layers)]
    w_o = [torch.randn(hidden, hidden, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
    w_down = [torch.randn(hidden, inter, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
    w_qkv = [torch.randn(qkv_out, hidden, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
    x_h = torch.randn(rows, hidden, device=dev, dtype=dt)
    x_i = torch.randn(rows, inter, device=dev, dtype=dt)
    sink = torch.empty(progs, device=dev, dtype=torch.float32)
    tiny = torch.randn(rows * hidden, device=dev, dtype=dt)
    outs: dict[str, float] = {}

    def stream_o(prefetch: bool, evict_first: bool, evict_last: bool, matmul: bool = True) -> None:
        for i in range(layers):
            w = w_o[i]
            _stream_kernel[(progs,)](kv[i], n_per_prog, sink, w, w.numel() * 2 // LINE, BLOCK=2048,
                                     PREFETCH=prefetch, EVICT_FIRST=evict_first, EVICT_LAST=evict_last,
                                     PF_BLOCK=256, num_warps=4)
            if matmul:
                torch.mm(x_h, w.t())

    def o_only() -> None:
        for i in range(layers):
            torch.mm(x_h, w_o[i].t())

    def down_tiny_qkv(prefetch: bool, evict_last: bool, tiny_progs: int) -> None:
        for i in range(layers):
            torch.mm(x_i, w_down[i].t())
            w = w_qkv[i]
            _tiny_kernel[(tiny_progs,)](tiny, tiny.numel(), w, w.numel() * 2 // LINE, BLOCK=triton.next_power_of_2(
                triton.cdiv(tiny.numel(), tiny_progs)), PREFETCH=prefetch, EVICT_LAST=evict_last, PF_BLOCK=256,
                num_warps=4)
            torch.mm(x_h, w.t())

    cases = {
        "o matmul alone": o_only,
        "stream alone": lambda: stream_o(False, False, False, matmul=False),
        "stream alone, evict_first": lambda: stream_o(False, True, False, matmul=False),
        "stream alone, prefetching o": lambda: stream_o(True, True, False, matmul=False),
        "stream+o": lambda: stream_o(False, False, False),
        "stream+o, evict_first": lambda: stream_o(False, True, False),
        "stream+o, prefetch": lambda: stream_o(True, False, False),
        "stream+o, prefetch, evict_first": lambda: stream_o(True, True, False),
        "stream+o, prefetch evict_last, evict_first": lambda: stream_o(True, True, True),
        "down+tiny+qkv": lambda: down_tiny_qkv(False, False, 64),
        "down+tiny+qkv, prefetch (64 progs)": lambda: down_tiny_qkv(True, False, 64),
        "down+tiny+qkv, prefetch (132 progs)": lambda: down_tiny_qkv(True, False, num_sms),
        "down+tiny+qkv, prefetch evict_last": lambda: down_tiny_qkv(True, True, 64),
    }
    for _round in range(2):
        for name, fn in cases.items():
            ms = time_graph(fn)
            outs.setdefault(name, ms)
            outs[name] = min(outs[name], ms)
            print(f"{name:48s} {ms:8.3f} ms", flush=True)
    print()
    print(f"{'case':48s} {f'ms / {layers} layers':>14s} {'us / layer':>10s}")
    for name, ms in outs.items():
        print(f"{name:48s} {ms:14.3f} {ms * 1000 / layers:10.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "l2_prefetch_probe.json").write_text(json.dumps({
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
        "layers": layers, "rows": rows, "ms": outs}, indent=1))


if __name__ == "__main__":
    main()
