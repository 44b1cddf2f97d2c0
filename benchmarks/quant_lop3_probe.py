"""Probe: the 4-bit matmul with the weight dequantized two values per instruction (bf16x2 / f16x2).

The engine's kernel (kernels/triton_quant.py) turns each 4-bit value into a float with about six
instructions (shift, mask, or, subtract, multiply, round). Here an inline-PTX routine takes one packed word (8
values) and gives 8 values in x's dtype with one `lop3` per pair (mask two nibbles and put them in the
mantissas of two 16-bit floats of 128 + q / 1024 + q), a paired subtract of 128 + z and a paired multiply by
the scale: 15 instructions for 8 weights. The scale is rounded to x's dtype first (so bf16 results can
differ from the float32 reference by a rounding of the scale).

The 8 outputs of a word are K rows 8 r + j (j = 0..7) in the checkpoint's packing. Two ways to feed them to the dot:
* `dots`: the words repacked so that output j of word r is the tile's row j R + r (R = BLOCK_K / 8); eight
  dots per K tile, dot j on x's contiguous columns j R .. j R + R - 1 (K tile 128: each dot is 16 deep);
* `join`: the 8 tensors joined and reshaped into one [BLOCK_K, BLOCK_N] tile, one dot.
`zs`: each column's zero point and scale read as one int32 word (4 bytes a thread, which the pipeliner copies
ahead asynchronously; the 1- and 2-byte loads of separate zeros and scales stay synchronous in the loop);
also the engine's own kernel with only this change. `math=0` leaves out the subtract and multiply (wrong values; timing only, to see what the ALU costs).
Times each at the Qwen2.5-7B shapes in CUDA graphs against the engine's kernel and cuBLAS bf16.

    python benchmarks/quant_lop3_probe.py --out benchmarks/results/<dir>
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

_BF16_ASM = tl.constexpr("""{
.reg .b32 t, p, zz, ss;
mov.b32 zz, {$9, $9};
mov.b32 ss, {$10, $10};
lop3.b32 p, $8, 0x000f000f, 0x43004300, 0xea;
sub.rn.bf16x2 p, p, zz;
mul.rn.bf16x2 p, p, ss;
mov.b32 {$0, $4}, p;
shr.u32 t, $8, 4;
lop3.b32 p, t, 0x000f000f, 0x43004300, 0xea;
sub.rn.bf16x2 p, p, zz;
mul.rn.bf16x2 p, p, ss;
mov.b32 {$1, $5}, p;
shr.u32 t, $8, 8;
lop3.b32 p, t, 0x000f000f, 0x43004300, 0xea;
sub.rn.bf16x2 p, p, zz;
mul.rn.bf16x2 p, p, ss;
mov.b32 {$2, $6}, p;
shr.u32 t, $8, 12;
lop3.b32 p, t, 0x000f000f, 0x43004300, 0xea;
sub.rn.bf16x2 p, p, zz;
mul.rn.bf16x2 p, p, ss;
mov.b32 {$3, $7}, p;
}""")
_NOMATH_ASM = tl.constexpr("""{
.reg .b32 t, p;
lop3.b32 p, $8, 0x000f000f, 0x43004300, 0xea;
mov.b32 {$0, $4}, p;
shr.u32 t, $8, 4;
lop3.b32 p, t, 0x000f000f, 0x43004300, 0xea;
mov.b32 {$1, $5}, p;
shr.u32 t, $8, 8;
lop3.b32 p, t, 0x000f000f, 0x43004300, 0xea;
mov.b32 {$2, $6}, p;
shr.u32 t, $8, 12;
lop3.b32 p, t, 0x000f000f, 0x43004300, 0xea;
mov.b32 {$3, $7}, p;
}""")
_CONSTRAINTS = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,h,h")


@triton.jit
def _words_to_bf16(words, zb, sb, MATH: tl.constexpr):
    if MATH:
        o = tl.inline_asm_elementwise(_BF16_ASM, _CONSTRAINTS, [words, zb, sb], dtype=(tl.int16,) * 8,
                                      is_pure=True, pack=1)
    else:
        o = tl.inline_asm_elementwise(_NOMATH_ASM, _CONSTRAINTS, [words, zb, sb], dtype=(tl.int16,) * 8,
                                      is_pure=True, pack=1)
    return o


@triton.jit(do_not_specialize=["M"])
def _zs_kernel(x_ptr, qweight_ptr, zs_ptr, out_ptr, M, N, stride_xm, k_per_split, group_rows,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIALS: tl.constexpr):
    """The engine's kernel (expanded unpack, float32 dequantization) with each column's zero point and fp16
    scale read as one int32 word (zero << 16 | scale bits): a 4-byte load, which the pipeliner can copy
    ahead asynchronously (the separate 1- and 2-byte loads stay synchronous in the loop)."""
    PACK: tl.constexpr = 8
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    word_rows = tl.arange(0, BLOCK_K // PACK)
    shifts = tl.arange(0, PACK) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        words = tl.load(qweight_ptr + (k0 // PACK + word_rows)[:, None] * N + offs_n[None, :], mask=mask_n[None, :],
                        other=0)
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 15, (BLOCK_K, BLOCK_N))
        zs = tl.load(zs_ptr + (k0 // group_rows) * N + offs_n, mask=mask_n, other=0)
        z = ((zs >> 16) & 0xFF).to(tl.float32) + triton_quant._MAGIC_FLOAT
        s = (zs & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        w = ((triton_quant._as_magic_float(q) - z[None, :]) * s[None, :]).to(x.dtype)
        acc = tl.dot(x, w, acc)
    if PARTIALS:
        out = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    else:
        out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def interleave(weight: Any, block_k: int) -> torch.Tensor:
    """qweight repacked so that word r of each K tile holds the tile's rows r, R + r, ..., 7 R + r (R = block_k
    / 8) at nibbles 0..7."""
    from kvserve.layers.quantization import pack_rows, unpack_rows

    q = unpack_rows(weight.qweight, 4)
    k, n = q.shape
    r = block_k // 8
    q = q.view(k // block_k, 8, r, n).transpose(1, 2).reshape(k, n)
    return pack_rows(q, 4)


def zs_words(weight: Any) -> torch.Tensor:
    """int32 [groups, N]: zero point << 16 | the fp16 scale's bits."""
    bits = weight.scales.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return (weight.zeros.to(torch.int32) << 16) | bits


