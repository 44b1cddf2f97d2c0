"""Probe: the 4-bit matmul with the weight as the tensor-core dot's first operand ("swapped" operands).

out^T [N, M] = W [N, K] @ x^T [K, M]. On Hopper the first operand of a warp-group MMA may come from registers,
the second must be in shared memory; the engine's kernel (kernels/triton_quant.py) dequantizes the weight
into the second operand, so each dequantized tile goes registers -> shared memory -> MMA. Here the weight is
the first operand and x^T (a few rows) the second. The packed words are transposed to [N, K / pack] so one
output feature's words are contiguous along K. Times every variant at the Qwen2.5-7B shapes in CUDA graphs
(as quant_matmul_bench.py does) against cuBLAS bf16 and the engine's kernel, checks each against the
reference dequantization, and prints which MMA operands the compiled kernel keeps in registers.

    python benchmarks/quant_swap_probe.py --out benchmarks/results/<dir>
"""

# ruff: noqa: ANN001, B023  (B023: the lambdas run within their iteration)

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import COPY_TBPS, write_result  # noqa: E402
from quant_matmul_bench import SHAPES, graph_time_us, random_packed  # noqa: E402

from kvserve.kernels import reference, triton_quant  # noqa: E402

_as_magic_float = triton_quant._as_magic_float
_MAGIC_FLOAT = triton_quant._MAGIC_FLOAT


