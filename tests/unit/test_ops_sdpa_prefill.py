"""The one-prompt prefill attention call (`ops._sdpa_prefill`): layout, GQA without repeated KV heads and
the cuDNN route with its padding to a bucket length (on CPU, SDPA refuses cuDNN and the prompt runs the flash
route's CPU kernels), against the torch reference; SDPA's process-wide settings left as they were; the bucket lengths built at start. tests/gpu/test_gpu_ops.py runs
the same path on the GPU."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import ops, reference
from kvserve.layers.attention_metadata import AttentionMetadata


def _case(tokens: int, num_heads: int, num_kv_heads: int):
    head_dim, block_size = 16, 16
    gen = torch.Generator().manual_seed(tokens)
    query = torch.randn(tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    num_blocks = -(-tokens // block_size)
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
        seq_lens=torch.tensor([tokens], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(tokens, dtype=torch.int64),
        max_query_len=tokens, max_seq_len=tokens, query_start_loc_cpu=[0, tokens], seq_lens_cpu=[tokens],
    )
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    reference.reshape_and_cache(key, value, kv_cache, md.slot_mapping)
    return query, key, value, reference.paged_attention(query, kv_cache, md, 0.3)


@pytest.mark.parametrize("tokens", [7, 300])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("cudnn_min_tokens, bucket", [(0, 256), (200, 256), (200, 1), (5, 16)])
def test_sdpa_prefill_matches_reference(
    tokens: int, heads: tuple[int, int], cudnn_min_tokens: int, bucket: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(200, 256): 300 tokens padded to 512; (5, 16): 7 tokens to 16, 300 to 304; (200, 1): no padding."""
    monkeypatch.setattr(ops, "SDPA_CUDNN_MIN_TOKENS", cudnn_min_tokens)
    monkeypatch.setattr(ops, "SDPA_CUDNN_BUCKET", bucket)
    query, key, value, expected = _case(tokens, *heads)
    out = ops._sdpa_prefill(query, key, value, 0.3)
    assert out.shape == query.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def _sdpa_settings() -> tuple[list[int], list[object]]:
    from torch.nn.attention import _cur_sdpa_kernel_backends

    return list(torch._C._get_sdp_priority_order()), list(_cur_sdpa_kernel_backends())


