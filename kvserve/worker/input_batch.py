"""Turns a SchedulerOutput into the flat tensors one forward pass reads, from persistent buffers.

Two objects live as long as the runner:

* `BlockTable`: every live request's block ids in a row of its own, held twice: a host numpy mirror (for
  slot mappings, computed on the host) and a device tensor (for attention). Each step applies only the
  scheduler's diffs (new block ids, resets, finished requests) to both: the device side gets one scatter of
  the changed entries, never a rebuilt table.
* `InputBuffers`: fixed-size host buffers (pinned on CUDA, so the host-to-device copies are asynchronous)
  and their device twins. `prepare` fills the host side with numpy, copies each used prefix to the device
  with `non_blocking=True`, and gathers the batch's block-table rows on the device. The device tensors are
  the same at every step, which is what lets a CUDA graph captured over them be replayed.

Host-buffer reuse: a pinned buffer may not be rewritten while a copy out of it is still queued. The
runner calls `wait_for_copies` before touching them: it waits for an event recorded after the previous
step's copies. With async scheduling that step is still on the GPU, but its copies ran first, once the
step before it (whose results the host has already read) finished, so the wait is short.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
from kvserve.layers.attention_metadata import AttentionMetadata
from kvserve.worker.cuda_graph import padding_rows


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # int64 [num_tokens] (padded length when padded_num_reqs is set)
    positions: torch.Tensor  # int64 [num_tokens]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampled]: last token of each request that samples
    sampled_req_ids: list[str]
    num_reqs: int  # real requests (rows past it are padding)
    padded_num_reqs: int | None  # decode batch padded to this CUDA-graph size (>= num_reqs), or None
    is_decode_only: bool
    all_rows_sample: bool  # decode-only and every row samples: logits rows = hidden[:num_reqs]
    cascade: bool = False  # attn_metadata.common_prefix_len > 0 (replay the cascade graph of the size)
    # A one-request prefill padded to this many tokens for its CUDA graph (the tensors and metadata describe
    # the padded batch; logits_indices the prompt's real last token), or None.
    prefill_padded_tokens: int | None = None
    # The token buffers padded to this many tokens for the piecewise graphs of that size (input_ids and
    # positions are the padded length; the metadata describes the real tokens only), or None.
    piecewise_tokens: int | None = None


# Cascade attention pays only when many requests share a long prefix; below these a decode batch attends
# as usual. Measured at 256 requests sharing 1,000 tokens (docs/perf_notes.md, entry 12); the thresholds
# themselves are starting points, not tuned.
CASCADE_MIN_REQS = 8
CASCADE_MIN_PREFIX_TOKENS = 256


def common_prefix_len(block_table: np.ndarray, rows: np.ndarray, seq_lens: np.ndarray, block_size: int) -> int:
    """Leading tokens that every request of a decode batch keeps in the same cache blocks, capped below
    each request's last token (its query, which attends as the request's own part).

    block_table: the host block table [num_rows, width]; rows: the batch's rows in it; seq_lens: the
    requests' lengths after this step. Reads only the columns that can be shared.
    """
    if len(seq_lens) == 0:
        return 0
    limit = int(seq_lens.min()) - 1
    if limit <= 0:
        return 0
    cols = -(-limit // block_size)
    table = block_table[:, :cols][rows]
    same = (table == table[:1]).all(axis=0)
    shared_blocks = cols if bool(same.all()) else int(same.argmin())
    return min(shared_blocks * block_size, limit)


def _host_buffer(size: int | tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    tensor = torch.zeros(size, dtype=dtype)
    return tensor.pin_memory() if pin else tensor


class BlockTable:
    """req_id -> row of block ids, mirrored on the host (numpy) and the device (int32 tensor).

    `width` = blocks of one max_model_len request. Rows are handed out on a request's first schedule and
    returned when it finishes; the row pool grows (doubling) if more requests are alive at once than
    expected (preempted requests keep their row).
    """

    def __init__(self, num_rows: int, width: int, device: torch.device) -> None:
        self.width = width
        self.device = device
        self._pin = device.type == "cuda"
        self.host = np.zeros((num_rows, width), dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)
        self.device_table = torch.zeros((num_rows, width), dtype=torch.int32, device=device)
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._staging_capacity = 0
        self._ensure_staging(max(1024, num_rows))

    # -- queries --------------------------------------------------------------------------------------

    def row(self, req_id: str) -> int:
        return self._row_of[req_id]

    def blocks(self, req_id: str) -> list[int]:
        """The request's block ids (host mirror), for tests and debugging."""
        row = self._row_of[req_id]
        return self.host[row, : self.num_blocks[row]].tolist()

    @property
    def num_live(self) -> int:
        return len(self._row_of)

    # -- updates --------------------------------------------------------------------------------------

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        """Apply one step's diffs: free finished requests' rows, reset and/or extend scheduled ones."""
        for req_id in scheduler_output.finished_req_ids:
            row = self._row_of.pop(req_id, None)
            if row is not None:
                self.num_blocks[row] = 0
                self._free_rows.append(row)
        flat_index: list[np.ndarray] = []
        values: list[list[int]] = []
        for s in scheduler_output.scheduled:
            row = self._row_of.get(s.req_id)
            if row is None:
                row = self._alloc_row(s.req_id)
            if s.reset_block_table:
                self.num_blocks[row] = 0
            if not s.new_block_ids:
                continue
            start = int(self.num_blocks[row])
            end = start + len(s.new_block_ids)
            if end > self.width:
                raise RuntimeError(
                    f"request {s.req_id} needs {end} blocks, more than max_model_len allows ({self.width})"
                )
            self.host[row, start:end] = s.new_block_ids
            self.num_blocks[row] = end
            flat_index.append(np.arange(row * self.width + start, row * self.width + end, dtype=np.int64))
            values.append(s.new_block_ids)
        if flat_index:
            self._push(np.concatenate(flat_index), np.concatenate([np.asarray(v, np.int32) for v in values]))

    def _alloc_row(self, req_id: str) -> int:
        if not self._free_rows:
            self._grow(2 * self.host.shape[0])
        row = self._free_rows.pop()
        self._row_of[req_id] = row
        self.num_blocks[row] = 0
        return row

    def _grow(self, num_rows: int) -> None:
        old_rows = self.host.shape[0]
        host = np.zeros((num_rows, self.width), dtype=np.int32)
        host[:old_rows] = self.host
        self.host = host
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(num_rows - old_rows, dtype=np.int64)])
        table = torch.zeros((num_rows, self.width), dtype=torch.int32, device=self.device)
        table[:old_rows] = self.device_table
        self.device_table = table
        self._free_rows.extend(range(num_rows - 1, old_rows - 1, -1))

    def _ensure_staging(self, size: int) -> None:
        if size <= self._staging_capacity:
            return
        self._staging_capacity = max(size, 2 * self._staging_capacity)
        self._index_host = _host_buffer(self._staging_capacity, torch.int64, self._pin)
        self._value_host = _host_buffer(self._staging_capacity, torch.int32, self._pin)
        self._index_dev = torch.zeros(self._staging_capacity, dtype=torch.int64, device=self.device)
        self._value_dev = torch.zeros(self._staging_capacity, dtype=torch.int32, device=self.device)

    def _push(self, flat_index: np.ndarray, values: np.ndarray) -> None:
        """Scatter the changed entries into the device table (two async copies and one index_copy_)."""
        n = len(flat_index)
        self._ensure_staging(n)
        self._index_host.numpy()[:n] = flat_index
        self._value_host.numpy()[:n] = values
        index = self._index_dev[:n]
        index.copy_(self._index_host[:n], non_blocking=True)
        value = self._value_dev[:n]
        value.copy_(self._value_host[:n], non_blocking=True)
        self.device_table.view(-1).index_copy_(0, index, value)


