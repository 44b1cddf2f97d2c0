"""CUDA-graph batch-size choice and padding (decode and one-prompt prefill graphs): pure functions, no GPU
needed."""

from __future__ import annotations

import functools

import pytest

from kvserve.config import DEFAULT_CUDA_GRAPH_SIZES, ConfigError, resolve_cuda_graph_sizes
from kvserve.core.outputs import ScheduledRequest
from kvserve.worker.cuda_graph import (
    CACHE_PREFILL_GRAPH_MAX_TOKENS,
    CUDAGraphRunner,
    choose_padding,
    padded_batch_size,
    padding_rows,
    prefill_graph_key,
    prefill_graph_sizes,
)


@pytest.mark.parametrize(
    ("num_reqs", "expected"),
    [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (17, 24), (33, 48), (64, 64), (65, 80), (100, 112),
     (177, 192), (256, 256)],
)
def test_padded_batch_size_is_smallest_captured_size_not_below(num_reqs: int, expected: int) -> None:
    sizes = resolve_cuda_graph_sizes(None, 256)
    assert padded_batch_size(num_reqs, sizes) == expected


def test_padded_batch_size_none_past_largest_or_for_empty_batch() -> None:
    assert padded_batch_size(9, [1, 2, 4, 8]) is None
    assert padded_batch_size(0, [1, 2, 4, 8]) is None
    assert padded_batch_size(3, []) is None


def test_every_batch_up_to_max_num_seqs_has_a_graph() -> None:
    for max_num_seqs in (1, 3, 50, 100, 256, 300):
        sizes = resolve_cuda_graph_sizes(None, max_num_seqs)
        assert sizes[-1] == max_num_seqs
        assert list(sizes) == sorted(set(sizes))
        for n in range(1, max_num_seqs + 1):
            padded = padded_batch_size(n, sizes)
            assert padded is not None and n <= padded <= max_num_seqs


def test_explicit_sizes_are_sorted_deduplicated_and_capped() -> None:
    assert resolve_cuda_graph_sizes([8, 1, 4, 4, 512], 64) == (1, 4, 8)
    assert resolve_cuda_graph_sizes([], 64) == ()
    with pytest.raises(ConfigError):
        resolve_cuda_graph_sizes([0, 4], 64)
    assert all(b > a for a, b in zip(DEFAULT_CUDA_GRAPH_SIZES, DEFAULT_CUDA_GRAPH_SIZES[1:], strict=False))


# Matmul-bound graph times shaped like the H200's (ms): 192 and 224 rows are slow sizes for cuBLAS.
H200_LIKE_MS = {144: 4.41, 160: 5.06, 176: 4.97, 192: 6.46, 208: 5.40, 224: 6.28, 240: 6.32, 256: 6.42}


def test_choose_padding_moves_a_size_only_to_a_clearly_faster_larger_one() -> None:
    choice = choose_padding(H200_LIKE_MS, min_gain=0.05)
    assert choice[192] == 208  # 16 % faster
    assert choice[160] == 160  # 176 is faster, by 2 %: not enough
    assert choice[224] == 224  # nothing larger is faster
    assert all(choice[s] == s for s in (144, 176, 208, 240, 256))
    # A larger gain threshold keeps 192 as well; 0 keeps every size.
    assert choose_padding(H200_LIKE_MS, min_gain=0.2)[192] == 192
    assert choose_padding(H200_LIKE_MS, min_gain=0.0) == {s: s for s in H200_LIKE_MS}
    assert choose_padding(H200_LIKE_MS, min_gain=-1.0) == {s: s for s in H200_LIKE_MS}


def test_choose_padding_takes_the_fastest_larger_size_and_never_a_smaller_one() -> None:
    times = {8: 3.0, 16: 2.0, 24: 1.5, 32: 1.5, 48: 4.0}
    choice = choose_padding(times, min_gain=0.05)
    assert choice == {8: 24, 16: 24, 24: 24, 32: 32, 48: 48}  # ties go to the smaller size
    for size, target in choice.items():
        assert target >= size and times[target] <= times[size]


