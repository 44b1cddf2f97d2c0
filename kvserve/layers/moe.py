"""A mixture-of-experts MLP (Qwen3-MoE's and Qwen2-MoE's sparse block, Mixtral's block_sparse_moe): a router and the
experts, and Qwen2-MoE's shared expert.

The router `gate` (hidden -> num_experts, no bias) is whole on every rank; `ops.select_experts` picks each
token's top-k experts from its logits and `ops.fused_moe` runs them. The experts' weights are two stacked
parameters: `experts.w13` [E, 2 * I, H] (each expert's gate rows, then its up rows) and `experts.w2` [E, H, I].

Checkpoints store each expert apart (`experts.J.gate_proj` / `up_proj` / `down_proj`, Mixtral's `w1` / `w3` /
`w2`) or, as HF Transformers 5 holds them in memory, fused (`experts.gate_up_proj` [E, 2 * I, H],
`experts.down_proj` [E, H, I]), or, as GGUF files hold them, stacked per projection (`ffn_gate_exps` /
`ffn_up_exps` [E, I, H], `ffn_down_exps` [E, H, I]); `FusedExperts.weight_loader` places any of these (shard
ids below).

Tensor parallelism: each expert's intermediate dim I is split over the ranks as the dense MLP's is (rank r holds
rows [r * I / n, (r + 1) * I / n) of every gate and up projection and those input columns of every down
projection), and the ranks' partial outputs are summed once after the experts. A shared expert (a dense MLP
every token runs, given to `SparseMoeBlock` built not to sum its own output over the ranks) splits as the dense MLP
does; its sigmoid gate (hidden -> 1) is whole on every rank, and its gated partial output joins the experts' in
that one sum.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import nn

from kvserve import distributed
from kvserve.kernels import ops
from kvserve.layers.linear import Linear

# The shard id of a fused checkpoint tensor: every expert of `w13` (gate_up_proj) or of `w2` (down_proj).
FUSED = "fused"
# The shard ids of a stacked gate-only or up-only tensor [E, I, H] of `w13` (a GGUF file's ffn_gate_exps /
# ffn_up_exps); a stacked down-only tensor is `w2`'s `FUSED`.
FUSED_GATE = "fused_gate"
FUSED_UP = "fused_up"
# Per-expert shard ids are (expert, part), part one of these.
_W13_PARTS = ("gate", "up")
_W2_PART = "down"


class FusedExperts(nn.Module):
    """The experts' stacked weights, this rank's share of each expert's intermediate dim (`intermediate_size`).

    Shard ids: (expert, "gate" | "up") of `w13`, (expert, "down") of `w2`, from a per-expert checkpoint tensor
    ([I_full, H] or [H, I_full]); `FUSED` for a fused one covering every expert. `names` are the checkpoint's
    names of the gate / up / down projections (for messages about a missing one)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        super().__init__()
        group = distributed.tp_group()
        self.tp_rank, self.tp_size = group.rank, group.size
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.names = names
        self.w13 = self._param((num_experts, 2 * intermediate_size, hidden_size), dtype,
                               tuple((e, part) for e in range(num_experts) for part in _W13_PARTS))
        self.w2 = self._param((num_experts, hidden_size, intermediate_size), dtype,
                              tuple((e, _W2_PART) for e in range(num_experts)))

    def _param(self, shape: tuple[int, ...], dtype: torch.dtype, shard_ids: tuple[Hashable, ...]) -> nn.Parameter:
        # torch.empty: the loader (or the dummy fill) overwrites every element.
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        param.shard_ids = shard_ids  # type: ignore[attr-defined]
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        param.describe_shard = self.describe_shard  # type: ignore[attr-defined]
        return param

    def describe_shard(self, prefix: str, shard_id: Hashable) -> str:
        """The checkpoint tensor that fills shard `shard_id`, for `prefix` (this module's parameter path, up to
        "experts"): "model.layers.0.mlp.experts.3.up_proj.weight"."""
        if not isinstance(shard_id, tuple):
            return f"{prefix} (shard {shard_id!r})"
        expert, part = shard_id
        name = dict(zip((*_W13_PARTS, _W2_PART), self.names, strict=True))[part]
        return f"{prefix}.{expert}.{name}.weight"

    def _rank_slice(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's share of `loaded`'s intermediate dim `dim` (the whole checkpoint's I)."""
        size = self.intermediate_size
        if loaded.shape[dim] != size * self.tp_size:
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)}: dim {dim} should be the experts' intermediate "
                             f"size {size * self.tp_size}")
        return loaded if self.tp_size == 1 else loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable) -> None:
        size = self.intermediate_size
        if shard_id in (FUSED_GATE, FUSED_UP):
            if param is not self.w13:
                raise ValueError(f"shard {shard_id!r} is not one of this parameter's")
            if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
                raise ValueError(f"a stacked experts tensor of shape {tuple(loaded.shape)}: expected "
                                 f"[{self.num_experts}, intermediate, hidden] (one slice per expert)")
            _check_shape(tuple(loaded.shape[2:]), tuple(param.shape[2:]))
            offset = 0 if shard_id == FUSED_GATE else size
            param.data.narrow(1, offset, size).copy_(self._rank_slice(loaded, 1))
            return
        if shard_id == FUSED:
            if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
                raise ValueError(f"a fused experts tensor of shape {tuple(loaded.shape)}: expected "
                                 f"[{self.num_experts}, ...] (one slice per expert)")
            if param is self.w13:
                if loaded.shape[1] % 2:
                    raise ValueError(f"checkpoint shape {tuple(loaded.shape)}: gate_up_proj's rows must be gate and "
                                     "up rows, as many of each")
                full = loaded.shape[1] // 2
                gate, up = loaded.narrow(1, 0, full), loaded.narrow(1, full, full)
                _check_shape(tuple(gate.shape[2:]), tuple(param.shape[2:]))
                param.data.narrow(1, 0, size).copy_(self._rank_slice(gate, 1))
                param.data.narrow(1, size, size).copy_(self._rank_slice(up, 1))
            else:
                _check_shape(tuple(loaded.shape[:2]), tuple(param.shape[:2]))
                param.data.copy_(self._rank_slice(loaded, 2))
            return
        if not isinstance(shard_id, tuple) or len(shard_id) != 2:
            raise ValueError(f"an expert's shard id is (expert, part), got {shard_id!r}")
        expert, part = shard_id
        if not isinstance(expert, int) or not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is not one of the model's {self.num_experts} experts")
        if loaded.dim() != 2:
            raise ValueError(f"an expert's weight must be a matrix, got shape {tuple(loaded.shape)}")
        if part == _W2_PART and param is self.w2:
            _check_shape((loaded.shape[0],), (param.shape[1],))
            param.data[expert].copy_(self._rank_slice(loaded, 1))
        elif part in _W13_PARTS and param is self.w13:
            _check_shape((loaded.shape[1],), (param.shape[2],))
            param.data[expert].narrow(0, _W13_PARTS.index(part) * size, size).copy_(self._rank_slice(loaded, 0))
        else:
            raise ValueError(f"shard {shard_id!r} is not one of this parameter's")


