"""Owns the model, the KV cache tensors and the sampler; runs one SchedulerOutput per call.

Start-up order (driven by EngineCore): construct (load weights, allocate persistent input buffers) ->
`determine_num_blocks` (CPU: the --kv-cache-memory budget; GPU: a profiled forward, see `worker.memory`;
the device's memory in use is read first, before the weights, and an instance whose --gpu-memory-utilization
budget exceeds the free memory refuses to start there; then --kv-cache-memory when given, else the
--gpu-memory-utilization budget) -> `initialize_kv_cache` -> `capture_cuda_graphs` (GPU, unless enforce_eager).

Per step: apply the scheduler's diffs to the runner's request states and block table, fill the persistent
input buffers, run the model (a CUDA-graph replay for decode-only batches that fit a captured size and for
one-request prefills up to the prefill graphs' size, piecewise graphs with eager attention between them for
other steps up to their size, else eager), sample on the device, and copy the sampled ids (and requested logprobs) to the host: the one
host sync of the step.

`execute_model_async` launches all of that and returns a `PendingOutput` without waiting; its `result()`
is the sync. Meanwhile the engine core may schedule and launch the next step (async scheduling): tokens
the scheduler marks as placeholders (sampled by the previous step, ids not yet on the host) are filled in
on the device from the previous step's sampled ids, so the GPU never waits for the host in between.

A step can also be launched in two halves: `launch_forward` (inputs, forward, logits) and `sample` (the
sampler, given the grammars' token masks, and the copy to the host). The engine core does so for a step
that samples a request under a grammar: the masks need the previous step's tokens, which it reads, and the
masks it computes, while the GPU runs the forward. Tokens recorded by then are sampled from the requests'
lists, not as placeholders.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvserve import envs
from kvserve.config import ConfigError, EngineConfig, kv_cache_torch_dtype
from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from kvserve.kernels import cublaslt, ops, triton_precompile
from kvserve.layers.attention_metadata import AttentionMetadata
from kvserve.layers.linear import Linear
from kvserve.layers.sampler import Sampler, SamplingRow, compute_logprobs, make_generator
from kvserve.model.gguf import dequantization_summary
from kvserve.model.loader import load_model
from kvserve.protocol.sampling_params import SamplingParams
from kvserve.structured_output import bitmask_words
from kvserve.worker import input_batch
from kvserve.worker.cuda_graph import (
    CACHE_PREFILL_GRAPH_MAX_TOKENS,
    CUDAGraphRunner,
    prefill_graph_key,
    prefill_graph_sizes,
)
from kvserve.worker.input_batch import BlockTable, InputBuffers
from kvserve.worker.memory import (
    CUDA_GRAPH_RESERVE_BYTES,
    GiB,
    KVCacheMemoryError,
    KVCachePlan,
    MemoryProfile,
    describe_requested_kv_cache,
    plan_kv_cache,
    plan_requested_kv_cache,
    prefill_graph_reserve_bytes,
    start_memory_error,
)
from kvserve.worker.piecewise import CudaGraphBackend, PiecewiseGraphs, piecewise_graph_sizes

logger = logging.getLogger(__name__)

# Most new tokens a one-request prefill CUDA graph serves (KVSERVE_PREFILL_GRAPH_MAX_TOKENS; 0: none). Eager,
# such a step is host-bound up to about this length on the H200's hosts (docs/perf_notes.md, entry 21).
PREFILL_GRAPH_MAX_TOKENS = envs.KVSERVE_PREFILL_GRAPH_MAX_TOKENS
# Most tokens of a step served by the piecewise CUDA graphs (KVSERVE_PIECEWISE_GRAPH_MAX_TOKENS; 0: none):
# steps that no whole-forward graph serves (worker/piecewise.py).
PIECEWISE_GRAPH_MAX_TOKENS = envs.KVSERVE_PIECEWISE_GRAPH_MAX_TOKENS
# A decode batch replays a larger captured size's graph when that one timed at least this much faster at
# start (KVSERVE_GRAPH_PAD_MIN_GAIN_PCT; 0: always the smallest size that holds the batch).
GRAPH_PAD_MIN_GAIN = envs.KVSERVE_GRAPH_PAD_MIN_GAIN_PCT / 100
# Matmul tuning runs each candidate over this many bytes of distinct weights (of the model's layers) at
# decode sizes, so that no call reads its weights from the previous one's L2 lines (50 MB on the H200).
GEMM_TUNING_WEIGHT_BYTES = 200 * 1024 * 1024
# Weight dtypes whose matmuls are tuned, and whether torch's own pick competes (tests force the cuBLASLt path
# with float32 models, whose greedy tokens must then equal torch's).
GEMM_TUNING_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
GEMM_TUNING_TORCH_CANDIDATE = True
# Decoder layers the precompile's forwards run (the first layer's variants differ, the others repeat).
PRECOMPILE_LAYERS = 2


@dataclass
class GemmGroup:
    """The model's dense `Linear` layers of one matmul shape, as this rank runs them."""

    names: list[str] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)
    biases: list[torch.Tensor | None] = field(default_factory=list)


def gemm_tuning_path() -> Path:
    """The stored matmul choices (KVSERVE_CACHE_DIR/gemm_tuning.json)."""
    return Path(envs.KVSERVE_CACHE_DIR) / "gemm_tuning.json"


def gemm_tuning_groups(model: torch.nn.Module) -> dict[tuple[int, int, bool, torch.dtype], GemmGroup]:
    """The model's fp16/bf16 dense `Linear` layers (not the LM head) by (N, K, bias added, dtype): the shapes the
    start-up matmul tuning chooses for. A row-parallel layer's bias counts only on the rank that adds it."""
    groups: dict[tuple[int, int, bool, torch.dtype], GemmGroup] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.weight is not None and module.weight.dtype in GEMM_TUNING_DTYPES:
            n, k = module.weight.shape
            bias = module.applied_bias()
            group = groups.setdefault((n, k, bias is not None, module.weight.dtype), GemmGroup())
            group.names.append(name)
            group.weights.append(module.weight)
            group.biases.append(bias)
    return groups