def zs_matmul(x: torch.Tensor, weight: Any, zs: torch.Tensor, cfg: dict[str, int]) -> torch.Tensor:
    m, k = x.shape
    n = weight.output_size
    split = cfg["split"]
    target = torch.empty((split, m, n) if split > 1 else (m, n), dtype=torch.float32 if split > 1 else x.dtype,
                         device=x.device)
    grid = (triton.cdiv(n, cfg["bn"]), triton.cdiv(m, cfg["bm"]), split)
    _zs_kernel[grid](x, weight.qweight, zs, target, m, n, x.stride(0), k // split, weight.group_rows,
                     BLOCK_M=cfg["bm"], BLOCK_N=cfg["bn"], BLOCK_K=cfg["bk"], PARTIALS=split > 1,
                     num_warps=cfg["warps"], num_stages=cfg["stages"])
    return target.sum(0).to(x.dtype) if split > 1 else target


@triton.jit(do_not_specialize=["M"])
def _lop3_kernel(x_ptr, qweight_ptr, zeros_ptr, scales_ptr, out_ptr, M, N, stride_xm, k_per_split, group_rows,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIALS: tl.constexpr,
                 MATH: tl.constexpr, JOIN: tl.constexpr, ZS: tl.constexpr):
    R: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rr = tl.arange(0, R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        words = tl.load(qweight_ptr + (k0 // 8 + rr)[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
        group = k0 // group_rows
        if ZS:
            zs = tl.load(zeros_ptr + group * N + offs_n, mask=mask_n, other=0)
            z = ((zs >> 16) & 0xFF).to(tl.float32) + 128.0
            s = (zs & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        else:
            z = tl.load(zeros_ptr + group * N + offs_n, mask=mask_n, other=0).to(tl.float32) + 128.0
            s = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0)
        zb = tl.broadcast_to(z.to(tl.bfloat16).to(tl.int16, bitcast=True)[None, :], (R, BLOCK_N))
        sb = tl.broadcast_to(s.to(tl.bfloat16).to(tl.int16, bitcast=True)[None, :], (R, BLOCK_N))
        o0, o1, o2, o3, o4, o5, o6, o7 = _words_to_bf16(words, zb, sb, MATH)
        xrow = x_ptr + offs_m[:, None] * stride_xm + k0
        if JOIN:
            w = tl.join(tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7)))
            w = tl.reshape(tl.permute(w, (0, 4, 3, 2, 1)), (BLOCK_K, BLOCK_N)).to(tl.bfloat16, bitcast=True)
            x = tl.load(xrow + tl.arange(0, BLOCK_K)[None, :], mask=mask_m[:, None], other=0.0)
            acc = tl.dot(x, w, acc)
        else:
            # Interleaved packing (`interleave`): output j of word r is K row k0 + j R + r, so dot j reads x's
            # contiguous columns k0 + j R ... k0 + j R + R - 1.
            cols = rr[None, :]
            ws = (o0, o1, o2, o3, o4, o5, o6, o7)
            for j in tl.static_range(8):
                xj = tl.load(xrow + j * R + cols, mask=mask_m[:, None], other=0.0)
                acc = tl.dot(xj, ws[j].to(tl.bfloat16, bitcast=True), acc)
    if PARTIALS:
        out = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    else:
        out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def lop3_matmul(x: torch.Tensor, weight: Any, cfg: dict[str, int], zs: torch.Tensor | None = None,
                qweight: torch.Tensor | None = None) -> torch.Tensor:
    m, k = x.shape
    n = weight.output_size
    split = cfg["split"]
    target = torch.empty((split, m, n) if split > 1 else (m, n), dtype=torch.float32 if split > 1 else x.dtype,
                         device=x.device)
    grid = (triton.cdiv(n, cfg["bn"]), triton.cdiv(m, cfg["bm"]), split)
    _lop3_kernel[grid](x, weight.qweight if qweight is None else qweight, weight.zeros if zs is None else zs, weight.scales, target, m, n, x.stride(0), k // split,
                       weight.group_rows, BLOCK_M=cfg["bm"], BLOCK_N=cfg["bn"], BLOCK_K=cfg["bk"],
                       PARTIALS=split > 1, MATH=cfg["math"], JOIN=cfg["join"], ZS=zs is not None, num_warps=cfg["warps"],
                       num_stages=cfg["stages"])
    return target.sum(0).to(x.dtype) if split > 1 else target


def auto_split(tiles: int, chunks: int, num_sms: int) -> int:
    split = 1
    while tiles * split < 2 * num_sms and split < 16 and chunks % (split * 2) == 0:
        split *= 2
    return split


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=lambda v: [int(x) for x in v.split(",")], default=[16, 64])
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    results: list[dict[str, Any]] = []
    table: list[str] = []
    for name, k, n in SHAPES:
        count = max(2, -(-200 * 2**20 // (k * n * 2)))
        dense = [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        packed = [random_packed(k, n, 4, 128, gen) for _ in range(count)]
        zss = [zs_words(w) for w in packed]
        qis = [interleave(w, 128) for w in packed]
        floor = (k * n / 2 + (k // 128) * n * 3) / (COPY_TBPS * 1e12) * 1e6
        # The reference with the scales rounded to bf16 first, as the paired multiply uses them.
        rounded = [type(w)(w.qweight, w.zeros, w.scales.to(torch.bfloat16), w.bits, w.group_rows, None)
                   for w in packed[:1]]
        for m in args.rows:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
            expected = reference.quantized_linear(x.float(), rounded[0]).float()
            exact = reference.quantized_linear(x, rounded[0]).float()
            exact_ref = reference.quantized_linear(x.float(), packed[0]).float()
            scale = expected.abs().max().item()
            bf16 = graph_time_us(lambda i: torch.nn.functional.linear(x, dense[i % count]), 2 * count, 5)
            base = triton_quant.pick_config(m, packed[0], num_sms)
            assert base is not None
            engine = graph_time_us(lambda i: triton_quant.quant_matmul(x, packed[i % count], None, base),
                                   2 * count, 5)
            best: dict[str, tuple[float, dict[str, int], float]] = {}
            bm = 16 if m <= 16 else 64
            for variant, join, math in (("zs", -1, 1), ("dots-zs", 0, 1), ("join-zs", 1, 1),
                                        ("dots-nomath-zs", 0, 0)):
                use_zs = variant.endswith("zs")
                for bn in (64, 128, 256):
                    for bk in ((128,) if join == 0 else (64, 128)):
                        for warps, stages in ((4, 3), (8, 3)):
                            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                            split0 = auto_split(tiles, k // bk, num_sms)
                            for split in sorted({split0, max(1, split0 // 2)}):
                                cfg = {"bm": bm, "bn": bn, "bk": bk, "warps": warps, "stages": stages, "math": math,
                                       "join": join, "split": split}
                                try:
                                    if join < 0:
                                        def call(i: int) -> torch.Tensor:
                                            return zs_matmul(x, packed[i % count], zss[i % count], cfg)
                                    else:
                                        def call(i: int) -> torch.Tensor:
                                            return lop3_matmul(x, packed[i % count], cfg,
                                                               zss[i % count] if use_zs else None,
                                                               qis[i % count] if join == 0 else None)
                                    out = call(0)
                                    err = (out.float() - (exact_ref if join < 0 else expected)).abs().max().item() / scale
                                    us = graph_time_us(call, 2 * count, 5)
                                except Exception as exc:  # noqa: BLE001 - a tiling that does not fit
                                    print(f"  {variant} {cfg}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                                    continue
                                if variant not in best or us < best[variant][0]:
                                    best[variant] = (us, cfg, err)
            parts = []
            for variant, (us, cfg, err) in best.items():
                parts.append(f"{variant} {us:6.1f} ({cfg['bn']}x{cfg['bk']} w{cfg['warps']} s{cfg['stages']} "
                             f"split {cfg['split']}, err {err:.1e})")
            ref_err = (exact - expected).abs().max().item() / scale
            line = (f"{name:<8} {m:>3} bf16 {bf16:6.1f} engine {engine:6.1f} floor {floor:5.1f} | " + " | ".join(parts)
                    + f" | bf16-reference err {ref_err:.1e}")
            print(line, flush=True)
            table.append(line)
            results.append({"shape": name, "rows": m, "bf16_us": bf16, "engine_us": engine,
                            "best": {v: {"us": b[0], "cfg": b[1], "err": b[2]} for v, b in best.items()}})
        dense.clear()
        packed.clear()
        zss.clear()
        qis.clear()
        torch.cuda.empty_cache()
    write_result(args.out, "quant_lop3_probe", {"rows": args.rows}, results, "cuda")
    print("\n" + "\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
