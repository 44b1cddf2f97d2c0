"""Causal prefill attention of one prompt through torch's SDPA backends (flash, cuDNN, memory-efficient) and
`varlen_attn`, at the Qwen2.5-7B head layout (28 query / 4 KV heads of 128), bf16, for 1k- and 8k-token
prompts: which backend `ops.prefill_attention` should call.

    python benchmarks/prefill_attention_backends.py --out /tmp/prefill_attn.json

Each backend's output is compared with the flash backend's first; ms per layer is timed over 28 calls.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 28, 4, 128, 28


def time_ms(fn: Callable[[], object], reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps * LAYERS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (reps * LAYERS)


def run_case(tokens: int) -> list[dict]:
    rows: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    group = HEADS // KV_HEADS
    q4 = q.transpose(0, 1).unsqueeze(0)
    k4 = k.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
    v4 = v.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
    kg, vg = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    flops = 4 * tokens * tokens * HEADS * HEAD_DIM / 2
    ref = None
    cases: list[tuple[str, Callable[[], torch.Tensor]]] = []
    for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("efficient", SDPBackend.EFFICIENT_ATTENTION)):

        def run(b: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel(b):
                return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)

        def run_gqa(b: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel(b):
                return F.scaled_dot_product_attention(q4, kg, vg, is_causal=True, enable_gqa=True)

        def run_repeat(b: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel(b):
                kk = k.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
                vv = v.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
                return F.scaled_dot_product_attention(q4, kk, vv, is_causal=True)

        cases += [(label, run), (label + "+gqa", run_gqa), (label + "+repeat", run_repeat)]
    try:
        from torch.nn.attention.varlen import varlen_attn

        qsl = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        cases.append(("varlen", lambda: varlen_attn(q, kr, vr, qsl, qsl, tokens, tokens, is_causal=True)))
    except Exception as exc:
        print(f"varlen_attn unavailable: {exc!r}")
    for label, fn in cases:
        row: dict = {"tokens": tokens, "backend": label}
        try:
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            out = out.squeeze(0).transpose(0, 1) if out.dim() == 4 else out
            if ref is None:
                ref = out.float()
            row["max_abs_diff_vs_flash"] = (out.float() - ref).abs().max().item()
            ms = time_ms(fn)
            row["ms_per_layer"] = ms
            row["tflops"] = flops / ms / 1e9
        except Exception as exc:
            row["error"] = repr(exc)[:200]
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [row for tokens in (1024, 2048, 4096, 8192) for row in run_case(tokens)]
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "results": rows}, indent=1))
    print(f"{'tokens':>6s} {'backend':16s} {'ms/layer':>9s} {'TFLOP/s':>8s} {'x28 ms':>7s} diff")
    for r in rows:
        if "error" in r:
            print(f"{r['tokens']:6d} {r['backend']:16s} error: {r['error']}")
        else:
            print(f"{r['tokens']:6d} {r['backend']:16s} {r['ms_per_layer']:9.3f} {r['tflops']:8.0f} "
                  f"{r['ms_per_layer'] * LAYERS:7.1f} {r['max_abs_diff_vs_flash']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