def test_choose_padding_keeps_a_batch_within_its_attention_launch() -> None:
    # Sizes up to 32 split the KV (4 KV heads on 132 SMs), larger ones do not: the padding-only timing
    # cannot see what a small batch's real rows would lose in an unsplit attention over long contexts.
    times = {8: 4.2, 16: 4.3, 32: 4.3, 48: 4.0, 64: 4.0}
    splits = {8: 9, 16: 5, 32: 3, 48: 1, 64: 1}
    assert choose_padding(times, 0.05) == {8: 48, 16: 48, 32: 48, 48: 48, 64: 64}
    assert choose_padding(times, 0.05, splits) == {s: s for s in times}
    # Within a group the fastest member is taken, even when a size of another group is faster still.
    same = {8: 16, 16: 16, 32: 16, 48: 1, 64: 1}
    times = {8: 4.3, 16: 4.3, 32: 4.0, 48: 3.5, 64: 4.0}
    assert choose_padding(times, 0.05) == {8: 48, 16: 48, 32: 48, 48: 48, 64: 64}
    assert choose_padding(times, 0.05, same) == {8: 32, 16: 32, 32: 32, 48: 48, 64: 64}


def test_runner_pads_each_batch_by_the_measured_choice() -> None:
    sizes = sorted(H200_LIKE_MS)
    runner = CUDAGraphRunner(None, [], {}, None, sizes, 4096, pad_min_gain=0.05)  # type: ignore[arg-type]
    runner._graphs = {(s, False): None for s in sizes}  # type: ignore[misc]  # as if captured
    assert runner.padded_size(180) == 192  # before any times: the smallest size that holds the batch
    runner.set_size_times(H200_LIKE_MS)
    assert [runner.padded_size(n) for n in (144, 150, 176, 177, 192, 193, 256)] == [144, 160, 176, 208, 208, 208, 256]
    assert runner.padded_size(257) is None
    with pytest.raises(ValueError, match="captured sizes"):
        runner.set_size_times({144: 1.0})


def test_runner_keeps_batches_within_their_attention_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.kernels import ops

    # As on the H200 for 4 KV heads: sizes up to 32 split the KV, larger ones do not, and past 66 requests the
    # one-split launch takes its busy tiling.
    def launch(size: int, cache: object, max_len: int) -> tuple[int, bool]:
        return (3 if size <= 32 else 1), size > 66

    monkeypatch.setattr(ops, "decode_attention_launch", launch)
    sizes = [8, 16, 32, 48, 64, 80]
    runner = CUDAGraphRunner(None, [object()], {}, None, sizes, 4096, pad_min_gain=0.05)  # type: ignore[arg-type,list-item]
    assert runner.attention_launch == {8: (3, False), 16: (3, False), 32: (3, False), 48: (1, False),
                                       64: (1, False), 80: (1, True)}
    runner._graphs = {(s, False): None for s in sizes}  # type: ignore[misc]  # as if captured
    runner.set_size_times({8: 4.2, 16: 4.3, 32: 4.3, 48: 3.0, 64: 4.0, 80: 2.0})
    # 80 is the fastest graph, but its attention launch differs from every smaller size's.
    assert [runner.padded_size(n) for n in (5, 12, 30, 40, 60, 70)] == [8, 16, 32, 48, 64, 80]


