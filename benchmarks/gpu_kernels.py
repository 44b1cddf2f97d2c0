"""GPU check of the Triton kernels: correctness at real model shapes, then timings against the roofline.

Run on the GPU machine from the repository root:

    python benchmarks/gpu_kernels.py --out benchmarks/results/gpu_kernels_h200.json

For each kernel (reshape_and_cache, paged_attention decode / prefill / mixed, rms_norm, rotary_embedding,
silu_and_mul), model shape (Qwen2.5-7B: 28 q / 4 kv heads, head_dim 128; SmolLM2-135M: 9 / 3, head_dim 64)
and dtype (bf16, fp16), and for the sampler's penalise_rows_ once (the 7B vocabulary, float32 logits), it:

1. runs the kernel once with every output buffer it writes poisoned with NaN first (for outputs the launcher
   allocates, its module's torch.empty is swapped for a NaN-filling one) and compares every element with
   kvserve/kernels/reference.py (tolerances fit the dtype);
2. times it with triton.testing.do_bench (median; do_bench clears the L2 cache between repetitions), and for
   decode attention also a CUDA-graph replay of the same launch (proves the launch is capturable and removes
   the Python launch overhead from the number);
3. reports the bytes it must move (each input read once, each output written once) over the time, against the
   4.28 TB/s device-to-device copy bandwidth measured on the H200 (--copy-tbps), and for prefill attention the
   causal FLOP rate against 788 TFLOP/s (the measured bf16 matmul rate).

The last thing printed is a table; --out gets the same rows as JSON. Exit status 1 when any check failed.
Needs torch >= 2.4 and triton >= 3.0 (written against torch 2.11 / triton 3.6). Runs in about 2 minutes on
an H200; --budget-s stops starting new cases once spent (those are recorded as skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from common import git_commit  # noqa: E402

from kvserve.kernels import (  # noqa: E402
    reference,
    triton_attention,
    triton_cache,
    triton_elementwise,
    triton_penalties,
)
from kvserve.layers.attention_metadata import AttentionMetadata  # noqa: E402


@dataclass(frozen=True)
class ModelShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int


MODELS = {
    "qwen2.5-7b": ModelShape(28, 4, 128, 3584, 18944),
    "smollm2-135m": ModelShape(9, 3, 64, 576, 1536),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BLOCK_SIZE = 16
ATTN_TOL = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}  # (atol, rtol)
# Elementwise kernels round like the reference: two ulps covers an intermediate rounding flip.
ELEMENTWISE_TOL = {torch.bfloat16: (1e-4, 2**-6), torch.float16: (1e-5, 2**-9)}
# (name, batch size, context length) for decode; None context = lengths drawn from 100..4096.
DECODE_CASES = [
    ("b1_ctx4k", 1, 4096),
    ("b1_ctx32k", 1, 32768),
    ("b8_ctx4k", 8, 4096),
    ("b32_ctx4k", 32, 4096),
    ("b64_ctx_mixed", 64, None),
    ("b128_ctx2k", 128, 2048),
    ("b256_ctx1k", 256, 1024),
]
# (name, [(query_len, seq_len), ...]) for batches with prefill chunks.
PREFILL_CASES = [
    ("prompt_2k", [(2048, 2048)]),
    ("chunks_4x512_over_1536_prefix", [(512, 2048)] * 4),
    ("prompts_16x512", [(512, 512)] * 16),
    ("mixed_chunk512_plus_31_decodes", [(512, 512)] + [(1, 2048)] * 31),
]
SPLIT_SWEEP = [1, 2, 4, 8, 16, 32, 64]


@dataclass
class Row:
    kernel: str
    model: str
    dtype: str
    case: str
    ok: bool | None = None
    max_abs_err: float | None = None
    ms: float | None = None
    graph_ms: float | None = None
    torch_ms: float | None = None
    bytes_moved: int = 0
    pct_of_copy: float | None = None
    tflops: float | None = None
    pct_of_matmul: float | None = None
    extra: dict = field(default_factory=dict)
    note: str = ""


class _PoisoningTorch:
    """Stands in for `torch` in a kernel module: float tensors it allocates start as NaN."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    @staticmethod
    def empty_like(*args: object, **kwargs: object) -> torch.Tensor:
        t = torch.empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


