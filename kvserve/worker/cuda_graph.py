"""CUDA graphs for decode-only batches and one-request prefills: capture once at start, replay padded to a
captured size.

A decode step of a 7B model is ~28 x 12 kernel launches whose Python + launch cost (several ms) would
exceed the GPU time at small batches; one graph replay costs ~10 us. Each graph is captured over the
runner's persistent device buffers (`InputBuffers.dev`, its batch block-table buffer, the KV cache), so a
replay only needs those buffers refilled: `InputBuffers.prepare(..., pad_to=size)` does that, with padding
rows that write nothing (slot -1) and attend to no key of their own (seq_len 0; in a cascade graph they
still attend to the shared prefix, and their output is never read).

Graphs are captured largest first into one shared memory pool (they never run concurrently, so their
activations can share memory). With cascade attention on, sizes of at least `cascade_min_size` get a
second graph whose attention reads the shared-prefix length from a device buffer, so it serves any
prefix. Attention's split count is fixed at capture from (batch size,
max_model_len); `triton_attention`'s docstring says why that stays valid for every shorter context.

Which decode graph a batch replays: the smallest captured size that holds it, unless a larger size with the
same attention launch (split count and tiling) ran at least `pad_min_gain` faster when every graph was timed right after the
capture, on the padding-only batch the capture leaves in the buffers (`choose_padding`); cascade batches
always take the smallest size (their graphs were not timed). The matmuls set
those times, and cuBLAS's are not monotonic in the row count (on the H200 a 192-row step's matmuls took
6.5 ms and a 208-row step's 5.4: docs/perf_notes.md, entry 24). Only sizes with the same attention launch
compete, because the padding-only timing cannot see the real rows' attention: a small batch moved to an
unsplit size would read each long context with one program per KV head.

One-request prefill graphs: a step whose only request brings at least 2 new tokens replays the graph of the
next multiple of PREFILL_GRAPH_BUCKET tokens. Eager, such a step costs 20-41 ms of host time on the H200's
hosts (about 250 launches and their Python), more than the GPU needs for prompts of up to a thousand tokens
or two (docs/perf_notes.md, entry 21). The padding tokens come after the request's real ones: token 0 at
position 0, slot -1, so they write nothing to the cache, and their rows of the output are never read. Two
kinds:
* fresh-prompt graphs (`prefill_sizes`, up to `KVSERVE_PREFILL_GRAPH_MAX_TOKENS`): the one-prompt fast path
  (`ops.prefill_attention`) over the step's own keys and values; the padding is more tokens of the prompt,
  invisible to the real ones under the causal mask. Flash in a graph (`ops` keeps cuDNN, which builds a
  graph per length, out of captures). Only where the fast path applies (CUDA, fp16/bf16).
* cache graphs (`cache_prefill_sizes`, up to CACHE_PREFILL_GRAPH_MAX_TOKENS): new tokens after cached
  context (a prefix-cache hit, a later chunk), and fresh prompts where there is no fast path. The Triton
  kernel attends over the cache and reads the lengths from the runner's buffers. The padding is a second
  request of seq_len 0, which reads nothing: as more tokens of the request, the request's last query tile
  would load never-written cache slots, and one stale inf or NaN there would reach the real rows through a
  zero attention weight. Up to 256 new tokens the eager step is host-bound and a graph wins (64 tokens
  after a cached prefix: 6.4 against 12.0-13.4 ms on the H200); past that, the padding (up to 127 tokens)
  costs more GPU time than the launch saves on a fast host (520 tokens in a 640-token graph: 16.2 against
  14.9 ms).
Other batches with prefill tokens (several requests, longer prompts) replay piecewise graphs (graphs between
the layers' attention launches, `worker.piecewise`) up to their size limit, and run eagerly past it.
"""

from __future__ import annotations

import bisect
import functools
import gc
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from kvserve import distributed
from kvserve.core.outputs import ScheduledRequest
from kvserve.kernels import ops
from kvserve.layers.attention_metadata import AttentionMetadata
from kvserve.model.registry import CausalLM

