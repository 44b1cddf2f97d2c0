"""Tensor parallelism: this process's rank in the group, how a model's heads split over the ranks, and the
two collectives the layers call.

Each rank is one process holding one device (`executor.multiproc` starts them). Rank 0 lives in the engine
core process; the others run the same steps in lockstep. The layers shard their weights when built, by
the group set here: column-parallel projections (q/k/v, gate/up) keep their rank's output rows,
row-parallel ones (o_proj, down) their input columns, and add the ranks' partial outputs with
`all_reduce`. The embedding is whole on every rank; an untied LM head is split by vocabulary and its
logits gathered (`all_gather`), so every rank holds the same whole logits and samples the same tokens
(NCCL's and gloo's collectives give every rank the same bits).

With one rank nothing here touches `torch.distributed`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvserve.model.arch import ArchConfig


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    group: Any = None  # the torch.distributed process group (None for one rank)


_group = TPGroup(0, 1)


def tp_group() -> TPGroup:
    return _group


def tp_size() -> int:
    return _group.size


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> None:
    """Join the group of `size` ranks (blocks until all have joined): NCCL on CUDA, gloo on CPU."""
    global _group
    if size == 1:
        _group = TPGroup(0, 1)
        return
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=size)
    _group = TPGroup(rank, size, dist.group.WORLD)


def destroy_tensor_parallel() -> None:
    global _group
    if _group.size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _group = TPGroup(0, 1)


def set_group_for_building(group: TPGroup) -> TPGroup:
    """Set the group layers read when built, returning the previous one (tests build one rank's shards in
    one process without joining a group)."""
    global _group
    previous, _group = _group, group
    return previous


# Depth of `no_collectives` blocks: start-up work that rank 0 declares free of collectives (TPWorkers'
# local phase), during which a dead rank is waited for rather than given a grace.
_no_collectives = 0


@contextlib.contextmanager
def no_collectives() -> Iterator[None]:
    """A block that must meet no other rank: a collective inside it raises RuntimeError at once instead of
    waiting, perhaps forever, for a rank that may be dead."""
    global _no_collectives
    _no_collectives += 1
    try:
        yield
    finally:
        _no_collectives -= 1


def collectives_forbidden() -> bool:
    """Whether this process is inside a `no_collectives` block (any thread may ask)."""
    return _no_collectives > 0


def _check_collective_allowed(name: str) -> None:
    if _no_collectives:
        raise RuntimeError(f"{name} inside a block declared free of collectives (distributed.no_collectives): "
                           "a rank that died meanwhile would leave it waiting forever")


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; `x` itself with one rank."""
    if _group.size == 1:
        return x
    _check_collective_allowed("all_reduce")
    import torch.distributed as dist

    dist.all_reduce(x, group=_group.group)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x`, stacked: [ranks, *x.shape] (x[None] with one rank)."""
    if _group.size == 1:
        return x.unsqueeze(0)
    _check_collective_allowed("all_gather")
    import torch.distributed as dist

    out = torch.empty((_group.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    # all_gather_single is all_gather_into_tensor's newer name (torch 2.13; older torch has the old one only).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous(), group=_group.group)
    return out.view(_group.size, *x.shape)


def check_tensor_parallel(arch: ArchConfig, size: int) -> None:
    """ValueError unless `arch` splits over `size` ranks: query heads and the MLP's width (the dense MLP's where a
    layer has one, each expert's and the shared expert's in a mixture-of-experts model) divide by it, and the KV
    heads either divide by it or divide it (each KV head is then held by size / kv_heads ranks)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    problems = []
    if arch.num_attention_heads % size:
        problems.append(f"num_attention_heads ({arch.num_attention_heads})")
    if arch.has_dense_mlp and arch.intermediate_size % size:
        problems.append(f"intermediate_size ({arch.intermediate_size})")
    if arch.is_moe and arch.moe_intermediate_size % size:
        problems.append(f"the experts' intermediate size ({arch.moe_intermediate_size}, each expert's MLP width)")
    if arch.is_moe and arch.shared_expert_intermediate_size % size:
        problems.append(f"shared_expert_intermediate_size ({arch.shared_expert_intermediate_size})")
    kv = arch.num_key_value_heads
    if kv % size and size % kv:
        problems.append(f"num_key_value_heads ({kv}, which must divide by it or divide it)")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={size} does not split the model: {', '.join(problems)} "
            f"{'is' if len(problems) == 1 else 'are'} not divisible by it"
        )


def check_quantized_split(arch: ArchConfig, size: int) -> None:
    """ValueError unless an AWQ / GPTQ checkpoint's row-split layers (o_proj and down_proj: each rank takes
    1/size of their input rows) leave each rank whole groups of `group_size` rows and whole packed words, and
    are not GPTQ act-order (its g_idx would scatter a rank's rows over every group); the ranks would each fail
    at load otherwise, after they started. Checked for the layers the checkpoint
    quantizes (`QuantConfig.applies_to`); call it after `check_tensor_parallel`."""
    config = arch.quantization
    if size == 1 or config is None or config.method not in ("awq", "gptq"):
        return
    for layer, rows in (("self_attn.o_proj", arch.num_attention_heads * arch.head_dim),
                        ("mlp.down_proj", arch.intermediate_size)):
        if not any(config.applies_to(f"model.layers.{i}.{layer}") for i in range(arch.num_hidden_layers)):
            continue
        if config.act_order:
            from kvserve.layers.quantization import ACT_ORDER_WITH_TP

            raise ValueError(ACT_ORDER_WITH_TP)
        share = rows // size
        unit = config.pack if config.group_size == -1 else math.lcm(config.group_size, config.pack)
        if share % unit:
            what = (f"a multiple of its group_size {config.group_size}" if config.group_size != -1 and
                    share % config.group_size else f"whole {config.bits}-bit words of {config.pack} values")
            raise ValueError(
                f"--tensor-parallel-size {size} does not split this {config.method.upper()} checkpoint: each rank "
                f"would take {share} of {layer.split('.')[-1]}'s {rows} input rows, not {what}; pass a smaller "
                "--tensor-parallel-size")


def first_kv_head(num_kv_heads: int, rank: int, size: int) -> int:
    """The first of the KV heads `rank` holds (`local_arch` says how many): its share's first, or the one
    it holds with other ranks when there are fewer KV heads than ranks."""
    return rank * num_kv_heads // size


def local_arch(arch: ArchConfig) -> ArchConfig:
    """The shapes this rank's layers have: its query heads, KV heads and MLP width, each expert's and the shared
    expert's (the rest unchanged)."""
    size = tp_size()
    if size == 1:
        return arch
    check_tensor_parallel(arch, size)
    return dataclasses.replace(
        arch,
        num_attention_heads=arch.num_attention_heads // size,
        num_key_value_heads=max(arch.num_key_value_heads // size, 1),
        intermediate_size=arch.intermediate_size // size,
        moe_intermediate_size=arch.moe_intermediate_size // size,
        shared_expert_intermediate_size=arch.shared_expert_intermediate_size // size,
    )