@triton.jit(do_not_specialize=["M"])
def _swap_kernel(x_ptr, qt_ptr, zeros_ptr, scales_ptr, out_ptr, M, N, k_words, stride_xm, k_per_split,
                 group_rows, BITS: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr, PARTIALS: tl.constexpr, EXPAND: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    pid_f = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_f = offs_f < N
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_F, BLOCK_M), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EXPAND:
            words = tl.load(qt_ptr + offs_f[:, None] * k_words + (k0 // PACK + tl.arange(0, BLOCK_K // PACK))[None, :],
                            mask=mask_f[:, None], other=0)
            q = (words[:, :, None] >> (tl.arange(0, PACK) * BITS)[None, None, :]) & ((1 << BITS) - 1)
            q = tl.reshape(q, (BLOCK_F, BLOCK_K))
        else:
            words = tl.load(qt_ptr + offs_f[:, None] * k_words + (offs_k // PACK)[None, :], mask=mask_f[:, None],
                            other=0)
            q = (words >> ((offs_k % PACK) * BITS)[None, :]) & ((1 << BITS) - 1)
        group = k0 // group_rows
        z = tl.load(zeros_ptr + group * N + offs_f, mask=mask_f, other=0).to(tl.float32) + _MAGIC_FLOAT
        s = tl.load(scales_ptr + group * N + offs_f, mask=mask_f, other=0.0).to(tl.float32)
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=mask_m[None, :], other=0.0)
        w = ((_as_magic_float(q) - z[:, None]) * s[:, None]).to(xt.dtype)
        acc = tl.dot(w, xt, acc)
    if PARTIALS:
        out = out_ptr + pid_k * M * N + offs_m[None, :] * N + offs_f[:, None]
    else:
        out = out_ptr + offs_m[None, :] * N + offs_f[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_f[:, None] & mask_m[None, :])


def swap_matmul(x: torch.Tensor, qt: torch.Tensor, weight: Any, cfg: dict[str, int]) -> tuple[torch.Tensor, Any]:
    m, k = x.shape
    n = weight.output_size
    split = cfg["split"]
    target = torch.empty((split, m, n) if split > 1 else (m, n), dtype=torch.float32 if split > 1 else x.dtype,
                         device=x.device)
    grid = (triton.cdiv(n, cfg["bf"]), triton.cdiv(m, cfg["bm"]), split)
    handle = _swap_kernel[grid](x, qt, weight.zeros, weight.scales, target, m, n, qt.shape[1], x.stride(0),
                                k // split, weight.group_rows, BITS=weight.bits, BLOCK_F=cfg["bf"],
                                BLOCK_M=cfg["bm"], BLOCK_K=cfg["bk"], PARTIALS=split > 1, EXPAND=cfg["expand"],
                                num_warps=cfg["warps"], num_stages=cfg["stages"])
    out = target.sum(0).to(x.dtype) if split > 1 else target
    return out, handle


def auto_split(tiles: int, chunks: int, num_sms: int) -> int:
    split = 1
    while tiles * split < 2 * num_sms and split < 16 and chunks % (split * 2) == 0:
        split *= 2
    return split


def mma_operands(handle: Any) -> list[str]:
    """The compiled kernel's MMA lines (TTGIR), shortened: whether operand A is a register dot operand or a
    shared-memory descriptor."""
    try:
        ttgir = handle.asm["ttgir"]
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        return [f"no ttgir: {type(exc).__name__}"]
    lines = [ln.strip()[:240] for ln in ttgir.splitlines() if "warp_group_dot " in ln or "ttg.local_alloc" in ln]
    return lines[:6]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=lambda v: [int(x) for x in v.split(",")], default=[16, 64])
    p.add_argument("--quick", action="store_true", help="fewer tilings")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    results: list[dict[str, Any]] = []
    table: list[str] = []
    shown_ir = False
    for name, k, n in SHAPES:
        count = max(2, -(-200 * 2**20 // (k * n * 2)))
        dense = [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        packed = [random_packed(k, n, 4, 128, gen) for _ in range(count)]
        qts = [w.qweight.t().contiguous() for w in packed]
        floor = (k * n / 2 + (k // 128) * n * 3) / (COPY_TBPS * 1e12) * 1e6
        for m in args.rows:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
            expected = reference.quantized_linear(x.float(), packed[0]).float()
            scale = expected.abs().max().item()
            bf16 = graph_time_us(lambda i, x=x: torch.nn.functional.linear(x, dense[i % count]), 2 * count, 5)
            base = triton_quant.pick_config(m, packed[0], num_sms)
            assert base is not None
            engine = graph_time_us(lambda i, x=x, c=base: triton_quant.quant_matmul(x, packed[i % count], None, c),
                                   2 * count, 5)
            timed: list[tuple[float, dict[str, int], float]] = []
            bm_choices = [16] if m <= 16 else sorted({min(64, max(16, triton.next_power_of_2(m))), 32})
            bf_choices = (64, 128)
            bk_choices = (64,) if args.quick else (64, 128)
            for bm in bm_choices:
                for bf in bf_choices:
                    for bk in bk_choices:
                        for warps in ((4,) if bf == 64 else (4, 8)):
                            for expand in (0, 1):
                                tiles = triton.cdiv(m, bm) * triton.cdiv(n, bf)
                                split0 = auto_split(tiles, k // bk, num_sms)
                                for split in sorted({split0, max(1, split0 // 2)}):
                                    cfg = {"bf": bf, "bm": bm, "bk": bk, "warps": warps, "stages": 3,
                                           "expand": expand, "split": split}
                                    try:
                                        out, handle = swap_matmul(x, qts[0], packed[0], cfg)
                                        err = (out.float() - expected).abs().max().item() / scale
                                        if not shown_ir:
                                            print("MMA operands of", cfg, *mma_operands(handle), sep="\n  ",
                                                  flush=True)
                                            shown_ir = True
                                        us = graph_time_us(lambda i, x=x, c=cfg: swap_matmul(x, qts[i % count],
                                                                                          packed[i % count], c),
                                                           2 * count, 5)
                                    except Exception as exc:  # noqa: BLE001 - a tiling that does not fit
                                        print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                                        continue
                                    timed.append((us, cfg, err))
            best_us, best, err = min(timed, key=lambda t: t[0])
            worst_err = max(t[2] for t in timed)
            line = (f"{name:<8} {m:>3} bf16 {bf16:7.1f} engine {engine:7.1f} swap-best {best_us:7.1f} floor "
                    f"{floor:5.1f}  {best}  max rel err {worst_err:.1e}")
            print(line, flush=True)
            table.append(line)
            results.append({"shape": name, "rows": m, "bf16_us": bf16, "engine_us": engine, "best_us": best_us,
                            "best": best, "max_rel_err": worst_err, "all": timed})
        dense.clear()
        packed.clear()
        qts.clear()
        torch.cuda.empty_cache()
    write_result(args.out, "quant_swap_probe", {"rows": args.rows}, results, "cuda")
    print("\n" + "\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
