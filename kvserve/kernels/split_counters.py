"""Counters for split launches whose last program finishes the work (the skinny matmul's split-K sum, the
decode attention's split merge).

Each program of a split group adds one to its group's counter when its partial is written; the program
that sees the count complete finishes the group and resets the counter to zero. So a buffer is all zeros
between launches, and one buffer per device serves every launch on that device, as long as launches that
use it do not overlap (kvserve computes on one stream).
"""

from __future__ import annotations

import torch


class SplitCounters:
    """Zeroed int32 counters, one buffer per device, grown (never during CUDA graph capture) on demand."""

    def __init__(self, what: str, min_size: int = 1 << 16) -> None:
        self.what = what
        self.min_size = min_size
        self.buffers: dict[torch.device, torch.Tensor] = {}
        # Buffers replaced by a larger one stay alive: a CUDA graph captured earlier may still point at them.
        self._retired: list[torch.Tensor] = []

    def get(self, device: torch.device, count: int) -> torch.Tensor:
        """At least `count` counters on `device`, all zero."""
        buffer = self.buffers.get(device)
        if buffer is None or buffer.numel() < count:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self.what} must be allocated before CUDA graph capture (run eagerly first)")
            if buffer is not None:
                self._retired.append(buffer)
            buffer = torch.zeros(max(count, self.min_size), dtype=torch.int32, device=device)
            self.buffers[device] = buffer
        return buffer