@pytest.mark.parametrize("cudnn_min_tokens", [0, 5])
def test_sdpa_prefill_leaves_the_process_sdpa_settings_alone(
    cudnn_min_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither route changes SDPA's priority order or enabled backends for the rest of the process (a
    priority set by kvserve once made HF's attention in the same process run flash instead of cuDNN on the
    H200). A refused cuDNN call falls back to flash with the right result and is remembered."""
    monkeypatch.setattr(ops, "SDPA_CUDNN_MIN_TOKENS", cudnn_min_tokens)
    monkeypatch.setattr(ops, "SDPA_CUDNN_BUCKET", 16)
    monkeypatch.setattr(ops, "_cudnn_refused", set())
    before = _sdpa_settings()
    query, key, value, expected = _case(20, 6, 2)
    out = ops._sdpa_prefill(query, key, value, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    assert _sdpa_settings() == before
    # CPU SDPA has no cuDNN kernel: the refusal is recorded once, for this dtype and head layout.
    assert ops._cudnn_refused == ({(torch.float32, 6, 2, 16, "cpu")} if cudnn_min_tokens else set())


def test_cudnn_prefill_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(ops, "SDPA_CUDNN_BUCKET", 256)
    monkeypatch.setattr(ops, "SDPA_CUDNN_MIN_TOKENS", 0)
    assert ops.cudnn_prefill_lengths(8192, cpu) == []  # cuDNN off
    monkeypatch.setattr(ops, "SDPA_CUDNN_MIN_TOKENS", 1000)
    # Every prompt of 1000..8192 tokens pads to one of these, and each is built once.
    assert ops.cudnn_prefill_lengths(8192, cpu) == list(range(1024, 8193, 256))
    assert ops.cudnn_prefill_lengths(1100, cpu) == [1024, 1280]
    assert ops.cudnn_prefill_lengths(999, cpu) == []
    # A long step budget does not build past SDPA_CUDNN_MAX_TOKENS; those prompts use flash.
    assert ops.cudnn_prefill_lengths(131072, cpu)[-1] == ops.SDPA_CUDNN_MAX_TOKENS
    assert not ops._use_cudnn(ops.SDPA_CUDNN_MAX_TOKENS + 1, cpu) and ops._use_cudnn(ops.SDPA_CUDNN_MAX_TOKENS, cpu)
    assert ops.warm_up_prefill_attention(4, 2, 16, torch.bfloat16, cpu, 8192) == []  # CUDA only


def test_cudnn_threshold_by_default_only_on_hopper_and_later(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "SDPA_CUDNN_MIN_TOKENS", -1)  # unset
    assert ops.cudnn_min_tokens(torch.device("cpu")) == 0
    for major, expected in ((9, 1024), (10, 1024), (8, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, m=major: (m, 0))
        assert ops.cudnn_min_tokens(torch.device("cuda")) == expected, major
    monkeypatch.setattr(ops, "SDPA_CUDNN_MIN_TOKENS", 0)  # set: never
    assert ops.cudnn_min_tokens(torch.device("cuda")) == 0


@pytest.mark.parametrize("tokens", [512, 300])
def test_cudnn_gets_the_layout_the_warm_up_built(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN caches a graph per shape and stride: whether the prompt is a bucket multiple (512) or padded
    (300 -> 512), and with value a strided view of a fused q/k/v output, SDPA receives contiguous tensors of
    the bucket length, as `warm_up_prefill_attention` builds them."""
    monkeypatch.setattr(ops, "SDPA_CUDNN_MIN_TOKENS", 256)
    monkeypatch.setattr(ops, "SDPA_CUDNN_BUCKET", 256)
    heads, kv_heads, head_dim = 6, 2, 16
    seen: list[tuple] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        seen.append(tuple((t.shape, t.stride()) for t in (q, k, v)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    query = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim).contiguous()
    key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim).contiguous()
    value = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)  # strided view
    out = ops._sdpa_prefill(query, key, value, 0.25)
    assert out.shape == (tokens, heads, head_dim)
    built_q = torch.zeros(512, heads, head_dim).transpose(0, 1).unsqueeze(0)
    built_kv = torch.zeros(512, kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
    expected = ((built_q.shape, built_q.stride()), (built_kv.shape, built_kv.stride()),
                (built_kv.shape, built_kv.stride()))
    assert seen == [expected]


@pytest.mark.parametrize("tokens", [300, 512])
def test_padded_inputs_reach_cudnn_without_copies(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v already padded to the bucket (what the padded rotary launch writes, zero rows past the prompt):
    SDPA gets those very tensors in the warm-up's layout, and the output is the unpadded prompt's."""
    monkeypatch.setattr(ops, "SDPA_CUDNN_MIN_TOKENS", 256)
    monkeypatch.setattr(ops, "SDPA_CUDNN_BUCKET", 256)
    query, key, value, expected = _case(tokens, 6, 2)
    padded = [ops._pad_tokens(t, 512) for t in (query, key, value)]
    seen: list[tuple[int, ...]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        seen.append(tuple(t.data_ptr() for t in (q, k, v)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    out = ops._sdpa_prefill(*padded, 0.3, tokens)
    assert out.shape == (tokens, 6, 16)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    assert seen == [tuple(t.data_ptr() for t in padded)]  # no copy in between


def test_prefill_attention_padding_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-prompt fresh prefill long enough for cuDNN pads to its bucket; several prompts, a prompt with
    cached context, a short prompt, a refused head layout or the switch off do not."""
    monkeypatch.setattr(ops, "SDPA_CUDNN_MIN_TOKENS", 256)
    monkeypatch.setattr(ops, "SDPA_CUDNN_BUCKET", 256)
    monkeypatch.setattr(ops, "prefill_fast_path_applies", lambda dtype, device: True)
    monkeypatch.setattr(ops, "_cudnn_refused", set())
    query, key = torch.zeros(300, 6, 16), torch.zeros(300, 2, 16)

    def md(qsl: list[int], seq_lens: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.zeros(len(seq_lens), 64, dtype=torch.int32),
            slot_mapping=torch.arange(qsl[-1], dtype=torch.int64),
            max_query_len=max(b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)),
            max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        )

    assert ops.prefill_attention_padding(md([0, 300], [300]), query, key) == 512
    assert ops.prefill_attention_padding(md([0, 512], [512]), query, key) == 512
    assert ops.prefill_attention_padding(md([0, 100, 300], [100, 200]), query, key) == 0  # two prompts
    assert ops.prefill_attention_padding(md([0, 300], [340]), query, key) == 0  # cached context
    assert ops.prefill_attention_padding(md([0, 200], [200]), query, key) == 0  # below cuDNN's threshold
    ops._cudnn_refused.add((query.dtype, 6, 2, 16, "cpu"))
    assert ops.prefill_attention_padding(md([0, 300], [300]), query, key) == 0
    ops._cudnn_refused.clear()
    ops.set_prefill_qkv_padding(False)
    try:
        assert ops.prefill_attention_padding(md([0, 300], [300]), query, key) == 0
    finally:
        ops.set_prefill_qkv_padding(True)


def test_prefill_attention_padding_is_decided_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer asks; the step's metadata keeps the first answer (the rule's checks run once)."""
    monkeypatch.setattr(ops, "SDPA_CUDNN_MIN_TOKENS", 256)
    monkeypatch.setattr(ops, "SDPA_CUDNN_BUCKET", 256)
    monkeypatch.setattr(ops, "prefill_fast_path_applies", lambda dtype, device: True)
    monkeypatch.setattr(ops, "_cudnn_refused", set())  # (earlier CPU runs of cuDNN's route were refused)
    checks: list[int] = []
    use_cudnn = ops._use_cudnn
    monkeypatch.setattr(ops, "_use_cudnn", lambda n, device: checks.append(n) or use_cudnn(n, device))
    query, key, value, _ = _case(300, 6, 2)
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, 300], dtype=torch.int32), seq_lens=torch.tensor([300], dtype=torch.int32),
        block_tables=torch.zeros(1, 32, dtype=torch.int32), slot_mapping=torch.arange(300, dtype=torch.int64),
        max_query_len=300, max_seq_len=300, query_start_loc_cpu=[0, 300], seq_lens_cpu=[300],
    )
    assert [ops.prefill_attention_padding(md, query, key) for _ in range(3)] == [512, 512, 512]
    assert checks == [300]
