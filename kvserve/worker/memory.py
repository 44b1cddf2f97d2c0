"""KV-cache sizing on the GPU: pure arithmetic over a measured memory profile (testable on the CPU).

`--gpu-memory-utilization` is a per-instance budget, as vLLM's: the fraction of the GPU's memory this
instance may use, whatever other processes (another kvserve or vLLM instance at 0.45, say) hold. When the
runner starts using the device (the CUDA context exists, no weights yet) it reads the memory in use
(`total - free`, device-wide); an instance whose budget exceeds the free memory then refuses to start
(`start_memory_error`). It loads the weights, runs one forward pass at `max_num_batched_tokens` (plus logits
and a sampling pass at `max_num_seqs` rows) and records a `MemoryProfile`. The KV cache then gets

    gpu_memory_utilization * total - (memory in use after profiling - memory in use at start)
        - activation peak - graph reserve

where the difference of the two device-wide readings is what this process added since its start (weights,
kept state, cuBLAS/Triton workspaces and the kernels' code; not the CUDA context, which exists at the first
reading, nor what the process held before: in-process engines count from their runner's start), and the
activation peak is what the profiled step allocated on top of that at its high point. Memory another process
takes or frees between the two readings is counted as this one's (more taken: fewer blocks; freed: the
difference is floored at the weights). CUDA graphs are captured after the KV cache exists (they bake in its
address), so their pool is a reserve here: a fixed amount for the decode graphs plus, with one-request
prefill graphs, the activation peak scaled to their largest token count and their outputs; the runner warns
after capture when the real pool is larger.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

GiB = 1 << 30

# Reserve for the shared CUDA-graph memory pool (decode activations at the largest captured batch: a few
# tens of MB for a 7B model at batch 256; the reserve leaves head-room for bigger models).
CUDA_GRAPH_RESERVE_BYTES = 512 << 20


def prefill_graph_reserve_bytes(
    activation_peak_bytes: int,
    profiled_tokens: int,
    graph_tokens: Sequence[int],
    row_bytes: int,
    piecewise_tokens: Sequence[int] = (),
    piecewise_row_bytes: int = 0,
) -> int:
    """What the one-request prefill graphs and the piecewise graphs add to the graph pool: the profiled
    step's activation peak scaled to the largest token count of either (a forward's activations grow with
    its tokens, a piece's are at most a forward's; the graphs share one pool, so the largest sets it), plus
    every prefill graph's output, which stays allocated in the pool (`row_bytes` per token: hidden size x
    element size), plus the piecewise graphs' attention output buffer (`piecewise_row_bytes` per token of
    the largest: query heads x head dim x element size). 0 without either kind."""
    largest = max([*graph_tokens, *piecewise_tokens], default=0)
    if not largest or profiled_tokens <= 0:
        return 0
    return (
        -(-activation_peak_bytes * largest // profiled_tokens)
        + sum(graph_tokens) * row_bytes
        + max(piecewise_tokens, default=0) * piecewise_row_bytes
    )


@dataclass(frozen=True)
class MemoryProfile:
    """Device memory facts, in bytes, measured once at start-up."""

    total_bytes: int  # the device's memory
    weights_bytes: int  # parameters (part of the growth below; its floor)
    in_use_bytes: int  # total - free after the profiling step, its temporaries released (device-wide)
    activation_peak_bytes: int  # peak allocation of the profiling step above its starting point
    graph_reserve_bytes: int  # set aside for CUDA graphs (0 when they are off)
    # total - free when the runner started using the device (CUDA context up, no weights): other processes'
    # memory and what this process held before. 0 (the default) counts everything in use as this instance's.
    in_use_at_start_bytes: int = 0

    @property
    def process_bytes(self) -> int:
        """What this process added to the device between the two readings (weights, kept state, workspaces):
        the growth of the device-wide figure, at least the weights (another process that freed memory in
        between would otherwise shrink it)."""
        return max(self.in_use_bytes - self.in_use_at_start_bytes, self.weights_bytes)

    @property
    def free_at_start_bytes(self) -> int:
        return self.total_bytes - self.in_use_at_start_bytes

    @property
    def non_kv_bytes(self) -> int:
        """Everything of this instance's budget that is not KV cache."""
        return self.process_bytes + self.activation_peak_bytes + self.graph_reserve_bytes


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    budget_bytes: int  # may be negative: then num_blocks is 0
    bytes_per_block: int

    def describe(self, profile: MemoryProfile, gpu_memory_utilization: float) -> str:
        return (
            f"GPU memory: total {profile.total_bytes / GiB:.2f} GiB x utilization {gpu_memory_utilization:.2f} "
            f"(this instance's budget; {profile.in_use_at_start_bytes / GiB:.2f} GiB was in use at start); "
            f"this process added {profile.process_bytes / GiB:.2f} GiB (weights {profile.weights_bytes / GiB:.2f} "
            f"GiB), activation peak {profile.activation_peak_bytes / GiB:.2f} GiB, graph reserve "
            f"{profile.graph_reserve_bytes / GiB:.2f} GiB -> KV cache {max(self.budget_bytes, 0) / GiB:.2f} GiB "
            f"= {self.num_blocks} blocks"
        )


