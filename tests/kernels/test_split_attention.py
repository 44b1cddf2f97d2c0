"""A mixed step's attention as one launch per run of alike requests (`ops.split_attention`) against the
reference over the whole batch: decode rows through the decode launch, fresh prompts through the fresh path
(here a torch causal attention over the step's own key/value, standing in for flash attention, which needs
a GPU), other chunks through the mixed kernel; the Triton kernels run under the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_attention import TOLERANCES, make_batch  # noqa: E402

from kvserve.kernels import ops, reference  # noqa: E402
from kvserve.kernels.triton_attention import launch_paged_attention  # noqa: E402
from kvserve.layers.attention_metadata import AttentionMetadata  # noqa: E402

FRESH = ops.PREFILL_FAST_MIN_QUERY_LEN


def step_key_value(kv_cache: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's key/value rows, as the model hands them to attention: what the cache holds at the step's
    slots (make_batch's cache already holds them)."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    slots = metadata.slot_mapping.long()
    return (kv_cache[0].reshape(-1, num_kv_heads, head_dim)[slots],
            kv_cache[1].reshape(-1, num_kv_heads, head_dim)[slots])


def causal_fresh(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: AttentionMetadata,
                 scale: float) -> torch.Tensor:
    """Causal attention of whole prompts over their own key/value (what flash attention computes), checking
    that the run's metadata describes exactly the rows it is given."""
    qsl = metadata.query_start_loc_cpu
    assert qsl[0] == 0 and qsl[-1] == query.shape[0] == key.shape[0] == value.shape[0]
    assert metadata.query_start_loc.tolist() == qsl and metadata.seq_lens_cpu == [b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)]
    group = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    for a, b in zip(qsl[:-1], qsl[1:], strict=True):
        q, k, v = (t[a:b].transpose(0, 1).float() for t in (query, key, value))
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        out[a:b] = attn.transpose(0, 1).to(query.dtype)
    return out


def test_run_kinds_follow_the_requests():
    # decode rows, a chunk over a cached prefix, fresh prompts (one long enough for flash), decode again
    qsl = [0, 1, 2, 40, 40 + FRESH, 43 + FRESH, 44 + FRESH]
    seq_lens = [9, 30, 100, FRESH, 3, 50]
    assert ops.attention_run_kinds(qsl, seq_lens, fresh_ok=True) == [
        ("decode", 0, 2), ("paged", 2, 3), ("fresh", 3, 5), ("decode", 5, 6)]
    # without the fresh path, the fresh prompts join the chunk's run
    assert ops.attention_run_kinds(qsl, seq_lens, fresh_ok=False) == [
        ("decode", 0, 2), ("paged", 2, 5), ("decode", 5, 6)]
    # fresh prompts all shorter than the flash threshold are served by the mixed kernel, with their neighbours
    short = [0, 1, 5, 9]
    assert ops.attention_run_kinds(short, [7, 4, 4], fresh_ok=True) == [("decode", 0, 1), ("paged", 1, 3)]
    # a one-token prompt is a decode row (one query token over a context of one)
    assert ops.attention_run_kinds([0, 1, 2], [1, 5], fresh_ok=True) == [("decode", 0, 2)]


def test_runs_only_for_large_mixed_steps(device):
    def runs(query_lens: list[int], seq_lens: list[int]) -> list[str] | None:
        _, _, metadata = make_batch(query_lens, seq_lens, 2, 1, 16, 16, torch.float32, device)
        found = ops.attention_runs(metadata, fresh_ok=True)
        return None if found is None else [r.kind for r in found]

    big = ops.SPLIT_ATTENTION_MIN_TOKENS
    assert runs([1, 1, big], [30, 40, big]) == ["decode", "fresh"]
    assert runs([1, 1, big - 3], [30, 40, big - 3]) is None  # under the token threshold: one launch
    assert runs([big], [big + 20]) is None  # one kind: one launch
    alternating = [1, big, 1, FRESH, 1, 1]
    assert runs(alternating, [5, big + 4, 6, FRESH, 7, 8]) is None  # five runs: one launch
    assert len(runs(alternating[:4], [5, big + 4, 6, FRESH])) == ops.SPLIT_ATTENTION_MAX_RUNS