class InputBuffers:
    """Persistent host/device buffers for one step's batch (see the module docstring).

    max_num_tokens: tokens of the largest step (max_num_batched_tokens, and at least max_num_reqs so a
    padded decode batch fits); max_num_reqs: requests of the largest step.
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        block_table_width: int,
        block_size: int,
        device: torch.device,
        cascade: bool = False,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.block_size = block_size
        self.device = device
        self.cascade = cascade
        pin = device.type == "cuda"
        self._host = {
            "input_ids": _host_buffer(max_num_tokens, torch.int64, pin),
            "positions": _host_buffer(max_num_tokens, torch.int64, pin),
            "slot_mapping": _host_buffer(max_num_tokens, torch.int64, pin),
            "query_start_loc": _host_buffer(max_num_reqs + 1, torch.int32, pin),
            "seq_lens": _host_buffer(max_num_reqs, torch.int32, pin),
            "rows": _host_buffer(max_num_reqs, torch.int64, pin),
            "logits_indices": _host_buffer(max_num_reqs, torch.int64, pin),
            # Placeholder fix-ups of n placeholders: [0, n) the token offsets in this batch, [n, 2n) the rows
            # of the previous step's sampled ids that hold them. One contiguous prefix, copied as it is: a
            # strided slice would be staged through a pageable temporary, whose copy can wait for the GPU.
            "placeholders": _host_buffer(2 * max_num_reqs, torch.int64, pin),
            "common_prefix_len": _host_buffer(1, torch.int32, pin),
            # The sampling requests of a step where not every token samples (`AttentionMetadata.sampled`):
            # their seq_lens, then their block-table rows (as int32; one buffer, one copy).
            "sampled": _host_buffer(2 * max_num_reqs, torch.int32, pin),
        }
        self._np = {name: t.numpy() for name, t in self._host.items()}
        self.dev = {name: torch.zeros_like(t, device=device) for name, t in self._host.items()}
        self.block_tables = torch.zeros((max_num_reqs, block_table_width), dtype=torch.int32, device=device)
        self.sampled_block_tables = torch.zeros_like(self.block_tables)
        self.sampled_starts = torch.arange(max_num_reqs + 1, dtype=torch.int32, device=device)
        # Recorded after each step's copies; re-recorded every step (one event, no per-step allocation).
        self._copies_done = torch.cuda.Event() if device.type == "cuda" else None

    def wait_for_copies(self) -> None:
        """Block until the previous step's host-to-device copies (inputs and block-table diffs) have run,
        so their pinned sources may be rewritten. Call before `BlockTable.apply` and `prepare`."""
        if self._copies_done is not None:
            # SYNC: on the previous step's input copies only (see the module docstring).
            self._copies_done.synchronize()

    def prepare(
        self,
        scheduler_output: SchedulerOutput,
        block_table: BlockTable,
        pad_to: int | None = None,
        prev_sampled: tuple[torch.Tensor, dict[str, int]] | None = None,
        prefill_pad_to: int | None = None,
        pad_as_request: bool = False,
        cascade_pad_to: int | None = None,
        token_pad_to: int | None = None,
    ) -> BatchInputs:
        """Fill the buffers for `scheduler_output` (block_table already updated for this step).

        pad_to: for a decode-only batch, the CUDA-graph batch size to fill (>= num_reqs): rows past
        num_reqs get token 0 at position 0, slot -1 (not written), seq_len 0 (attend to nothing), and one
        query token each. Ignored for batches with prefill chunks.
        cascade_pad_to: the size to fill instead when the batch turns out to be a cascade batch (shared
        prefix), given with pad_to: `CUDAGraphRunner.padded_size(n, cascade=True)`.
        prev_sampled: the previous step's sampled ids on the device and each request's row in them; a
        placeholder token (negative id, the last of its request's tokens) is replaced on the device by
        its request's row. Raises RuntimeError for a placeholder with no such row.
        prefill_pad_to: for a one-request batch of at least 2 tokens (what `cuda_graph.prefill_graph_key`
        accepts), the prefill graph's token count to fill (>= its tokens) with padding tokens: token 0 at
        position 0, slot -1 (not written); the logits index stays the real last token. Raises RuntimeError
        for other batches. The padding is
        * pad_as_request=False: more tokens of the request (query_start_loc [0, n], seq_len its cached
          context + n). For attention over the step's own keys only (the one-prompt fast path): over the
          cache, the request's last query tile would load the never-written slots up to n.
        * pad_as_request=True: a second request of seq_len 0 (query_start_loc [0, real, n], seq_lens
          [context + real, 0]), which attends to nothing (needs buffers of 2 requests or more).
        token_pad_to: for a batch that neither pad_to nor prefill_pad_to pads, the piecewise graph size to
        fill (>= its tokens): tokens past the batch's get token 0 at position 0, slot -1 (not written).
        Only the token buffers are padded; the metadata and the requests stay the batch's own.
        """
        scheduled = scheduler_output.scheduled
        num_reqs = len(scheduled)
        if num_reqs > self.max_num_reqs:
            raise RuntimeError(f"batch of {num_reqs} requests exceeds max_num_seqs={self.max_num_reqs}")
        self.wait_for_copies()
        h = self._np
        query_lens = np.fromiter((len(s.token_ids) for s in scheduled), dtype=np.int64, count=num_reqs)
        num_computed = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
        rows = np.fromiter((block_table.row(s.req_id) for s in scheduled), dtype=np.int64, count=num_reqs)
        qsl = h["query_start_loc"]
        qsl[0] = 0
        np.cumsum(query_lens, out=qsl[1 : num_reqs + 1])
        num_tokens = int(qsl[num_reqs])
        if num_tokens > self.max_num_tokens:
            raise RuntimeError(f"batch of {num_tokens} tokens exceeds max_num_batched_tokens={self.max_num_tokens}")
        seq_lens = num_computed + query_lens
        h["seq_lens"][:num_reqs] = seq_lens
        h["rows"][:num_reqs] = rows
        is_decode = num_tokens == num_reqs

        positions = h["positions"][:num_tokens]
        if is_decode:
            h["input_ids"][:num_reqs] = [s.token_ids[0] for s in scheduled]
            positions[:] = num_computed
            token_rows = rows
        else:
            input_ids = h["input_ids"]
            offset = 0
            for s in scheduled:
                input_ids[offset : offset + len(s.token_ids)] = s.token_ids
                offset += len(s.token_ids)
            req_of_token = np.repeat(np.arange(num_reqs), query_lens)
            positions[:] = num_computed[req_of_token] + (np.arange(num_tokens) - qsl[:num_reqs][req_of_token])
            token_rows = rows[req_of_token]
        block_ids = block_table.host[token_rows, positions // self.block_size].astype(np.int64)
        h["slot_mapping"][:num_tokens] = block_ids * self.block_size + positions % self.block_size

        sample_rows = [i for i, s in enumerate(scheduled) if s.sample]
        num_sampled = len(sample_rows)
        h["logits_indices"][:num_sampled] = qsl[1:][sample_rows] - 1

        placeholders = np.flatnonzero(h["input_ids"][:num_tokens] < 0)
        num_placeholders = len(placeholders)
        if num_placeholders:
            self._fill_placeholder_rows(scheduled, qsl, placeholders, prev_sampled)

        prefix_len = 0
        if self.cascade and is_decode and num_reqs >= CASCADE_MIN_REQS:
            prefix_len = common_prefix_len(block_table.host, rows, seq_lens, self.block_size)
            if prefix_len < CASCADE_MIN_PREFIX_TOKENS:
                prefix_len = 0

        if prefix_len and cascade_pad_to is not None:
            pad_to = cascade_pad_to
        padded = pad_to if (is_decode and pad_to is not None) else None
        padded_tokens = None
        max_query_len = int(query_lens.max()) if num_reqs else 0
        max_seq_len = int(seq_lens.max()) if num_reqs else 0
        if prefill_pad_to is not None:
            if (
                is_decode
                or num_reqs != 1
                or not num_tokens <= prefill_pad_to <= self.max_num_tokens
                or (pad_as_request and self.max_num_reqs < 2)
            ):
                raise RuntimeError(
                    f"cannot pad this batch to a {prefill_pad_to}-token prefill ({num_reqs} requests, "
                    f"{num_tokens} tokens; buffers hold {self.max_num_tokens} tokens, {self.max_num_reqs} requests)"
                )
            padded_tokens = prefill_pad_to
            # The graph computes the row of logits_indices[0] whether or not the step samples: the real
            # last token (a stale index from another step could lie past this one's tokens).
            h["logits_indices"][0] = num_tokens - 1
            h["input_ids"][num_tokens:padded_tokens] = 0
            h["positions"][num_tokens:padded_tokens] = 0
            h["slot_mapping"][num_tokens:padded_tokens] = -1
            if pad_as_request:
                qsl[2] = padded_tokens
                h["seq_lens"][1] = 0
                h["rows"][1] = 0  # any valid row: a seq_len of 0 reads none of it
                max_query_len = max(num_tokens, padded_tokens - num_tokens)
            else:
                qsl[1] = max_query_len = padded_tokens
                h["seq_lens"][0] = max_seq_len = int(num_computed[0]) + padded_tokens
        elif padded is None and token_pad_to is not None:
            if not num_tokens <= token_pad_to <= self.max_num_tokens:
                raise RuntimeError(
                    f"cannot pad a batch of {num_tokens} tokens to {token_pad_to} (buffers hold {self.max_num_tokens})"
                )
            h["input_ids"][num_tokens:token_pad_to] = 0
            h["positions"][num_tokens:token_pad_to] = 0
            h["slot_mapping"][num_tokens:token_pad_to] = -1
        elif padded is not None:
            if padded < num_reqs or padded > self.max_num_reqs or padded > self.max_num_tokens:
                raise RuntimeError(f"cannot pad a batch to {padded} rows (buffers hold {self.max_num_reqs})")
            for name, values in padding_rows(num_reqs, padded).items():
                start = num_reqs + 1 if name == "query_start_loc" else num_reqs
                h[name][start : start + len(values)] = values
            h["rows"][num_reqs:padded] = 0  # any valid row: a seq_len of 0 reads none of it
        n_reqs = padded or (2 if padded_tokens is not None and pad_as_request else num_reqs)
        n_tokens = padded or padded_tokens or num_tokens
        piecewise_tokens = token_pad_to if padded is None and padded_tokens is None else None
        buffer_tokens = piecewise_tokens or n_tokens

        dev = self.dev
        for name, length in (
            ("input_ids", buffer_tokens),
            ("positions", buffer_tokens),
            ("slot_mapping", buffer_tokens),
            ("query_start_loc", n_reqs + 1),
            ("seq_lens", n_reqs),
            ("rows", n_reqs),
            ("logits_indices", max(num_sampled, 1) if padded_tokens is not None else num_sampled),
        ):
            dev[name][:length].copy_(self._host[name][:length], non_blocking=True)
        if prefix_len:
            h["common_prefix_len"][0] = prefix_len
            dev["common_prefix_len"].copy_(self._host["common_prefix_len"], non_blocking=True)
        if num_placeholders:
            assert prev_sampled is not None
            fix = dev["placeholders"][: 2 * num_placeholders]
            fix.copy_(self._host["placeholders"][: 2 * num_placeholders], non_blocking=True)
            offsets, sampled_rows = fix[:num_placeholders], fix[num_placeholders:]
            dev["input_ids"].index_copy_(0, offsets, prev_sampled[0].index_select(0, sampled_rows))
        # The sampling tokens as a decode batch, for steps that run the model with output rows: not a decode
        # batch where every row samples, not one padded for a decode graph (the graph computes every row,
        # then the rows are selected), not a prefill graph (its metadata is captured).
        sampled_dev = None
        if num_sampled and padded is None and padded_tokens is None and not (is_decode and num_sampled == num_reqs):
            sampled_seq_lens = seq_lens[sample_rows]
            h["sampled"][:num_sampled] = sampled_seq_lens
            h["sampled"][num_sampled : 2 * num_sampled] = rows[sample_rows]
            sampled_dev = dev["sampled"][: 2 * num_sampled]
            sampled_dev.copy_(self._host["sampled"][: 2 * num_sampled], non_blocking=True)
        if self._copies_done is not None:
            self._copies_done.record()
        block_tables = self.block_tables[:n_reqs]
        torch.index_select(block_table.device_table, 0, dev["rows"][:n_reqs], out=block_tables)
        sampled = None
        if sampled_dev is not None:
            sampled_tables = self.sampled_block_tables[:num_sampled]
            torch.index_select(block_table.device_table, 0, sampled_dev[num_sampled:], out=sampled_tables)
            sampled = AttentionMetadata(
                query_start_loc=self.sampled_starts[: num_sampled + 1],
                seq_lens=sampled_dev[:num_sampled],
                block_tables=sampled_tables,
                slot_mapping=dev["slot_mapping"][:0],
                max_query_len=1,
                max_seq_len=int(sampled_seq_lens.max()),
                query_start_loc_cpu=list(range(num_sampled + 1)),
                seq_lens_cpu=sampled_seq_lens.tolist(),
            )

        metadata = AttentionMetadata(
            query_start_loc=dev["query_start_loc"][: n_reqs + 1],
            seq_lens=dev["seq_lens"][:n_reqs],
            block_tables=block_tables,
            slot_mapping=dev["slot_mapping"][:n_tokens],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=qsl[: n_reqs + 1].tolist(),
            seq_lens_cpu=h["seq_lens"][:n_reqs].tolist(),
            common_prefix_len=prefix_len,
            common_prefix_len_tensor=dev["common_prefix_len"] if prefix_len else None,
            sampled=sampled,
        )
        return BatchInputs(
            input_ids=dev["input_ids"][:buffer_tokens],
            positions=dev["positions"][:buffer_tokens],
            attn_metadata=metadata,
            logits_indices=dev["logits_indices"][:num_sampled],
            sampled_req_ids=[scheduled[i].req_id for i in sample_rows],
            num_reqs=num_reqs,
            padded_num_reqs=padded,
            is_decode_only=is_decode,
            all_rows_sample=is_decode and num_sampled == num_reqs,
            cascade=prefix_len > 0,
            prefill_padded_tokens=padded_tokens,
            piecewise_tokens=piecewise_tokens,
        )

    def _fill_placeholder_rows(
        self,
        scheduled: list[ScheduledRequest],
        qsl: np.ndarray,
        placeholders: np.ndarray,
        prev_sampled: tuple[torch.Tensor, dict[str, int]] | None,
    ) -> None:
        """Host side of the placeholder fix-up: each placeholder's offset and its previous-step row."""
        num_reqs = len(scheduled)
        owners = np.searchsorted(qsl[1 : num_reqs + 1], placeholders, side="right")
        rows_of = prev_sampled[1] if prev_sampled is not None else {}
        fix = self._np["placeholders"]
        n = len(placeholders)
        for j, (offset, i) in enumerate(zip(placeholders.tolist(), owners.tolist(), strict=True)):
            req_id = scheduled[i].req_id
            row = rows_of.get(req_id)
            if row is None or offset != int(qsl[i + 1]) - 1:
                raise RuntimeError(
                    f"request {req_id} has a placeholder token the previous step did not sample"
                )
            fix[j] = offset
            fix[n + j] = row
