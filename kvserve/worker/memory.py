"""KV-cache sizing on the GPU: pure arithmetic over a measured memory profile (testable on the CPU).

The runner loads the weights, then runs one forward pass at `max_num_batched_tokens` (plus logits and a
sampling pass at `max_num_seqs` rows) and records a `MemoryProfile`. The KV cache then gets

    gpu_memory_utilization * total - (memory in use after profiling) - activation peak - graph reserve

where "memory in use" is the device-wide figure (`total - free`: weights, CUDA context, cuBLAS/Triton
workspaces, and anything other processes hold), and the activation peak is what the profiled step
allocated on top of that at its high point. CUDA graphs are captured after the KV cache exists (they bake
in its address), so their pool is a reserve here: a fixed amount for the decode graphs plus, with
one-request prefill graphs, the activation peak scaled to their largest token count and their outputs; the
runner warns after capture when the real pool is larger.
"""

from __future__ import annotations

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
    weights_bytes: int  # parameters (informational: already part of in_use_bytes)
    in_use_bytes: int  # total - free after the profiling step, its temporaries released
    activation_peak_bytes: int  # peak allocation of the profiling step above its starting point
    graph_reserve_bytes: int  # set aside for CUDA graphs (0 when they are off)


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    budget_bytes: int  # may be negative: then num_blocks is 0
    bytes_per_block: int

    def describe(self, profile: MemoryProfile, gpu_memory_utilization: float) -> str:
        return (
            f"GPU memory: total {profile.total_bytes / GiB:.2f} GiB x utilization {gpu_memory_utilization:.2f}; "
            f"in use {profile.in_use_bytes / GiB:.2f} GiB (weights {profile.weights_bytes / GiB:.2f} GiB), "
            f"activation peak {profile.activation_peak_bytes / GiB:.2f} GiB, graph reserve "
            f"{profile.graph_reserve_bytes / GiB:.2f} GiB -> KV cache {max(self.budget_bytes, 0) / GiB:.2f} GiB "
            f"= {self.num_blocks} blocks"
        )


def plan_kv_cache(profile: MemoryProfile, gpu_memory_utilization: float, bytes_per_block: int) -> KVCachePlan:
    """How many KV blocks fit: see the module docstring. Never negative."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    budget = (
        int(profile.total_bytes * gpu_memory_utilization)
        - profile.in_use_bytes
        - profile.activation_peak_bytes
        - profile.graph_reserve_bytes
    )
    return KVCachePlan(num_blocks=max(budget, 0) // bytes_per_block, budget_bytes=budget, bytes_per_block=bytes_per_block)


def gpu_capacity_hint(
    profile: MemoryProfile, gpu_memory_utilization: float, bytes_per_block: int, blocks_needed: int
) -> str:
    """What to change when one max_model_len request does not fit (names the flags, with numbers)."""
    missing = blocks_needed * bytes_per_block - max(
        int(profile.total_bytes * gpu_memory_utilization)
        - profile.in_use_bytes
        - profile.activation_peak_bytes
        - profile.graph_reserve_bytes,
        0,
    )
    wanted = (
        profile.in_use_bytes + profile.activation_peak_bytes + profile.graph_reserve_bytes
        + blocks_needed * bytes_per_block
    ) / profile.total_bytes
    parts = [
        f"{missing / GiB:.2f} GiB more KV cache is needed",
        (
            f"raise --gpu-memory-utilization from {gpu_memory_utilization:.2f} to at least {wanted:.2f}"
            if wanted <= 1.0
            else "the model does not leave room for it on this GPU even at --gpu-memory-utilization 1.0"
        ),
        f"lower --max-num-batched-tokens (activation peak {profile.activation_peak_bytes / GiB:.2f} GiB)",
    ]
    if profile.graph_reserve_bytes:
        parts.append(f"pass --enforce-eager (frees the {profile.graph_reserve_bytes / GiB:.2f} GiB graph reserve)")
    return "; ".join(parts)