def test_run_metadata_describes_each_run_alone(device):
    query_lens, seq_lens = [1, 1, 300, FRESH, 250], [30, 41, 330, FRESH, 250]
    _, _, metadata = make_batch(query_lens, seq_lens, 2, 1, 16, 16, torch.float32, device)
    runs = ops.attention_runs(metadata, fresh_ok=True)
    assert runs is not None and [(r.kind, r.req_start, r.req_end) for r in runs] == [
        ("decode", 0, 2), ("paged", 2, 3), ("fresh", 3, 5)]
    assert ops.attention_runs(metadata, fresh_ok=True) is runs  # built once a step
    for run in runs:
        m = run.metadata
        assert m.query_start_loc.tolist() == m.query_start_loc_cpu
        assert m.query_start_loc_cpu == [q - run.token_start for q in metadata.query_start_loc_cpu[run.req_start:run.req_end + 1]]
        assert m.seq_lens.tolist() == m.seq_lens_cpu == seq_lens[run.req_start:run.req_end]
        assert torch.equal(m.block_tables, metadata.block_tables[run.req_start:run.req_end])
        assert torch.equal(m.slot_mapping, metadata.slot_mapping[run.token_start:run.token_end])
        assert m.max_query_len == max(query_lens[run.req_start:run.req_end])
        assert m.max_seq_len == max(seq_lens[run.req_start:run.req_end])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [
        # decode rows, a chunk over a cached prefix, fresh prompts: the scheduler's order in a busy step
        ([1, 1, 1, 200, FRESH + 5, 230], [40, 75, 3, 260, FRESH + 5, 230]),
        # fresh prompts first, then decode rows (runs in any order), one row the first token of its context
        ([300, FRESH, 1, 1, 1], [300, FRESH, 1, 90, 17]),
        # a chunk of a fresh prompt between chunks over cached prefixes
        ([120, 310, 90, 1], [150, 310, 400, 64]),
    ],
    ids=["decode_chunk_fresh", "fresh_then_decode", "fresh_between_chunks"],
)
def test_split_matches_the_reference(dtype, query_lens, seq_lens, device, poison_allocations, monkeypatch):
    monkeypatch.setattr(ops, "SPLIT_ATTENTION_MIN_TOKENS", 64)  # small batches keep the interpreter quick
    poison_allocations(ops)  # the assembled output starts as NaN: every row must come from some run
    query, kv_cache, metadata = make_batch(query_lens, seq_lens, 6, 2, 32, 16, dtype, device, seed=3)
    key, value = step_key_value(kv_cache, metadata)
    runs = ops.attention_runs(metadata, fresh_ok=True)
    assert runs is not None and len(runs) >= 2
    scale = 32**-0.5
    seen: list[str] = []

    def fresh(*args: object) -> torch.Tensor:
        seen.append("fresh")
        return causal_fresh(*args)  # type: ignore[arg-type]

    def paged(q: torch.Tensor, cache: torch.Tensor, m: AttentionMetadata, s: float, out: torch.Tensor) -> torch.Tensor:
        seen.append("decode" if m.is_decode_only else "paged")
        return launch_paged_attention(q, cache, m, s, out)

    out = ops.split_attention(query, key, value, kv_cache, metadata, scale, paged=paged, fresh=fresh)
    assert out is not None
    assert seen == [r.kind for r in runs]
    expected = reference.paged_attention(query, kv_cache, metadata, scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_split_leaves_small_steps_and_cpu_to_one_launch(device):
    query, kv_cache, metadata = make_batch([1, 1, 40], [20, 30, 40], 2, 1, 16, 16, torch.float32, device)
    key, value = step_key_value(kv_cache, metadata)
    assert ops.split_attention(query, key, value, kv_cache, metadata, 0.25, paged=launch_paged_attention,
                               fresh=causal_fresh) is None
    if not query.is_cuda:  # without a launcher given, CPU tensors never split
        big = ops.SPLIT_ATTENTION_MIN_TOKENS
        query, kv_cache, metadata = make_batch([1, big], [20, big], 2, 1, 16, 16, torch.float32, device)
        key, value = step_key_value(kv_cache, metadata)
        assert ops.split_attention(query, key, value, kv_cache, metadata, 0.25) is None