logger = logging.getLogger(__name__)


def padded_batch_size(num_reqs: int, capture_sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= num_reqs (capture_sizes sorted ascending), or None when there is
    none (the batch runs eagerly)."""
    if num_reqs < 1:
        return None
    index = bisect.bisect_left(capture_sizes, num_reqs)
    return capture_sizes[index] if index < len(capture_sizes) else None


def choose_padding(
    times_ms: Mapping[int, float], min_gain: float, attention_launch: Mapping[int, Hashable] | None = None
) -> dict[int, int]:
    """For each captured decode size s, the size whose graph serves the batches that s is the smallest fit
    for: s itself, or the larger size with the least measured time when that time is below t(s) / (1 +
    min_gain) (the graphs' matmuls can be faster at more rows: cuBLAS picks its kernel by the row count).
    times_ms: each size's measured replay time, on a padding-only batch (attention reads nothing, so the
    time is what the size's matmuls and other row-wise kernels cost). attention_launch: what the decode
    attention launch of each size depends on (its KV split count and tiling: `ops.decode_attention_launch`);
    a batch moves only to a size with the
    same, since the padding-only timing cannot see its real rows' attention: a small batch sent to a size
    whose attention is unsplit would read each long context with a single program. min_gain <= 0 keeps
    every size."""
    sizes = sorted(times_ms)
    choice = {}
    for i, size in enumerate(sizes):
        same = [s for s in sizes[i:] if attention_launch is None or attention_launch[s] == attention_launch[size]]
        best = min(same, key=lambda s: (times_ms[s], s))
        faster = min_gain > 0 and times_ms[best] * (1 + min_gain) <= times_ms[size]
        choice[size] = best if faster else size
    return choice


def _has_fp8_weights(model: torch.nn.Module) -> bool:
    """Whether any layer of `model` holds online fp8 weights (`--quantization fp8`, `Linear.weight_fp8`)."""
    # (isinstance: tests drive the runner with stand-in models that are not modules)
    return isinstance(model, torch.nn.Module) and any(
        getattr(module, "weight_fp8", None) is not None for module in model.modules())


# One-request prefill graphs are captured at multiples of this many tokens.
PREFILL_GRAPH_BUCKET = 128


# Cache prefill graphs (over the cache) serve at most this many new tokens (see the module docstring).
CACHE_PREFILL_GRAPH_MAX_TOKENS = 256


def prefill_graph_sizes(max_tokens: int, bucket: int = PREFILL_GRAPH_BUCKET) -> list[int]:
    """Token counts of the one-request prefill graphs: the multiples of `bucket` up to `max_tokens`."""
    if bucket < 1 or max_tokens < bucket:
        return []
    return list(range(bucket, max_tokens // bucket * bucket + 1, bucket))


def prefill_graph_key(
    scheduled: Sequence[ScheduledRequest], prefill_sizes: Sequence[int], cache_sizes: Sequence[int]
) -> tuple[int, bool] | None:
    """(padded token count, whether it is a cache graph) of the prefill graph a step replays, or None (the
    step runs as it would without prefill graphs): the step schedules exactly one request with at least 2
    tokens (one token is a decode batch); a fresh prompt takes a fresh-prompt graph when there are any
    (`prefill_sizes`), otherwise, like new tokens after cached context, a cache graph (`cache_sizes`)."""
    if len(scheduled) != 1:
        return None
    only = scheduled[0]
    num_tokens = len(only.token_ids)
    if num_tokens < 2:
        return None
    if only.num_computed_tokens == 0 and prefill_sizes:
        padded = padded_batch_size(num_tokens, prefill_sizes)
        return None if padded is None else (padded, False)
    padded = padded_batch_size(num_tokens, cache_sizes)
    return None if padded is None else (padded, True)


def padding_rows(num_reqs: int, padded: int) -> dict[str, list[int]]:
    """The per-row inputs of the padding rows num_reqs..padded-1 (what `InputBuffers.prepare` writes):
    token 0 at position 0, slot -1 (nothing written to the cache), seq_len 0 (attends to nothing), and
    query_start_loc continuing one token per row."""
    count = max(padded - num_reqs, 0)
    return {
        "input_ids": [0] * count,
        "positions": [0] * count,
        "slot_mapping": [-1] * count,
        "seq_lens": [0] * count,
        "query_start_loc": list(range(num_reqs + 1, padded + 1)),
    }


# Capture with `CUDAGraph.capture_begin` / `capture_end` directly (`capture_graph`) rather than through the
# `torch.cuda.graph` context manager, which before each capture synchronizes the device, empties the caching
# allocator and the pinned-host cache (and runs a garbage-collector pass in some torch versions). Start-up
# captures hundreds of graphs one after another on one stream, where none of that is needed (on the H200 the
# capture took 3.5 s against 4.0-5.5: docs/perf_notes.md, entry 40). False: the context manager (kept for
# the start-up A/B, benchmarks/engine_benchmarks.py --graph-capture).
LEAN_CAPTURE = True

T = TypeVar("T")


def capture_graph(fn: Callable[[], T], pool: Any, stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture what `fn` launches on `stream` into a new graph that allocates from `pool`; returns the graph
    and fn's result (its tensors live in the pool). Call with `stream` current; the caller runs fn once on it
    outside capture first where anything is set up lazily (cuBLAS workspaces, kernel compiles).

    The garbage collector is paused during the capture: a collection there may free another, unreachable
    CUDAGraph (an engine dropped earlier in the process), and destroying a graph while a stream captures is
    an error that invalidates the capture. Such garbage is collected after it.

    A capture that fails (fn raises, or CUDA invalidated it) raises after `_release_failed_capture` has
    undone what torch leaves behind (the pool's routing and reference, the default generator's capture
    mode), so that the caller can free the memory and retry into a new pool."""
    graph = torch.cuda.CUDAGraph()
    # With tensor parallelism the capture holds NCCL collectives, and torch's NCCL watchdog thread queries
    # CUDA events meanwhile: in the global mode another thread's unsafe call invalidates the capture.
    mode = "thread_local" if distributed.tp_size() > 1 else "global"
    collecting = gc.isenabled()
    gc.disable()
    try:
        if not LEAN_CAPTURE:
            # The outer stream context restores the caller's stream: the graph context leaves its own
            # stream current when its capture_end raises.
            with torch.cuda.stream(stream):
                try:
                    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=mode):
                        out = fn()
                except BaseException:
                    _release_failed_capture(graph, pool)
                    raise
            return graph, out
        with torch.cuda.stream(stream):
            try:
                graph.capture_begin(pool=pool, capture_error_mode=mode)
            except BaseException:
                _release_failed_capture(graph, pool)
                raise
            try:
                out = fn()
            except BaseException:
                try:  # end the capture so the stream is usable again; the first error is the one to report
                    graph.capture_end()
                except Exception:  # noqa: BLE001 (an invalidated capture also fails to end)
                    pass
                _release_failed_capture(graph, pool)
                raise
            try:
                graph.capture_end()
            except BaseException:
                _release_failed_capture(graph, pool)
                raise
        return graph, out
    finally:
        if collecting:
            gc.enable()


# Graphs whose capture failed, kept alive: torch's pinned-host allocator still holds their capture's
# record, whose filter points at the graph object (reset, they hold no GPU resources).
_FAILED_GRAPHS: list[torch.cuda.CUDAGraph] = []


def _release_failed_capture(graph: torch.cuda.CUDAGraph, pool: Any) -> None:
    """Undo what a capture that did not end leaves behind in torch (2.11 on the H200 host, measured with
    benchmarks/capture_failure_probe.py; docs/perf_notes.md, entry 43):
    * the caching allocator keeps routing to `pool` and holds the capture's reference to it: `capture_begin`
      starts both, `capture_end` ends the routing only after CUDA ended the capture, and the graph gives its
      reference back only if it did. The pool's memory then stays reserved for the life of the process.
      The reference is given back only where this call ended the routing (so never for a capture that did
      not get as far as taking it).
    * the default CUDA generator stays in capture mode: every random op on it outside a capture then fails
      ("Offset increment outside graph capture"). Where a random op shows that, its state is replaced by a
      copy (same seed and offset) that is not capturing; otherwise the op's offset is given back.
    The pinned-host allocator's record of the capture cannot be ended from Python, so a later capture into
    the same pool id is refused; kvserve's retries capture into a new pool. The graph is kept alive
    (`_FAILED_GRAPHS`), and so is its registration with the generator: where it was the first graph to
    register, the generator's graph-safe seed and offset stay allocated: 1 KiB that torch allocates at
    capture_begin on the capture's stream, so a new 2 MiB segment where that stream has no free small block
    (benchmarks/capture_failure_residue.py). A failure here is logged: the capture's own error is the one the
    caller gets."""
    try:
        graph.pool()  # raises unless the capture ended
    except RuntimeError:
        pass
    else:
        return  # it ended: the graph gives its reference back when it is destroyed
    try:
        _FAILED_GRAPHS.append(graph)
        device = torch.cuda.current_device()
        if pool is not None:  # (a pool of the graph's own has no id to name here; kvserve always passes one)
            try:
                torch._C._cuda_endAllocateToPool(device, pool)
            except RuntimeError:
                pass  # not routing to it: the capture never took its reference, or torch ended the routing
            else:
                torch._C._cuda_releasePool(device, pool)
        graph.reset()
        generator = torch.cuda.default_generators[device]
        try:
            offset = generator.get_offset()
            torch.empty(1, device=torch.device("cuda", device)).uniform_()
        except RuntimeError:
            generator.graphsafe_set_state(generator.clone_state())
        else:
            generator.set_offset(offset)
    except Exception:  # noqa: BLE001 (the capture's error is the one to raise)
        logger.warning("cleaning up after a failed CUDA graph capture failed", exc_info=True)


def warm_up_and_capture(fn: Callable[[], T], pool: Any, stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, T]:
    """One graph of `fn` into `pool`, after a warm-up run outside capture (it compiles the Triton kernels of
    this shape and sets up cuBLAS). Call on `stream`."""
    fn()
    return capture_graph(fn, pool, stream)


class CUDAGraphRunner:
    """Owns the captured graphs. `capture` once (after the KV cache exists), then `replay(size)` (decode) or
    `replay_prefill(num_tokens, cache)`.

    input_ids/positions/slot_mapping/query_start_loc/seq_lens: the runner's persistent device buffers
    (at least max(sizes) long, query_start_loc one more); block_tables: its persistent batch block-table
    buffer [>= max(sizes), width], width * block_size >= max_model_len.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        buffers: dict[str, torch.Tensor],
        block_tables: torch.Tensor,
        sizes: Sequence[int],
        max_model_len: int,
        cascade_min_size: int | None = None,
        prefill_sizes: Sequence[int] = (),
        cache_prefill_sizes: Sequence[int] = (),
        pad_min_gain: float = 0.0,
    ) -> None:
        """cascade_min_size: also capture cascade graphs for sizes >= it (needs buffers
        "common_prefix_len"); None: none. prefill_sizes / cache_prefill_sizes: token counts of the
        fresh-prompt and of the cache prefill graphs (the token buffers must hold the largest; cache graphs
        need request buffers of at least 2). pad_min_gain > 0: time the decode graphs after capture, and let
        a batch replay a larger size's graph when that one is faster by this fraction (`choose_padding`)."""
        self.pad_min_gain = pad_min_gain
        # Each decode size's attention launch ((KV split count, busy tiling), from host ints): padding keeps it.
        self.attention_launch = {
            size: ops.decode_attention_launch(size, kv_caches[0], max_model_len) for size in sizes
        } if kv_caches else None
        # With fp8 weights a size's matmuls take their numerics from its row count (`ops.fp8_numerics`:
        # weight-only fp8 up to FP8_SKINNY_MAX_ROWS rows, activations quantized past it; the fp16 dot up to 16
        # rows): padding keeps a batch's, so that a timing at start cannot decide which numerics a batch gets.
        self.fp8_numerics = ({size: ops.fp8_numerics(size) for size in sizes}
                             if model is not None and _has_fp8_weights(model) else None)
        self.model = model
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.block_tables = block_tables
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.cascade_sizes = (
            [s for s in self.sizes if s >= cascade_min_size] if cascade_min_size is not None else []
        )
        self.prefill_sizes = sorted(prefill_sizes)
        self.cache_prefill_sizes = sorted(cache_prefill_sizes)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._prefill_graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Replays of prefill graphs so far, fresh-prompt (False) and cache (True) graphs: tests read them.
        self.prefill_replays = {False: 0, True: 0}
        self.pool_bytes = 0
        self.capture_s = 0.0
        # The graphs' memory pool and capture stream once captured (the piecewise graphs share them).
        self.pool: Any = None
        self.stream: torch.cuda.Stream | None = None
        # Decode graphs timed at capture (ms per replay of a padding-only batch), and the size whose graph
        # serves the batches each size is the smallest fit for (`choose_padding`).
        self.size_ms: dict[int, float] = {}
        self._pad_to: dict[int, int] = {}

    def padded_size(self, num_reqs: int, cascade: bool = False) -> int | None:
        """The decode graph size a batch of num_reqs requests replays (None: no graph holds it). A cascade
        batch takes the smallest size that holds it: only the plain graphs were timed, and a cascade
        graph's shared-prefix kernel also works for the padding rows and splits the prefix by the size."""
        if not self._graphs:
            return None
        size = padded_batch_size(num_reqs, self.sizes)
        if size is None or cascade:
            return size
        return self._pad_to.get(size, size)

    def has(self, size: int, cascade: bool) -> bool:
        return (size, cascade) in self._graphs

    def _metadata(self, size: int, cascade: bool) -> AttentionMetadata:
        b = self.buffers
        return AttentionMetadata(
            query_start_loc=b["query_start_loc"][: size + 1],
            seq_lens=b["seq_lens"][:size],
            block_tables=self.block_tables[:size],
            slot_mapping=b["slot_mapping"][:size],
            max_query_len=1,
            # Captured for the longest context: the split count and grid then fit every replay.
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[self.max_model_len] * size,
            # Any positive host value selects the cascade kernels; they read the length from the buffer.
            common_prefix_len=1 if cascade else 0,
            common_prefix_len_tensor=b["common_prefix_len"] if cascade else None,
        )

    def _forward(self, size: int, cascade: bool) -> torch.Tensor:
        b = self.buffers
        metadata = self._metadata(size, cascade)
        return self.model(b["input_ids"][:size], b["positions"][:size], self.kv_caches, metadata)

    def _prefill_forward(self, num_tokens: int, starts: torch.Tensor | None) -> torch.Tensor:
        """One request padded to num_tokens tokens; starts: for a fresh-prompt graph, a device int32
        [0, num_tokens] of this size's own (made before capture); None for a cache graph.
        * fresh-prompt graph: one prompt of num_tokens tokens, attended by the fast path over this step's
          keys and values (seq_lens and the block table are there for the metadata's contract);
        * cache graph: the request, then the padding as a request of seq_len 0, over the cache. The host
          lengths only give the token count, the request count and the longest query (what the kernel's
          launch depends on), and say "not a fresh prompt" (no fast path); the kernel reads the real lengths
          from the buffers."""
        b = self.buffers
        if starts is None:
            metadata = AttentionMetadata(
                query_start_loc=b["query_start_loc"][:3],
                seq_lens=b["seq_lens"][:2],
                block_tables=self.block_tables[:2],
                slot_mapping=b["slot_mapping"][:num_tokens],
                max_query_len=num_tokens,
                max_seq_len=self.max_model_len,
                # (within max_model_len, as the reference's gathers need on the CPU)
                query_start_loc_cpu=[0, num_tokens - 1, num_tokens],
                seq_lens_cpu=[num_tokens, 0],
            )
        else:
            metadata = AttentionMetadata(
                query_start_loc=starts,
                seq_lens=starts[1:],
                block_tables=self.block_tables[:1],
                slot_mapping=b["slot_mapping"][:num_tokens],
                max_query_len=num_tokens,
                max_seq_len=num_tokens,
                query_start_loc_cpu=[0, num_tokens],
                seq_lens_cpu=[num_tokens],
            )
        # Returns the row of `logits_indices[0]` alone (the request's last real token, as `prepare` sets it).
        return self.model(b["input_ids"][:num_tokens], b["positions"][:num_tokens], self.kv_caches, metadata,
                          b["logits_indices"][:1])

    def _for_each_variant(self, run: Callable[[tuple[int, bool], bool, Callable[[], torch.Tensor]], None]) -> None:
        """Set the buffers to a padding-only batch (writes nothing, reads only cache block 0) and call
        run(key, is_prefill, forward) for every graph, largest first: the prefill graphs (key (tokens,
        cache)), then the decode graphs (key (size, cascade)). Call on the capture stream."""
        b = self.buffers
        largest = self.sizes[-1]
        tokens = max([largest, *self.prefill_sizes, *self.cache_prefill_sizes])
        b["input_ids"][:tokens].zero_()
        b["positions"][:tokens].zero_()
        b["slot_mapping"][:tokens].fill_(-1)
        b["logits_indices"][:1].zero_()  # the prefill graphs' output row
        self.block_tables[: max(largest, 2)].zero_()  # (a cache graph's padding request reads row 1)
        device = b["input_ids"].device
        starts = {n: torch.tensor([0, n], dtype=torch.int32, device=device) for n in self.prefill_sizes}
        self._prefill_starts = starts  # the graphs read them
        variants = [(n, False) for n in self.prefill_sizes] + [(n, True) for n in self.cache_prefill_sizes]
        for n, cache in sorted(variants, reverse=True):
            if cache:  # a request of n tokens with no context (reading cache block 0), then an empty one
                b["query_start_loc"][:3].copy_(torch.tensor([0, n, n], dtype=torch.int32))
                b["seq_lens"][:2].copy_(torch.tensor([n, 0], dtype=torch.int32))
            run((n, cache), True, functools.partial(self._prefill_forward, n, None if cache else starts[n]))
        b["seq_lens"][:largest].zero_()
        b["query_start_loc"][: largest + 1].copy_(torch.arange(largest + 1, dtype=torch.int32))
        if self.cascade_sizes:
            b["common_prefix_len"].zero_()
        variants = [(size, True) for size in self.cascade_sizes] + [(size, False) for size in self.sizes]
        for size, cascade in sorted(variants, reverse=True):
            run((size, cascade), False, functools.partial(self._forward, size, cascade))

    @torch.inference_mode()
    def run_eagerly(self) -> None:
        """Run each graph's forward once, eagerly, on the inputs `capture` uses (what it launches; captures
        nothing): how start-up lists the Triton variants the capture will need."""
        self._for_each_variant(lambda key, is_prefill, forward: forward())

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first (the prefill graphs, then the decode graphs), into one
        pool. The buffers are set to a padding-only batch (writes nothing, reads only cache block 0) for the
        warm-up and capture runs."""
        start = time.perf_counter()
        device = self.buffers["input_ids"].device
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # as after the capture: the difference is then the pool's alone
        before = torch.cuda.mem_get_info()[0]
        pool = self.pool = torch.cuda.graph_pool_handle()
        stream = self.stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())

        def capture_one(key: tuple[int, bool], is_prefill: bool, forward: Callable[[], torch.Tensor]) -> None:
            if not is_prefill:
                self._graphs[key] = warm_up_and_capture(forward, pool, stream)
                return
            self._prefill_graphs[key] = warm_up_and_capture(forward, pool, stream)
            if not key[1] and not ops.prefill_fast_path_applies(self.model.dtype, device):
                # The fast path failed and turned itself off: this fresh-prompt graph attends over the
                # cache with the padding as more tokens of the prompt (see the module docstring).
                raise RuntimeError("the one-prompt prefill fast path turned off during the graphs' warm-up")

        with torch.cuda.stream(stream):
            self._for_each_variant(capture_one)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-up runs' blocks, so that the pool's size below is the pool's
        if self.pad_min_gain > 0 and len(self.sizes) > 1:
            self._time_decode_graphs()
        self.pool_bytes = max(before - torch.cuda.mem_get_info()[0], 0)
        self.capture_s = time.perf_counter() - start
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s%s)%s in %.1f s, pool %.1f MiB",
            len(self._graphs), self.sizes,
            f"; cascade attention at {self.cascade_sizes}" if self.cascade_sizes else "",
            (f" and one-request prefill graphs ({len(self.prefill_sizes)} fresh-prompt up to "
             f"{max(self.prefill_sizes, default=0)} tokens, {len(self.cache_prefill_sizes)} over the cache up to "
             f"{max(self.cache_prefill_sizes, default=0)})") if self._prefill_graphs else "",
            self.capture_s, self.pool_bytes / (1 << 20),
        )

    def _time_decode_graphs(self, warm_up: int = 2, repeats: int = 5) -> None:
        """Time every decode graph on the padding-only batch the capture left in the buffers (no cache
        reads or writes: what a size costs by itself) and choose each size's padding from that. The
        fastest of `repeats` replays counts: what a size can do, not the noise of one replay."""
        for size in self.sizes:
            graph = self._graphs[(size, False)][0]
            for _ in range(warm_up):
                graph.replay()
            best = float("inf")
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end))
            self.size_ms[size] = best
        self.set_size_times(self.size_ms)

    def _padding_keys(self) -> dict[int, Hashable] | None:
        """What a batch keeps when it replays a larger size's graph (`choose_padding`): its attention launch and,
        with fp8 weights, its matmuls' numerics; None when neither applies."""
        if self.attention_launch is None and self.fp8_numerics is None:
            return None
        launch, fp8 = self.attention_launch or {}, self.fp8_numerics or {}
        return {size: (launch.get(size), fp8.get(size)) for size in self.sizes}

    def set_size_times(self, times_ms: dict[int, float]) -> None:
        """Take each decode size's time (ms per replay of a padding-only batch; every captured size) and
        choose the padding from it (`choose_padding` with this runner's pad_min_gain)."""
        if sorted(times_ms) != self.sizes:
            raise ValueError(f"times for sizes {sorted(times_ms)}, captured sizes {self.sizes}")
        self.size_ms = dict(times_ms)
        self._pad_to = choose_padding(self.size_ms, self.pad_min_gain, self._padding_keys())
        moved = {s: t for s, t in self._pad_to.items() if t != s}
        if moved:
            logger.info(
                "decode graphs timed at capture: batches that fit size s first replay a larger, faster graph: %s",
                ", ".join(f"{s} -> {t} ({self.size_ms[t]:.2f} vs {self.size_ms[s]:.2f} ms)" for s, t in moved.items()),
            )

    def replay(self, size: int, cascade: bool = False) -> torch.Tensor:
        """Run the graph of `size` (its cascade variant if `cascade`) over the current buffer contents;
        returns its hidden states [size, hidden_size] (a buffer of the pool, valid until the next replay)."""
        graph, out = self._graphs[(size, cascade)]
        graph.replay()
        return out

    def replay_prefill(self, num_tokens: int, cache: bool) -> torch.Tensor:
        """Run the prefill graph of `num_tokens` (a captured size; `cache`: the cache graph) over the current
        buffers, filled by `InputBuffers.prepare(..., prefill_pad_to=num_tokens, pad_as_request=cache)`.
        Returns the final hidden state of the request's last real token [1, hidden_size] (the row
        `logits_indices[0]` names; valid until the next replay)."""
        graph, out = self._prefill_graphs[(num_tokens, cache)]
        graph.replay()
        self.prefill_replays[cache] += 1
        return out
