"""Piecewise CUDA graphs: a step's forward as one graph per stretch between two layers' attention, with
attention itself launched eagerly between the replays.

Steps that no whole-forward graph serves (several requests with prefill tokens, decode batches past the
largest decode graph, a later chunk of a long prompt) used to launch every kernel from Python: about 250
launches for a 7B model, 20-41 ms of host time on the H200's hosts, more than the GPU needs for a step of
a few hundred tokens (docs/perf_notes.md, entries 21 and 38). Attention is what keeps such a step out of a
whole graph: its launch (grid, tiles, the flash path for fresh prompts) follows the step's request lengths.
Everything else in a layer reads only per-token inputs, so for a token count T it can be captured once:

    piece 0      embedding, layer 0 up to its attention (norm, q/k/v, rotary, cache write)
    attention 0  eager, over the step's real metadata, into a fixed output buffer
    piece i      layer i - 1 past its attention (o_proj, norm, MLP), layer i up to its attention
    ...
    finish       eager: the last layer's attention and the rest of it, and the final norm, on the rows that
                 sample (their attention as decode queries where the metadata describes them)

A step of n tokens replays the pieces of the smallest captured T >= n. Its tokens n..T-1 are padding
(token 0 at position 0, slot -1: nothing is written to the cache); they are rows of their own in every
row-wise op of the pieces, attention computes only the real n rows, and no real row reads a padding row.

Memory: the pieces of all sizes share the decode graphs' pool and are captured after them. The attention
output buffer is allocated outside the pool. A piece's q/k/v and residual outputs are held only as weak
views (`weak_view`), so later captures reuse their memory: the next piece may take q/k/v's (attention has
read them by then), the piece after it the residual's (the next piece read it). That is safe because a step
replays the pieces in capture order, on one stream, with nothing between them but the eager attention and
`finish`, which allocate from the ordinary allocator. Moving attention (or anything reading a piece's
outputs) to another stream would break it.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from kvserve.layers.attention_metadata import AttentionMetadata
from kvserve.worker.cuda_graph import warm_up_and_capture

logger = logging.getLogger(__name__)

PieceOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v, residual

# Piecewise graph sizes: multiples of SMALL_STEP tokens up to SMALL_MAX, then of LARGE_STEP.
SMALL_STEP = 64
SMALL_MAX = 512
LARGE_STEP = 128


def piecewise_graph_sizes(max_tokens: int) -> list[int]:
    """Token counts of the piecewise graphs up to max_tokens: 64, 128, ..., 512, then 640, 768, ... (the
    padding stays under 1/4 of a step from 256 tokens on, under 1/8 past 1,024)."""
    small = list(range(SMALL_STEP, min(max_tokens, SMALL_MAX) + 1, SMALL_STEP))
    large = list(range(SMALL_MAX + LARGE_STEP, max_tokens + 1, LARGE_STEP)) if max_tokens > SMALL_MAX else []
    return small + large


def piecewise_size(
    num_reqs: int, num_tokens: int, one_fresh_prompt: bool, sizes: Sequence[int]
) -> int | None:
    """The piecewise graph size (padded token count) a step replays, or None (it runs eagerly): the smallest
    size >= num_tokens. A step of one fresh prompt is left out: its attention may want q/k/v in a padded
    layout that the pieces, captured for steps of several requests, do not produce (the one-prompt cuDNN
    path); the one-request prefill graphs serve such prompts up to their own limit."""
    if num_tokens < 1 or (num_reqs == 1 and one_fresh_prompt):
        return None
    index = bisect.bisect_left(sizes, num_tokens)
    return sizes[index] if index < len(sizes) else None


class _CudaMemory:
    """Exposes a CUDA tensor's memory through `__cuda_array_interface__` without owning it."""

    _TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}

    def __init__(self, tensor: torch.Tensor) -> None:
        size = tensor.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(tensor.shape),
            "typestr": self._TYPESTR[size],
            "data": (tensor.data_ptr(), False),
            "strides": tuple(s * size for s in tensor.stride()),
            "version": 2,
        }