def test_fp8_weights_keep_a_batch_on_its_side_of_the_weight_only_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """With fp8 weights a batch of up to FP8_SKINNY_MAX_ROWS rows runs weight-only fp8 matmuls and a larger
    one quantizes its activations too: padding never crosses that line, however the graphs timed (a faster
    larger graph would otherwise change a small batch's numerics by a start-up timing)."""
    import torch

    from kvserve.kernels import ops, triton_gemm

    monkeypatch.setattr(ops, "FP8_SKINNY_MAX_ROWS", 32)
    monkeypatch.setattr(triton_gemm, "FP8_FP16_DOT", True)
    monkeypatch.setattr(ops, "decode_attention_launch", lambda size, cache, max_len: (1, False))
    sizes = [8, 16, 24, 32, 48, 64]
    times = {8: 4.0, 16: 4.0, 24: 4.1, 32: 4.2, 48: 3.0, 64: 3.5}
    layer = torch.nn.Module()
    plain = CUDAGraphRunner(torch.nn.Sequential(layer), [object()], {}, None, sizes, 4096,  # type: ignore[arg-type,list-item]
                            pad_min_gain=0.05)
    assert plain.fp8_numerics is None
    layer.weight_fp8 = torch.nn.Parameter(torch.zeros(1), requires_grad=False)  # as Linear.quantize_fp8 leaves it
    fp8 = CUDAGraphRunner(torch.nn.Sequential(layer), [object()], {}, None, sizes, 4096,  # type: ignore[arg-type,list-item]
                          pad_min_gain=0.05)
    assert fp8.fp8_numerics == {8: (True, True), 16: (True, True), 24: (True, False), 32: (True, False),
                                48: (False, False), 64: (False, False)}
    for runner in (plain, fp8):
        runner._graphs = {(s, False): None for s in sizes}  # type: ignore[misc]  # as if captured
        runner.set_size_times(times)
    batches = (5, 12, 20, 30, 40, 60)
    assert [plain.padded_size(n) for n in batches] == [48, 48, 48, 48, 48, 64]
    assert [fp8.padded_size(n) for n in batches] == [8, 16, 24, 32, 48, 64]