@contextlib.contextmanager
def poisoned_allocations(module: ModuleType) -> Iterator[None]:
    original = module.torch
    module.torch = _PoisoningTorch()
    try:
        yield
    finally:
        module.torch = original


def compare(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> tuple[bool, float]:
    """Every element: finite where expected is finite, and within atol + rtol * |expected|."""
    a, e = actual.float(), expected.float()
    close = torch.isclose(a, e, atol=atol, rtol=rtol, equal_nan=True)
    err = (a - e).abs().nan_to_num(float("inf"), float("inf"), float("inf"))
    return bool(close.all()), float(err.max()) if err.numel() else 0.0


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows: list[Row] = []
        self.start = time.perf_counter()

    def out_of_time(self, row: Row) -> bool:
        if time.perf_counter() - self.start < self.args.budget_s:
            return False
        row.note = "skipped: time budget spent"
        self.rows.append(row)
        return True

    def bench(self, fn: Callable[[], object]) -> float:
        return float(triton.testing.do_bench(fn, warmup=10, rep=self.args.rep_ms, return_mode="median"))

    def graph_bench(self, fn: Callable[[], object]) -> float:
        fn()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.bench(graph.replay)

    def finish(self, row: Row, ms: float, bytes_moved: int, flops: float | None = None) -> None:
        row.ms, row.bytes_moved = ms, bytes_moved
        row.pct_of_copy = 100.0 * bytes_moved / (ms * 1e-3) / (self.args.copy_tbps * 1e12)
        if flops is not None:
            row.tflops = flops / (ms * 1e-3) / 1e12
            row.pct_of_matmul = 100.0 * row.tflops / self.args.matmul_tflops
        self.rows.append(row)
        print(
            f"  {row.kernel:18s} {row.model:13s} {row.dtype:4s} {row.case:34s} ok={row.ok} "
            f"err={row.max_abs_err:.2e} {ms * 1e3:9.1f} us {row.pct_of_copy:6.1f}% copy"
            + (f" {row.tflops:6.1f} TFLOP/s" if row.tflops is not None else ""),
            flush=True,
        )


# ------------------------------------------------------------------------------------ batch builders


def make_batch(
    shape: ModelShape, dtype: torch.dtype, lens: list[tuple[int, int]], gen: torch.Generator,
    layout: str = "nhd", scattered: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Query + KV cache + metadata for (query_len, seq_len) requests; blocks scattered by a permutation
    (scattered) or each request's in order, as a fresh engine allocates them. layout "hnd" stores each
    block's heads apart ([2, blocks, kv heads, block_size, head_dim] in memory) behind the logical
    [2, blocks, block_size, kv heads, head_dim] view every kernel takes."""
    if layout not in ("nhd", "hnd"):
        raise ValueError(f"unknown KV cache layout {layout!r} (nhd or hnd)")
    device = torch.device("cuda")
    blocks_per_req = [triton.cdiv(s, BLOCK_SIZE) for _, s in lens]
    num_blocks = sum(blocks_per_req) + 8
    perm = (torch.randperm(num_blocks, device=device, generator=gen) if scattered
            else torch.arange(num_blocks, device=device)).to(torch.int32)
    block_tables = torch.zeros(len(lens), max(blocks_per_req) + 1, dtype=torch.int32, device=device)
    used = 0
    for r, n in enumerate(blocks_per_req):
        block_tables[r, :n] = perm[used : used + n]
        used += n
    if layout == "hnd":
        kv_cache = torch.randn(2, num_blocks, shape.num_kv_heads, BLOCK_SIZE, shape.head_dim, device=device,
                               dtype=dtype, generator=gen).transpose(2, 3)
    else:
        kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim, device=device,
                               dtype=dtype, generator=gen)
    num_tokens = sum(q for q, _ in lens)
    query = torch.randn(
        num_tokens, shape.num_heads, shape.head_dim, device=device, dtype=dtype, generator=gen
    )
    query_start_loc = [0]
    for q, _ in lens:
        query_start_loc.append(query_start_loc[-1] + q)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for _, s in lens], dtype=torch.int32, device=device),
        block_tables=block_tables,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),  # unused by attention
        max_query_len=max(q for q, _ in lens),
        max_seq_len=max(s for _, s in lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=[s for _, s in lens],
    )
    return query, kv_cache, metadata


def attention_bytes(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> int:
    """Each request's context K and V read once, query read once, output written once."""
    per_token_kv = 2 * kv_cache.shape[3] * kv_cache.shape[4] * kv_cache.element_size()
    return sum(metadata.seq_lens_cpu) * per_token_kv + 2 * query.numel() * query.element_size()


def causal_flops(shape: ModelShape, lens: list[tuple[int, int]]) -> float:
    """QK^T and PV over the keys each query may see: 4 * heads * head_dim per (query, key) pair."""
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in lens)
    return 4.0 * shape.num_heads * shape.head_dim * pairs


# ------------------------------------------------------------------------------------------ cases


def run_attention(runner: Runner, model: str, shape: ModelShape, dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    atol, rtol = ATTN_TOL[dtype]
    scale = shape.head_dim**-0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for case, batch, ctx in DECODE_CASES:
        row = Row("attention_decode", model, dtype_name, case)
        if runner.out_of_time(row):
            continue
        if ctx is None:
            seq_lens = torch.randint(100, 4097, (batch,), generator=torch.Generator().manual_seed(1)).tolist()
        else:
            seq_lens = [ctx] * batch
        query, kv_cache, metadata = make_batch(shape, dtype, [(1, s) for s in seq_lens], gen)
        splits = triton_attention.choose_num_splits(batch, shape.num_kv_heads, metadata.max_seq_len, num_sms)
        row.extra["num_splits"] = splits
        out = torch.full_like(query, float("nan"))
        with poisoned_allocations(triton_attention):
            triton_attention.paged_attention(query, kv_cache, metadata, scale, out=out)
        expected = reference.paged_attention(query, kv_cache, metadata, scale)
        row.ok, row.max_abs_err = compare(out, expected, atol, rtol)
        del expected

        def call(q=query, kv=kv_cache, md=metadata, o=out) -> None:
            triton_attention.paged_attention(q, kv, md, scale, out=o)

        ms = runner.bench(call)
        try:
            row.graph_ms = runner.graph_bench(call)
        except Exception as exc:  # recorded, not fatal: the table shows which launch failed to capture
            row.note = f"graph capture failed: {exc!r}"[:200]
            row.ok = False
        runner.finish(row, ms, attention_bytes(query, kv_cache, metadata))
        if model == "qwen2.5-7b" and dtype_name == "bf16" and case in ("b1_ctx4k", "b8_ctx4k", "b1_ctx32k"):
            sweep_splits(runner, model, dtype_name, case, query, kv_cache, metadata, scale)
        del query, kv_cache, metadata, out
        torch.cuda.empty_cache()

    for case, lens in PREFILL_CASES:
        row = Row("attention_prefill", model, dtype_name, case)
        if runner.out_of_time(row):
            continue
        query, kv_cache, metadata = make_batch(shape, dtype, lens, gen)
        out = torch.full_like(query, float("nan"))
        triton_attention.paged_attention(query, kv_cache, metadata, scale, out=out)
        expected = reference.paged_attention(query, kv_cache, metadata, scale)
        row.ok, row.max_abs_err = compare(out, expected, atol, rtol)
        del expected
        ms = runner.bench(
            lambda q=query, kv=kv_cache, md=metadata, o=out: triton_attention.paged_attention(
                q, kv, md, scale, out=o
            )
        )
        runner.finish(row, ms, attention_bytes(query, kv_cache, metadata), causal_flops(shape, lens))
        del query, kv_cache, metadata, out
        torch.cuda.empty_cache()


def sweep_splits(
    runner: Runner,
    model: str,
    dtype_name: str,
    case: str,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> None:
    """Decode time per forced split count: the data to tune choose_num_splits with."""
    dtype = DTYPES[dtype_name]
    expected = reference.paged_attention(query, kv_cache, metadata, scale)
    for splits in SPLIT_SWEEP:
        row = Row(
            "attention_split", model, dtype_name, f"{case}_splits{splits}", extra={"num_splits": splits}
        )
        out = torch.full_like(query, float("nan"))
        with poisoned_allocations(triton_attention):
            triton_attention.launch_paged_attention(query, kv_cache, metadata, scale, out, num_splits=splits)
        row.ok, row.max_abs_err = compare(out, expected, *ATTN_TOL[dtype])

        def call(o=out, s=splits) -> None:
            triton_attention.launch_paged_attention(query, kv_cache, metadata, scale, o, num_splits=s)

        ms = runner.bench(call)
        row.graph_ms = runner.graph_bench(call)
        runner.finish(row, ms, attention_bytes(query, kv_cache, metadata))


def run_cache(runner: Runner, model: str, shape: ModelShape, dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    for case, num_tokens in (("prefill_8192", 8192), ("decode_256", 256)):
        row = Row("reshape_and_cache", model, dtype_name, case)
        if runner.out_of_time(row):
            continue
        num_blocks = triton.cdiv(num_tokens, BLOCK_SIZE) * 2
        kv_cache = torch.full(
            (2, num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim),
            float("nan"),
            dtype=dtype,
            device="cuda",
        )
        width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
        qkv = torch.randn(num_tokens, width, dtype=dtype, device="cuda")
        q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        key = qkv[:, q_size : q_size + kv_size].view(num_tokens, shape.num_kv_heads, shape.head_dim)
        value = qkv[:, q_size + kv_size :].view(num_tokens, shape.num_kv_heads, shape.head_dim)
        slot_mapping = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens]
        slot_mapping[::97] = -1  # padding tokens
        expected = kv_cache.clone()
        triton_cache.reshape_and_cache(key, value, kv_cache, slot_mapping)
        reference.reshape_and_cache(key, value, expected, slot_mapping)
        row.ok = bool(torch.equal(kv_cache.isnan(), expected.isnan())) and bool(
            torch.equal(kv_cache.nan_to_num(0.0), expected.nan_to_num(0.0))
        )
        row.max_abs_err = float((kv_cache.float() - expected.float()).nan_to_num(0.0).abs().max())
        ms = runner.bench(partial(triton_cache.reshape_and_cache, key, value, kv_cache, slot_mapping))
        row.torch_ms = runner.bench(partial(reference.reshape_and_cache, key, value, expected, slot_mapping))
        bytes_moved = 2 * 2 * key.numel() * key.element_size() + slot_mapping.numel() * 8
        runner.finish(row, ms, bytes_moved)


def run_elementwise(runner: Runner, model: str, shape: ModelShape, dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    atol, rtol = ELEMENTWISE_TOL[dtype]
    module = triton_elementwise
    for num_tokens in (8192, 256):
        hidden = shape.hidden_size
        x = torch.randn(num_tokens, hidden, dtype=dtype, device="cuda")
        residual = torch.randn(num_tokens, hidden, dtype=dtype, device="cuda")
        weight = torch.randn(hidden, dtype=dtype, device="cuda")
        elt = x.element_size()
        for with_residual in (False, True):
            row = Row(
                "rms_norm", model, dtype_name, f"t{num_tokens}" + ("_residual" if with_residual else "")
            )
            if runner.out_of_time(row):
                continue
            r = residual if with_residual else None
            with poisoned_allocations(module):
                out, new_residual = module.rms_norm(x, weight, 1e-6, r)
            expected, expected_residual = reference.rms_norm(x, weight, 1e-6, r)
            ok_out, err_out = compare(out, expected, atol, rtol)
            ok_res, err_res = compare(new_residual, expected_residual, atol, rtol)
            row.ok, row.max_abs_err = ok_out and ok_res, max(err_out, err_res)
            ms = runner.bench(partial(module.rms_norm, x, weight, 1e-6, r))
            row.torch_ms = runner.bench(partial(reference.rms_norm, x, weight, 1e-6, r))
            runner.finish(row, ms, x.numel() * elt * (4 if with_residual else 2) + hidden * elt)

        row = Row("rotary_embedding", model, dtype_name, f"t{num_tokens}")
        if not runner.out_of_time(row):
            width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
            qkv = torch.randn(num_tokens, width, dtype=dtype, device="cuda")
            q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
            query = qkv[:, :q_size].view(num_tokens, shape.num_heads, shape.head_dim)
            key = qkv[:, q_size : q_size + kv_size].view(num_tokens, shape.num_kv_heads, shape.head_dim)
            positions = torch.randint(0, 32768, (num_tokens,), device="cuda")
            inv_freq = 1.0 / 1e6 ** (
                torch.arange(0, shape.head_dim, 2, device="cuda").float() / shape.head_dim
            )
            freqs = torch.arange(32768, device="cuda").float()[:, None] * inv_freq[None, :]
            cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
            with poisoned_allocations(module):
                q_out, k_out = module.rotary_embedding(positions, query, key, cos_sin)
            q_exp, k_exp = reference.rotary_embedding(positions, query, key, cos_sin)
            # Both the kernel and the reference round x*cos + rot(x)*sin in low precision (the kernel may
            # fuse a multiply-add), so they can differ by an ulp of the *inputs* where the output cancels
            # towards 0; a tolerance relative to the output fails there. Judge each against the exact
            # float32 result instead: the kernel must be no less accurate than the reference.
            ok = True
            for out, exp, x in ((q_out, q_exp, query), (k_out, k_exp, key)):
                exact = reference.rotary_embedding(positions, x.float(), x.float(), cos_sin)[0]
                err_kernel = (out.float() - exact).abs().max().item()
                err_ref = (exp.float() - exact).abs().max().item()
                ok = ok and bool(torch.isfinite(out).all()) and err_kernel <= 1.25 * err_ref + 1e-6
                row.max_abs_err = max(row.max_abs_err or 0.0, (out.float() - exp.float()).abs().max().item())
            row.ok = ok
            ms = runner.bench(partial(module.rotary_embedding, positions, query, key, cos_sin))
            row.torch_ms = runner.bench(partial(reference.rotary_embedding, positions, query, key, cos_sin))
            qk_bytes = (query.numel() + key.numel()) * elt
            runner.finish(row, ms, 2 * qk_bytes + num_tokens * (8 + shape.head_dim * 4))

        row = Row("silu_and_mul", model, dtype_name, f"t{num_tokens}")
        if not runner.out_of_time(row):
            gate_up = torch.randn(num_tokens, 2 * shape.intermediate_size, dtype=dtype, device="cuda")
            with poisoned_allocations(module):
                out = module.silu_and_mul(gate_up)
            row.ok, row.max_abs_err = compare(out, reference.silu_and_mul(gate_up), atol, rtol)
            ms = runner.bench(partial(module.silu_and_mul, gate_up))
            row.torch_ms = runner.bench(partial(reference.silu_and_mul, gate_up))
            runner.finish(row, ms, gate_up.numel() * elt * 3 // 2)
        torch.cuda.empty_cache()


def run_penalties(runner: Runner, vocab: int) -> None:
    """The sampler's penalty kernel on float32 logits of `vocab` columns: bit-equal to the reference."""
    for num_rows in (256, 50):
        row = Row("penalise_rows_", "qwen2.5-7b", "fp32", f"rows{num_rows}_vocab{vocab}")
        if runner.out_of_time(row):
            continue
        gen = torch.Generator(device="cuda").manual_seed(num_rows)
        logits = torch.randn(num_rows, vocab, device="cuda", generator=gen) * 4
        capacity = 2 * num_rows  # the rows' slots scattered over a buffer twice as tall, as after churn
        seen = torch.rand(capacity, vocab, device="cuda", generator=gen) < 0.01
        counts = torch.randint(0, 3, (capacity, vocab), device="cuda", generator=gen).float()
        counts *= torch.rand(capacity, vocab, device="cuda", generator=gen) < 0.002
        rows = torch.arange(num_rows, device="cuda")
        slots = torch.randperm(capacity, device="cuda", generator=gen)[:num_rows]
        penalties = [torch.full((num_rows,), v, device="cuda") for v in (1.05, 0.1, 0.2)]
        args = (rows, slots, seen, counts, *penalties)
        got, expected = logits.clone(), logits.clone()
        triton_penalties.penalise_rows_(got, *args)
        reference.penalise_rows_(expected, *args)
        row.ok = bool(torch.equal(got, expected))
        row.max_abs_err = float((got - expected).abs().max())
        ms = runner.bench(partial(triton_penalties.penalise_rows_, got, *args))
        row.torch_ms = runner.bench(partial(reference.penalise_rows_, expected, *args))
        runner.finish(row, ms, num_rows * vocab * (4 + 4 + 1 + 4) + num_rows * 8 * 2)
        torch.cuda.empty_cache()


def measure_copy_tbps() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read and written (how the 4.28 TB/s was measured)."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = float(triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median"))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'kernel':18s} {'model':13s} {'dtype':5s} {'case':34s} {'ok':5s} {'max_err':>8s} {'us':>9s} "
        f"{'graph_us':>9s} {'torch_us':>9s} {'%copy':>6s} {'TFLOP/s':>8s}  note"
    )
    print("\n" + header)
    print("-" * len(header))

    def num(v: float | None, scale: float = 1.0, fmt: str = "9.1f") -> str:
        return format(v * scale, fmt) if v is not None else " " * int(fmt.split(".")[0])

    for r in rows:
        print(
            f"{r.kernel:18s} {r.model:13s} {r.dtype:5s} {r.case:34s} {str(r.ok):5s} "
            f"{num(r.max_abs_err, 1, '8.1e')} {num(r.ms, 1e3)} {num(r.graph_ms, 1e3)} {num(r.torch_ms, 1e3)} "
            f"{num(r.pct_of_copy, 1, '6.1f')} {num(r.tflops, 1, '8.1f')}  "
            + " ".join(f"{k}={v}" for k, v in r.extra.items())
            + (f" {r.note}" if r.note else "")
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    kernel_groups = ["cache", "attention", "elementwise", "penalties"]
    parser.add_argument("--kernels", nargs="+", default=kernel_groups, choices=kernel_groups)
    parser.add_argument("--copy-tbps", type=float, default=4.28, help="copy bandwidth to compare against")
    parser.add_argument(
        "--matmul-tflops", type=float, default=788.0, help="bf16 matmul rate to compare against"
    )
    parser.add_argument("--rep-ms", type=int, default=50, help="do_bench repetition time per measurement")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no new case after this long")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2

    runner = Runner(args)
    copy_tbps = measure_copy_tbps()
    print(
        f"{torch.cuda.get_device_name()}: measured copy {copy_tbps:.2f} TB/s (comparing against {args.copy_tbps})"
    )
    per_shape = {"cache": run_cache, "attention": run_attention, "elementwise": run_elementwise}
    for model in args.models:
        for dtype_name in args.dtypes:
            print(f"[{model} {dtype_name}] t={time.perf_counter() - runner.start:.0f}s", flush=True)
            for name, run in per_shape.items():
                if name in args.kernels:
                    run(runner, model, MODELS[model], dtype_name)
    if "penalties" in args.kernels:
        run_penalties(runner, 152064)  # the Qwen2.5-7B vocabulary; float32 logits whatever the model's dtype

    failed = [r for r in runner.rows if r.ok is False]
    summary = {
        "benchmark": "gpu_kernels",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "settings": {key: str(value) for key, value in vars(args).items()},
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "copy_tbps_reference": args.copy_tbps,
        "copy_tbps_measured": copy_tbps,
        "matmul_tflops_reference": args.matmul_tflops,
        "wall_s": time.perf_counter() - runner.start,
        "num_failed": len(failed),
        "rows": [asdict(r) for r in runner.rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print_table(runner.rows)
    print(f"\n{len(runner.rows)} rows, {len(failed)} failed, {summary['wall_s']:.0f} s; JSON in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