def weak_view(tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over `tensor`'s memory that does not keep it allocated (its dtype, shape and strides)."""
    view = torch.as_tensor(_CudaMemory(tensor), device=tensor.device)
    return view.view(tensor.dtype)


class GraphBackend(Protocol):
    """How pieces are captured: `capture(fn)` returns (replay, outputs): replay() reruns what fn launched,
    writing the same output tensors; `keep(t)` is how the runner holds an output between replays."""

    def capture(self, fn: Callable[[], PieceOutputs]) -> tuple[Callable[[], None], PieceOutputs]: ...

    def keep(self, tensor: torch.Tensor) -> torch.Tensor: ...


class CudaGraphBackend:
    """Real CUDA graphs into a shared pool on a capture stream; outputs kept as weak views."""

    def __init__(self, pool: Any, stream: torch.cuda.Stream) -> None:
        self.pool = pool
        self.stream = stream

    def capture(self, fn: Callable[[], PieceOutputs]) -> tuple[Callable[[], None], PieceOutputs]:
        graph, out = warm_up_and_capture(fn, self.pool, self.stream)
        return graph.replay, out

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        return weak_view(tensor)


class EagerBackend:
    """Stands in for CUDA graphs where there are none (CPU tests of the piecewise plumbing): a replay reruns
    the piece on the captured inputs and copies its results into the captured outputs, which is what a
    graph's fixed addresses amount to."""

    def capture(self, fn: Callable[[], PieceOutputs]) -> tuple[Callable[[], None], PieceOutputs]:
        out = fn()

        def replay() -> None:
            # Each output in place (q/k/v may be disjoint views of one tensor; a piece may also hand back
            # an input it updated in place, a copy onto itself).
            for old, new in zip(out, fn(), strict=True):
                if old.data_ptr() != new.data_ptr():
                    old.copy_(new)

        return replay, out

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class PiecewiseGraphs:
    """The pieces of every size. `capture(backend)` once (after the KV cache exists), then
    `replay(size, metadata, output_rows)` for a step whose buffers `InputBuffers.prepare(...,
    token_pad_to=size)` filled.

    model: a CausalLM with `piecewise_model` (the decoder's `piece` / `finish`, its layers'
    `self_attn.attend` and `attend_output_rows`); buffers: the runner's persistent device buffers (input_ids,
    positions, slot_mapping, query_start_loc, seq_lens; at least max(sizes) tokens and 2 requests);
    block_tables: its batch block-table buffer (2 rows or more).
    """

    def __init__(
        self,
        model: Any,
        kv_caches: list[torch.Tensor],
        buffers: dict[str, torch.Tensor],
        block_tables: torch.Tensor,
        sizes: Sequence[int],
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.block_tables = block_tables
        self.sizes = sorted(sizes)
        self.attn_out: torch.Tensor | None = None
        # size -> one (replay, (q, k, v, residual) as kept) per layer
        self._pieces: dict[int, list[tuple[Callable[[], None], PieceOutputs]]] = {}
        self.replays = 0  # steps served so far (tests read it)
        self.capture_s = 0.0

    def padded_size(self, num_reqs: int, num_tokens: int, one_fresh_prompt: bool) -> int | None:
        if not self._pieces:
            return None
        return piecewise_size(num_reqs, num_tokens, one_fresh_prompt, self.sizes)

    def _decoder(self) -> Any:
        return self.model.piecewise_model

    def _metadata(self, size: int) -> AttentionMetadata:
        """What a piece of `size` tokens is captured with: a step of two requests (a decode row and a chunk)
        whose slots are the slot buffer's first `size`. The pieces read only slot_mapping from it; two
        requests keep the one-prompt padded layout out (`ops.prefill_attention_padding`)."""
        b = self.buffers
        return AttentionMetadata(
            query_start_loc=b["query_start_loc"][:3],
            seq_lens=b["seq_lens"][:2],
            block_tables=self.block_tables[:2],
            slot_mapping=b["slot_mapping"][:size],
            max_query_len=size - 1,
            max_seq_len=size - 1,
            query_start_loc_cpu=[0, 1, size],
            seq_lens_cpu=[1, size - 1],
        )

    def _ensure_attn_out(self) -> torch.Tensor:
        decoder = self._decoder()
        attn = decoder.layers[0].self_attn
        width = attn.num_heads * attn.head_dim
        if self.attn_out is None or self.attn_out.shape[0] < self.sizes[-1] or self.attn_out.shape[1] != width:
            # Zeros: padding rows past a step's tokens are never written by attention and stay finite.
            self.attn_out = torch.zeros(
                (self.sizes[-1], width), dtype=self.model.dtype, device=self.kv_caches[0].device
            )
        return self.attn_out

    def _piece_fn(self, index: int, size: int, residual: torch.Tensor | None) -> Callable[[], PieceOutputs]:
        b = self.buffers
        metadata = self._metadata(size)
        attn_out = self._ensure_attn_out()[:size]
        decoder = self._decoder()

        def run() -> PieceOutputs:
            return decoder.piece(index, b["input_ids"][:size], b["positions"][:size], self.kv_caches, metadata,
                                 attn_out, residual)

        return run

    def _set_padding_inputs(self) -> None:
        """Token buffers as a padding-only step: token 0 at position 0, slot -1 (nothing written)."""
        b = self.buffers
        n = self.sizes[-1]
        b["input_ids"][:n].zero_()
        b["positions"][:n].zero_()
        b["slot_mapping"][:n].fill_(-1)

    def run_eagerly(self) -> None:
        """Run every piece of every size once, eagerly (what the capture launches; captures nothing)."""
        if not self.sizes:
            return
        self._set_padding_inputs()
        num_layers = len(self._decoder().layers)
        for size in sorted(self.sizes, reverse=True):
            residual = None
            for index in range(num_layers):
                residual = self._piece_fn(index, size, residual)()[3]

    def capture(self, backend: GraphBackend) -> None:
        """Capture the pieces of every size, largest first. The token buffers are set to a padding-only step
        for the warm-up and capture runs."""
        if not self.sizes:
            return
        start = time.perf_counter()
        self._set_padding_inputs()
        num_layers = len(self._decoder().layers)
        for size in sorted(self.sizes, reverse=True):
            pieces = []
            residual: torch.Tensor | None = None
            for index in range(num_layers):
                replay, out = backend.capture(self._piece_fn(index, size, residual))
                residual = out[3]  # strong until the next piece is captured (it reads it)
                pieces.append((replay, tuple(backend.keep(t) for t in out)))
                del out
            del residual
            self._pieces[size] = pieces
        self.capture_s = time.perf_counter() - start
        logger.info("captured piecewise CUDA graphs for %d step sizes (%d-%d tokens, %d pieces each) in %.1f s",
                    len(self.sizes), self.sizes[0], self.sizes[-1], num_layers, self.capture_s)

    def replay(self, size: int, metadata: AttentionMetadata, output_rows: torch.Tensor) -> torch.Tensor:
        """Run a step of metadata.num_tokens tokens (<= size) whose token buffers hold its inputs padded to
        `size`: the pieces, each layer's attention eagerly over `metadata`, then the last layer and the final
        norm on output_rows (int64 [n] token indices). Returns [n, hidden] (n = 0: the cache writes were the
        whole step, and an empty tensor)."""
        pieces = self._pieces[size]
        decoder = self._decoder()
        num_tokens = metadata.num_tokens
        attn_out = self.attn_out
        assert attn_out is not None and num_tokens <= size
        out_rows = attn_out[:num_tokens]
        last = len(pieces) - 1
        self.replays += 1
        for index, (replay, (q, k, v, residual)) in enumerate(pieces):
            replay()
            if index == last:
                if output_rows.shape[0] == 0:
                    return attn_out.new_empty((0, residual.shape[1]))
                attn_rows = decoder.layers[index].attend_output_rows(
                    q, k, v, self.kv_caches[index], metadata, output_rows, out=out_rows
                )
                return decoder.finish(attn_rows, residual, output_rows)
            decoder.layers[index].self_attn.attend(q, k, v, self.kv_caches[index], metadata, out=out_rows)
        raise AssertionError("a piecewise forward has at least one layer")
