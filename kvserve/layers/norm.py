"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import ops
from kvserve.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    """``weight * normalize(x)`` over the last dim; the normalisation runs in float32 (HF's order)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden_size]. Returns (normed, new_residual) with new_residual = x + residual (or x).

        Callers that have no residual stream (q/k norm, the final norm) take element 0.
        """
        return ops.rms_norm(x, self.weight, self.eps, residual)