@dataclass
class RunnerRequestState:
    """What sampling needs to remember about a live request (kept across preemption)."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)  # the request's own (NewRequestData's)
    # prompt_logprobs: the next prompt position whose logprob is still to compute (position 0 has none)
    next_prompt_target: int = 1


class PendingOutput:
    """A launched step's sampled ids (and logprobs) on their way to the host. `result()` waits for them,
    records the tokens in the requests' states and returns the step's ModelRunnerOutput. Call it once."""

    def __init__(
        self,
        req_ids: list[str],
        states: list[RunnerRequestState],
        sampled_host: torch.Tensor | None,
        logprob_host: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None,
        done: torch.cuda.Event | None,
        prompt_logprobs: PromptLogprobsPending | None = None,
    ) -> None:
        self.req_ids = req_ids
        self._states = states
        self._sampled_host = sampled_host
        self._logprob_host = logprob_host
        self._done = done
        self._prompt_logprobs = prompt_logprobs
        # Whether result() has recorded the tokens in the requests' states.
        self.recorded = False

    @classmethod
    def empty(cls, prompt_logprobs: PromptLogprobsPending | None = None) -> PendingOutput:
        done = None
        if prompt_logprobs is not None and prompt_logprobs.values.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return cls([], [], None, None, done, prompt_logprobs)

    def result(self) -> ModelRunnerOutput:
        if self._done is not None:
            # SYNC: the step's one wait: its sampled ids (and logprobs) have reached the host.
            self._done.synchronize()
        token_ids: list[int] = self._sampled_host.tolist() if self._sampled_host is not None else []
        logprobs = _logprobs_lists(self._logprob_host, self._states)
        for state, token_id in zip(self._states, token_ids, strict=True):
            state.output_token_ids.append(token_id)
        self.recorded = True
        prompt = self._prompt_logprobs.lists() if self._prompt_logprobs is not None else {}
        return ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=token_ids, logprobs=logprobs,
                                 prompt_logprobs=prompt)


@dataclass
class LaunchedStep:
    """A step whose forward pass and logits are launched and whose sampling is not (`ModelRunner.sample`
    launches it)."""

    scheduler_output: SchedulerOutput
    sampled_req_ids: list[str]
    logits: torch.Tensor | None  # None: no request samples in this step
    prompt_logprobs: PromptLogprobsPending | None


@dataclass
class PromptLogprobSpan:
    """One request's prompt positions whose logprobs a step computes: the logits of hidden rows
    `row .. row + count - 1` give the logprobs of prompt tokens `first .. first + count - 1` (each row's
    next token), with the top `k`."""

    req_id: str
    row: int
    first: int
    count: int
    k: int


@dataclass
class PromptLogprobsPending:
    """A step's prompt logprobs on their way to the host (`values` / `token_ids` / `ranks` as
    `sampler.compute_logprobs` gives them, the spans' rows in order)."""

    spans: list[PromptLogprobSpan]
    values: torch.Tensor
    token_ids: torch.Tensor
    ranks: torch.Tensor

    def lists(self) -> dict[str, list[TokenLogprobs]]:
        values, ids, ranks = self.values.tolist(), self.token_ids.tolist(), self.ranks.tolist()
        out: dict[str, list[TokenLogprobs]] = {}
        i = 0
        for span in self.spans:
            width = 1 + span.k
            out[span.req_id] = [TokenLogprobs(token_ids=ids[r][:width], logprobs=values[r][:width], rank=ranks[r])
                                for r in range(i, i + span.count)]
            i += span.count
        return out


def _logprobs_lists(
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None, states: list[RunnerRequestState]
) -> list[TokenLogprobs | None]:
    wanted = [s.sampling_params.logprobs for s in states]
    if host is None or all(k is None for k in wanted):
        return [None] * len(states)
    values_t, ids_t, ranks_t = host
    values = values_t.tolist()
    ids = ids_t.tolist()
    ranks = ranks_t.tolist() if ranks_t is not None else [0] * len(states)
    out: list[TokenLogprobs | None] = []
    for i, k in enumerate(wanted):
        if k is None:
            out.append(None)
        else:
            out.append(TokenLogprobs(token_ids=ids[i][: 1 + k], logprobs=values[i][: 1 + k], rank=ranks[i]))
    return out