def plan_kv_cache(profile: MemoryProfile, gpu_memory_utilization: float, bytes_per_block: int) -> KVCachePlan:
    """How many KV blocks fit: see the module docstring. Never negative."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    budget = int(profile.total_bytes * gpu_memory_utilization) - profile.non_kv_bytes
    return KVCachePlan(num_blocks=max(budget, 0) // bytes_per_block, budget_bytes=budget, bytes_per_block=bytes_per_block)


def start_memory_error(free_bytes: int, total_bytes: int, gpu_memory_utilization: float) -> str | None:
    """Why an instance cannot start when the device's free memory at its start is below its budget
    (`gpu_memory_utilization * total`): the numbers, who holds the rest and what to lower; None when it fits."""
    wanted = int(total_bytes * gpu_memory_utilization)
    if free_bytes >= wanted:
        return None
    at_most = math.floor(free_bytes / total_bytes * 100) / 100
    lower = (
        f"lower --gpu-memory-utilization to at most {at_most:.2f}"
        if at_most > 0
        else "lower --gpu-memory-utilization"
    )
    return (
        f"only {free_bytes / GiB:.2f} GiB of the GPU's {total_bytes / GiB:.2f} GiB is free at start, less than the "
        f"{wanted / GiB:.2f} GiB that --gpu-memory-utilization {gpu_memory_utilization:.2f} asks for this instance "
        f"(the utilization is a per-instance budget, as vLLM's); other processes (or earlier allocations of this "
        f"one) hold {(total_bytes - free_bytes) / GiB:.2f} GiB: {lower}, or free GPU memory"
    )


def gpu_capacity_hint(
    profile: MemoryProfile, gpu_memory_utilization: float, bytes_per_block: int, blocks_needed: int
) -> str:
    """What to change when one max_model_len request does not fit (names the flags, with numbers). The
    suggested utilization is this instance's non-KV memory plus the KV cache needed, over the total, rounded
    up; past the memory free at start, raising it needs other processes to release memory."""
    kv_needed = blocks_needed * bytes_per_block
    missing = kv_needed - max(int(profile.total_bytes * gpu_memory_utilization) - profile.non_kv_bytes, 0)
    wanted = math.ceil((profile.non_kv_bytes + kv_needed) / profile.total_bytes * 100) / 100
    if wanted * profile.total_bytes <= profile.free_at_start_bytes:
        raise_it = f"raise --gpu-memory-utilization from {gpu_memory_utilization:.2f} to at least {wanted:.2f}"
    elif wanted <= 1.0:
        raise_it = (
            f"raise --gpu-memory-utilization from {gpu_memory_utilization:.2f} to at least {wanted:.2f}, after "
            f"other processes release GPU memory (only {profile.free_at_start_bytes / GiB:.2f} GiB was free at "
            f"start)"
        )
    else:
        raise_it = "the model does not leave room for it on this GPU even at --gpu-memory-utilization 1.0"
    parts = [
        f"{missing / GiB:.2f} GiB more KV cache is needed",
        raise_it,
        f"lower --max-num-batched-tokens (activation peak {profile.activation_peak_bytes / GiB:.2f} GiB)",
    ]
    if profile.graph_reserve_bytes:
        parts.append(f"pass --enforce-eager (frees the {profile.graph_reserve_bytes / GiB:.2f} GiB graph reserve)")
    return "; ".join(parts)


# ------------------------------------------------------------------- --kv-cache-memory on a GPU


class KVCacheMemoryError(ValueError):
    """--kv-cache-memory asks for more than the GPU has free after the weights, activations and graphs."""


def free_after_profile(profile: MemoryProfile) -> int:
    """What the device has free for a KV cache after the profile: its free memory (total less everything in
    use on it, by any process) less the activation peak and the CUDA-graph reserve. May be negative."""
    return profile.total_bytes - profile.in_use_bytes - profile.activation_peak_bytes - profile.graph_reserve_bytes


def plan_requested_kv_cache(profile: MemoryProfile, kv_cache_bytes: int, bytes_per_block: int) -> KVCachePlan:
    """The KV cache at the size --kv-cache-memory (vLLM's --kv-cache-memory-bytes) asks for, per GPU, in
    place of the --gpu-memory-utilization budget: as many whole blocks as fit in `kv_cache_bytes`. Raises
    KVCacheMemoryError, with the numbers, when the device does not have that much free after the weights,
    the activation peak and the graph reserve (`free_after_profile`)."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    available = free_after_profile(profile)
    if kv_cache_bytes > available:
        parts = [
            f"--kv-cache-memory {kv_cache_bytes / GiB:.2f} GiB does not fit on this GPU: it has "
            f"{max(available, 0) / GiB:.2f} GiB free for the KV cache (total {profile.total_bytes / GiB:.2f} GiB; "
            f"in use {profile.in_use_bytes / GiB:.2f} GiB, weights {profile.weights_bytes / GiB:.2f} GiB of it; "
            f"activation peak {profile.activation_peak_bytes / GiB:.2f} GiB; graph reserve "
            f"{profile.graph_reserve_bytes / GiB:.2f} GiB)",
            "lower --kv-cache-memory",
            f"lower --max-num-batched-tokens (activation peak {profile.activation_peak_bytes / GiB:.2f} GiB)",
        ]
        if profile.graph_reserve_bytes:
            parts.append(f"pass --enforce-eager (frees the {profile.graph_reserve_bytes / GiB:.2f} GiB graph reserve)")
        raise KVCacheMemoryError("; ".join(parts))
    return KVCachePlan(num_blocks=kv_cache_bytes // bytes_per_block, budget_bytes=kv_cache_bytes,
                       bytes_per_block=bytes_per_block)


def describe_requested_kv_cache(plan: KVCachePlan, profile: MemoryProfile) -> str:
    """The start-up line for a KV cache sized by --kv-cache-memory."""
    return (
        f"GPU memory: total {profile.total_bytes / GiB:.2f} GiB; in use {profile.in_use_bytes / GiB:.2f} GiB "
        f"(weights {profile.weights_bytes / GiB:.2f} GiB), activation peak "
        f"{profile.activation_peak_bytes / GiB:.2f} GiB, graph reserve {profile.graph_reserve_bytes / GiB:.2f} GiB; "
        f"KV cache {plan.budget_bytes / GiB:.2f} GiB as --kv-cache-memory asks (--gpu-memory-utilization not "
        f"used) = {plan.num_blocks} blocks"
    )
