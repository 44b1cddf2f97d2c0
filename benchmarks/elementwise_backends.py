"""Triton vs torch eager vs torch.compile for the fused elementwise ops, at Qwen2.5-7B shapes (GPU).

For each op (rms_norm with residual, rotary_embedding, silu_and_mul) and token count (decode batches 1 / 64
/ 256 and an 8192-token prefill step), times one call as the engine runs it: replayed inside a CUDA graph
(`triton.testing.do_bench_cudagraph`, so launch overhead is what a captured decode step pays) and launched
eagerly (`do_bench`, what a prefill step pays). Also records torch.compile's first-call time per op (the
start-up cost it adds). Prints a table; --out gets JSON. Decides `ops.set_elementwise_backend`'s default.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton.testing  # noqa: E402
from common import write_result  # noqa: E402

from kvserve.kernels import reference, triton_elementwise  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 3584, 18944, 28, 4, 128


def inputs(num_tokens: int) -> dict[str, tuple]:
    dt = torch.bfloat16
    x = torch.randn(num_tokens, HIDDEN, dtype=dt, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.randn(HIDDEN, dtype=dt, device="cuda")
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dt, device="cuda")
    q = qkv[:, : HEADS * HEAD_DIM].view(num_tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(num_tokens, KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 32768, (num_tokens,), device="cuda")
    cos_sin = torch.randn(32768, HEAD_DIM, device="cuda")
    gate_up = torch.randn(num_tokens, 2 * INTER, dtype=dt, device="cuda")
    return {
        "rms_norm": (x, weight, 1e-6, residual),
        "rotary_embedding": (positions, q, k, cos_sin),
        "silu_and_mul": (gate_up,),
    }


def timed(fn: Callable[[], object], graph: bool) -> float:
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    rows = []
    compile_s: dict[str, float] = {}
    compiled = {}
    for op in ("rms_norm", "rotary_embedding", "silu_and_mul"):
        compiled[op] = torch.compile(getattr(reference, op), dynamic=True)
    for num_tokens in (1, 64, 8192):
        data = inputs(num_tokens)
        for op, op_args in data.items():
            impls = {
                "triton": getattr(triton_elementwise, op),
                "torch": getattr(reference, op),
                "compile": compiled[op],
            }
            row: dict[str, object] = {"op": op, "num_tokens": num_tokens}
            for name, fn in impls.items():
                if name == "compile" and op not in compile_s:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn(*op_args)
                    torch.cuda.synchronize()
                    compile_s[op] = time.perf_counter() - t0
                for graph in (True, False):
                    key = f"{name}_{'graph' if graph else 'eager'}_us"
                    try:
                        row[key] = 1e3 * timed(lambda fn=fn, a=op_args: fn(*a), graph)
                    except Exception as exc:  # a backend that cannot be captured is recorded, not fatal
                        row[key] = None
                        row[f"{key}_error"] = repr(exc)[:200]
            rows.append(row)
    write_result(args.out, "elementwise_backends", {}, {"rows": rows, "compile_first_call_s": compile_s}, "cuda")
    print(f"\ncompile first call (s): {', '.join(f'{k} {v:.1f}' for k, v in compile_s.items())}")
    cols = [f"{b}_{m}_us" for m in ("graph", "eager") for b in ("triton", "torch", "compile")]
    print(f"{'op':<18}{'tokens':>7} " + " ".join(f"{c[:-3]:>15}" for c in cols))
    for r in rows:
        cells = " ".join(f"{r[c]:>15.1f}" if isinstance(r.get(c), float) else f"{'-':>15}" for c in cols)
        print(f"{r['op']:<18}{r['num_tokens']:>7} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
