"""ops dispatch on the GPU (skipped without CUDA): the prefill attention fast path against the torch reference,
the skinny matmul at the Qwen2.5-7B shapes inside a replayed CUDA graph, and a chain of dependent kernels
launched with programmatic dependent launch."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import ops, reference
from kvserve.layers.attention_metadata import AttentionMetadata

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("lens", [[2048], [700], [300, 64, 1000]])
@pytest.mark.parametrize("heads", [(28, 4, 128), (9, 3, 64)])
@pytest.mark.parametrize("cudnn_min_tokens", [0, 512], ids=["flash", "cudnn-first"])
def test_prefill_fast_path_matches_reference(
    lens: list[int], heads: tuple[int, int, int], cudnn_min_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ops, "SDPA_CUDNN_MIN_TOKENS", cudnn_min_tokens)
    num_heads, num_kv_heads, head_dim = heads
    block_size, dtype, device = 16, torch.bfloat16, "cuda"
    num_tokens = sum(lens)
    query = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    # Each request's blocks in shuffled order, so the reference reads them through the table.
    blocks_per_req = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(blocks_per_req)).tolist()
    tables, slots, start = [], [], 0
    for n, nb in zip(lens, blocks_per_req, strict=True):
        table = perm[start : start + nb]
        start += nb
        tables.append(table + [0] * (max(blocks_per_req) - nb))
        slots += [table[t // block_size] * block_size + t % block_size for t in range(n)]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(lens), max_seq_len=max(lens), query_start_loc_cpu=qsl, seq_lens_cpu=list(lens),
    )
    kv_cache = torch.zeros(2, len(perm), block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    reference.reshape_and_cache(key, value, kv_cache, md.slot_mapping)
    scale = head_dim**-0.5
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = ops.prefill_attention(query, key, value, md, scale)
        torch.cuda.synchronize()
    assert out is not None, "the fast path did not apply"
    # The kernel kvserve named is the one that ran (torch's own order would pick cuDNN on an H200).
    ran_cudnn = any("cudnn" in event.name.lower() for event in prof.events())
    assert ran_cudnn == (len(lens) == 1 and 0 < cudnn_min_tokens <= lens[0]), [e.name for e in prof.events()][:20]
    expected = reference.paged_attention(query, kv_cache, md, scale)
    err = (out.float() - expected.float()).norm() / expected.float().norm()
    assert err < 1e-2, f"relative error {err:.2e}"


QWEN_7B = {"qkv": (4608, 3584, True), "o_proj": (3584, 3584, False), "gate_up": (37888, 3584, False),
           "down": (3584, 18944, False), "lm_head": (152064, 3584, False)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 8, ops.SKINNY_GEMM_MAX_ROWS])
def test_skinny_linear_in_a_cuda_graph(dtype: torch.dtype, m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.linear's small-row path at the real shapes, captured once and replayed three times with its output
    set to NaN before each replay: every tile is written on every replay (the split counters reset)."""
    from kvserve.kernels import triton_gemm

    launches: list[str] = []
    skinny = triton_gemm.skinny_linear

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        launches.append("skinny")
        return skinny(*args, **kwargs)

    monkeypatch.setattr(triton_gemm, "skinny_linear", counted)

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(m)
    for name, (n, k, has_bias) in QWEN_7B.items():
        assert triton_gemm.pick_config(m, n, k, num_sms) is not None, name
        x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
        w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(dtype)
        b = torch.randn(n, generator=gen, device="cuda").to(dtype) if has_bias else None
        expected = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
        launches.clear()
        ops.linear(x, w, b)  # outside the capture: compiles, allocates the split counters
        assert launches == ["skinny"], f"{name}: ops.linear did not take the Triton kernel"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.linear(x, w, b)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=2**-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rotary_embedding_and_cache_at_qwen_shape(dtype: torch.dtype) -> None:
    """The fused rotary + cache write at Qwen2.5-7B's heads (28 query / 4 KV of 128), q/k/v as views of one
    QKV output, a padding slot: the rotated q/k equal the rotary kernel's alone, and the cache equals the
    torch reference's write of them; the outputs start as NaN, so an unwritten element fails."""
    from kvserve.kernels import triton_elementwise

    num_tokens, heads, kv_heads, head_dim, block_size = 37, 28, 4, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(7)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen, device="cuda").to(dtype)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(num_tokens, kv_heads, head_dim)
    positions = torch.randint(0, 32768, (num_tokens,), generator=gen, device="cuda")
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(32768, dtype=torch.float32)[:, None] * inv_freq[None, :]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).cuda()
    slots = torch.randperm(64 * block_size, generator=gen, device="cuda")[:num_tokens]
    slots[5] = -1
    kv_cache = torch.full((2, 64, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    expected_cache = kv_cache.clone()
    q_out, k_out = ops.rotary_embedding_and_cache(positions, q, k, v, table, kv_cache, slots)
    q_alone, k_alone = triton_elementwise.rotary_embedding(positions, q, k, table)
    assert torch.equal(q_out, q_alone) and torch.equal(k_out, k_alone)
    # Bitwise the torch reference too: each product rounded before the sum. (With FMA contraction, the GPU
    # kernel differed from it in about a fifth of the elements at large positions.)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, table)
    assert torch.equal(q_alone, q_ref) and torch.equal(k_alone, k_ref)
    reference.reshape_and_cache(k_alone, v, expected_cache, slots)
    assert torch.equal(kv_cache.isnan(), expected_cache.isnan())
    assert torch.equal(kv_cache.nan_to_num(), expected_cache.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens, pad_to", [(1100, 1280), (1024, 1024)])
def test_rotary_padded_at_qwen_shape(
    dtype: torch.dtype, num_tokens: int, pad_to: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The padded rotary launch of a one-prompt cuDNN prefill at Qwen2.5-7B's heads, outputs allocated as
    NaN: rows up to the prompt are the unpadded launch's q/k and v itself, the rest zeros, and the cache is
    written as by the unpadded launch."""
    from kvserve.kernels import triton_elementwise

    heads, kv_heads, head_dim, block_size = 28, 4, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(11)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen, device="cuda").to(dtype)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(num_tokens, kv_heads, head_dim)
    positions = torch.arange(num_tokens, device="cuda")
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(4096, dtype=torch.float32)[:, None] * inv_freq[None, :]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).cuda()
    slots = torch.randperm(128 * block_size, generator=gen, device="cuda")[:num_tokens]
    kv_cache = torch.full((2, 128, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    expected_cache = kv_cache.clone()
    q_plain, k_plain = triton_elementwise.rotary_embedding(positions, q, k, table, v, expected_cache, slots)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    q_pad, k_pad, v_pad = ops.rotary_embedding_and_cache_padded(positions, q, k, v, table, kv_cache, slots, pad_to)
    monkeypatch.setattr(torch, "empty", empty)
    for out, plain in ((q_pad, q_plain), (k_pad, k_plain), (v_pad, v)):
        assert out.shape == (pad_to, *plain.shape[1:]) and out.is_contiguous()
        assert torch.equal(out[:num_tokens], plain)
        assert not out[num_tokens:].isnan().any() and not out[num_tokens:].any()
    assert torch.equal(kv_cache.isnan(), expected_cache.isnan())
    assert torch.equal(kv_cache.nan_to_num(), expected_cache.nan_to_num())


@pytest.mark.parametrize("m", [1, 8])
def test_pdl_chain_of_dependent_kernels(m: int) -> None:
    """Four Qwen2.5-7B MLP blocks at decode size, each kernel reading the one before's output (norm -> gate_up
    -> silu -> down -> norm ...), in a CUDA graph with PDL launches: bitwise the plain launches' result, on
    every replay (outputs poisoned first). Catches a kernel that reads its input before the wait."""
    from kvserve.kernels import triton_pdl

    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device)[0] < 9 or not triton_pdl.HAS_GDC:
        pytest.skip("programmatic dependent launch needs sm_90+ and a Triton with the intrinsics")
    gen = torch.Generator(device="cuda").manual_seed(11)
    hidden, inter = 3584, 18944
    layers = [
        (
            (torch.randn(2 * inter, hidden, generator=gen, device="cuda") * hidden**-0.5).bfloat16(),
            (torch.randn(hidden, inter, generator=gen, device="cuda") * inter**-0.5).bfloat16(),
            (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).bfloat16(),
        )
        for _ in range(4)
    ]
    inputs = [torch.randn(m, hidden, generator=gen, device="cuda").bfloat16() for _ in range(4)]
    static_in = inputs[0].clone()

    def chain(x: torch.Tensor) -> torch.Tensor:
        residual = None
        for gate_up, down, norm in layers:
            normed, residual = ops.rms_norm(x, norm, 1e-6, residual)
            x = ops.linear(ops.silu_and_mul(ops.linear(normed, gate_up)), down)
        return ops.rms_norm(x, layers[0][2], 1e-6, residual)[0]

    try:
        triton_pdl.set_enabled(False)
        expected = [chain(x) for x in inputs]
        triton_pdl.set_enabled(True)
        assert triton_pdl.enabled(device)
        eager = chain(inputs[0])  # also compiles the PDL variants outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static_in)
    finally:
        triton_pdl.set_enabled(True)
    assert torch.equal(eager, expected[0])
    # A new input before every replay: a kernel reading an intermediate before its producer finished would see
    # the previous replay's values (or NaN in the output) and differ.
    for x, want in zip(inputs[1:] + inputs[:1], expected[1:] + expected[:1], strict=True):
        static_in.copy_(x)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.parametrize("m", [1, 8, ops.SKINNY_GEMM_MAX_ROWS])
def test_matmul_epilogues_at_qwen_shape(m: int) -> None:
    """Qwen2.5-7B's gate/up and q/k/v projections with their fused epilogues, in a CUDA graph replayed on new
    inputs: bitwise the unfused ops (matmul then SiLU-and-mul; matmul then rotary + cache write)."""
    from kvserve.kernels import triton_elementwise

    gen = torch.Generator(device="cuda").manual_seed(m)
    hidden, inter, heads, kv_heads, head_dim, block_size = 3584, 18944, 28, 4, 128, 16
    w_gu = (torch.randn(2 * inter, hidden, generator=gen, device="cuda") * hidden**-0.5).bfloat16()
    n_qkv = (heads + 2 * kv_heads) * head_dim
    w_qkv = (torch.randn(n_qkv, hidden, generator=gen, device="cuda") * hidden**-0.5).bfloat16()
    b_qkv = torch.randn(n_qkv, generator=gen, device="cuda").bfloat16()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(32768, dtype=torch.float32)[:, None] * inv_freq[None, :]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).cuda()
    x = torch.zeros(m, hidden, dtype=torch.bfloat16, device="cuda")
    positions = torch.zeros(m, dtype=torch.int64, device="cuda")
    slots = torch.zeros(m, dtype=torch.int64, device="cuda")
    cache = torch.zeros(2, 64, block_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")

    def fused() -> tuple[torch.Tensor, torch.Tensor]:
        act = ops.linear_silu_mul(x, w_gu)
        qkv = ops.linear_rope_cache(x, w_qkv, b_qkv, positions, table, cache, slots, heads, kv_heads, head_dim)
        assert qkv is not None, "the q/k/v epilogue did not apply"
        return act, qkv

    assert ops._skinny(x, w_gu, None, silu_mul=True) is not None, "the gate/up epilogue did not apply"
    fused()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        act_out, qkv_out = fused()
    for replay in range(3):
        x.copy_(torch.randn(m, hidden, generator=gen, device="cuda"))
        positions.copy_(torch.randint(0, 32768, (m,), generator=gen, device="cuda"))
        slots.copy_(torch.randperm(64 * block_size, generator=gen, device="cuda")[:m])
        slots[0] = -1
        cache.fill_(float("nan"))
        act_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(act_out, ops.silu_and_mul(ops.linear(x, w_gu))), replay
        plain = ops.linear(x, w_qkv, b_qkv)
        q, k, v = plain.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        expected_cache = torch.full_like(cache, float("nan"))
        q_rot, k_rot = triton_elementwise.rotary_embedding(
            positions, q.view(m, heads, head_dim), k.view(m, kv_heads, head_dim), table,
            v.view(m, kv_heads, head_dim), expected_cache, slots,
        )
        assert torch.equal(qkv_out, torch.cat([q_rot.view(m, -1), k_rot.view(m, -1), v], dim=-1)), replay
        assert torch.equal(cache.isnan(), expected_cache.isnan()), replay
        assert torch.equal(cache.nan_to_num(), expected_cache.nan_to_num()), replay


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [33, 48, ops.TMA_GATE_UP_MAX_DECODE_ROWS, ops.PREFILL_GATE_UP_MIN_ROWS, 4100])
def test_tma_gate_up_at_qwen_shape(dtype: torch.dtype, m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused TMA gate/up matmul (decode tiling, and the opt-in prefill one) at the Qwen2.5-7B MLP shape,
    captured in a CUDA graph and replayed on new inputs with its output poisoned: as close to a float32 matmul
    + SiLU-and-mul as cuBLAS then `silu_and_mul` are (they are not bitwise equal: the two matmuls sum in
    different orders)."""
    from kvserve.kernels import triton_gate_up

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the fused TMA gate/up matmul needs sm_90+")
    monkeypatch.setattr(ops, "_prefill_silu_fusion", True)  # opt-in

    gen = torch.Generator(device="cuda").manual_seed(m)
    hidden, inter = 3584, 18944
    w = (torch.randn(2 * inter, hidden, generator=gen, device="cuda") * hidden**-0.5).to(dtype)
    x = torch.zeros(m, hidden, dtype=dtype, device="cuda")
    calls = []
    launch = triton_gate_up.gate_up_silu
    triton_gate_up.gate_up_silu = lambda *a, **kw: calls.append(1) or launch(*a, **kw)
    try:
        ops.linear_silu_mul(x, w)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.linear_silu_mul(x, w)
    finally:
        triton_gate_up.gate_up_silu = launch
    assert calls, "the fused TMA path did not run"
    for replay in range(2):
        x.copy_(torch.randn(m, hidden, generator=gen, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        gate, up = torch.nn.functional.linear(x.float(), w.float()).split(inter, dim=-1)
        exact = torch.nn.functional.silu(gate) * up
        unfused = ops.silu_and_mul(torch.nn.functional.linear(x, w))
        fused_err = (out.float() - exact).abs()
        unfused_err = (unfused.float() - exact).abs()
        assert not out.isnan().any(), replay
        assert fused_err.max() <= 1.5 * unfused_err.max(), (replay, fused_err.max(), unfused_err.max())
        assert fused_err.mean() <= 1.1 * unfused_err.mean(), (replay, fused_err.mean(), unfused_err.mean())


@pytest.mark.parametrize("config_name", ["DECODE_CONFIG", "PREFILL_CONFIG"])
@pytest.mark.parametrize("m,d,k", [(40, 80, 112), (1100, 200, 72)])
def test_tma_gate_up_partial_tiles(config_name: str, m: int, d: int, k: int) -> None:
    """The engine's TMA tilings on shapes with partial tiles on every axis (the gate tile of the last column
    block then reaches into the up rows; K is shorter than, or not a multiple of, BLOCK_K), output poisoned:
    within bf16 rounding of a float32 matmul followed by SiLU-and-mul."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    from kvserve.kernels import triton_gate_up

    config = getattr(triton_gate_up, config_name)
    gen = torch.Generator(device="cuda").manual_seed(m + d)
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(2 * d, k, generator=gen, device="cuda") * k**-0.5).bfloat16()
    assert triton_gate_up.fits(x, w, None, config)
    out = torch.full((m, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    triton_gate_up.gate_up_silu(x, w, config, out=out)
    torch.cuda.synchronize()
    want = reference.silu_and_mul(torch.nn.functional.linear(x.float(), w.float()).bfloat16())
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [48, 200, 1024])
def test_every_cublaslt_candidate_computes_linear(dtype: torch.dtype, m: int) -> None:
    """Each algorithm cuBLASLt's heuristic offers (pooled over the workspace limits) computes
    torch.nn.functional.linear at the Qwen2.5-7B shapes, bias included, with its output poisoned first."""
    from kvserve.kernels import cublaslt

    gen = torch.Generator(device="cuda").manual_seed(m)
    for name, (n, k, has_bias) in QWEN_7B.items():
        x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
        w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(dtype)
        b = torch.randn(n, generator=gen, device="cuda").to(dtype) if has_bias else None
        expected = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        plan = cublaslt.LtMatmul(m, n, k, dtype, has_bias, torch.cuda.current_device())
        assert plan.check_inputs(x, w, b)
        assert not plan.check_inputs(x[:, :-1], w, b) and not plan.check_inputs(x.float(), w, b)
        assert len(plan.candidates) >= 2, name
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        for i in range(len(plan.candidates)):
            out.fill_(float("nan"))
            plan.run(x, w, b, out, candidate=i)
            err = (out.float() - expected).abs().max().item()
            assert err <= 2e-2 * expected.abs().max().item(), (name, i, plan.config(i), err)


def _tuned_linear_eager_and_graphed(x: torch.Tensor, weight: torch.Tensor,
                                    bias: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
    """ops.linear(x, weight, bias) eagerly, and captured in a CUDA graph replayed twice over a poisoned output
    (asserted bitwise equal to the eager result): (the eager result, the cuBLASLt candidate each ops.linear
    call ran, [] for torch's linear)."""
    from kvserve.kernels import cublaslt

    runs: list[int] = []
    run = cublaslt.LtMatmul.run

    def counted(self: cublaslt.LtMatmul, *args: object, **kwargs: object) -> torch.Tensor:
        runs.append(self.chosen)
        return run(self, *args, **kwargs)  # type: ignore[arg-type]

    cublaslt.LtMatmul.run = counted  # type: ignore[method-assign]
    try:
        eager = ops.linear(x, weight, bias)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.linear(x, weight, bias)
    finally:
        cublaslt.LtMatmul.run = run  # type: ignore[method-assign]
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    return eager, runs


def test_tuned_linear_runs_in_a_cuda_graph_and_keeps_its_choice(tmp_path: object) -> None:
    """tune() registers a cuBLASLt plan (torch left out, so one is registered) that ops.linear then runs,
    eagerly and captured in a graph replayed over a poisoned output; the choice is stored in the results
    dict and, after the registry is cleared, taken from it without timing."""
    from kvserve.kernels import cublaslt

    cublaslt.clear_tuning()
    gen = torch.Generator(device="cuda").manual_seed(3)
    n, k, m = 4608, 3584, 64
    weights = [(torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).bfloat16() for _ in range(3)]
    biases = [torch.randn(n, generator=gen, device="cuda").bfloat16() for _ in range(3)]
    cache: dict[str, dict] = {}
    try:
        result = cublaslt.tune(m, weights, biases, cache=cache, torch_candidate=False)
        assert result.choice != cublaslt.TORCH_CHOICE and not result.cached and result.chosen_us > 0
        assert cublaslt.num_tuned() == 1 and len(cache) == 1
        x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
        plan = cublaslt.tuned_plan(x, weights[1], biases[1])
        assert plan is not None and plan.chosen == result.choice
        assert cublaslt.tuned_plan(x, weights[1], None) is None  # no plan for the shape without bias
        assert cublaslt.tuned_plan(x[:32], weights[1], biases[1]) is None  # nor for other row counts
        expected = torch.nn.functional.linear(x.float(), weights[1].float(), biases[1].float())
        eager, runs = _tuned_linear_eager_and_graphed(x, weights[1], biases[1])
        assert runs == [result.choice, result.choice]
        assert (eager.float() - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()
        stored = dict(cache)
        cublaslt.clear_tuning()
        again = cublaslt.tune(m, weights, biases, cache=cache, torch_candidate=False)
        assert again.cached and again.choice == result.choice and cache == stored
    finally:
        cublaslt.clear_tuning()


def test_a_shipped_decode_size_choice_applies_on_its_stack() -> None:
    """On the stack the shipped choices were measured on (GPU, cuBLASLt and torch builds), the shipped choice
    for the Qwen2.5-7B down projection at 192 rows (a cuBLASLt candidate) is found untimed, registered, and
    computes linear inside a CUDA graph as eagerly; on another stack nothing is shipped for it (skip)."""
    from kvserve.kernels import cublaslt

    n, k, m = 3584, 18944, 192
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")  # the engine's setting (part of the key)
    try:
        shipped = cublaslt.shipped_choices()
        key = cublaslt.cache_key(torch.device("cuda"), m, n, k, torch.bfloat16, False, sustained=True)
        if key not in shipped:
            pytest.skip(f"the shipped matmul choices are for another GPU or library stack (not {key})")
        assert shipped[key]["choice"] != cublaslt.TORCH_CHOICE
        cublaslt.clear_tuning()
        gen = torch.Generator(device="cuda").manual_seed(11)
        weights = [(torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).bfloat16() for _ in range(2)]
        result = cublaslt.tune(m, weights, [None, None], cache={}, sustained=True, defaults=shipped,
                               time_missing=False)
        assert result.cached and not result.untimed and result.choice != cublaslt.TORCH_CHOICE
        x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
        plan = cublaslt.tuned_plan(x, weights[0], None)
        assert plan is not None and plan.chosen == result.choice
        eager, runs = _tuned_linear_eager_and_graphed(x, weights[0], None)
        assert runs == [result.choice, result.choice]
        expected = torch.nn.functional.linear(x.float(), weights[0].float())
        assert (eager.float() - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()
    finally:
        cublaslt.clear_tuning()
        torch.backends.cuda.preferred_blas_library(before)


def test_sustained_tuning_chooses_a_correct_plan_and_stores_it_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """tune(..., sustained=True) at a prefill-sized row count on the GPU (the warm-up and rounds shortened):
    every correct candidate is timed, the registered plan computes linear, and the choice is stored under the
    sustained key and found again from it without timing."""
    from kvserve.kernels import cublaslt

    monkeypatch.setattr(cublaslt, "SUSTAINED_WARM_US", 20_000.0)
    monkeypatch.setattr(cublaslt, "SUSTAINED_MIN_US", 2_000.0)
    cublaslt.clear_tuning()
    gen = torch.Generator(device="cuda").manual_seed(5)
    n, k, m = 1024, 512, 4096
    weights = [(torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).bfloat16() for _ in range(2)]
    biases: list[torch.Tensor | None] = [None, None]
    cache: dict[str, dict] = {}
    try:
        result = cublaslt.tune(m, weights, biases, cache=cache, torch_candidate=False, sustained=True)
        assert result.choice != cublaslt.TORCH_CHOICE and result.chosen_us > 0 and result.torch_us > 0
        (key,) = cache
        assert key.endswith("|sustained") and cache[key]["choice"] == result.choice
        x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
        plan = cublaslt.tuned_plan(x, weights[1], None)
        assert plan is not None and plan.chosen == result.choice  # what ops.linear runs
        out = ops.linear(x, weights[1], None)
        expected = torch.nn.functional.linear(x.float(), weights[1].float())
        assert (out.float() - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()
        cublaslt.clear_tuning()
        again = cublaslt.tune(m, weights, biases, cache=cache, torch_candidate=False, sustained=True)
        assert again.cached and again.choice == result.choice
    finally:
        cublaslt.clear_tuning()
