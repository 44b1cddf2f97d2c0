"""Gated MLP activations: ``act(gate) * up`` over a fused [gate | up] projection."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import ops


class SiluAndMul(nn.Module):
    """x: [num_tokens, 2 * d] holding gate then up -> silu(gate) * up, [num_tokens, d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)


# HF `hidden_act` -> the gated activation module for a fused gate_up projection.
_ACT_AND_MUL: dict[str, type[nn.Module]] = {"silu": SiluAndMul}


def supported_activations() -> list[str]:
    return sorted(_ACT_AND_MUL)


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """A new module computing ``act(gate) * up``; ValueError for an activation we do not implement."""
    cls = _ACT_AND_MUL.get(hidden_act)
    if cls is None:
        raise ValueError(
            f"unsupported hidden_act {hidden_act!r}; supported: {', '.join(supported_activations())}"
        )
    return cls()