def prefer_cublaslt(device: torch.device) -> bool:
    """On CUDA, route torch's matmuls to cuBLASLt (process-wide), unless TORCH_BLAS_PREFER_CUBLASLT is set
    (then torch's own reading of it stands). On the H200 this made decode at batch 32-64 about 1 % faster
    and changed prefill and batch-1 decode by less than the noise (docs/perf_notes.md, entry 20)."""
    if device.type != "cuda" or envs.TORCH_BLAS_PREFER_CUBLASLT_SET:
        return False
    torch.backends.cuda.preferred_blas_library("cublaslt")
    return True


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device_config.device)
        prefer_cublaslt(self.device)
        # total - free when this runner started using the device (CUDA), before its weights: the budget
        # counts only what this process adds from here on (`worker.memory`).
        self.in_use_at_start_bytes: int | None = None
        if self.device.type == "cuda":
            self.in_use_at_start_bytes = self.read_memory_at_start()
        self.dtype: torch.dtype = getattr(torch, config.model_config.dtype)
        # The KV cache's dtype: the model's, or fp8 (--kv-cache-dtype), which the cache-writing kernels scale
        # into and attention scales back out of (each layer's `Attention.k_scale` / `v_scale`: the checkpoint's
        # KV-cache scales, else 1.0).
        self.kv_cache_dtype: torch.dtype = getattr(
            torch, kv_cache_torch_dtype(config.cache_config.kv_cache_dtype, config.model_config.dtype))
        self.block_size = config.cache_config.block_size
        # Before any CUDA graph capture: the graphs bake each layer's KV-cache scales (plain floats) in.
        self.model = load_model(config.model_config, self.device, self.kv_cache_dtype)
        # This rank's shapes (its heads and KV heads with tensor parallelism): what the caches, buffers and
        # warm-up batches are built from. The vocabulary, hidden size and layer count are the checkpoint's.
        self.arch = self.model.layer_arch
        self.eos_token_ids = list(self.arch.eos_token_ids)
        self.sampler = Sampler(seed=config.model_config.seed)
        self.requests: dict[str, RunnerRequestState] = {}
        # the live requests whose sampling reads their earlier output (SamplingParams.needs_output_history)
        self._history_req_ids: set[str] = set()
        # the live requests with prompt_logprobs whose prompt positions are not all computed yet
        self._prompt_logprob_req_ids: set[str] = set()
        sched = config.scheduler_config
        self.max_num_reqs = sched.max_num_seqs
        width = -(-config.model_config.max_model_len // self.block_size)
        self.block_table = BlockTable(self.max_num_reqs, width, self.device)
        self.inputs = InputBuffers(
            max_num_tokens=max(sched.max_num_batched_tokens, self.max_num_reqs),
            max_num_reqs=self.max_num_reqs,
            block_table_width=width,
            block_size=self.block_size,
            device=self.device,
            cascade=config.cascade_attn,
        )
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: CUDAGraphRunner | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.memory_profile: MemoryProfile | None = None
        self.gemm_tuning: list[cublaslt.TuneResult] = []  # what tune_gemms() chose (and timed)
        self.precompile_stats: dict[str, Any] = {}  # what precompile_kernels() found and compiled
        self.kv_plan: KVCachePlan | None = None
        # The last launched step's sampled ids (device) and each sampling request's row in them: where
        # the next step's placeholder tokens come from.
        self._prev_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        # The last sampled step's output: until its result() records its tokens, they are placeholders.
        self._last_output: PendingOutput | None = None

    # ------------------------------------------------------------------ KV cache

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one block takes over every layer, K and V, in the cache's dtype (1 byte a value for fp8)."""
        arch = self.arch
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * arch.num_hidden_layers * self.block_size * arch.num_key_value_heads * arch.head_dim * elem

    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def read_memory_at_start(self) -> int:
        """The device's memory in use (total - free, every process's) as this runner starts: after the CUDA
        context exists (`mem_get_info` creates it) and after this process's garbage and cached free blocks are
        released (an earlier in-process engine's, which this one's weights would otherwise reuse unseen), before
        the weights. Refuses to start (ConfigError) when the free memory is below what
        --gpu-memory-utilization asks for, unless --num-gpu-blocks-override or --kv-cache-memory sizes the cache
        instead."""
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        cache = self.config.cache_config
        if not cache.num_blocks and cache.gpu_kv_cache_memory_bytes is None:
            error = start_memory_error(free, total, cache.gpu_memory_utilization)
            if error is not None:
                raise ConfigError(error)
        return total - free

    def gguf_capacity_note(self) -> str:
        """For a GGUF model, what a GPU capacity error adds: its weights are dequantized at load, so the file's
        size is not what they take ("" for other models)."""
        model_config = self.config.model_config
        if not model_config.is_gguf or model_config.load_format == "dummy":
            return ""
        return (f" (note: {dequantization_summary(model_config.model, self.weights_bytes(), model_config.dtype)}; "
                f"a smaller GGUF quantization does not make them smaller, an AWQ or GPTQ checkpoint stays packed "
                f"on the GPU)")

    def determine_num_blocks(self) -> int:
        """Blocks that fit the KV budget: `--kv-cache-memory` on CPU; on GPU `--kv-cache-memory` when given
        (checked against what the device has free after the profile), else what `gpu_memory_utilization`
        leaves after the weights and a profiled forward at max_num_batched_tokens (see `worker.memory`)."""
        per_block = self.kv_cache_bytes_per_block()
        if self.device.type == "cpu":
            return max(self.config.cache_config.kv_cache_memory_bytes // per_block, 0)
        self.memory_profile = self.profile_memory()
        requested = self.config.cache_config.gpu_kv_cache_memory_bytes
        if requested is not None:  # --kv-cache-memory: that size, if the device has it free
            try:
                self.kv_plan = plan_requested_kv_cache(self.memory_profile, requested, per_block)
            except KVCacheMemoryError as exc:  # the GGUF note reads the file's metadata: only when it is said
                raise ConfigError(str(exc) + self.gguf_capacity_note()) from None
            logger.info("%s", describe_requested_kv_cache(self.kv_plan, self.memory_profile))
            return self.kv_plan.num_blocks
        self.kv_plan = plan_kv_cache(
            self.memory_profile, self.config.cache_config.gpu_memory_utilization, per_block
        )
        logger.info(
            "%s", self.kv_plan.describe(self.memory_profile, self.config.cache_config.gpu_memory_utilization)
        )
        return self.kv_plan.num_blocks

    @torch.inference_mode()
    def profile_memory(self) -> MemoryProfile:
        """Run the largest step the scheduler can send (max_num_batched_tokens prompt tokens, then logits and
        a top-k/top-p sampling pass with logprobs over max_num_seqs rows) and measure its peak memory."""
        sched = self.config.scheduler_config
        device = self.device
        if self.gemm_tuning_enabled():
            try:  # the tuned matmuls' workspace, resident from now on: counted in the memory in use
                cublaslt.workspace(device)
            except cublaslt.LtUnavailable:
                pass
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base_allocated = torch.cuda.memory_allocated(device)

        num_tokens = sched.max_num_batched_tokens
        max_len = self.config.model_config.max_model_len
        num_reqs = min(max(1, -(-num_tokens // max_len)), num_tokens)
        lens = [num_tokens // num_reqs + (1 if i < num_tokens % num_reqs else 0) for i in range(num_reqs)]
        # A one-block cache that no token writes (slot -1): activations, not KV, are being measured.
        arch = self.arch
        kv_shape = (2, 1, self.block_size, arch.num_key_value_heads, arch.head_dim)
        kv_caches = [
            torch.zeros(kv_shape, dtype=self.kv_cache_dtype, device=device) for _ in range(arch.num_hidden_layers)
        ]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        width = -(-max(lens) // self.block_size)
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_tables=torch.zeros((num_reqs, width), dtype=torch.int32, device=device),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
            max_query_len=max(lens),
            max_seq_len=max(lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=lens,
        )
        generator = torch.Generator(device=device)
        generator.manual_seed(0)
        input_ids = torch.randint(0, arch.vocab_size, (num_tokens,), device=device, generator=generator)
        positions = torch.cat([torch.arange(n, device=device) for n in lens])
        hidden = self.model(input_ids, positions, kv_caches, metadata)
        num_rows = self.max_num_reqs
        rows_index = torch.arange(num_rows, device=device) % num_tokens
        logits = self.model.compute_logits(hidden[rows_index])
        # Every sampling step at once, penalties included: their per-request counts (`PenaltyCounts`, kept on
        # the device for as many rows) stay allocated and count as memory in use, their temporaries in the peak.
        params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, logprobs=20,
                                repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1,
                                allowed_token_ids=[0])
        req_ids = [f"memory profile {i}" for i in range(num_rows)]
        # Every row under a grammar too (its mask's temporaries; the mask allows every token).
        mask = b"\xff" * (4 * bitmask_words(arch.vocab_size))
        rows = [SamplingRow(params, [0], [0], None, req_id=req_id, grammar_mask=mask) for req_id in req_ids]
        kept_before = self.sampler.kept_bytes()
        self.sampler(logits, rows, self.eos_token_ids)
        self.sampler.release(req_ids)
        torch.cuda.synchronize(device)
        # The kept counts stay allocated: memory in use below, not a temporary of the peak.
        peak = torch.cuda.max_memory_allocated(device) - base_allocated - (self.sampler.kept_bytes() - kept_before)
        del hidden, logits, kv_caches, metadata, input_ids, positions
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        use_graphs = self.config.use_cuda_graphs
        weights = self.weights_bytes()
        # Not read (a runner that did not start on CUDA): everything in use counts as this instance's.
        at_start = self.in_use_at_start_bytes or 0
        if total - free - at_start < weights:
            logger.warning(
                "GPU memory in use grew by %.2f GiB since this instance started, less than its %.2f GiB of weights: "
                "memory counted at start was released meanwhile (by another process, or an earlier engine of this "
                "one); the KV cache is sized as if this instance added only its weights (start instances on a "
                "shared GPU one after another)",
                (total - free - at_start) / GiB, weights / GiB,
            )
        return MemoryProfile(
            total_bytes=total,
            weights_bytes=weights,
            in_use_bytes=total - free,
            in_use_at_start_bytes=at_start,
            activation_peak_bytes=peak,
            graph_reserve_bytes=(
                CUDA_GRAPH_RESERVE_BYTES
                + prefill_graph_reserve_bytes(
                    peak, num_tokens, [n for sizes in self.prefill_graph_sizes() for n in sizes],
                    arch.hidden_size * torch.empty((), dtype=self.dtype).element_size(),
                    piecewise_tokens=self.piecewise_graph_sizes(),
                    piecewise_row_bytes=arch.q_size * torch.empty((), dtype=self.dtype).element_size(),
                )
                if use_graphs
                else 0
            ),
        )

    def set_max_model_len(self, max_model_len: int) -> None:
        """Lower max_model_len (max_model_len auto, once the KV cache is sized; before it is allocated): what is
        built from it later (CUDA graphs, prefill graph sizes, warm-up shapes, the length check of a step) takes
        the new length. What was sized with the old one (the block tables' width, the profiled step) stays: it
        holds every shorter length."""
        self.config = self.config.with_max_model_len(max_model_len)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        arch = self.arch
        shape = (2, num_blocks, self.block_size, arch.num_key_value_heads, arch.head_dim)
        # Zeroed so never-written slots hold finite values: masked attention weights are exactly 0, and
        # 0 * NaN from uninitialised memory would still poison the output.
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device) for _ in range(arch.num_hidden_layers)
        ]

    @torch.inference_mode()
    def warm_up_kernels(self) -> list[int]:
        """Run the kernels' start-up shapes (`_warm_up_batches`), so that the first requests that need them
        find them compiled (seconds each on the H200), then build cuDNN's prefill attention graphs. Nothing
        is written to the cache (slot -1). Returns the mixed chunk lengths run."""
        if not self.kv_caches:
            return []
        lengths = self._warm_up_batches()
        device, arch = self.device, self.arch
        # cuDNN prefill attention builds a graph per padded prompt length: all of them now (logged).
        longest = min(self.config.scheduler_config.max_num_batched_tokens, self.config.model_config.max_model_len)
        start = time.perf_counter()
        built = ops.warm_up_prefill_attention(
            arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, self.dtype, device, longest
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if built:
            logger.info("cuDNN prefill attention: built %d graphs for prompts of %d-%d tokens in %.1f s",
                        len(built), ops.cudnn_min_tokens(device), built[-1], time.perf_counter() - start)
        return lengths

    def _warm_up_batches(self, times: dict[str, float] | None = None) -> list[int]:
        """One small mixed batch (a decode row plus a prefill chunk with cached context) per query length that
        gives the mixed attention kernel a different tile shape; a two-prompt fresh prefill (the
        multi-request flash attention path, whose first use also stalled); eagerly served shared-prefix
        batches (no graphs); and the LM head at every row count the skinny matmul serves (it runs outside
        the graphs). Returns the mixed chunk lengths run; `times`, if given, gets each batch's seconds
        (GPU included)."""

        def mark(name: str, start: float) -> float:
            if times is None:
                return start
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = time.perf_counter()
            times[name] = now - start
            return now
        arch = self.arch
        group = arch.num_attention_heads // arch.num_key_value_heads
        shapes: dict[int, int] = {}  # the mixed kernel's rows per tile -> the shortest chunk giving it
        for query_len in range(2, 129):
            block_m = min(128, max(16, 1 << (query_len * group - 1).bit_length()))
            shapes.setdefault(block_m, query_len)
        device, context = self.device, 3
        lengths = sorted(shapes.values())
        batches = [([1, query_len], [context + 1, context + query_len]) for query_len in lengths]
        fresh = ops.PREFILL_FAST_MIN_QUERY_LEN
        batches.append(([fresh, fresh], [fresh, fresh]))
        tick = time.perf_counter()
        for query_lens, seq_lens in batches:
            num_tokens = sum(query_lens)
            starts = [0, query_lens[0], num_tokens]
            metadata = AttentionMetadata(
                query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                block_tables=self._warm_up_block_table(2, max(seq_lens)),
                slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
                query_start_loc_cpu=starts,
                seq_lens_cpu=seq_lens,
            )
            positions = [p for q, s in zip(query_lens, seq_lens, strict=True) for p in range(s - q, s)]
            input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
            pos = torch.tensor(positions, dtype=torch.int64, device=device)
            self.model(input_ids, pos, self.kv_caches, metadata)
            tick = mark(f"{'fresh' if query_lens[0] > 1 else 'mixed'} {query_lens[-1]}", tick)
        if device.type == "cuda" and self.config.cascade_attn and not self.config.use_cuda_graphs:
            self._warm_up_cascade()  # (with graphs, the capture compiles the cascade kernels)
        tick = mark("cascade", tick)
        if device.type == "cuda":
            self._warm_up_decode_launches()
        tick = mark("decode", tick)
        # Steps sample from 1 to max_num_seqs rows; the skinny matmul's variants depend on the row count.
        hidden = torch.zeros(min(self.max_num_reqs, ops.SKINNY_GEMM_MAX_ROWS + 1), arch.hidden_size,
                             dtype=self.dtype, device=device)
        for rows in range(1, hidden.shape[0] + 1):
            self.model.compute_logits(hidden[:rows])
        mark("logits", tick)
        return lengths

    @torch.inference_mode()
    def warm_up_sampled_rows(self) -> None:
        """The part of a step that runs on its sampled rows alone, outside the graphs (the last layer past its
        attention, the final norm and the LM head: `finish`, `compute_logits`), at every row count from the
        skinny matmul's last + 1 to max_num_seqs (below that the skinny matmul's Triton variants serve, and
        the warm-up batches ran the LM head there). cuBLAS loads a kernel the first time a shape needs it,
        and that holds the host until the GPU is idle: at the end of a forward, the step's output then came
        a step late (a fresh engine's first LM head at 47 rows held the host 283.7 ms on the H200). Called
        last at start on the GPU, after the graph capture."""
        if not self.kv_caches:
            return
        first, n, arch = ops.SKINNY_GEMM_MAX_ROWS + 1, self.max_num_reqs, self.arch
        if n < first:
            return
        decoder = getattr(self.model, "piecewise_model", None)  # (a model without it: the LM head alone)
        attn_rows = torch.zeros(n, arch.num_attention_heads * arch.head_dim, dtype=self.dtype, device=self.device)
        residual = torch.zeros(n, arch.hidden_size, dtype=self.dtype, device=self.device)
        rows = torch.arange(n, device=self.device)
        for m in range(first, n + 1):
            hidden = decoder.finish(attn_rows[:m], residual, rows[:m]) if decoder is not None else residual[:m]
            self.model.compute_logits(hidden)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _warm_up_block_table(self, num_reqs: int, seq_len: int) -> torch.Tensor:
        """Block-table rows for a warm-up batch that reads cache block 0 only: zeroed rows of the runner's
        persistent batch table where they hold seq_len (a step's table is a slice of it, and Triton
        specialises a kernel on whether that row stride divides by 16: a table of another width compiled
        variants the steps never use, and left theirs to compile at the first such step), else a new one."""
        table = self.inputs.block_tables
        if num_reqs <= table.shape[0] and seq_len <= table.shape[1] * self.block_size:
            rows = table[:num_reqs]
            rows.zero_()
            return rows
        return torch.zeros((num_reqs, -(-seq_len // self.block_size)), dtype=torch.int32, device=self.device)

    def _warm_up_decode_launches(self) -> None:
        """One decode attention launch per kernel variant and merge that eager decode-style launches can take
        (`ops.decode_launch_shapes`): the rows a step with prefill tokens samples attend as a decode batch of
        any size at any context, which the decode graphs, captured at max_model_len, do not all cover (a
        5-row batch's 14 splits need the reduce kernel's 16-split variant). Reads cache block 0 only."""
        arch, device = self.arch, self.device
        kv_cache = self.kv_caches[0]
        shapes = ops.decode_launch_shapes(
            self.max_num_reqs, self.config.model_config.max_model_len, arch.num_key_value_heads, ops.num_sms(device)
        )
        for num_reqs, seq_len in shapes:
            query = torch.zeros(num_reqs, arch.num_attention_heads, arch.head_dim, dtype=self.dtype, device=device)
            ops.paged_attention(query, kv_cache, self._warm_up_decode_metadata(num_reqs, seq_len), arch.head_dim**-0.5)

    def _warm_up_decode_metadata(self, num_reqs: int, seq_len: int, prefix: int = 0) -> AttentionMetadata:
        """A decode batch of num_reqs requests of seq_len tokens that reads cache block 0 only and writes
        nothing (slot -1); prefix > 0: its requests share that many leading tokens (cascade)."""
        device = self.device
        starts = list(range(num_reqs + 1))
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.full((num_reqs,), seq_len, dtype=torch.int32, device=device),
            block_tables=self._warm_up_block_table(num_reqs, seq_len),
            slot_mapping=torch.full((num_reqs,), -1, dtype=torch.int64, device=device),
            max_query_len=1,
            max_seq_len=seq_len,
            query_start_loc_cpu=starts,
            seq_lens_cpu=[seq_len] * num_reqs,
            common_prefix_len=prefix,
            common_prefix_len_tensor=torch.tensor([prefix], dtype=torch.int32, device=device) if prefix else None,
        )

    def _warm_up_cascade(self) -> None:
        """Decode batches of 8 to 64 requests sharing a prefix: every tile height of the shared-prefix kernel,
        with the own part split (8 requests) and unsplit (64 on a large GPU), so that eager serving does
        not compile them on its first shared-prefix batch. Reads cache block 0 only; writes nothing."""
        device = self.device
        prefix = input_batch.CASCADE_MIN_PREFIX_TOKENS
        seq_len = prefix + 44
        if seq_len > self.config.model_config.max_model_len:
            return
        for num_reqs in (8, 16, 32, 64):
            if num_reqs > self.max_num_reqs:
                break
            metadata = self._warm_up_decode_metadata(num_reqs, seq_len, prefix)
            input_ids = torch.zeros(num_reqs, dtype=torch.int64, device=device)
            pos = torch.full((num_reqs,), seq_len - 1, dtype=torch.int64, device=device)
            self.model(input_ids, pos, self.kv_caches, metadata)

    def gemm_tuning_enabled(self) -> bool:
        """Whether the start-up matmul tuning can register a cuBLASLt choice (`_gemm_tuning_can_register`);
        where it cannot (another GPU, stack or model with the default lookups only), neither the lookups nor the
        cuBLASLt workspace are needed."""
        plan = self.gemm_tuning_plan()
        if not plan:
            return False
        if any(time_missing for *_, time_missing in plan):  # no stored choice needed: nothing to read
            return True
        stored = {**cublaslt.shipped_choices(), **cublaslt.load_cache(gemm_tuning_path())}
        return self._gemm_tuning_can_register(plan, gemm_tuning_groups(self.model), stored)

    def _gemm_tuning_can_register(self, plan: list[tuple[int, bool, bool]],
                                  groups: dict[tuple[int, int, bool, torch.dtype], GemmGroup],
                                  stored: dict[str, dict]) -> bool:
        """A row count of the plan may be timed, or `stored` (the stored and shipped choices) holds a choice for
        one of its (rows, shape)s on this GPU and library stack (the keys `cublaslt.tune` reads)."""
        if any(time_missing for *_, time_missing in plan):
            return True
        try:
            return any(
                cublaslt.cache_key(self.device, rows, n, k, dtype, has_bias, GEMM_TUNING_TORCH_CANDIDATE, sustained)
                in stored for rows, sustained, _ in plan for n, k, has_bias, dtype in groups)
        except Exception as exc:  # noqa: BLE001 - cuBLASLt unavailable, say: nothing can be registered
            logger.info("matmul tuning off: its stored choices could not be read (%s: %s)", type(exc).__name__, exc)
            return False

    def gemm_tuning_plan(self) -> list[tuple[int, bool, bool]]:
        """(rows, sustained, time_missing) the start-up matmul tuning covers on CUDA:
        * the decode graph sizes: timed briefly each with KVSERVE_GEMM_TUNING; else, with
          KVSERVE_DECODE_GEMM_CHOICES, the stored or shipped sustained choices, never timed at start (cuBLASLt's
          candidates at these sizes are timed sustained by benchmarks/cublaslt_algos.py);
        * the large prefill step's rows: sustained choices, stored, shipped, or timed at start with
          KVSERVE_PREFILL_GEMM_TUNING=2; none with KVSERVE_PREFILL_GEMM_TUNING=0.
        A decode graph size equal to the step budget is the budget's."""
        if self.device.type != "cuda":
            return []
        budget = self.prefill_gemm_tuning_rows()
        decode = [rows for rows in self.gemm_tuning_rows() if rows not in budget]
        if envs.KVSERVE_GEMM_TUNING:
            plan = [(rows, False, True) for rows in decode]
        elif envs.KVSERVE_DECODE_GEMM_CHOICES:
            plan = [(rows, True, False) for rows in decode]
        else:
            plan = []
        return plan + [(rows, True, envs.KVSERVE_PREFILL_GEMM_TUNING >= 2) for rows in budget]

    def gemm_tuning_rows(self) -> list[int]:
        """Row counts whose matmuls are tuned at start: the decode graph sizes past the Triton skinny matmul's
        range (with CUDA graphs on; eager batches come in every size). Other steps of exactly such a token
        count (a prefill graph of 128 or 256 tokens, say) run the tuned plans too. The step budget's rows are
        `prefill_gemm_tuning_rows`' (sustained timings: short timings' choices at 8,192 rows made TTFT 8k 2-7 ms
        slower on the H200, docs/perf_notes.md, entry 28)."""
        if not self.config.use_cuda_graphs:
            return []
        return sorted({n for n in self.config.cuda_graph_sizes if n > ops.SKINNY_GEMM_MAX_ROWS})

    def prefill_gemm_tuning_rows(self) -> list[int]:
        """The step budget (`max_num_batched_tokens`) when it is larger than the prefill and piecewise CUDA
        graphs' size limits (PREFILL_GRAPH_MAX_TOKENS, PIECEWISE_GRAPH_MAX_TOKENS): the token count of a busy
        engine's prefill steps (a long prompt's chunks, a burst of prompts), which run eagerly and long enough
        to run at the clock the GPU's power cap allows. [] when KVSERVE_PREFILL_GEMM_TUNING is 0."""
        if not envs.KVSERVE_PREFILL_GEMM_TUNING:
            return []
        budget = self.config.scheduler_config.max_num_batched_tokens
        return [budget] if budget > max(PREFILL_GRAPH_MAX_TOKENS, PIECEWISE_GRAPH_MAX_TOKENS) else []

    @torch.inference_mode()
    def tune_gemms(self) -> list[cublaslt.TuneResult]:
        """Choose between torch's pick and cuBLASLt's candidate algorithms for every distinct fp16/bf16 `Linear`
        shape of the model (not the LM head) at each row count of `gemm_tuning_plan()` (by timing, or from the
        stored or shipped choices) and register the choice (`ops.linear` runs it), before the CUDA graphs are
        captured. Timed choices are kept in KVSERVE_CACHE_DIR, so a later start with the same GPU, libraries
        and shapes only checks them. Does nothing when `gemm_tuning_enabled()` is false (an empty plan: all three
        switches off, or eager on a small step budget; or lookups only, with nothing stored or shipped for this
        stack and model); a shape cuBLASLt cannot run, or any failure of the tuning, leaves torch's pick for
        it (start-up never fails for this optional step)."""
        plan = self.gemm_tuning_plan()
        if not plan:
            return []
        start = time.perf_counter()
        groups = gemm_tuning_groups(self.model)
        path = gemm_tuning_path()
        cache = cublaslt.load_cache(path)
        shipped = cublaslt.shipped_choices()
        if not self._gemm_tuning_can_register(plan, groups, {**shipped, **cache}):
            return []
        decided_before = cublaslt.decided_keys()
        results: list[cublaslt.TuneResult] = []
        unavailable: list[str] = []
        try:
            for rows, sustained, time_missing in plan:
                for group in groups.values():
                    weights, biases = group.weights, group.biases
                    # Enough distinct weights that a call never finds the previous one's in L2 (about 200 MB).
                    nbytes = weights[0].numel() * weights[0].element_size()
                    count = min(max(2, -(-GEMM_TUNING_WEIGHT_BYTES // nbytes)), len(weights))
                    try:
                        results.append(cublaslt.tune(rows, weights[:count], biases[:count], cache=cache,
                                                     torch_candidate=GEMM_TUNING_TORCH_CANDIDATE,
                                                     sustained=sustained, defaults=shipped if sustained else None,
                                                     time_missing=time_missing))
                    except cublaslt.LtUnavailable as exc:
                        unavailable.append(str(exc))
            if any(not r.cached and not r.untimed for r in results):
                try:
                    cublaslt.save_cache(path, cache)
                except OSError as exc:
                    logger.warning("could not save the matmul tuning to %s (%s)", path, exc)
        except Exception as exc:  # noqa: BLE001 - an optional speed-up must not fail the start
            logger.warning("matmul tuning failed (%s: %s): torch's own algorithm choice runs", type(exc).__name__, exc)
            cublaslt.forget(cublaslt.decided_keys() - decided_before)
            return []
        finally:  # the timing graphs and their buffers go before the engine's graphs are captured
            gc.collect()
            if self.device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
        if unavailable:
            logger.info("matmul tuning: %d shapes left to torch (%s)", len(unavailable), unavailable[0])
        timed = [r for r in results if not r.cached and not r.untimed]
        logger.info(
            "matmul tuning: %d shapes at %d row counts in %.1f s (%d from %s or the shipped choices, %d left to "
            "torch untimed); cuBLASLt's other candidates run in %d; newly timed: %.0f of %.0f us saved over one "
            "call of each",
            len(groups), len(plan), time.perf_counter() - start, sum(r.cached for r in results), path,
            sum(r.untimed for r in results), cublaslt.num_tuned(), sum(r.torch_us - r.chosen_us for r in timed),
            sum(r.torch_us for r in timed),
        )
        self.gemm_tuning = results
        return results

    def prefill_graph_sizes(self) -> tuple[list[int], list[int]]:
        """Token counts of the one-request prefill graphs (with CUDA graphs on), multiples of
        `cuda_graph.PREFILL_GRAPH_BUCKET` up to PREFILL_GRAPH_MAX_TOKENS, the step budget and max_model_len:
        (fresh-prompt graphs, where the one-prompt fast path applies; cache graphs, up to
        `CACHE_PREFILL_GRAPH_MAX_TOKENS`, where the request buffers hold 2 requests)."""
        if not self.config.use_cuda_graphs:
            return [], []
        limit = min(
            PREFILL_GRAPH_MAX_TOKENS,
            self.config.scheduler_config.max_num_batched_tokens,
            self.config.model_config.max_model_len,
        )
        sizes = prefill_graph_sizes(limit)
        fresh = sizes if ops.prefill_fast_path_applies(self.dtype, self.device) else []
        cache = [n for n in sizes if n <= CACHE_PREFILL_GRAPH_MAX_TOKENS] if self.max_num_reqs >= 2 else []
        return fresh, cache

    def piecewise_graph_sizes(self) -> list[int]:
        """Token counts of the piecewise graphs (with CUDA graphs on, for a model that has pieces, and request
        buffers of 2 or more): `piecewise.piecewise_graph_sizes` up to PIECEWISE_GRAPH_MAX_TOKENS and the
        step budget."""
        if not self.config.use_cuda_graphs or self.max_num_reqs < 2 or not hasattr(self.model, "piecewise_model"):
            return []
        limit = min(PIECEWISE_GRAPH_MAX_TOKENS, self.config.scheduler_config.max_num_batched_tokens)
        return piecewise_graph_sizes(limit)

    def _piecewise_graphs(self) -> PiecewiseGraphs:
        return PiecewiseGraphs(
            self.model, self.kv_caches, self.inputs.dev, self.inputs.block_tables, self.piecewise_graph_sizes()
        )

    def _graph_runner(self, prefill_sizes: list[int], cache_prefill_sizes: list[int]) -> CUDAGraphRunner:
        return CUDAGraphRunner(
            self.model,
            self.kv_caches,
            self.inputs.dev,
            self.inputs.block_tables,
            self.config.cuda_graph_sizes,
            self.config.model_config.max_model_len,
            cascade_min_size=input_batch.CASCADE_MIN_REQS if self.config.cascade_attn else None,
            prefill_sizes=prefill_sizes,
            cache_prefill_sizes=cache_prefill_sizes,
            # The timed choice could differ between ranks, and every rank must replay the same size.
            pad_min_gain=GRAPH_PAD_MIN_GAIN if self.config.tensor_parallel_size == 1 else 0.0,
        )

    @contextlib.contextmanager
    def _first_layers(self, n: int) -> Iterator[None]:
        """Run the model with its first n decoder layers only (and their caches) inside the block: in the
        Llama/Qwen2/Qwen3 decoders every layer launches the same kernel variants except the first (no
        residual yet), so two cover them all. A model whose layers differ (sliding-window layers, per-layer
        quantization) would need them all; the engine's count of late variants would show what was missed.
        A model without a `model.layers` list runs whole."""
        inner = getattr(self.model, "model", None)
        layers = getattr(inner, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or len(layers) <= n or len(self.kv_caches) != len(layers):
            yield
            return
        kv_caches = self.kv_caches
        inner.layers = torch.nn.ModuleList(list(layers)[:n])  # type: ignore[union-attr]
        self.kv_caches = kv_caches[:n]
        try:
            yield
        finally:
            inner.layers = layers  # type: ignore[union-attr]
            self.kv_caches = kv_caches

    def precompile_kernels(self) -> dict[str, Any] | None:
        """Compile every Triton kernel variant the warm-up and the graph capture will launch, on a thread pool,
        before they run (`triton_precompile`): the warm-up batches and each graph's forward run once eagerly
        with each launch of a variant not yet loaded skipped and recorded, then the recorded variants compile
        on the pool. Returns
        what was compiled (also kept in `precompile_stats`), or None where it does not apply (not CUDA, no KV
        cache, KVSERVE_TRITON_PRECOMPILE=0, a Triton without the hooks). A failure is logged and leaves the
        compiles to the warm-up."""
        if not (self.device.type == "cuda" and self.kv_caches and envs.KVSERVE_TRITON_PRECOMPILE
                and triton_precompile.available()):
            return None
        start = time.perf_counter()
        precompiler = triton_precompile.Precompiler()
        try:
            batch_times: dict[str, float] = {}
            with precompiler, torch.inference_mode(), self._first_layers(PRECOMPILE_LAYERS):
                self._warm_up_batches(batch_times)
                torch.cuda.synchronize(self.device)
                batches_s = time.perf_counter() - start
                if self.config.use_cuda_graphs:
                    self._graph_runner(*self.prefill_graph_sizes()).run_eagerly()
                    self._piecewise_graphs().run_eagerly()
                torch.cuda.synchronize(self.device)
                found_s = time.perf_counter() - start
        except Exception:
            if self.config.tensor_parallel_size > 1:
                raise  # the other ranks went on with the forwards' collectives: no rank may fall back alone
            logger.exception("compiling the Triton kernels ahead of the warm-up failed; the warm-up compiles them")
            return None
        elapsed = time.perf_counter() - start
        durations = sorted(precompiler.durations, reverse=True)
        self.precompile_stats = {"variants": len(precompiler.variants), "failed": list(precompiler.failed),
                                 "batches_s": batches_s, "batch_times_s": batch_times, "find_s": found_s,
                                 "total_s": elapsed, "workers": precompiler.workers, "compile_s": durations}
        logger.info("compiled %d Triton kernel variants on %d threads in %.1f s (%.1f s to find them; %.1f s of "
                    "compiles, the longest %.1f s)%s", len(precompiler.variants), precompiler.workers, elapsed,
                    found_s, sum(durations), max(durations, default=0.0),
                    f"; {len(precompiler.failed)} failed: {', '.join(precompiler.failed)}" if precompiler.failed
                    else "")
        return self.precompile_stats

    def capture_cuda_graphs(self) -> None:
        """Capture the decode graphs and the one-request prefill graphs (GPU, graphs enabled, KV cache
        allocated). A failed capture is logged and retried without the fresh-prompt graphs, then without any
        prefill graph; if that fails too, the runner stays eager rather than failing start-up."""
        if not self.config.use_cuda_graphs or not self.kv_caches:
            return
        fresh, cache = self.prefill_graph_sizes()
        attempts = [(fresh, cache), ([], cache), ([], [])]
        for attempt in [a for i, a in enumerate(attempts) if a not in attempts[:i]]:
            graphs = self._graph_runner(*attempt)
            try:
                graphs.capture()
            except Exception as exc:
                if self.config.tensor_parallel_size > 1:
                    # Every rank must hold the same graphs (each replay's collectives meet the other ranks'),
                    # and a retry here would be this rank's alone.
                    raise RuntimeError("CUDA graph capture failed on this rank; with tensor parallelism the "
                                       "engine cannot fall back alone: pass --enforce-eager") from exc
                logger.exception(
                    "CUDA graph capture failed; %s",
                    "retrying with fewer prefill graphs" if attempt[0] or attempt[1] else "the runner stays eager",
                )
            else:
                self.graphs = graphs
                self._capture_piecewise(graphs)
                reserve = self.memory_profile.graph_reserve_bytes if self.memory_profile is not None else None
                if reserve is not None and graphs.pool_bytes > reserve:
                    logger.warning(
                        "the CUDA graphs took %.0f MiB, more than the %.0f MiB reserved for them: the KV cache may "
                        "leave less head-room than --gpu-memory-utilization asks (KVSERVE_PREFILL_GRAPH_MAX_TOKENS "
                        "lowers the prefill graphs' share)",
                        graphs.pool_bytes / (1 << 20), reserve / (1 << 20),
                    )
                return
            # Out of the except block, so the traceback no longer holds the failed graphs' memory.
            del graphs
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _capture_piecewise(self, graphs: CUDAGraphRunner) -> None:
        """Capture the piecewise graphs into the decode graphs' pool, after them (their pool growth is added
        to `graphs.pool_bytes`). A failure is logged and leaves those steps eager."""
        if not self.piecewise_graph_sizes() or graphs.pool is None or graphs.stream is None:
            return
        piecewise = self._piecewise_graphs()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.mem_get_info(self.device)[0]
        captured = False
        try:
            with torch.inference_mode(), torch.cuda.stream(graphs.stream):
                piecewise.capture(CudaGraphBackend(graphs.pool, graphs.stream))
            torch.cuda.current_stream().wait_stream(graphs.stream)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the warm-up runs' blocks, so that the pool's growth below is the pool's
            captured = True
        except Exception as exc:
            if self.config.tensor_parallel_size > 1:
                raise RuntimeError("piecewise CUDA graph capture failed on this rank; with tensor parallelism "
                                   "the engine cannot fall back alone: pass --enforce-eager") from exc
            logger.exception("piecewise CUDA graph capture failed; steps that no other graph serves stay eager")
        if not captured:
            # Out of the except block, so the traceback no longer holds the partial graphs' memory.
            del piecewise
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            return
        self.piecewise = piecewise
        graphs.pool_bytes += max(before - torch.cuda.mem_get_info(self.device)[0], 0)
        graphs.capture_s += piecewise.capture_s

    # ------------------------------------------------------------------ one step

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        self.inputs.wait_for_copies()  # the block-table diffs below reuse pinned staging buffers
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self._history_req_ids.discard(req_id)
            self._prompt_logprob_req_ids.discard(req_id)
        self.sampler.release(scheduler_output.finished_req_ids)
        for new in scheduler_output.new_requests:
            params = new.sampling_params
            generator = make_generator(params.seed, self.device) if params.seed is not None else None
            self.requests[new.req_id] = RunnerRequestState(
                prompt_token_ids=new.prompt_token_ids, sampling_params=params, generator=generator,
                eos_token_ids=new.eos_token_ids,
            )
            if params.needs_output_history:
                self._history_req_ids.add(new.req_id)
            else:
                self._history_req_ids.discard(new.req_id)
            if params.prompt_logprobs is not None and len(new.prompt_token_ids) > 1:
                self._prompt_logprob_req_ids.add(new.req_id)
            else:
                self._prompt_logprob_req_ids.discard(new.req_id)
        self.block_table.apply(scheduler_output)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens."""
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Launch one step (forward, logits, sampling with the scheduler output's grammar masks, the
        device-to-host copy of the results) without waiting for the GPU; the returned PendingOutput's
        `result()` waits."""
        return self.sample(self.launch_forward(scheduler_output), scheduler_output.grammar_bitmask)

    @torch.inference_mode()
    def launch_forward(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Launch a step's forward pass and logits (and prompt logprobs) without waiting for the GPU. Its
        sampling is `sample`'s, called before the next step's launch."""
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return LaunchedStep(scheduler_output, [], None, None)
        num_reqs = len(scheduler_output.scheduled)
        prompt_spans = self._prompt_logprob_spans(scheduler_output) if self._prompt_logprob_req_ids else None
        # A step that computes prompt logprobs needs every token's final state: it runs eagerly, unpadded.
        graphs = self.graphs if prompt_spans is None else None
        pad_to = graphs.padded_size(num_reqs) if graphs is not None else None
        cascade_pad_to = graphs.padded_size(num_reqs, cascade=True) if graphs is not None else None
        prefill_key = (
            prefill_graph_key(scheduler_output.scheduled, graphs.prefill_sizes, graphs.cache_prefill_sizes)
            if graphs is not None
            else None
        )
        token_pad_to = self._piecewise_size(scheduler_output, pad_to, prefill_key) if prompt_spans is None else None
        batch = self.inputs.prepare(
            scheduler_output,
            self.block_table,
            pad_to,
            self._prev_sampled,
            prefill_pad_to=prefill_key[0] if prefill_key is not None else None,
            pad_as_request=prefill_key is not None and prefill_key[1],
            cascade_pad_to=cascade_pad_to,
            token_pad_to=token_pad_to,
        )
        # Rows whose final states the step needs, when not every row: the model computes only those past the
        # last layer's cache write (a prefill's other tokens need their K/V, nothing more).
        if batch.padded_num_reqs is not None and graphs is not None and graphs.has(
            batch.padded_num_reqs, batch.cascade
        ):
            hidden = graphs.replay(batch.padded_num_reqs, batch.cascade)
            sample_hidden = hidden[:num_reqs] if batch.all_rows_sample else hidden[batch.logits_indices]
        elif prefill_key is not None and graphs is not None:
            sample_hidden = graphs.replay_prefill(*prefill_key)  # the last token's row only
        elif batch.piecewise_tokens is not None and self.piecewise is not None:
            sample_hidden = self.piecewise.replay(batch.piecewise_tokens, batch.attn_metadata, batch.logits_indices)
        else:
            output_rows = None if batch.all_rows_sample or prompt_spans else batch.logits_indices
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata, output_rows)
            if batch.all_rows_sample:
                sample_hidden = hidden[:num_reqs]
            else:
                sample_hidden = hidden[batch.logits_indices] if prompt_spans else hidden
        prompt_logprobs = self._prompt_logprobs(hidden, prompt_spans) if prompt_spans else None
        if not batch.sampled_req_ids:
            return LaunchedStep(scheduler_output, [], None, prompt_logprobs)
        logits = self.model.compute_logits(sample_hidden)
        return LaunchedStep(scheduler_output, batch.sampled_req_ids, logits, prompt_logprobs)

    @torch.inference_mode()
    def sample(self, launched: LaunchedStep, grammar_bitmask: dict[str, bytes]) -> PendingOutput:
        """Launch a launched step's sampling (each request in `grammar_bitmask` restricted to its mask) and
        the copy of its results to the host, without waiting for the GPU."""
        if launched.logits is None:
            self._prev_sampled = None
            output = PendingOutput.empty(launched.prompt_logprobs)
        else:
            output = self._sample(launched, grammar_bitmask)
        self._last_output = output
        return output

    def _sample(self, launched: LaunchedStep, masks: dict[str, bytes]) -> PendingOutput:
        assert launched.logits is not None
        sampled_req_ids = launched.sampled_req_ids
        states = [self.requests[req_id] for req_id in sampled_req_ids]
        previous = self._last_output
        # The previous step's tokens are placeholders still when its result() has not recorded them.
        pending = (self._pending_rows(launched.scheduler_output, sampled_req_ids)
                   if previous is not None and not previous.recorded else None)
        rows = [
            SamplingRow(
                params=s.sampling_params,
                prompt_token_ids=s.prompt_token_ids,
                output_token_ids=s.output_token_ids,
                generator=s.generator,
                req_id=req_id,
                pending_row=pending[i] if pending is not None else None,
                grammar_mask=masks.get(req_id) if masks else None,
                eos_token_ids=s.eos_token_ids,
            )
            for i, (req_id, s) in enumerate(zip(sampled_req_ids, states, strict=True))
        ]
        pending_ids = self._prev_sampled[0] if pending is not None and self._prev_sampled is not None else None
        sampled = self.sampler(launched.logits, rows, self.eos_token_ids, pending_ids)
        self._prev_sampled = (
            sampled.sampled_token_ids,
            {req_id: i for i, req_id in enumerate(sampled_req_ids)},
        )
        sampled_host = self._to_host(sampled.sampled_token_ids)
        logprob_host = None
        if sampled.logprobs is not None and sampled.logprob_token_ids is not None:
            ranks = sampled.sampled_ranks
            logprob_host = (
                self._to_host(sampled.logprobs),
                self._to_host(sampled.logprob_token_ids),
                self._to_host(ranks) if ranks is not None else None,
            )
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return PendingOutput(sampled_req_ids, states, sampled_host, logprob_host, done, launched.prompt_logprobs)

    def _prompt_logprob_spans(self, scheduler_output: SchedulerOutput) -> list[PromptLogprobSpan] | None:
        """The prompt positions of this step's tokens whose logprobs are still to compute, per request with
        prompt_logprobs; advances each request's next position (a request whose prompt is done leaves the
        set). None when the step has none."""
        spans: list[PromptLogprobSpan] = []
        row = 0
        wanting = self._prompt_logprob_req_ids
        for s in scheduler_output.scheduled:
            n = len(s.token_ids)
            if s.req_id in wanting:
                state = self.requests[s.req_id]
                prompt_len = len(state.prompt_token_ids)
                # The logits at position p give the logprob of the token at p + 1.
                first = max(s.num_computed_tokens + 1, state.next_prompt_target)
                last = min(s.num_computed_tokens + n, prompt_len - 1)
                if first <= last:
                    k = state.sampling_params.prompt_logprobs or 0
                    spans.append(PromptLogprobSpan(s.req_id, row + first - 1 - s.num_computed_tokens, first,
                                                   last - first + 1, k))
                    state.next_prompt_target = last + 1
                if state.next_prompt_target >= prompt_len:
                    wanting.discard(s.req_id)
            row += n
        return spans or None

    def _prompt_logprobs(self, hidden: torch.Tensor, spans: list[PromptLogprobSpan]) -> PromptLogprobsPending:
        """The raw logprobs of the spans' prompt tokens and their top-k, from the step's hidden rows (every
        token's). Computed max_num_seqs rows at a time: the memory profile's sampling pass over that many rows
        holds more [rows, vocab] temporaries than a slice does."""
        device = hidden.device
        pinned = device.type == "cuda"  # copied without waiting for the forward the step launched
        rows = torch.tensor([r for sp in spans for r in range(sp.row, sp.row + sp.count)], dtype=torch.int64,
                            pin_memory=pinned).to(device, non_blocking=True)
        targets = torch.tensor(
            [t for sp in spans for t in self.requests[sp.req_id].prompt_token_ids[sp.first : sp.first + sp.count]],
            dtype=torch.int64, pin_memory=pinned,
        ).to(device, non_blocking=True)
        max_k = max(sp.k for sp in spans)
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        step = self.max_num_reqs
        for lo in range(0, rows.numel(), step):
            logits = self.model.compute_logits(hidden[rows[lo : lo + step]])
            raw = torch.log_softmax(logits.float(), dim=1)
            del logits
            parts.append(compute_logprobs(raw, targets[lo : lo + step], max_k))
            del raw  # before the next slice's: one slice's [rows, vocab] tensors at a time
        values, ids, ranks = (torch.cat(t) for t in zip(*parts, strict=True))
        return PromptLogprobsPending(spans, self._to_host(values), self._to_host(ids), self._to_host(ranks))

    def check_invariants(self) -> None:
        """The requests that read their output history, and those with prompt logprobs still to compute, are
        exactly the live ones whose parameters and progress say so; the sampler keeps state for live requests
        only."""
        history = {req_id for req_id, s in self.requests.items() if s.sampling_params.needs_output_history}
        assert self._history_req_ids == history, \
            f"history requests {sorted(self._history_req_ids)} differ from the live ones {sorted(history)}"
        prompt = {req_id for req_id, s in self.requests.items()
                  if s.sampling_params.prompt_logprobs is not None and s.next_prompt_target < len(s.prompt_token_ids)}
        assert self._prompt_logprob_req_ids == prompt, \
            f"prompt-logprob requests {sorted(self._prompt_logprob_req_ids)} differ from the live ones {sorted(prompt)}"
        self.sampler.check_invariants(set(self.requests))

    def _pending_rows(self, scheduler_output: SchedulerOutput, sampled_req_ids: list[str]) -> list[int | None] | None:
        """For each sampled request whose sampling reads its earlier output (penalties, min_tokens, bad words) and whose
        newest token is still a placeholder (async scheduling: sampled by the previous step, not yet in its
        state's output list), that token's row in the previous step's sampled ids; None for the others.
        None when no request has such a token (when no live request reads its output, the common case, that
        costs nothing per request)."""
        prev = self._prev_sampled
        needing = self._history_req_ids
        if prev is None or not needing:
            return None
        rows_of = prev[1]
        # A placeholder's row exists: InputBuffers.prepare raised otherwise.
        pending_of = {s.req_id: rows_of[s.req_id] for s in scheduler_output.scheduled
                      if s.req_id in needing and s.token_ids[-1] < 0}
        if not pending_of:
            return None
        return [pending_of.get(req_id) for req_id in sampled_req_ids]

    def _piecewise_size(
        self, scheduler_output: SchedulerOutput, pad_to: int | None, prefill_key: tuple[int, bool] | None
    ) -> int | None:
        """The piecewise graph size of a step that neither a decode graph nor a prefill graph serves, or None."""
        piecewise = self.piecewise
        if piecewise is None or prefill_key is not None:
            return None
        scheduled = scheduler_output.scheduled
        num_reqs = len(scheduled)
        num_tokens = scheduler_output.total_num_scheduled_tokens
        graphs = self.graphs
        if num_tokens == num_reqs and pad_to is not None and graphs is not None and graphs.has(pad_to, False):
            return None  # a decode graph's batch (its cascade variant too, where captured)
        one_fresh_prompt = num_reqs == 1 and scheduled[0].num_computed_tokens == 0
        return piecewise.padded_size(num_reqs, num_tokens, one_fresh_prompt)

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """An asynchronous copy into pinned memory on CUDA (complete once the step's event is); a copy on
        CPU (the sampler's tensors are scratch)."""
        if tensor.device.type != "cuda":
            return tensor.clone()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host
