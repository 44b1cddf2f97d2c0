"""Persistent input buffers and the diff-updated block table, on CPU against a from-scratch oracle."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
from kvserve.layers.attention_metadata import last_token_metadata
from kvserve.worker.input_batch import (
    CASCADE_MIN_PREFIX_TOKENS,
    CASCADE_MIN_REQS,
    BlockTable,
    InputBuffers,
    common_prefix_len,
)

BLOCK_SIZE = 4
WIDTH = 8  # max_model_len 32


def _sched(req_id: str, tokens: list[int], computed: int, new_blocks: list[int], reset: bool = False,
           sample: bool = True) -> ScheduledRequest:
    return ScheduledRequest(req_id, tokens, computed, new_blocks, reset, sample)


def test_block_table_applies_diffs_on_host_and_device() -> None:
    table = BlockTable(num_rows=2, width=WIDTH, device=torch.device("cpu"))
    table.apply(SchedulerOutput(scheduled=[_sched("a", [1] * 5, 0, [7, 3], reset=True),
                                           _sched("b", [1] * 2, 0, [9], reset=True)]))
    table.apply(SchedulerOutput(scheduled=[_sched("a", [1], 5, []), _sched("b", [1] * 3, 2, [4])]))
    assert table.blocks("a") == [7, 3] and table.blocks("b") == [9, 4]
    # a third live request grows the row pool; a preempted-and-resumed request starts over
    table.apply(SchedulerOutput(scheduled=[_sched("c", [1], 0, [5], reset=True),
                                           _sched("a", [1] * 6, 0, [11, 12], reset=True)]))
    assert table.blocks("c") == [5] and table.blocks("a") == [11, 12]
    for req_id in ("a", "b", "c"):
        row = table.row(req_id)
        n = len(table.blocks(req_id))
        assert table.device_table[row, :n].tolist() == table.blocks(req_id)
    # finishing frees the row for the next request, which starts empty
    row_b = table.row("b")
    table.apply(SchedulerOutput(finished_req_ids=["b"], scheduled=[_sched("d", [1], 0, [6], reset=True)]))
    assert table.row("d") == row_b and table.blocks("d") == [6]
    assert table.num_live == 3


def _oracle(scheduled: list[ScheduledRequest], tables: dict[str, list[int]]) -> dict[str, list[int]]:
    input_ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
    for s in scheduled:
        for i, token in enumerate(s.token_ids):
            pos = s.num_computed_tokens + i
            input_ids.append(token)
            positions.append(pos)
            slots.append(tables[s.req_id][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        qsl.append(qsl[-1] + len(s.token_ids))
        seq_lens.append(s.num_computed_tokens + len(s.token_ids))
    return {"input_ids": input_ids, "positions": positions, "slot_mapping": slots, "query_start_loc": qsl,
            "seq_lens": seq_lens}


def test_prepare_matches_a_from_scratch_build_over_random_steps() -> None:
    rng = random.Random(0)
    device = torch.device("cpu")
    table = BlockTable(num_rows=4, width=WIDTH, device=device)
    buffers = InputBuffers(max_num_tokens=64, max_num_reqs=8, block_table_width=WIDTH, block_size=BLOCK_SIZE,
                           device=device)
    tables: dict[str, list[int]] = {}
    lengths: dict[str, int] = {}
    next_block = iter(rng.sample(range(100), 100))
    checked_sampled = 0
    for step in range(30):
        scheduled = []
        for r in range(rng.randint(1, 6)):
            req_id = f"r{r}"
            computed = lengths.get(req_id, 0)
            if computed >= 28:
                continue
            n = 1 if rng.random() < 0.5 else rng.randint(1, min(9, 32 - computed))
            need = -(-(computed + n) // BLOCK_SIZE) - len(tables.get(req_id, []))
            new = [next(next_block) for _ in range(need)] if need > 0 else []
            reset = req_id not in tables
            tables[req_id] = tables.get(req_id, []) + new
            scheduled.append(_sched(req_id, [rng.randint(0, 999) for _ in range(n)], computed, new, reset,
                                    sample=rng.random() < 0.8))
            lengths[req_id] = computed + n
        if not scheduled:
            break
        out = SchedulerOutput(scheduled=scheduled)
        table.apply(out)
        batch = buffers.prepare(out, table)
        want = _oracle(scheduled, tables)
        assert batch.input_ids.tolist() == want["input_ids"], step
        assert batch.positions.tolist() == want["positions"]
        md = batch.attn_metadata
        assert md.slot_mapping.tolist() == want["slot_mapping"]
        assert md.query_start_loc.tolist() == want["query_start_loc"] == md.query_start_loc_cpu
        assert md.seq_lens.tolist() == want["seq_lens"] == md.seq_lens_cpu
        for i, s in enumerate(scheduled):
            assert md.block_tables[i, : len(tables[s.req_id])].tolist() == tables[s.req_id]
        sampled = [i for i, s in enumerate(scheduled) if s.sample]
        assert batch.sampled_req_ids == [scheduled[i].req_id for i in sampled]
        assert batch.logits_indices.tolist() == [want["query_start_loc"][i + 1] - 1 for i in sampled]
        # The sampling tokens as a decode batch, built from persistent buffers, where not every row samples.
        if not sampled or batch.all_rows_sample:
            assert md.sampled is None
        else:
            ref, got = last_token_metadata(md, sampled), md.sampled
            assert got is not None and got.query_start_loc_cpu == ref.query_start_loc_cpu
            assert got.seq_lens_cpu == ref.seq_lens_cpu == got.seq_lens.tolist()
            assert got.query_start_loc.tolist() == ref.query_start_loc_cpu
            assert (got.max_query_len, got.max_seq_len) == (1, ref.max_seq_len)
            for j, i in enumerate(sampled):
                assert got.block_tables[j, : len(tables[scheduled[i].req_id])].tolist() == tables[scheduled[i].req_id]
        checked_sampled += md.sampled is not None
    assert checked_sampled > 5


def _after_prefill_of_a_and_b() -> tuple[BlockTable, InputBuffers]:
    """A block table and buffers after one step prefilled a (5 tokens, blocks 3, 8) and b (3, block 5)."""
    device = torch.device("cpu")
    table = BlockTable(num_rows=4, width=WIDTH, device=device)
    buffers = InputBuffers(max_num_tokens=16, max_num_reqs=8, block_table_width=WIDTH, block_size=BLOCK_SIZE,
                           device=device)
    prefill = SchedulerOutput(scheduled=[_sched("a", [1] * 5, 0, [3, 8], reset=True),
                                         _sched("b", [2] * 3, 0, [5], reset=True)])
    table.apply(prefill)
    buffers.prepare(prefill, table)
    return table, buffers


def test_decode_batch_padded_to_graph_size() -> None:
    table, buffers = _after_prefill_of_a_and_b()
    decode = SchedulerOutput(scheduled=[_sched("a", [42], 5, []), _sched("b", [43], 3, [])])
    table.apply(decode)
    batch = buffers.prepare(decode, table, pad_to=4)
    md = batch.attn_metadata
    assert batch.padded_num_reqs == 4 and batch.num_reqs == 2 and batch.all_rows_sample
    assert batch.input_ids.tolist() == [42, 43, 0, 0]
    assert batch.positions.tolist() == [5, 3, 0, 0]
    assert md.slot_mapping.tolist() == [8 * 4 + 1, 5 * 4 + 3, -1, -1]
    assert md.seq_lens.tolist() == [6, 4, 0, 0]
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert md.block_tables.shape[0] == 4
    assert md.sampled is None  # every row samples: the graph's output rows are the batch's
    # a batch with a prefill chunk is never padded
    mixed = SchedulerOutput(scheduled=[_sched("a", [7], 6, []), _sched("b", [8, 9], 4, [])])
    table.apply(mixed)
    assert buffers.prepare(mixed, table, pad_to=4).padded_num_reqs is None


def test_placeholder_tokens_come_from_the_previous_steps_samples() -> None:
    table, buffers = _after_prefill_of_a_and_b()
    # The previous step sampled b then a (rows 0 and 1); a also gets a known prompt-like token first.
    prev = (torch.tensor([77, 66]), {"b": 0, "a": 1})
    mixed = SchedulerOutput(scheduled=[_sched("a", [-1], 5, []), _sched("c", [4, 5], 0, [9], reset=True),
                                       _sched("b", [-1], 3, [])])
    table.apply(mixed)
    batch = buffers.prepare(mixed, table, prev_sampled=prev)
    assert batch.input_ids.tolist() == [66, 4, 5, 77]
    assert batch.positions.tolist() == [5, 0, 1, 3]
    # A placeholder the previous step did not sample is an error, not a silent token id -1.
    decode = SchedulerOutput(scheduled=[_sched("c", [-1], 2, [])])
    table.apply(decode)
    with pytest.raises(RuntimeError, match="did not sample"):
        buffers.prepare(decode, table, prev_sampled=prev)


def test_every_copy_out_of_the_host_buffers_is_contiguous(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host buffers are pinned on a GPU so their copies queue behind the step without the host waiting; a
    strided slice of one is staged by torch through a pageable temporary, a copy CUDA may make wait for the
    stream (the placeholder fix-ups were copied that way until session 20). Every copy `prepare` and the block
    table make out of a host buffer must take a contiguous slice into a contiguous one, placeholders
    included."""
    table, buffers = _after_prefill_of_a_and_b()
    host_storages = {t.untyped_storage().data_ptr() for t in buffers._host.values()}
    host_storages |= {table._index_host.untyped_storage().data_ptr(), table._value_host.untyped_storage().data_ptr()}
    copies: list[tuple[bool, bool]] = []
    real_copy = torch.Tensor.copy_

    def recording_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if src.untyped_storage().data_ptr() in host_storages:
            copies.append((dst.is_contiguous(), src.is_contiguous()))
        return real_copy(dst, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
    prev = (torch.tensor([77, 66]), {"b": 0, "a": 1})
    step = SchedulerOutput(scheduled=[_sched("a", [-1], 5, [10]), _sched("b", [-1], 3, [])])
    table.apply(step)
    batch = buffers.prepare(step, table, prev_sampled=prev, pad_to=4)
    assert batch.input_ids.tolist() == [66, 77, 0, 0]
    assert len(copies) >= 8  # the block-table diff, the inputs and the placeholder fix-ups
    assert all(dst and src for dst, src in copies), copies


# ------------------------------------------------------------------------------- cascade attention


def test_common_prefix_len_counts_shared_blocks_below_every_query() -> None:
    table = np.array([[7, 3, 5, 9, 0], [7, 3, 5, 2, 0], [7, 3, 6, 1, 0], [4, 4, 4, 4, 4]], dtype=np.int32)
    # Rows 0-2 share blocks 7, 3 (8 tokens of block size 4); row 2 differs from the third block on.
    assert common_prefix_len(table, np.array([0, 1, 2]), np.array([15, 15, 15]), 4) == 8
    assert common_prefix_len(table, np.array([0, 1]), np.array([15, 15]), 4) == 12
    # A request's own query token is never part of the prefix: capped at the shortest length - 1.
    assert common_prefix_len(table, np.array([0, 1]), np.array([15, 7]), 4) == 6
    assert common_prefix_len(table, np.array([0, 1]), np.array([15, 1]), 4) == 0
    assert common_prefix_len(table, np.array([0, 3]), np.array([15, 15]), 4) == 0
    # One request shares everything with itself, up to its query.
    assert common_prefix_len(table, np.array([0]), np.array([13]), 4) == 12
    assert common_prefix_len(table, np.array([], dtype=np.int64), np.array([], dtype=np.int64), 4) == 0


def _shared_prompt_steps(num_reqs: int, prompt_len: int, cascade: bool, shared: bool = True
                         ) -> tuple[BlockTable, InputBuffers, SchedulerOutput, dict[str, list[int]]]:
    """num_reqs requests whose prompts share all full blocks (or, not `shared`, have their own) and own
    their last block; returns the buffers after the prefill step and the first decode step's output."""
    block_size = 16
    width = 64
    device = torch.device("cpu")
    table = BlockTable(num_rows=num_reqs, width=width, device=device)
    buffers = InputBuffers(max_num_tokens=num_reqs * prompt_len, max_num_reqs=num_reqs + 4, block_table_width=width,
                           block_size=block_size, device=device, cascade=cascade)
    full = prompt_len // block_size
    tables: dict[str, list[int]] = {}
    prefill = []
    for r in range(num_reqs):
        first = 1 if shared else 1 + r * full  # shared: the prefix cache hands every request the same ids
        tables[f"r{r}"] = list(range(first, first + full)) + [5000 + r]
        prefill.append(_sched(f"r{r}", [r] * prompt_len, 0, tables[f"r{r}"], reset=True))
    out = SchedulerOutput(scheduled=prefill)
    table.apply(out)
    buffers.prepare(out, table)
    decode = SchedulerOutput(scheduled=[_sched(f"r{r}", [r], prompt_len, []) for r in range(num_reqs)])
    table.apply(decode)
    return table, buffers, decode, tables


def test_decode_batch_sharing_a_long_prefix_gets_cascade_metadata() -> None:
    prompt_len = CASCADE_MIN_PREFIX_TOKENS + 40  # 296 tokens: 18 full blocks shared (288 tokens)
    table, buffers, decode, _ = _shared_prompt_steps(CASCADE_MIN_REQS, prompt_len, cascade=True)
    batch = buffers.prepare(decode, table, pad_to=CASCADE_MIN_REQS + 4)
    md = batch.attn_metadata
    assert batch.cascade and md.common_prefix_len == 288
    assert md.common_prefix_len_tensor is not None and md.common_prefix_len_tensor.tolist() == [288]
    # Padding rows do not lower the prefix, and every real row really holds those blocks.
    shared_cols = 288 // 16
    rows = md.block_tables[: CASCADE_MIN_REQS, :shared_cols]
    assert bool((rows == rows[0]).all())


@pytest.mark.parametrize("shared", [True, False], ids=["cascade", "plain"])
def test_a_cascade_batch_fills_its_own_graph_size(shared: bool) -> None:
    """pad_to is the measured choice for plain graphs; a cascade batch fills cascade_pad_to instead."""
    prompt_len = CASCADE_MIN_PREFIX_TOKENS + 40
    table, buffers, decode, _ = _shared_prompt_steps(CASCADE_MIN_REQS, prompt_len, cascade=True, shared=shared)
    batch = buffers.prepare(decode, table, pad_to=CASCADE_MIN_REQS + 4, cascade_pad_to=CASCADE_MIN_REQS + 2)
    assert batch.cascade == shared
    expected = CASCADE_MIN_REQS + 2 if shared else CASCADE_MIN_REQS + 4
    assert batch.padded_num_reqs == expected
    md = batch.attn_metadata
    assert md.seq_lens.shape[0] == expected and md.seq_lens[CASCADE_MIN_REQS:].tolist() == [0] * (expected - CASCADE_MIN_REQS)


@pytest.mark.parametrize("case", ["flag_off", "too_few_requests", "prefix_too_short", "nothing_shared"])
def test_cascade_only_when_enabled_and_worth_it(case: str) -> None:
    num_reqs = CASCADE_MIN_REQS - 1 if case == "too_few_requests" else CASCADE_MIN_REQS
    prompt_len = CASCADE_MIN_PREFIX_TOKENS - 10 if case == "prefix_too_short" else CASCADE_MIN_PREFIX_TOKENS + 40
    table, buffers, decode, _ = _shared_prompt_steps(num_reqs, prompt_len, cascade=case != "flag_off",
                                                     shared=case != "nothing_shared")
    batch = buffers.prepare(decode, table)
    assert not batch.cascade
    assert batch.attn_metadata.common_prefix_len == 0 and batch.attn_metadata.common_prefix_len_tensor is None


# ------------------------------------------------------------------------- one-prompt prefill graphs


def test_one_prompt_prefill_padded_to_a_graph_size() -> None:
    device = torch.device("cpu")
    table = BlockTable(num_rows=2, width=WIDTH, device=device)
    buffers = InputBuffers(max_num_tokens=16, max_num_reqs=4, block_table_width=WIDTH, block_size=BLOCK_SIZE,
                           device=device)
    step = SchedulerOutput(scheduled=[_sched("a", [5, 6, 7, 8, 9], 0, [3, 6], reset=True)])
    table.apply(step)
    batch = buffers.prepare(step, table, prefill_pad_to=8)
    md = batch.attn_metadata
    assert batch.prefill_padded_tokens == 8 and batch.num_reqs == 1 and batch.padded_num_reqs is None
    # the prompt, then padding tokens 0 at position 0 that write nothing (slot -1)
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert md.slot_mapping.tolist() == [12, 13, 14, 15, 24, -1, -1, -1]
    # one prompt of 8 tokens with no cached context; the logits row is the prompt's real last token
    assert md.query_start_loc.tolist() == [0, 8] and md.query_start_loc_cpu == [0, 8]
    assert md.seq_lens.tolist() == [8] and md.seq_lens_cpu == [8]
    assert md.max_query_len == 8 and md.max_seq_len == 8
    assert batch.logits_indices.tolist() == [4] and batch.sampled_req_ids == ["a"]
    assert md.sampled is None  # the graph's captured metadata attends; no per-step sampled rows
    # unpadded, the same step is what it was, and its sampling token is a decode query over the prompt
    plain = buffers.prepare(step, table)
    assert plain.prefill_padded_tokens is None and plain.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert plain.attn_metadata.slot_mapping.tolist() == [12, 13, 14, 15, 24]
    sampled = plain.attn_metadata.sampled
    assert sampled is not None and sampled.seq_lens.tolist() == sampled.seq_lens_cpu == [5]
    assert sampled.block_tables[0, :2].tolist() == [3, 6] and sampled.query_start_loc_cpu == [0, 1]


@pytest.mark.parametrize("context", [6, 0], ids=["after-cached-context", "fresh"])
def test_prefill_padded_as_a_second_request_of_no_length(context: int) -> None:
    """The cache graphs' padding: a request of seq_len 0, so the real request's tiles read only its own
    written slots."""
    device = torch.device("cpu")
    table = BlockTable(num_rows=2, width=WIDTH, device=device)
    buffers = InputBuffers(max_num_tokens=16, max_num_reqs=4, block_table_width=WIDTH, block_size=BLOCK_SIZE,
                           device=device)
    if context:
        table.apply(SchedulerOutput(scheduled=[_sched("a", [1, 2, 3, 4, 5, 6], 0, [3, 6], reset=True)]))
        step = SchedulerOutput(scheduled=[_sched("a", [7, 8, 9], 6, [2])])
        slots = [26, 27, 8]
    else:
        step = SchedulerOutput(scheduled=[_sched("a", [7, 8, 9], 0, [3], reset=True)])
        slots = [12, 13, 14]
    table.apply(step)
    batch = buffers.prepare(step, table, prefill_pad_to=8, pad_as_request=True)
    md = batch.attn_metadata
    assert batch.prefill_padded_tokens == 8 and batch.num_reqs == 1
    assert batch.input_ids.tolist() == [7, 8, 9, 0, 0, 0, 0, 0]
    assert batch.positions.tolist() == [context, context + 1, context + 2, 0, 0, 0, 0, 0]
    assert md.slot_mapping.tolist() == [*slots, -1, -1, -1, -1, -1]
    assert md.query_start_loc.tolist() == [0, 3, 8] and md.query_start_loc_cpu == [0, 3, 8]
    assert md.seq_lens.tolist() == [context + 3, 0] and md.seq_lens_cpu == [context + 3, 0]
    assert md.max_query_len == 5 and md.max_seq_len == context + 3
    assert md.block_tables.shape[0] == 2 and md.block_tables[0].tolist()[: len(table.blocks("a"))] == table.blocks("a")
    assert batch.logits_indices.tolist() == [2] and batch.sampled_req_ids == ["a"]


def test_prefill_padding_keeps_placeholders_and_unsampled_chunks() -> None:
    device = torch.device("cpu")
    table = BlockTable(num_rows=2, width=WIDTH, device=device)
    buffers = InputBuffers(max_num_tokens=16, max_num_reqs=4, block_table_width=WIDTH, block_size=BLOCK_SIZE,
                           device=device)
    # a resumed request recomputes its prompt and outputs; its last token was sampled by the previous step
    step = SchedulerOutput(scheduled=[_sched("a", [5, 6, 7, -1], 0, [3], reset=True)])
    table.apply(step)
    batch = buffers.prepare(step, table, prev_sampled=(torch.tensor([11, 42]), {"a": 1}), prefill_pad_to=8,
                            pad_as_request=True)
    assert batch.input_ids.tolist() == [5, 6, 7, 42, 0, 0, 0, 0]
    assert batch.logits_indices.tolist() == [3]
    # a chunk that does not reach the request's last token samples nothing
    chunk = SchedulerOutput(scheduled=[_sched("b", [1, 2, 3], 0, [4], reset=True, sample=False)])
    table.apply(chunk)
    buffers.dev["logits_indices"].fill_(15)  # a stale index past this step's tokens
    batch = buffers.prepare(chunk, table, prefill_pad_to=8)
    assert batch.sampled_req_ids == [] and batch.logits_indices.numel() == 0
    # the prefill graph still computes the row logits_indices[0] names: the chunk's last token, not a stale one
    assert buffers.dev["logits_indices"][0].item() == 2


@pytest.mark.parametrize("case", ["two requests", "decode", "too few", "past the buffers"])
def test_prefill_padding_refuses_other_batches(case: str) -> None:
    device = torch.device("cpu")
    table = BlockTable(num_rows=2, width=WIDTH, device=device)
    buffers = InputBuffers(max_num_tokens=16, max_num_reqs=4, block_table_width=WIDTH, block_size=BLOCK_SIZE,
                           device=device)
    table.apply(SchedulerOutput(scheduled=[_sched("a", [1, 2, 3, 4, 5], 0, [3, 6], reset=True),
                                           _sched("b", [1, 2], 0, [7], reset=True)]))
    pad_to = 8
    if case == "two requests":
        step = SchedulerOutput(scheduled=[_sched("a", [1, 2], 5, []), _sched("b", [3], 2, [])])
    elif case == "decode":
        step = SchedulerOutput(scheduled=[_sched("a", [1], 5, [])])
    elif case == "too few":
        step = SchedulerOutput(scheduled=[_sched("a", [1, 2, 3], 0, [], reset=True)])
        pad_to = 2
    else:
        step = SchedulerOutput(scheduled=[_sched("a", [1, 2, 3], 0, [], reset=True)])
        pad_to = 17
    table.apply(step)
    with pytest.raises(RuntimeError, match="cannot pad"):
        buffers.prepare(step, table, prefill_pad_to=pad_to)