@pytest.mark.parametrize("fp16_dot", [True, False])
def test_fp8_weights_keep_a_batch_on_its_side_of_the_fp16_dot_rows(fp16_dot: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to 16 rows an fp8 layer's skinny matmul runs its dot in fp16 on scaled bf16 activations, past them
    in bf16 (the sums rounded otherwise): a batch of 9-16 never replays the 24-row graph however fast it timed,
    unless the fp16 dot is off (KVSERVE_FP8_FP16_DOT=0)."""
    import torch

    from kvserve.kernels import ops, triton_gemm

    monkeypatch.setattr(ops, "FP8_SKINNY_MAX_ROWS", 32)
    monkeypatch.setattr(triton_gemm, "FP8_FP16_DOT", fp16_dot)
    monkeypatch.setattr(ops, "decode_attention_launch", lambda size, cache, max_len: (1, False))
    sizes = [8, 16, 24, 32]
    layer = torch.nn.Module()
    layer.weight_fp8 = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    runner = CUDAGraphRunner(torch.nn.Sequential(layer), [object()], {}, None, sizes, 4096,  # type: ignore[arg-type,list-item]
                             pad_min_gain=0.05)
    runner._graphs = {(s, False): None for s in sizes}  # type: ignore[misc]  # as if captured
    runner.set_size_times({8: 4.0, 16: 4.0, 24: 3.0, 32: 4.2})
    assert [runner.padded_size(n) for n in (5, 12, 20, 30)] == ([8, 16, 24, 32] if fp16_dot else [24, 24, 24, 32])


def test_cascade_batches_take_the_smallest_size() -> None:
    sizes = sorted(H200_LIKE_MS)
    runner = CUDAGraphRunner(None, [], {}, None, sizes, 4096, pad_min_gain=0.05)  # type: ignore[arg-type]
    runner._graphs = {(s, False): None for s in sizes}  # type: ignore[misc]  # as if captured
    runner.set_size_times(H200_LIKE_MS)
    assert runner.padded_size(180) == 208
    assert runner.padded_size(180, cascade=True) == 192
    assert runner.padded_size(257, cascade=True) is None


def test_padding_rows_write_nothing_and_attend_to_nothing() -> None:
    rows = padding_rows(5, 8)
    assert rows["slot_mapping"] == [-1, -1, -1]
    assert rows["seq_lens"] == [0, 0, 0]
    assert rows["positions"] == [0, 0, 0]
    assert rows["input_ids"] == [0, 0, 0]
    # one query token per padding row, continuing after the 5 real rows' offsets 0..5
    assert rows["query_start_loc"] == [6, 7, 8]
    assert all(v == [] for v in padding_rows(8, 8).values())


def test_decode_splits_fill_the_gpu_within_limits() -> None:
    from kvserve.kernels.ops import DECODE_PROGRAMS_PER_SM, decode_num_splits

    sms, kv_heads = 132, 4
    for batch in (1, 2, 8, 32, 64, 128, 256, 512):
        for max_seq_len in (1, 64, 1000, 32768):
            splits = decode_num_splits(batch, kv_heads, max_seq_len, sms)
            assert 1 <= splits <= 64
            assert splits <= max(1, max_seq_len // 64)  # never a split without a full tile of keys
            if batch * kv_heads >= sms:  # the unsplit programs already cover the SMs
                assert splits == 1
            elif splits < min(64, max(1, max_seq_len // 64)):  # not capped: the target is met
                assert batch * kv_heads * splits >= DECODE_PROGRAMS_PER_SM * sms
    assert decode_num_splits(256, kv_heads, 32768, sms) == 1
    assert decode_num_splits(64, kv_heads, 1024, sms) == 1
    assert decode_num_splits(8, kv_heads, 32768, sms) == 9
    assert decode_num_splits(1, kv_heads, 32768, sms) == 64


def test_prefill_graph_sizes_are_bucket_multiples_up_to_the_limit() -> None:
    assert prefill_graph_sizes(2048) == list(range(128, 2049, 128))
    assert prefill_graph_sizes(1000) == [128, 256, 384, 512, 640, 768, 896]
    assert prefill_graph_sizes(127) == [] and prefill_graph_sizes(0) == []
    assert prefill_graph_sizes(100, bucket=32) == [32, 64, 96]


def _one(num_tokens: int, computed: int) -> ScheduledRequest:
    return ScheduledRequest("r", list(range(num_tokens)), computed, [], computed == 0, True)


def test_prefill_graph_key_only_for_one_request_that_fits() -> None:
    sizes = prefill_graph_sizes(1024)
    cache_sizes = [n for n in sizes if n <= CACHE_PREFILL_GRAPH_MAX_TOKENS]
    assert cache_sizes == [128, 256]
    key = functools.partial(prefill_graph_key, prefill_sizes=sizes, cache_sizes=cache_sizes)
    assert key([_one(2, 0)]) == (128, False)
    assert key([_one(128, 0)]) == (128, False)
    assert key([_one(129, 0)]) == (256, False)
    assert key([_one(1024, 0)]) == (1024, False)
    assert key([_one(1025, 0)]) is None  # past the largest graph: eager
    assert key([_one(1, 0)]) is None  # one token: a decode-shaped batch
    assert key([_one(100, 0), _one(20, 0)]) is None  # two requests
    assert prefill_graph_key([_one(100, 0)], [], []) is None
    # after cached context (a prefix hit, a later chunk): a cache graph, up to the largest of those
    assert key([_one(100, 28)]) == (128, True)
    assert key([_one(256, 4000)]) == (256, True)
    assert key([_one(257, 28)]) is None
    assert key([_one(1, 28)]) is None
    # no fresh-prompt graphs (no one-prompt fast path, e.g. float32): fresh prompts take cache graphs too
    assert prefill_graph_key([_one(100, 0)], [], cache_sizes) == (128, True)
    assert prefill_graph_key([_one(300, 0)], [], cache_sizes) is None