def covered_shards(param: nn.Parameter, shard_id: Hashable) -> tuple[Hashable, ...]:
    """The shards of `param` that loading a checkpoint tensor as `shard_id` fills: every expert's for `FUSED`,
    every expert's gate (up) rows for `FUSED_GATE` (`FUSED_UP`), else `shard_id` alone."""
    if shard_id == FUSED:
        return tuple(param.shard_ids)  # type: ignore[attr-defined]
    if shard_id in (FUSED_GATE, FUSED_UP):
        part = _W13_PARTS[0] if shard_id == FUSED_GATE else _W13_PARTS[1]
        return tuple(s for s in param.shard_ids if isinstance(s, tuple) and s[1] == part)  # type: ignore[attr-defined]
    return (shard_id,)


def _check_shape(got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ValueError(f"checkpoint shape {got} does not match the parameter's {want}")


class SparseMoeBlock(nn.Module):
    """The routed experts of one layer: x [T, H] -> [T, H], the sum over each token's top_k experts of its
    router weight times the expert's SiLU-gated MLP, plus, with a `shared_expert` (x [T, H] -> this rank's
    partial [T, H], not summed over the ranks), sigmoid(shared_expert_gate(x)) times its output (Qwen2-MoE's);
    summed over the tensor-parallel ranks once."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 dtype: torch.dtype, expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 round_weights: bool = True, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        # HF's routers: Qwen3-MoE's rounds the chosen experts' weights to the model dtype, Mixtral's keeps them in
        # float32 (each expert's output times its weight is then rounded once).
        self.round_weights = round_weights
        self.gate = Linear(hidden_size, num_experts, False, dtype)  # replicated: every rank routes every token
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, dtype, expert_names)
        self.shared_expert = shared_expert
        # replicated, as the router
        self.shared_expert_gate = None if shared_expert is None else Linear(hidden_size, 1, False, dtype)
        self.tp_size = distributed.tp_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = ops.select_experts(self.gate(x), self.top_k, self.renormalize)
        if self.round_weights:
            weights = weights.to(x.dtype)
        out = ops.fused_moe(x, self.experts.w13, self.experts.w2, weights, ids)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            # HF's op order in the model dtype: the gate's sigmoid times the shared output, added to the experts'.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return distributed.all_reduce(out) if self.tp_size > 1 else out
